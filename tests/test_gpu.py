"""The GPU suite (`pytest -m gpu`, run by benchmarks/run_gpu.sh): skipped without CUDA, each test
needing FlashInfer or DeepEP skipped without them.

- FlashInfer attention equals the torch backend for prefill, decode, verify and MLA.
- The fixed-capacity exchange on one GPU equals the same exchange on CPU, and DeepEP's
  low-latency kernels (when installed; two ranks, on one GPU or two) equal its emulation.
- Greedy output of every speculation mode on CUDA equals no speculation, and compiled, captured
  (CUDA graphs) and overlapped steps equal the plain engine.
"""
import importlib.util
import os

import pytest
import torch

from moespec.attention import TorchPagedAttention, create_backend
from moespec.batch import Span, pack_spans
from moespec.kv_cache import KVCache
from moespec.models.weights import KVSpec

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
needs_flashinfer = pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer")
needs_deepep = pytest.mark.skipif(importlib.util.find_spec("deep_ep") is None, reason="needs DeepEP")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (mode, query tokens per request): prefill chunks, decode, 1 + k verify tokens
SHAPES = [("prefill", 9), ("decode", 1), ("verify", 3)]


def attention_run(backend, spec: KVSpec, mode: str, q_len: int, heads: int, seed: int = 0,
                  device: str = "cuda") -> torch.Tensor:
    """One layer's attention over 3 requests with some KV history, in bfloat16 (also on the CPU,
    through tests/fake_flashinfer.py: tests/test_flashinfer_cpu.py)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    page = 16
    cache = KVCache([spec], 32, page, torch.bfloat16, device)
    spans = [Span([3 * b, 3 * b + 1, 3 * b + 2], 5 + 11 * b, [1] * q_len) for b in range(3)]
    batch = pack_spans(spans, page, mode, sampled=None if mode == "verify" else [True] * 3).to(device)
    backend.plan(batch.attention_metadata())
    layer = cache.layers[0]
    for t in (layer.k, layer.v):
        if t is not None:
            t.copy_(torch.randn(t.shape, generator=gen, device=device, dtype=torch.float32).to(t.dtype))
    T = batch.num_tokens
    q = torch.randn(T, heads, spec.k_dim, generator=gen, device=device).to(torch.bfloat16)
    k = torch.randn(T, spec.num_kv_heads, spec.k_dim, generator=gen, device=device).to(torch.bfloat16)
    v = None if layer.v is None else torch.randn(T, spec.num_kv_heads, spec.v_dim, generator=gen,
                                                 device=device).to(torch.bfloat16)
    return backend.run(q, k, v, layer, spec.k_dim ** -0.5, spec.v_dim).float()


@needs_flashinfer
@pytest.mark.parametrize("mode,q_len", SHAPES)
def test_flashinfer_equals_torch_attention_gqa(mode, q_len):
    spec = KVSpec(num_kv_heads=2, k_dim=128, v_dim=128)
    want = attention_run(TorchPagedAttention(), spec, mode, q_len, heads=8)
    got = attention_run(create_backend("flashinfer", "cuda"), spec, mode, q_len, heads=8)
    assert torch.allclose(got, want, atol=2e-2, rtol=2e-2), (got - want).abs().max()


@needs_flashinfer
@pytest.mark.parametrize("mode,q_len", SHAPES)
def test_flashinfer_equals_torch_attention_mla(mode, q_len):
    """DeepSeek's MLA: one latent KV head of 512 + 64 rope dims; values are the first 512."""
    spec = KVSpec(num_kv_heads=1, k_dim=576, v_dim=512, separate_v=False)
    want = attention_run(TorchPagedAttention(), spec, mode, q_len, heads=16)
    got = attention_run(create_backend("flashinfer", "cuda"), spec, mode, q_len, heads=16)
    assert torch.allclose(got, want, atol=2e-2, rtol=2e-2), (got - want).abs().max()


