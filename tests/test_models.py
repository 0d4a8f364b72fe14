"""Our DeepSeek-V3 and Llama forwards against transformers' implementations (float32)."""
import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

from moespec.attention import DenseCausalAttention, ForwardContext
from moespec.models import load_model
from reference import paged_forward, randomize_routing

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 1.0,
        "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}
DEEPSEEK_CASES = {
    "no-q-lora/one-group/all-moe/bias": dict(q_lora_rank=None, n_group=1, topk_group=1, first_k_dense_replace=0,
                                             attention_bias=True),
    "q-lora/4-groups/yarn": dict(q_lora_rank=12, n_group=4, topk_group=2, first_k_dense_replace=1,
                                 rope_parameters=YARN, max_position_embeddings=128),
    "2-dense/2-groups/no-interleave/bias": dict(q_lora_rank=24, n_group=2, topk_group=1, first_k_dense_replace=2,
                                                rope_interleave=False, norm_topk_prob=False, n_shared_experts=2,
                                                attention_bias=True),
}
LLAMA_CASES = {
    "mha": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa2/tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "gqa4/llama3-rope/bias": dict(num_attention_heads=8, num_key_value_heads=2, attention_bias=True,
                                  rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                                                   "rope_theta": 500000.0}),
}


def deepseek_config(**overrides) -> DeepseekV3Config:
    base = dict(vocab_size=97, hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=3,
                n_shared_experts=1, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
                routed_scaling_factor=2.5, max_position_embeddings=256)
    base.update(overrides)
    return DeepseekV3Config(**base)


def llama_config(**overrides) -> LlamaConfig:
    base = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3, max_position_embeddings=256)
    base.update(overrides)
    return LlamaConfig(**base)


def save_random(hf_model, path) -> None:
    torch.manual_seed(0)
    randomize_routing(hf_model)
    hf_model.save_pretrained(path)


def compare(hf_model, path, prompts):
    ours = load_model(path, show_progress=False)
    for chunk in (None, 7):
        got = paged_forward(ours, prompts, page_size=4, chunk=chunk)
        for prompt, logits in zip(prompts, got):
            with torch.no_grad():
                ref = hf_model(torch.tensor([prompt])).logits[0]
            assert (logits - ref).abs().max().item() < 1e-4
    # the dense (training) path agrees too
    ids = torch.tensor([prompts[0][:16], prompts[1][:16]])
    with torch.no_grad():
        hidden = ours(ids.flatten(), torch.arange(16).repeat(2), ForwardContext(DenseCausalAttention(2), None))
        ref = hf_model(ids).logits
    assert (ours.compute_logits(hidden).view(2, 16, -1) - ref).abs().max().item() < 1e-4


def prompts_for(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (23, 16, 41)]


@pytest.mark.parametrize("case", list(DEEPSEEK_CASES))
def test_deepseek_v3_matches_transformers(case, tmp_path):
    torch.manual_seed(0)
    hf = DeepseekV3ForCausalLM(deepseek_config(**DEEPSEEK_CASES[case])).eval()
    save_random(hf, tmp_path)
    compare(hf, tmp_path, prompts_for(97))


@pytest.mark.parametrize("case", list(LLAMA_CASES))
def test_llama_matches_transformers(case, tmp_path):
    torch.manual_seed(0)
    hf = LlamaForCausalLM(llama_config(**LLAMA_CASES[case])).eval()
    save_random(hf, tmp_path)
    compare(hf, tmp_path, prompts_for(101))


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 32, 33])
def test_small_row_linear_matches_f_linear(rows, monkeypatch):
    """`linear` takes weight @ xᵀ for 2-32 float32 rows on the CPU (one row padded to two when
    asked): same values as F.linear, with and without bias, contiguous output; other row counts
    (and one unpadded row) stay on F.linear."""
    from moespec.models import layers

    mm_calls = []
    real_mm = torch.mm
    monkeypatch.setattr(layers.torch, "mm", lambda a, b: mm_calls.append(b.shape) or real_mm(a, b))
    torch.manual_seed(rows)
    x, weight, bias = torch.randn(rows, 48), torch.randn(80, 48), torch.randn(80)
    for b in (None, bias):
        for pad in (False, True):
            mm_calls.clear()
            out = layers.linear(x, weight, b, pad_single_row=pad)
            assert out.shape == (rows, 80) and out.is_contiguous()
            torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-5)
            takes_gemm = 2 <= rows <= 32 or (rows == 1 and pad)
            assert mm_calls == ([(48, max(rows, 2))] if takes_gemm else [])


def test_runner_pads_single_rows_only_for_models_larger_than_the_cache(monkeypatch):
    """The runner turns on one-row padding in every Linear and expert block when the model's
    weights exceed the last-level cache, and leaves it off otherwise."""
    import moespec.model_runner as model_runner
    from moespec.models.deepseek_v3 import DeepseekV3Config as OurConfig, DeepseekV3ForCausalLM as OurModel
    from moespec.models.layers import Linear
    from moespec.models.moe import LocalExperts

    model = OurModel(OurConfig.from_hf(deepseek_config().to_dict()))
    padded = [m for m in model.modules() if isinstance(m, (Linear, LocalExperts))]
    assert padded and any(isinstance(m, LocalExperts) for m in padded)
    size = model_runner.weight_bytes(model)
    for cache_bytes, expected in ((size - 1, True), (size, False)):
        monkeypatch.setattr(model_runner, "last_level_cache_bytes", lambda: cache_bytes)
        model_runner.ModelRunner(model, 4, 16)
        assert all(m.pad_single_row is expected for m in padded)
        for stream in (True, False):  # a draft's speculator says its weights stream, whatever their size
            model_runner.ModelRunner(model, 4, 16, weights_stream=stream)
            assert all(m.pad_single_row is stream for m in padded)


