"""FP8-resident DeepSeek weights: the block-scaled GEMMs against dequantized matmuls, a model that
keeps its FP8 checkpoint in FP8 against the same checkpoint dequantized on load (greedy, token for
token, with and without its MTP layer drafting), and what loading costs in memory: a ~420 MB FP8
checkpoint loaded by two expert-parallel ranks, each holding its half of the experts."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

from moespec import LLM, SamplingParams
from moespec.models import load_model
from moespec.models.fp8 import (batched_fp8_linear, cuda_fp8_linear, dequantize_fp8_block, fp8_linear,
                                quantize_fp8_block, reference_fp8_linear, scale_shape)
from moespec.models.moe import grouped_linear
from reference import randomize_routing
from test_checkpoint_loading import unfuse_experts
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent


def random_fp8(rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return quantize_fp8_block(torch.randn(rows, cols, generator=gen) * 0.05)


def test_reference_fp8_gemm_equals_the_dequantized_matmul():
    for rows, cols in ((300, 260), (256, 128), (130, 7)):  # partial blocks on both sides, and exact ones
        weight, scale = random_fp8(rows, cols)
        assert scale.shape == scale_shape(rows, cols) and weight.dtype == torch.float8_e4m3fn
        x = torch.randn(5, cols, generator=torch.Generator().manual_seed(1))
        bias = torch.randn(rows, generator=torch.Generator().manual_seed(2))
        expected = x @ dequantize_fp8_block(weight, scale, torch.float32).t() + bias
        got = reference_fp8_linear(x, weight, scale, bias)
        # float32 sums of up to 260 products, slab by slab against one matmul: the kernels may
        # split the reduction differently (outputs are about 1 in size)
        assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5), (got - expected).abs().max()


def test_slabs_of_many_blocks_equal_the_dequantized_matmul():
    """The GPU fallback's slabs (several 128-row blocks at a time, a partial block last)."""
    weight, scale = random_fp8(600, 256, seed=4)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5))
    expected = x @ dequantize_fp8_block(weight, scale, torch.float32).t()
    for slab_rows in (256, 2048):
        assert torch.allclose(reference_fp8_linear(x, weight, scale, slab_rows=slab_rows), expected, rtol=1e-5, atol=1e-6)


# ----------------------------------------------- the CUDA path through torch's own scaled_mm checks


class ScaledMMCalls(TorchDispatchMode):
    """Counts the block-scaled GEMMs a call issues (on `meta` tensors: run through torch's meta
    kernel, which makes the CUDA kernel's layout checks)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in (torch.ops.aten._scaled_mm_v2.default, torch.ops.aten._scaled_mm.default)
        return func(*args, **(kwargs or {}))


def meta_fp8(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An e4m3 weight [..., N, K] and its block scales [..., N/128, K/128] on `meta`."""
    *lead, N, K = shape
    return (torch.empty(*shape, dtype=torch.float8_e4m3fn, device="meta"),
            torch.empty(*lead, *scale_shape(N, K), device="meta"))


def deepseek_v3_projections() -> dict[str, tuple[int, int]]:
    """(N, K) of every FP8 linear of DeepSeek-V3, from its config.json as released."""
    c = json.loads((ROOT / "configs" / "deepseek-v3" / "config.json").read_text())
    M, H, nope, rope, v = (c["hidden_size"], c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                           c["v_head_dim"])
    shared = c["moe_intermediate_size"] * c["n_shared_experts"]
    return {"q_a_proj": (c["q_lora_rank"], M), "q_b_proj": (H * (nope + rope), c["q_lora_rank"]),
            "kv_a_proj_with_mqa": (c["kv_lora_rank"] + rope, M), "kv_b_proj": (H * (nope + v), c["kv_lora_rank"]),
            "o_proj": (M, H * v), "mlp.gate_up": (2 * c["intermediate_size"], M), "mlp.down": (M, c["intermediate_size"]),
            "shared.gate_up": (2 * shared, M), "shared.down": (M, shared),
            "expert.w13": (2 * c["moe_intermediate_size"], M), "expert.w2": (M, c["moe_intermediate_size"])}


