"""DeepSeek checkpoints in the released layout: FP8 block-scaled weights, the MTP layer stored as
model.layers.{num_hidden_layers}.*, and clear errors for bad checkpoints and damaged files."""
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

from moespec.models import WeightError, load_config, load_model
from moespec.models.weights import WeightLoader
from reference import paged_forward, randomize_routing

L = 2  # target layers; the MTP layer is model.layers.2


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-128x128-block e4m3 quantization, as DeepSeek-V3 ships its linear weights."""
    out_dim, in_dim = w.shape
    rows, cols = -(-out_dim // 128), -(-in_dim // 128)
    scale = torch.zeros(rows, cols)
    q = torch.empty(out_dim, in_dim, dtype=torch.float8_e4m3fn)
    for r in range(rows):
        for c in range(cols):
            block = w[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128]
            scale[r, c] = block.abs().max().clamp(min=1e-8) / 448.0
            q[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128] = (block / scale[r, c]).to(torch.float8_e4m3fn)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.repeat_interleave(128, 0)[: q.shape[0]].repeat_interleave(128, 1)[:, : q.shape[1]]


def is_fp8_linear(name: str, tensor: torch.Tensor) -> bool:
    return (tensor.dim() == 2 and name.endswith("proj.weight") and "embed" not in name)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    config = DeepseekV3Config(vocab_size=90, hidden_size=160, intermediate_size=200, moe_intermediate_size=136,
                              num_hidden_layers=L, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
                              num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                              kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
                              v_head_dim=16, max_position_embeddings=128)
    hf = DeepseekV3ForCausalLM(config).eval()
    randomize_routing(hf)
    block = DeepseekV3DecoderLayer(config, layer_idx=L).eval()  # MoE block of the MTP layer
    with torch.no_grad():  # a bare layer gets no post_init: its expert tensors are uninitialized
        for name, param in block.named_parameters():
            param.copy_(torch.ones_like(param) if "norm" in name else torch.randn_like(param) * 0.02)
    mtp = {f"model.layers.{L}.{k}": v for k, v in block.state_dict().items()}
    for name, dim in (("enorm", 160), ("hnorm", 160), ("shared_head.norm", 160)):
        mtp[f"model.layers.{L}.{name}.weight"] = 1 + 0.1 * torch.randn(dim)
    mtp[f"model.layers.{L}.eh_proj.weight"] = torch.randn(160, 320) * 0.05
    mtp[f"model.layers.{L}.embed_tokens.weight"] = hf.model.embed_tokens.weight.detach().clone()
    mtp[f"model.layers.{L}.shared_head.head.weight"] = hf.lm_head.weight.detach().clone()
    for k, v in mtp.items():
        if k.endswith("e_score_correction_bias"):
            v.normal_()
    tensors = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    tensors.update(mtp)
    # transformers fuses experts in memory; write the released per-expert layout
    tensors = unfuse_experts(tensors)
    stored, dequantized = {}, {}
    for name, tensor in tensors.items():
        if is_fp8_linear(name, tensor):
            q, scale = quantize_fp8(tensor)
            stored[name], stored[name + "_scale_inv"] = q, scale
            dequantized[name] = dequantize(q, scale)
        else:
            stored[name] = dequantized[name] = tensor.contiguous()
    path = tmp_path_factory.mktemp("fp8")
    half = sorted(stored)[: len(stored) // 2]
    shards = {"model-00001-of-00002.safetensors": {k: stored[k] for k in half},
              "model-00002-of-00002.safetensors": {k: v for k, v in stored.items() if k not in half}}
    for file, part in shards.items():
        save_file(part, str(path / file))
    index = {"weight_map": {k: f for f, part in shards.items() for k in part}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    hf_json = config.to_dict()
    hf_json["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    hf_json["rope_scaling"] = hf_json.pop("rope_parameters")  # the released configs' key
    (path / "config.json").write_text(json.dumps(hf_json))
    return path, config, dequantized


def unfuse_experts(tensors: dict) -> dict:
    out = {}
    for name, t in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def reference_mtp_logits(config, weights: dict, prompt: list[int]) -> torch.Tensor:
    """Straightforward MTP: transformers' target and decoder block on the dequantized weights."""
    hf = DeepseekV3ForCausalLM(config).eval()
    hf.load_state_dict({k: v for k, v in fuse_for_hf(weights).items() if not k.startswith(f"model.layers.{L}.")},
                       strict=True)
    block = DeepseekV3DecoderLayer(config, layer_idx=L).eval()
    prefix = f"model.layers.{L}."
    block_weights = {k[len(prefix):]: v for k, v in fuse_for_hf(weights).items() if k.startswith(prefix)}
    block.load_state_dict({k: v for k, v in block_weights.items() if k.split(".")[0] in
                           ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")}, strict=True)

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps))

    ids = torch.tensor([prompt])
    with torch.no_grad():
        hidden = hf.model(ids).last_hidden_state[:, :-1]  # target's final hidden at 0..n-2
        embeds = hf.model.embed_tokens(ids[:, 1:])  # next tokens 1..n-1
        x = torch.cat([rms(embeds, weights[prefix + "enorm.weight"]), rms(hidden, weights[prefix + "hnorm.weight"])], -1)
        x = x @ weights[prefix + "eh_proj.weight"].T
        T = x.shape[1]
        pos = torch.arange(T)[None]
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        x = block(x, attention_mask=mask, position_embeddings=hf.model.rotary_emb(x, pos), position_ids=pos)
        x = rms(x, weights[prefix + "shared_head.norm.weight"])
        return (x @ weights[prefix + "shared_head.head.weight"].T)[0]