def exchange_on(device: str, backend: str = "torch", ctx=None, microbatch: bool = False,
                fp8_dispatch: bool = False) -> torch.Tensor:
    """A DeepSeek-shaped MoE layer (hidden 7168 is DeepEP's; 32 experts top-8) through the fixed-capacity
    exchange on `device` (EP=1 unless `ctx` says otherwise): each rank's 48 tokens, whole or as two
    microbatches in turns (each low-latency call received before the next is issued), dispatched
    in bf16 or FP8 (e4m3 rows, per-128 scales)."""
    from moespec.config import ParallelSection
    from moespec.parallel import EPExperts, EPRuntime
    from moespec.parallel.groups import single_process_context
    ctx = ctx or single_process_context(ParallelSection())
    runtime = EPRuntime(ctx, backend=backend, max_tokens_per_rank=64, microbatch=microbatch, dp=True,
                        fp8_dispatch=fp8_dispatch)
    try:
        torch.manual_seed(0)
        experts = EPExperts(32, 7168, 256, runtime, 8).to(device=device, dtype=torch.bfloat16)
        gen = torch.Generator().manual_seed(1 + ctx.ep_rank)
        x = torch.randn(48, 7168, generator=gen).to(device=device, dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(32, generator=gen)[:8] for _ in range(48)]).to(device)
        weights = torch.rand(48, 8, generator=gen).to(device=device, dtype=torch.bfloat16)
        with runtime.step(list(range(0, 49, 2)), low_latency=True):
            return experts(x, ids, weights).float().cpu()
    finally:
        runtime.close()


def test_fixed_capacity_exchange_on_gpu_equals_cpu():
    cpu, gpu = exchange_on("cpu"), exchange_on("cuda")
    assert torch.allclose(gpu, cpu, atol=5e-2, rtol=5e-2), (gpu - cpu).abs().max()


def deepep_rank(rank: int) -> dict:
    """One of two EP ranks: GPU rank % device_count (one GPU holds both ranks where there is only
    one), a gloo group (NCCL refuses two ranks on one GPU; DeepEP's Buffer uses its group for
    host objects only). DeepEP's low-latency kernels, whole, microbatched and with FP8 dispatch,
    against the emulated exchange over the same group on CPU."""
    import datetime

    import torch.distributed as dist

    from moespec.parallel import ParallelContext, destroy
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    cpu = ParallelContext(rank, 2, rank, dist.group.WORLD, rank, 2, rank == 0, torch.device("cpu"), 120.0)
    gpu = ParallelContext(rank, 2, rank, dist.group.WORLD, rank, 2, rank == 0, device, 120.0)
    try:
        want, want_fp8 = exchange_on("cpu", ctx=cpu), exchange_on("cpu", ctx=cpu, fp8_dispatch=True)
        return {"whole": (exchange_on(device, "deepep", gpu) - want).abs().max().item(),
                "halves": (exchange_on(device, "deepep", gpu, microbatch=True) - want).abs().max().item(),
                "fp8": (exchange_on(device, "deepep", gpu, fp8_dispatch=True) - want_fp8).abs().max().item()}
    finally:
        destroy(cpu)


@needs_deepep
def test_deepep_low_latency_equals_the_emulation_at_ep2():
    """DeepEP needs EP >= 2 (its config table starts at 2): two processes, on one GPU or two."""
    from moespec.parallel.local_launch import run_ranks
    for outcome in run_ranks(deepep_rank, 2, timeout_s=150):
        assert outcome.error is None, outcome.error
        # FP8: DeepEP's cast on the GPU may round a few e4m3 values the other way (bf16 vs FP8: 0.2)
        errors, limits = outcome.value, {"whole": 5e-2, "halves": 5e-2, "fp8": 1e-1}
        assert all(errors[key] < limit for key, limit in limits.items()), errors


@needs_deepep
def test_deepeps_config_table_holds_every_allowed_ep_size():
    """parallel.ep_size is checked against DEEPEP_EP_SIZES: the installed DeepEP has a config for each."""
    from deep_ep import Buffer

    from moespec.config import DEEPEP_EP_SIZES
    for size in DEEPEP_EP_SIZES:
        assert Buffer.get_dispatch_config(size) is not None and Buffer.get_combine_config(size) is not None


CASES = [("checkpoints/tiny-deepseek-v3", {"mode": "mtp", "num_speculative_tokens": 1}),
         ("checkpoints/tiny-deepseek-v3", {"mode": "mtp", "num_speculative_tokens": 3}),
         ("checkpoints/tiny-llama", {"mode": "draft", "draft_model": "checkpoints/tiny-llama-draft",
                                     "num_speculative_tokens": 4}),
         ("checkpoints/tiny-llama", {"mode": "mtp", "mtp_head": "checkpoints/tiny-llama-mtp-head",
                                     "num_speculative_tokens": 2})]