SMALL = {"K/128 = 1": (256, 128), "K/128 = 2": (128, 256), "K/128 = 3": (384, 384), "K/128 = 5": (256, 640),
         "K/128 = 6": (128, 768)}


@pytest.mark.parametrize("rows", [1, 2, 128])
@pytest.mark.parametrize("name,shape", [*SMALL.items(), *deepseek_v3_projections().items()])
def test_cuda_fp8_gemm_passes_torchs_scaled_mm_checks(name, shape, rows):
    """The CUDA FP8 linear on `meta` tensors: torch's meta kernel for scaled_mm makes the checks its
    CUDA kernel makes (the 1x128 activation scales [T, K/128] with strides (1, T), even at T = 1;
    the 128x128 weight scales [round_up(K/128, 4), N/128] with strides (1, round_up(K/128, 4))).
    Whole blocks go through scaled_mm; a partial block (kv_a_proj_with_mqa, N = 576) is dequantized."""
    N, K = shape
    weight, scale = meta_fp8(N, K)
    x = torch.empty(rows, K, dtype=torch.bfloat16, device="meta")
    if N % 128 == 0:
        assert cuda_fp8_linear(x, weight, scale).shape == (rows, N)
    with ScaledMMCalls() as calls:
        out = fp8_linear(x, weight, scale, torch.empty(N, dtype=torch.bfloat16, device="meta"))
    assert out.shape == (rows, N) and out.dtype == torch.bfloat16
    assert calls.calls == (N % 128 == 0)


@pytest.mark.parametrize("rows", [1, 2, 128])
def test_grouped_cuda_fp8_gemms_pass_torchs_scaled_mm_checks(rows):
    """The routed experts' two forms on `meta`: rows sorted by expert (`grouped_linear`, one GEMM per
    expert hit, one of them a single row) and every expert over every row (`batched_fp8_linear`),
    at DeepSeek-V3's expert shapes."""
    shapes = deepseek_v3_projections()
    for N, K in (shapes["expert.w13"], shapes["expert.w2"]):
        weight, scale = meta_fp8(4, N, K)
        counts = [rows, 0, 1, 2]
        with ScaledMMCalls() as calls:
            grouped = grouped_linear(torch.empty(sum(counts), K, dtype=torch.bfloat16, device="meta"), counts, weight,
                                     scale)
            batched = batched_fp8_linear(torch.empty(4, rows, K, dtype=torch.bfloat16, device="meta"), weight, scale)
        assert grouped.shape == (sum(counts), N) and batched.shape == (4, rows, N)
        assert calls.calls == 3 + 4


@pytest.mark.parametrize("capability,cuda,cublaslt,supported", [
    ((9, 0), "12.9", 120903, True), ((9, 0), "12.8", 120903, False), ((9, 0), "12.9", 120805, False),
    ((8, 9), "12.9", 120903, False), ((10, 0), "13.0", 130100, False)])
def test_block_scaled_gemm_only_where_torch_has_it(monkeypatch, capability, cuda, cublaslt, supported):
    """torch 2.13 runs DeepSeek-style (1x128, 128x128) scaling on SM90 only, built with CUDA and
    loaded with cuBLASLt >= 12.9, and raises NotImplementedError elsewhere (ScaledBlas.cpp
    `_check_deepseek_support`): anywhere else FP8 linears take the dequantizing fallback."""
    import moespec.models.fp8 as fp8
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(fp8, "cublaslt_version", lambda: cublaslt)
    fp8.blockwise_scaled_mm_supported.cache_clear()
    try:
        assert fp8.blockwise_scaled_mm_supported(0) is supported
    finally:
        fp8.blockwise_scaled_mm_supported.cache_clear()


def test_quantized_weights_are_close_to_the_originals():
    w = torch.randn(256, 384, generator=torch.Generator().manual_seed(2))
    q, s = quantize_fp8_block(w)
    relative = (dequantize_fp8_block(q, s, torch.float32) - w).abs().max() / w.abs().max()
    assert relative < 0.07  # e4m3 keeps 3 mantissa bits