def fuse_for_hf(weights: dict) -> dict:
    out, experts = {}, {}
    for name, t in weights.items():
        if ".mlp.experts." in name:
            prefix, rest = name.split(".mlp.experts.")
            e, proj = rest.split(".")[:2]
            experts.setdefault(prefix, {}).setdefault(int(e), {})[proj] = t
        else:
            out[name] = t
    for prefix, by_expert in experts.items():
        ids = sorted(by_expert)
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([by_expert[e]["gate_proj"], by_expert[e]["up_proj"]]) for e in ids])
        out[f"{prefix}.mlp.experts.down_proj"] = torch.stack([by_expert[e]["down_proj"] for e in ids])
    return out


def test_fp8_checkpoint_with_mtp_layer_loads_and_matches(fp8_checkpoint):
    path, config, weights = fp8_checkpoint
    model = load_model(path, show_progress=False)
    assert model.num_mtp_layers == 1
    assert model.mtp_embeds[0] is model.model.embed_tokens  # equal copies are shared, not duplicated
    prompt = torch.randint(0, 90, (19,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = reference_mtp_logits(config, weights, prompt)
    # ours: target over the prompt, then the MTP layer over (next token, target hidden) pairs
    from moespec.attention import AttentionMetadata, ForwardContext, TorchPagedAttention
    from moespec.kv_cache import KVCache
    n, S = len(prompt) - 1, 4
    cache = KVCache(model.kv_cache_spec(), 8, S, torch.float32)
    meta = AttentionMetadata(torch.tensor([0, n]), torch.tensor([0, 5]), torch.arange(5), torch.tensor([n - 16]),
                             torch.arange(n), S)
    backend = TorchPagedAttention()
    backend.plan(meta)
    ctx = ForwardContext(backend, cache.layers)
    with torch.no_grad():
        hidden = model(torch.tensor(prompt[:-1]), torch.arange(n), ctx)
        mtp_hidden = model.forward_mtp(0, torch.tensor(prompt[1:]), hidden, torch.arange(n), ctx)
        ours = model.compute_mtp_logits(0, mtp_hidden)
    assert (ours - ref).abs().max().item() < 1e-4
    # and the target itself matches transformers on the dequantized weights
    target = paged_forward(model, [prompt])[0]
    hf = DeepseekV3ForCausalLM(config).eval()
    hf.load_state_dict({k: v for k, v in fuse_for_hf(weights).items() if not k.startswith(f"model.layers.{L}.")})
    with torch.no_grad():
        assert (target - hf(torch.tensor([prompt])).logits[0]).abs().max().item() < 1e-4


def test_rope_scaling_and_rope_parameters_keys_agree(fp8_checkpoint):
    path = fp8_checkpoint[0]
    config = load_config(path)  # written with the released configs' `rope_scaling`
    assert config.rope.type == "default" and config.rope.theta == 10000.0
    hf = json.loads((path / "config.json").read_text())
    for key in ("rope_scaling", "rope_parameters"):
        variant = dict(hf)
        variant.pop("rope_scaling")
        variant[key] = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 1.0,
                        "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000}
        from moespec.models.deepseek_v3 import DeepseekV3Config as Ours
        rope = Ours.from_hf(variant).rope
        assert (rope.type, rope.factor, rope.original_max_position_embeddings) == ("yarn", 40, 4096)


def corrupt(path, tmp_path, edit) -> str:
    from safetensors.torch import load_file
    out = tmp_path / "bad"
    out.mkdir()
    (out / "config.json").write_text((path / "config.json").read_text())
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    return str(out)


def test_missing_tensor_is_named(fp8_checkpoint, tmp_path):
    bad = corrupt(fp8_checkpoint[0], tmp_path, lambda t: t.pop("model.layers.2.hnorm.weight"))
    with pytest.raises(WeightError, match=r"model\.layers\.2\.hnorm\.weight \(160,\)"):
        load_model(bad, show_progress=False)


def test_misshaped_tensor_is_named(fp8_checkpoint, tmp_path):
    bad = corrupt(fp8_checkpoint[0], tmp_path, lambda t: t.update({"model.norm.weight": torch.ones(7)}))
    with pytest.raises(WeightError, match=r"model\.norm\.weight.*\(7,\).*\(160,\)"):
        load_model(bad, show_progress=False)


def test_unexpected_tensor_is_named(fp8_checkpoint, tmp_path):
    bad = corrupt(fp8_checkpoint[0], tmp_path, lambda t: t.update({"model.layers.0.extra.weight": torch.ones(3)}))
    with pytest.raises(WeightError, match=r"unexpected tensor 'model\.layers\.0\.extra\.weight'"):
        load_model(bad, show_progress=False)


def test_expert_shape_mismatch_is_named(fp8_checkpoint, tmp_path):
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    bad = corrupt(fp8_checkpoint[0], tmp_path, lambda t: (t.pop(name + "_scale_inv"), t.update({name: torch.ones(5, 5)})))
    with pytest.raises(WeightError, match=r"experts\.3\.down_proj\.weight.*\(5, 5\)"):
        load_model(bad, show_progress=False)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A small single-file checkpoint, copied by each test before it damages it."""
    from tiny_models import save_tiny_llama
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(path)
    return path


def damaged_copy(src: Path, tmp_path: Path, damage) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    damage(dst)
    return dst


def truncate(path: Path) -> None:
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def huge_header_length(path: Path) -> None:
    file = path / "model.safetensors"
    file.write_bytes(struct.pack("<Q", 2 ** 60) + file.read_bytes()[8:])


def garbage_header(path: Path) -> None:
    file = path / "model.safetensors"
    data = file.read_bytes()
    n = int.from_bytes(data[:8], "little")
    file.write_bytes(data[:8] + b"#" * n + data[8 + n:])


def directory_as_file(path: Path) -> None:
    (path / "extra.safetensors").mkdir()


def shard(path: Path) -> None:
    """Rewrite a single-file checkpoint as two shards and an index."""
    tensors = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(path / file))
    index = {"weight_map": {n: f for f, part in shards.items() for n in part}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("damage, file, problem", [
    (truncate, "model.safetensors", "is truncated: "),
    (huge_header_length, "model.safetensors", "has a corrupt header: "),
    (garbage_header, "model.safetensors", "has a corrupt header: "),
    (directory_as_file, "extra.safetensors", "is not a file"),
])
def test_damaged_safetensors_file_is_named(tiny_checkpoint, tmp_path, damage, file, problem):
    path = damaged_copy(tiny_checkpoint, tmp_path, damage)
    with pytest.raises(WeightError) as error:
        load_model(path, show_progress=False)
    assert f"checkpoint file {path / file} {problem}" in str(error.value)


def test_truncated_file_error_says_how_short_and_keeps_the_original_error(tiny_checkpoint, tmp_path):
    path = damaged_copy(tiny_checkpoint, tmp_path, truncate)
    size = (tiny_checkpoint / "model.safetensors").stat().st_size
    with pytest.raises(WeightError, match=rf"is truncated: {size // 2} bytes, its header describes {size} \(.+\)$"):
        load_model(path, show_progress=False)


def test_missing_shard_is_named_before_any_tensor_is_read(tiny_checkpoint, tmp_path):
    path = damaged_copy(tiny_checkpoint, tmp_path, shard)
    load_model(path, show_progress=False)  # the sharded copy itself is fine
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    count = sum(f == "model-00002-of-00002.safetensors" for f in weight_map.values())
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightError) as error:
        WeightLoader(path)
    assert str(error.value) == (f"model.safetensors.index.json lists model-00002-of-00002.safetensors "
                                f"({count} tensors), which is not in {path}")


@pytest.mark.parametrize("text", ["{\"weight_map\": {", "{\"metadata\": {}}", "[]"])
def test_corrupt_index_is_named(tiny_checkpoint, tmp_path, text):
    path = damaged_copy(tiny_checkpoint, tmp_path, shard)
    (path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(WeightError, match=str(path / "model.safetensors.index.json")):
        load_model(path, show_progress=False)


def test_tensor_absent_from_its_indexed_shard_is_named(tiny_checkpoint, tmp_path):
    path = damaged_copy(tiny_checkpoint, tmp_path, shard)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name = next(n for n, f in index["weight_map"].items() if f == "model-00002-of-00002.safetensors")
    index["weight_map"][name] = "model-00001-of-00002.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightError) as error:
        load_model(path, show_progress=False)
    assert f"checkpoint file {path / 'model-00001-of-00002.safetensors'} has no tensor {name!r}" in str(error.value)


def test_invalid_config_json_names_file_line_and_column(tiny_checkpoint, tmp_path):
    path = damaged_copy(tiny_checkpoint, tmp_path, lambda p: (p / "config.json").write_text(
        '{\n  "model_type": "llama",,\n  "hidden_size": 64\n}\n'))
    with pytest.raises(WeightError) as error:
        load_model(path, show_progress=False)
    assert str(error.value) == f"{path / 'config.json'} is not valid JSON: Expecting property name enclosed in " \
                               "double quotes at line 2, column 25"


def test_cli_reports_truncated_checkpoint_in_one_line(tiny_checkpoint, tmp_path):
    path = damaged_copy(tiny_checkpoint, tmp_path, truncate)
    config = tmp_path / "c.yaml"
    config.write_text(f"model:\n  path: {path}\n  dtype: float32\ncache:\n  page_size: 4\n  num_kv_pages: 64\n")
    result = subprocess.run([sys.executable, "-m", "moespec", "generate", "--config", str(config), "--prompt", "x"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("moespec: error: ")]
    assert len(errors) == 1 and str(path / "model.safetensors") in errors[0] and "truncated" in errors[0]