@pytest.mark.parametrize("model,spec", CASES, ids=lambda c: c if isinstance(c, str) else c["mode"])
def test_greedy_identity_of_every_speculation_mode_on_cuda(model, spec):
    from moespec import LLM, SamplingParams
    from moespec.bench import heldout_prompts
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    path = os.path.join(ROOT, model)
    plain = LLM(model=path, device="cuda")
    prompts = heldout_prompts(plain.get_tokenizer(), 4, 64)
    want = [o.token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]
    spec = {k: os.path.join(ROOT, v) if k in ("draft_model", "mtp_head") else v for k, v in spec.items()}
    fast = LLM(model=path, device="cuda", speculation={**spec, "adaptive": False})
    got = [o.token_ids for o in fast.generate(prompts, greedy, use_tqdm=False)]
    assert got == want
    assert fast.engine.spec_stats.steps > 0


@pytest.mark.parametrize("model, spec, options", [
    ("checkpoints/tiny-deepseek-v3", {"mode": "none"}, {"compile": True}),
    ("checkpoints/tiny-deepseek-v3", {"mode": "none"}, {"overlap": True}),
    ("checkpoints/tiny-deepseek-v3", {"mode": "mtp", "num_speculative_tokens": 2}, {"compile": True}),
    ("checkpoints/tiny-llama", {"mode": "none"}, {"compile": True, "overlap": True}),
    ("checkpoints/tiny-deepseek-v3", {"mode": "none"}, {"cuda_graph": True}),
    ("checkpoints/tiny-deepseek-v3", {"mode": "mtp", "num_speculative_tokens": 2},
     {"cuda_graph": True, "overlap": True}),
    ("checkpoints/tiny-llama", {"mode": "none"}, {"cuda_graph": True}),
])
def test_compiled_and_overlapped_steps_on_cuda_give_the_same_tokens(model, spec, options):
    """model.compile (torch.compile on CUDA), model.cuda_graph (CUDA graphs) and scheduler.overlap
    against the plain engine."""
    from moespec import LLM, SamplingParams
    from moespec.bench import heldout_prompts
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    path = os.path.join(ROOT, model)
    plain = LLM(model=path, device="cuda", speculation=spec, max_num_seqs=4)
    prompts = heldout_prompts(plain.get_tokenizer(), 4, 64)
    want = [o.token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]
    other = LLM(model=path, device="cuda", speculation=spec, max_num_seqs=4, compile_batch_sizes=[4], **options)
    other.engine.warm_up()
    assert [o.token_ids for o in other.generate(prompts, greedy, use_tqdm=False)] == want
    if options.get("cuda_graph"):
        from moespec.capture import CudaReplay
        captured = other.engine.runner.static.captured
        assert captured and all(isinstance(step.graph, CudaReplay) for step in captured.values())


@needs_flashinfer
@pytest.mark.parametrize("model", ["checkpoints/tiny-llama"])
def test_captured_flashinfer_steps_on_cuda_give_the_same_tokens(model):
    """model.cuda_graph on the FlashInfer backend (its CUDA-graph wrappers, planned before each
    replay) against eager FlashInfer steps, in bfloat16 (FlashInfer has no float32 kernels).
    tiny-deepseek-v3's latent is 128 + 16 dims; FlashInfer's MLA kernels take 512 + 64 only."""
    from moespec import LLM, SamplingParams
    from moespec.bench import heldout_prompts
    from moespec.capture import CudaReplay
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    options = dict(model=os.path.join(ROOT, model), device="cuda", dtype="bfloat16", attention_backend="flashinfer",
                   max_num_seqs=4)
    plain = LLM(**options)
    prompts = heldout_prompts(plain.get_tokenizer(), 4, 64)
    want = [o.token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]
    captured = LLM(**options, cuda_graph=True, compile_batch_sizes=[4])  # captured as it starts
    assert [o.token_ids for o in captured.generate(prompts, greedy, use_tqdm=False)] == want
    steps = captured.engine.runner.static.captured
    assert steps and all(isinstance(step.graph, CudaReplay) for step in steps.values())