def test_grouped_fp8_gemm_equals_each_experts_matmul():
    E, N, K = 3, 256, 128
    pairs = [random_fp8(N, K, seed=e) for e in range(E)]
    weight, scale = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    counts = [2, 0, 3]
    x = torch.randn(sum(counts), K, generator=torch.Generator().manual_seed(3))
    got = grouped_linear(x, counts, weight, scale)
    rows = [0, 0, 2, 2, 2]
    expected = torch.stack([x[i] @ dequantize_fp8_block(weight[e], scale[e], torch.float32).t()
                            for i, e in enumerate(rows)])
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_masked_fp8_experts_equal_each_experts_matmul():
    """The fixed-capacity layout [E, N, K] through FP8 experts: every row of every expert equals
    that expert's own (dequantized) two projections."""
    from moespec.models.moe import LocalExperts
    torch.manual_seed(0)
    experts = LocalExperts(3, 128, 128)
    plain = LocalExperts(3, 128, 128)
    for name in ("w13", "w2"):
        weight = getattr(experts, name).data
        pairs = [quantize_fp8_block(w) for w in weight]
        getattr(plain, name).data.copy_(torch.stack([dequantize_fp8_block(q, s, torch.float32) for q, s in pairs]))
    experts.to_fp8()
    for name in ("w13", "w2"):
        pairs = [quantize_fp8_block(w) for w in getattr(plain, name).data]
        getattr(experts, name).data.copy_(torch.stack([p[0] for p in pairs]))
        getattr(experts, f"{name}_scale_inv").data.copy_(torch.stack([p[1] for p in pairs]))
    x = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(1))
    counts = [5, 0, 2]
    got = experts.forward_masked(x, torch.tensor(counts))
    expected = plain.forward_masked(x, torch.tensor(counts))
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5)
    every_row = experts.forward_masked(x)  # no counts: every row valid
    for e, count in enumerate(counts):
        assert torch.allclose(every_row[e], experts.run_expert(e, x[e]), rtol=1e-4, atol=1e-5)
        assert torch.allclose(got[e, :count], every_row[e, :count], rtol=1e-4, atol=1e-5)
        assert not got[e, count:].any()  # the rows past a count: not computed, zero
    # captured (a static step), every expert runs over every token: a replay with other routing
    # runs the same ops (the grouped path sizes its GEMMs by per-expert counts read on the host)
    from moespec.capture import CheckedReplay
    from moespec.static_step import run_captured
    tokens, ids = x[0], torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]])
    weights = torch.rand(5, 2, generator=torch.Generator().manual_seed(2))
    real_rows = torch.tensor(5)
    replay = CheckedReplay(lambda: (run_captured(experts, (tokens, ids, weights), real_rows),))
    ids.copy_(torch.tensor([[1, 2], [1, 0], [1, 2], [1, 0], [2, 0]]))
    assert torch.allclose(replay.replay()[0], experts.forward_grouped(tokens, ids, weights), rtol=1e-4, atol=1e-5)


class OutputsComputed(TorchDispatchMode):
    """Output elements the matmuls of a call compute: rows x columns of each mm / bmm, and of a
    grouped_mm its rows up to the last group's end (its kernel skips the rest)."""

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0
        self.grouped = False  # whether any grouped_mm ran

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten._grouped_mm.default:
            self.grouped = True
            if out.device.type == "meta":
                return out
            offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
            self.elements += int(offs[-1]) * out.shape[-1]
        elif func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default):
            self.elements += out.numel()
        return out


def captured(fn, *args):
    """fn(*args) as inside a captured or compiled step (models.layers.fixed_shapes)."""
    from moespec.models.layers import CAPTURING
    token = CAPTURING.set(True)
    try:
        return fn(*args)
    finally:
        CAPTURING.reset(token)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("step", ["eager", "captured"])