def test_rotary_table_matches_direct_computation_and_stays_float32():
    """cos/sin come from a table built once; casting the model leaves it (and the frequencies)
    float32, and `reserve_rope_positions` extends it past max_position_embeddings."""
    from torch import nn

    from moespec.models.layers import RopeConfig, RotaryEmbedding, reserve_rope_positions

    rope = RotaryEmbedding(16, RopeConfig.from_hf({"rope_parameters": YARN}), 64, interleave=True)
    model = nn.Sequential(nn.Linear(2, 2), rope).to(torch.bfloat16)
    assert rope.cos_sin.dtype == rope.inv_freq.dtype == torch.float32
    reserve_rope_positions(model, 100)
    positions = torch.tensor([0, 5, 63, 64, 99])
    cos, sin = rope(positions, torch.float32)  # [T, R/2] each
    angles = positions[:, None].double() * rope.inv_freq.double()[None, :]
    assert rope.scale != 1.0
    torch.testing.assert_close(cos.double(), angles.cos() * rope.scale, atol=1e-5, rtol=0)
    torch.testing.assert_close(sin.double(), angles.sin() * rope.scale, atol=1e-5, rtol=0)
    assert rope(positions, torch.bfloat16)[0].dtype == torch.bfloat16


def test_merged_projections_load_and_save_under_checkpoint_names(tmp_path):
    """q/k/v and gate/up load from their separate checkpoint tensors into one weight each, split
    back to exactly the checkpoint's tensors, and a missing or mis-shaped part is named."""
    from safetensors.torch import load_file, save_file

    from moespec.models import WeightError
    from moespec.models.layers import unmerge_tensors

    hf = LlamaForCausalLM(llama_config(num_attention_heads=4, num_key_value_heads=2, attention_bias=True)).eval()
    save_random(hf, tmp_path / "m")
    ours = load_model(tmp_path / "m", show_progress=False)
    attn, mlp = hf.model.layers[1].self_attn, hf.model.layers[1].mlp
    merged = ours.model.layers[1]
    assert torch.equal(merged.self_attn.qkv_proj.weight,
                       torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    assert torch.equal(merged.self_attn.qkv_proj.bias, torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
    assert torch.equal(merged.mlp.gate_up_proj.weight, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    saved = load_file(str(tmp_path / "m" / "model.safetensors"))
    exported = unmerge_tensors(ours, ours.state_dict())
    assert set(exported) == set(saved)
    assert all(torch.equal(exported[name], saved[name]) for name in saved)

    def write(edit) -> str:
        (tmp_path / "bad").mkdir(exist_ok=True)
        (tmp_path / "bad" / "config.json").write_text((tmp_path / "m" / "config.json").read_text())
        tensors = dict(saved)
        edit(tensors)
        save_file(tensors, str(tmp_path / "bad" / "model.safetensors"))
        return str(tmp_path / "bad")
    # older Llama checkpoints store each layer's rotary inverse frequencies; they are recomputed
    stale = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    assert torch.equal(load_model(write(lambda t: t.update(stale)), show_progress=False).lm_head.weight,
                       ours.lm_head.weight)
    with pytest.raises(WeightError, match=r"missing tensors for: model\.layers\.2\.self_attn\.k_proj\.weight$"):
        load_model(write(lambda t: t.pop("model.layers.2.self_attn.k_proj.weight")), show_progress=False)
    with pytest.raises(WeightError, match=r"up_proj\.weight' has shape \(5, 64\), expected \(96, 64\)"):
        load_model(write(lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.ones(5, 64)})),
                   show_progress=False)


@pytest.mark.parametrize("first,num_local,tokens,top_k", [(0, 8, 1, 2), (0, 8, 3, 2), (4, 4, 5, 1), (0, 6, 2, 3)])
def test_dense_small_batch_experts_match_grouped(first, num_local, tokens, top_k):
    """Batches of few (token, expert) pairs per local expert run every local expert in batched
    matmuls and pick each token's chosen outputs: the same result as running each hit expert on
    its tokens, including a rank holding experts [first, first + num_local) under expert
    parallelism; more pairs take the grouped loop."""
    from moespec.models.moe import LocalExperts

    torch.manual_seed(tokens)
    experts = LocalExperts(num_local + first, 32, 24, first=first, num_local=num_local)
    x = torch.randn(tokens, 32)
    ids = torch.stack([torch.randperm(num_local)[:top_k] for _ in range(tokens)]) + first  # [T, A]
    weights = torch.rand(tokens, top_k)
    grouped = experts.forward_grouped(x, ids, weights)
    pairs_per_expert = tokens * top_k / num_local
    for limit, expected_path in ((pairs_per_expert, "forward_dense"), (pairs_per_expert - 0.1, "forward_grouped")):
        experts.dense_pairs_per_expert = limit
        calls = []
        for name in ("forward_dense", "forward_grouped"):
            real = getattr(LocalExperts, name)
            setattr(experts, name, lambda *a, real=real, name=name: calls.append(name) or real(experts, *a))
        torch.testing.assert_close(experts(x, ids, weights), grouped, rtol=1e-5, atol=1e-6)
        assert calls == [expected_path]
        del experts.forward_dense, experts.forward_grouped
