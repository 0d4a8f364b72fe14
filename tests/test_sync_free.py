"""No host sync inside a forward. The DeepSeek-V3 architecture (the released config's shapes, FP8
routed experts, the MTP layer) runs decode, verify and MTP forwards on the `meta` device, with
its routed experts behind the fixed-capacity exchange at EP=1. A meta tensor has no values: any
`.tolist()`, `.item()`, `.cpu()`, `int(t)`, `nonzero()` without a size, or other read of a value
on the host raises, so the forward passes only if nothing between the batch going in and the
logits coming out waits for the device. Attention is planned on the host beforehand, as on a GPU.
"""
import json
from pathlib import Path

import pytest
import torch

from moespec.attention import TorchPagedAttention, plan_forward
from moespec.batch import Span, pack_spans
from moespec.config import ParallelSection
from moespec.kv_cache import KVCache
from moespec.models import build_model
from moespec.models.deepseek_v3 import DeepseekV3Config
from moespec.models.llama import LlamaConfig
from moespec.parallel import EPExperts, EPRuntime
from moespec.parallel.groups import single_process_context

ROOT = Path(__file__).resolve().parent.parent
PAGE = 64


def deepseek_on_meta(runtime: EPRuntime, layers: int = 5) -> torch.nn.Module:
    """DeepSeek-V3 (config.json as released) cut to `layers` layers (3 dense, the rest MoE), FP8."""
    hf = json.loads((ROOT / "configs" / "deepseek-v3" / "config.json").read_text())
    hf["num_hidden_layers"] = layers
    config = DeepseekV3Config.from_hf(hf)

    def experts(c):
        return EPExperts(c.n_routed_experts, c.hidden_size, c.moe_intermediate_size, runtime, c.num_experts_per_tok)
    return build_model(config, torch.bfloat16, "meta", "fp8", experts_factory=experts)


def plan_on_host(spans: list[Span], mode: str, caches: list, runtime: EPRuntime | None):
    """The batch and its attention plan (each half's too, under two-batch overlap) built on the
    host, then moved to the device (meta)."""
    batch = pack_spans(spans, PAGE, mode, sampled=[True] * len(spans) if mode != "verify" else None)
    split = runtime.two_batch_split(batch.qo_bounds) if runtime else None
    ctx = plan_forward(TorchPagedAttention(), batch.attention_metadata(), caches, split)
    for backend in [ctx.backend] + [half.backend for half in ctx.halves or ()]:
        backend.slots = backend.slots.to("meta")
        for group in backend.groups:
            for name in ("rows", "kv_slots", "mask", "out_index"):
                if getattr(group, name) is not None:
                    setattr(group, name, getattr(group, name).to("meta"))
    return batch.to("meta"), ctx


def run_forwards(model, runtime: EPRuntime | None, mode: str, tokens_per_request: int) -> torch.Tensor:
    cache = KVCache(model.kv_cache_spec(), 64, PAGE, torch.bfloat16, "meta")
    spans = [Span([3 * b, 3 * b + 1, 3 * b + 2], 100 + 17 * b, [5] * tokens_per_request) for b in range(6)]
    batch, ctx = plan_on_host(spans, mode, cache.layers, runtime)
    step = runtime.step(batch.qo_bounds, low_latency=True) if runtime else torch.no_grad()
    with torch.inference_mode(), step:
        hidden = model(batch.input_ids, batch.positions, ctx)
        logits = model.compute_logits(hidden[batch.sample_indices])
        if hasattr(model, "forward_mtp") and getattr(model, "num_mtp_layers", 0):
            mtp = model.forward_mtp(0, batch.input_ids, hidden, batch.positions, ctx)  # the verify re-run
            logits = model.compute_mtp_logits(0, mtp)
    return logits


@pytest.fixture(scope="module")
def runtime():
    runtime = EPRuntime(single_process_context(ParallelSection()), microbatch=True, max_tokens_per_rank=256)
    yield runtime
    runtime.close()


@pytest.mark.parametrize("mode,tokens,two_batch", [("decode", 1, False), ("verify", 2, False), ("verify", 3, False),
                                                   ("decode", 1, True), ("verify", 2, True)])
def test_deepseek_forward_reads_nothing_on_the_host(runtime, mode, tokens, two_batch):
    """two_batch: the halves take turns through every layer (parallel.two_batch_overlap)."""
    runtime.two_batch, planned = two_batch, runtime.two_batch_plans
    try:
        model = deepseek_on_meta(runtime)
        logits = run_forwards(model, runtime, mode, tokens)
    finally:
        runtime.two_batch = False
    assert logits.device.type == "meta" and logits.shape == (6 if mode == "decode" else 6 * tokens, 129280)
    assert runtime.two_batch_plans - planned == int(two_batch)  # one plan: the target forward, then the MTP re-run


def test_draft_model_forward_reads_nothing_on_the_host():
    config = LlamaConfig.from_hf({"model_type": "llama", "vocab_size": 1000, "hidden_size": 256,
                                  "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "max_position_embeddings": 4096})
    logits = run_forwards(build_model(config, torch.bfloat16, "meta"), None, "decode", 1)
    assert logits.shape == (6, 1000)


def test_a_host_read_in_the_moe_layer_is_caught(runtime, monkeypatch):
    """Put a `.tolist()` back into the MoE layer (as `bincount().tolist()` was): the forward fails."""
    masked = EPExperts.forward_masked

    def with_host_read(self, x, counts, dtype=None):
        counts.tolist()  # what a per-expert Python loop over the received counts would do
        return masked(self, x, counts, dtype)
    monkeypatch.setattr(EPExperts, "forward_masked", with_host_read)
    with pytest.raises((RuntimeError, NotImplementedError), match="meta"):
        run_forwards(deepseek_on_meta(runtime), runtime, "decode", 1)


def test_two_batch_overlap_in_the_old_order_is_refused(monkeypatch):
    """Two-batch overlap runs above under the emulated DeepEP double buffer, one low-latency call
    in flight. With receive-before-issue taken out (the order before: B's dispatch issued while
    A's is in flight), the emulation refuses A's receive, as DeepEP would hang."""
    from moespec.parallel import ParallelError
    from moespec.parallel.exchange import LowLatencyExchange
    monkeypatch.setattr(LowLatencyExchange, "receive_in_flight", lambda self: None)
    runtime = EPRuntime(single_process_context(ParallelSection()), microbatch=True, max_tokens_per_rank=256,
                        two_batch=True)
    try:
        with pytest.raises(ParallelError, match=r"dispatch #0 received after dispatch #1 was issued"):
            run_forwards(deepseek_on_meta(runtime), runtime, "verify", 2)
    finally:
        runtime.close()