def test_masked_experts_compute_only_the_valid_rows_and_replay_with_other_counts(fp8, step):
    """The fixed-capacity layout [L, N, M] with counts: the matmuls compute the valid rows' outputs
    alone (4 experts x 16 rows, 3 of them valid: 3 / 64 of the rows), eager (counts read on the
    CPU) and as in a captured step (nothing read on the host), and a captured call (a checked
    replay: the same ops on the same memory, no host read) gives the right outputs after the
    counts and rows change in place."""
    from moespec.capture import CheckedReplay
    from moespec.models.moe import LocalExperts
    torch.manual_seed(0)
    L, N, M, I = 4, 16, 256, 128
    experts = LocalExperts(L, M, I)
    if fp8:
        pairs = {name: [quantize_fp8_block(w) for w in getattr(experts, name).data] for name in ("w13", "w2")}
        experts.to_fp8()
        for name, qs in pairs.items():
            getattr(experts, name).data.copy_(torch.stack([q for q, _ in qs]))
            getattr(experts, f"{name}_scale_inv").data.copy_(torch.stack([s for _, s in qs]))
    x, counts = torch.randn(L, N, M), torch.tensor([2, 0, 1, 0])
    with OutputsComputed() as computed:
        got = experts.forward_masked(x, counts) if step == "eager" else captured(experts.forward_masked, x, counts)
    assert computed.elements == 3 * (2 * I + M)  # every row: 64 x (2I + M)
    every_row = experts.forward_masked(x)
    for e, count in enumerate(counts.tolist()):
        assert torch.allclose(got[e, :count], every_row[e, :count], rtol=1e-4, atol=1e-5)
        assert not got[e, count:].any()
    replay = CheckedReplay(lambda: (captured(experts.forward_masked, x, counts),))
    counts.copy_(torch.tensor([16, 3, 0, 7]))
    x.copy_(torch.randn(L, N, M))
    expected = experts.forward_masked(x.clone(), counts.clone())
    torch.testing.assert_close(replay.replay()[0], expected)
    assert expected[0].abs().sum() > 0 and not expected[2].any()


def fp8_experts(L: int, M: int, I: int):
    """LocalExperts with random e4m3 weights and their block scales."""
    from moespec.models.moe import LocalExperts
    experts = LocalExperts(L, M, I)
    pairs = {name: [quantize_fp8_block(w) for w in getattr(experts, name).data] for name in ("w13", "w2")}
    experts.to_fp8()
    for name, qs in pairs.items():
        getattr(experts, name).data.copy_(torch.stack([q for q, _ in qs]))
        getattr(experts, f"{name}_scale_inv").data.copy_(torch.stack([s for _, s in qs]))
    return experts


def deepep_fp8_rows(L: int, N: int, M: int):
    """(e4m3 [L, N, M], float32 scales [L, N, M/128]) in the layouts DeepEP's FP8 low-latency
    dispatch hands over: the scales allocated [L, M/128, N] and transposed (column-major)."""
    from moespec.parallel.exchange import quantize_per_block
    values, scales = quantize_per_block(torch.randn(L * N, M, dtype=torch.bfloat16))
    column_major = torch.empty(L, M // 128, N).transpose(1, 2)
    column_major.copy_(scales.view(L, N, M // 128))
    return values.view(L, N, M), column_major


@pytest.fixture
def fake_deep_gemm(monkeypatch):
    """DeepGEMM's masked GEMM stood in for by tests/fake_deep_gemm.py (its contract checked, the
    product computed on the CPU), on an SM90 GPU as far as the dispatch can tell."""
    import fake_deep_gemm
    from moespec.models import fp8
    fake_deep_gemm.calls.clear()
    monkeypatch.setattr(fp8, "masked_fp8_gemm", lambda: fake_deep_gemm.m_grouped_fp8_gemm_nt_masked)
    monkeypatch.setattr(fp8, "cuda_major", lambda device: 9)
    return fake_deep_gemm


def test_an_fp8_dispatch_goes_into_the_masked_fp8_gemm_as_it_arrived(fake_deep_gemm, monkeypatch):
    """DeepEP's FP8 low-latency dispatch hands the experts (e4m3 rows, per-128 scales in its
    column-major layout): with FP8 weights, DeepGEMM's masked grouped GEMM takes that pair itself
    (its very storage, never dequantized and quantized again) and the call keeps DeepGEMM's
    contract (tests/fake_deep_gemm.py); the second projection's activations are quantized here.
    Without DeepGEMM the pair is dequantized, and both give the same rows."""
    from moespec.models import fp8
    torch.manual_seed(0)
    L, N, M, I = 3, 128, 256, 128
    experts = fp8_experts(L, M, I)
    received = deepep_fp8_rows(L, N, M)
    counts = torch.tensor([8, 0, 3], dtype=torch.int32)
    got = experts.forward_masked(received, counts, torch.bfloat16)
    calls = fake_deep_gemm.calls
    assert len(calls) == 2
    assert calls[0][0].data_ptr() == received[0].data_ptr() and calls[0][1].data_ptr() == received[1].data_ptr()
    assert calls[1][0].shape == (L, N, I)  # the activations, quantized for the down projection
    monkeypatch.setattr(fp8, "masked_fp8_gemm", lambda: None)
    expected = experts.forward_masked(received, counts, torch.bfloat16)
    assert len(calls) == 2 and expected.dtype == torch.bfloat16
    for e, count in enumerate(counts.tolist()):
        torch.testing.assert_close(got[e, :count].float(), expected[e, :count].float(), rtol=0.05, atol=0.02)


@pytest.mark.parametrize("major,rows,dtype,runs", [
    (9, 128, torch.bfloat16, True), (9, 256, None, True),
    (9, 8, torch.bfloat16, False),  # a partial row tile: it would write into the next expert's rows
    (9, 192, torch.bfloat16, False),
    (10, 128, torch.bfloat16, False),  # SM100 reads UE8M0 scales: DeepSeek's float32 ones would be cut
    (8, 128, torch.bfloat16, False), (12, 128, torch.bfloat16, False), (None, 128, torch.bfloat16, False),
    (9, 128, torch.float16, False)])  # DeepGEMM writes bf16 only
def test_deep_gemm_runs_only_calls_it_takes(fake_deep_gemm, monkeypatch, major, rows, dtype, runs):
    """DeepGEMM's masked GEMM runs on SM90 alone (float32 scales; SM100 reads powers of two, other
    GPUs have no FP8 recipe), over whole 128-row tiles per expert, for bf16 outputs; any other call
    takes the dequantizing path, and the valid rows come out the same either way."""
    from moespec.models import fp8
    monkeypatch.setattr(fp8, "cuda_major", lambda device: major)
    torch.manual_seed(1)
    L, M, I = 2, 256, 128
    experts = fp8_experts(L, M, I)
    received = deepep_fp8_rows(L, rows, M)
    counts = torch.tensor([min(rows, 5), 2], dtype=torch.int32)
    got = experts.forward_masked(received, counts, dtype)
    assert len(fake_deep_gemm.calls) == (2 if runs else 0)
    monkeypatch.setattr(fp8, "masked_fp8_gemm", lambda: None)
    expected = experts.forward_masked(received, counts, dtype)
    for e, count in enumerate(counts.tolist()):
        torch.testing.assert_close(got[e, :count].float(), expected[e, :count].float(), rtol=0.05, atol=0.02)


@pytest.mark.parametrize("major,dtype,device_kernel", [
    (9, torch.bfloat16, True), (10, torch.bfloat16, True), (8, torch.bfloat16, False), (12, torch.bfloat16, False),
    (9, torch.float16, False)])
def test_grouped_mm_only_where_it_reads_no_host(monkeypatch, major, dtype, device_kernel):
    """torch's grouped_mm has its device kernel for bf16 on SM90 and SM100 alone (GroupedBlas.cpp);
    elsewhere its fallback copies the group ends to the host and loops, which a captured step
    cannot hold: there the masked experts take the every-row path instead."""
    from moespec.models import fp8
    from moespec.models.moe import LocalExperts
    monkeypatch.setattr(fp8, "cuda_major", lambda device: major)
    assert fp8.grouped_mm_reads_no_host(torch.empty(2, 3, dtype=dtype, device="meta")) is device_kernel
    with torch.device("meta"):  # `meta` as the GPU the capability names: the path the layer takes
        experts = LocalExperts(2, 128, 64).to(dtype)
        x, counts = torch.empty(2, 16, 128, dtype=dtype), torch.empty(2, dtype=torch.int32)
    with OutputsComputed() as computed:
        experts.forward_masked(x, counts)
    assert computed.grouped == device_kernel


def test_cublaslt_is_read_for_torchs_own_cuda():
    """A host may hold cuBLASLt 12 and 13; torch loads the one of the CUDA it was built with."""
    from moespec.models.fp8 import cublaslt_names
    assert cublaslt_names("12.9")[0] == "libcublasLt.so.12" and cublaslt_names("13.0")[0] == "libcublasLt.so.13"
    assert cublaslt_names(None)[-1] == "libcublasLt.so"


# ---------------------------------------------------------------------- a model kept in FP8


def write_fp8_deepseek(path, hidden=256, moe_intermediate=128, experts=4, layers=2, vocab=120, seed=0) -> int:
    """A random DeepSeek-V3 (one dense layer, then MoE layers, plus an MTP layer) in the released
    FP8 layout: per-expert tensors, every decoder projection e4m3 with its weight_scale_inv, the
    MTP layer at model.layers.{layers}. Returns the checkpoint's bytes."""
    torch.manual_seed(seed)
    config = DeepseekV3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                              moe_intermediate_size=moe_intermediate, num_hidden_layers=layers, num_attention_heads=2,
                              num_key_value_heads=2, n_routed_experts=experts, num_experts_per_tok=2, n_group=2,
                              topk_group=1, first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=128,
                              qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, max_position_embeddings=256,
                              eos_token_id=None, bos_token_id=None)
    hf = DeepseekV3ForCausalLM(config).eval()
    randomize_routing(hf)
    block = DeepseekV3DecoderLayer(config, layer_idx=layers).eval()
    with torch.no_grad():
        for name, param in block.named_parameters():
            param.copy_(torch.ones_like(param) if "norm" in name else torch.randn_like(param) * 0.02)
    L = layers
    tensors = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    tensors.update({f"model.layers.{L}.{k}": v.detach().clone() for k, v in block.state_dict().items()})
    for name in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"model.layers.{L}.{name}.weight"] = torch.ones(hidden)
    tensors[f"model.layers.{L}.eh_proj.weight"] = torch.randn(hidden, 2 * hidden) * 0.05
    tensors[f"model.layers.{L}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[f"model.layers.{L}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    stored = {}
    for name, tensor in unfuse_experts(tensors).items():
        if "_proj" in name and name.endswith(".weight") and ".layers." in name and "eh_proj" not in name:
            stored[name], stored[name + "_scale_inv"] = quantize_fp8_block(tensor)
        else:
            stored[name] = tensor.contiguous()
    save_file(stored, str(path / "model.safetensors"))
    hf_json = config.to_dict()
    hf_json["num_nextn_predict_layers"] = 1
    hf_json["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                      "activation_scheme": "dynamic"}
    hf_json["rope_scaling"] = hf_json.pop("rope_parameters")
    (path / "config.json").write_text(json.dumps(hf_json))
    return sum(t.numel() * t.element_size() for t in stored.values())


@pytest.fixture(scope="module")
def fp8_deepseek(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8-deepseek")
    write_fp8_deepseek(path)
    return str(path)


PROMPTS = [[3, 40, 7, 9, 1], [9] * 21, [5, 1, 77, 100, 2, 64, 8, 12, 90, 33, 11], [60, 61, 62]]


def test_fp8_resident_weights_stay_fp8(fp8_deepseek):
    model = load_model(fp8_deepseek, quantization="auto", show_progress=False)
    layer = model.model.layers[1]
    assert layer.self_attn.q_b_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.mlp.experts.w13.dtype == torch.float8_e4m3fn and layer.mlp.experts.w13_scale_inv.shape == (4, 2, 2)
    assert layer.mlp.shared_experts.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    assert model.mtp[0].mlp.experts.w2.dtype == torch.float8_e4m3fn
    assert layer.self_attn.kv_b_proj.weight.dtype == torch.float32  # absorbed into attention: dequantized
    assert model.mtp[0].eh_proj.weight.dtype == torch.float32 and model.lm_head.weight.dtype == torch.float32
    dequantized = load_model(fp8_deepseek, quantization="none", show_progress=False)
    assert all(p.dtype == torch.float32 for n, p in dequantized.named_parameters())


@pytest.mark.parametrize("speculation", [None, {"mode": "mtp", "num_speculative_tokens": 2, "adaptive": False}],
                         ids=["plain", "mtp-k2"])
def test_fp8_resident_greedy_output_equals_dequantize_on_load(fp8_deepseek, speculation):
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = {}
    for quantization in ("fp8", "none"):
        llm = LLM(model=fp8_deepseek, quantization=quantization, speculation=speculation, page_size=4,
                  num_kv_pages=128)
        kept = llm.engine.model.model.layers[1].mlp.experts.w13.dtype
        assert kept == (torch.float8_e4m3fn if quantization == "fp8" else torch.float32)
        outputs[quantization] = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert outputs["fp8"] == outputs["none"]


# ---------------------------------------------------------------------- memory of a real load


def peak_rss_bytes() -> int:
    """This process's peak RSS (VmHWM; ru_maxrss would include the parent's peak from before spawn)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def load_as_rank(rank: int, path: str) -> dict:
    """Join 2 EP ranks and load the checkpoint (this rank's experts only, FP8 kept)."""
    from moespec.config import build_config
    from moespec.distributed import join_ranks
    from moespec.models import load_model
    from moespec.parallel import ep_experts_factory
    torch.nn.Linear(2, 2, device="meta")  # torch imports its meta-device kernels on first use
    baseline = peak_rss_bytes()  # after the imports
    config = build_config({"model": {"path": path}, "parallel": {"ep_size": 2, "timeout_s": 60}})
    ranks = join_ranks(config)
    try:
        model = load_model(path, "float32", quantization="auto", show_progress=False,
                           experts_factory=ep_experts_factory(ranks.runtime))
        held = sum(t.numel() * t.element_size() for t in {id(p): p for p in model.parameters()}.values())
        return {"baseline": baseline, "peak": peak_rss_bytes(), "held": held,
                "experts": model.model.layers[1].mlp.experts.num_local}
    finally:
        ranks.close()


def test_each_rank_reads_only_its_experts_and_keeps_fp8(tmp_path):
    """~420 MB of FP8 checkpoint (7 MoE layers + the MTP layer, 32 experts each); each of 2 ranks
    may grow its peak RSS by at most 0.6x the checkpoint while loading."""
    from moespec.parallel.local_launch import run_ranks
    size = write_fp8_deepseek(tmp_path, hidden=1024, moe_intermediate=512, experts=32, layers=8, vocab=256)
    assert size >= 300 * 2**20
    results = run_ranks(load_as_rank, 2, str(tmp_path), timeout_s=300)
    report = []
    for result in results:
        assert result.error is None, result.error
        r = result.value
        grown = r["peak"] - r["baseline"]
        report.append({"checkpoint_mb": size / 2**20, "held_mb": r["held"] / 2**20, "rss_growth_mb": grown / 2**20,
                       "ratio": grown / size})
        assert r["experts"] == 16
        assert grown <= 0.6 * size, report
    print("load memory per rank:", json.dumps(report))


@pytest.mark.gpu
def test_cuda_fp8_path_against_the_cpu_reference(fp8_deepseek):
    """The CUDA FP8 path (activations quantized per token per 128 channels, block-scaled
    scaled_mm, bf16) against the CPU reference (float32, unquantized activations): the error of
    the top-20 logprobs of each prompt's first token, and where greedy outputs first diverge."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=20)
    runs = {}
    for device, dtype in (("cpu", "float32"), ("cuda", "bfloat16")):
        llm = LLM(model=fp8_deepseek, quantization="fp8", device=device, dtype=dtype, page_size=4, num_kv_pages=128)
        runs[device] = llm.generate(PROMPTS, params, use_tqdm=False)
    errors, divergences = [], []
    for cpu, gpu in zip(runs["cpu"], runs["cuda"]):
        top_cpu, top_gpu = cpu.logprobs[0].top, gpu.logprobs[0].top
        errors += [abs(top_cpu[t] - top_gpu[t]) for t in top_cpu if t in top_gpu]
        same = [a == b for a, b in zip(cpu.token_ids, gpu.token_ids)]
        divergences.append(same.index(False) if False in same else None)
    print(json.dumps({"max_top20_logprob_error": max(errors), "mean_top20_logprob_error": sum(errors) / len(errors),
                      "first_greedy_divergence": divergences}))
    assert max(errors) < 0.5
