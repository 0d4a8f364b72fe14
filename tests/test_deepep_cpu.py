"""The DeepEP backend (parallel.moe_backend: deepep) end to end on the CPU: 2 ranks over gloo, each
with the fake `deep_ep` (tests/fake_deep_ep.py, which enforces DeepEP's contracts) installed.

The tiny DeepSeek here has hidden size 2048, one DeepEP's kernels are built for, so nothing is
patched: `check_deepep_model` (at `EPRuntime.configure`) and the fake's low-latency hidden check
run as they would on GPUs (8 experts of intermediate 32 and 4 heads keep a forward cheap).

Prefill steps run DeepEP's normal mode, decode and verify steps its low-latency mode, and prefill
steps come between decode steps, so the buffer must be cleaned before each return to low latency
(the fake refuses a low-latency call on a dirty buffer). Two steps leave the mode to the layers
(`DeepEPExperts.fixed_exchange`): with replicated attention one of them is low latency, and the
other, microbatched, runs one half in low latency and the other (130 tokens: a share past the
capacity) in normal mode within the same forward. Under data-parallel attention each rank runs
its own requests, and a rank without any joins the others' MoE layers (`EPRuntime.join`), in
both modes. The target and MTP logits of every step, on every rank, must equal one process's over
the same requests and batches within bf16 tolerance, with and without microbatching; each rank's
one Buffer must be built once, serve every MoE layer (the MTP layer's too), see exactly the calls
the steps make, and be destroyed by `runtime.close()`. FP8 low-latency dispatch is checked within
FP8's rounding.

Then the engine across ranks (moe_backend: deepep, engine after engine on one Buffer) against one
process's greedy outputs; the Buffer built while the overlap helper agrees on the next step on
the control group, in the interleaving that once paired their collectives wrongly; and the
stand-in itself: DeepEP's results and refusals at the Buffer level.

Every test spawns 2 ranks (parallel.local_launch.run_ranks): a rank that fails, hangs or dies is
reported within 40 s (collectives time out after 10), never left hanging.
"""
from __future__ import annotations

import contextlib
import time

import pytest
import torch

from moespec.attention import AttentionMetadata, TorchPagedAttention, plan_forward
from moespec.config import EngineConfig, ParallelSection
from moespec.kv_cache import KVCache, PageAllocator
from moespec.models import load_model
from moespec.parallel import EPRuntime, destroy, ep_experts_factory, init_parallel, split_point
from moespec.parallel.local_launch import run_ranks
from test_distributed_engine import run_schedule as serve_greedy  # -> (outputs, verify steps)
from tiny_models import save_tiny_deepseek

HIDDEN = 2048
PROMPTS = [[5, 17, 3, 99, 42, 7, 8, 1, 60, 2, 11], [9, 4, 4, 30, 2, 11, 18, 40, 6], [70, 71, 72, 73, 74, 75, 76, 77],
           [1, 2, 3, 4], [(7 * i + 3) % 120 for i in range(131)]]
# Each step: {request: tokens} and low_latency (False: DeepEP's normal mode, True: low latency,
# None: the layers pick). Data-parallel: requests 0, 2, 4 on rank 0, 1 and 3 on rank 1.
SCHEDULE = [({0: 6, 1: 4}, False),  # prefill
            ({0: 1, 1: 1}, True),  # decode
            ({0: 2, 1: 1}, None),  # verify (1 + k): replicated, every share fits -> low latency
            ({2: 5, 0: 1}, False),  # a prefill beside a decode (dp: rank 1 joins in normal mode)
            ({0: 1, 1: 1, 2: 1}, True),  # decode: the buffer cleaned after normal mode first
            ({3: 3, 4: 130, 1: 1}, None),  # replicated, microbatched: halves of 3 (low latency) and 131 tokens
            ({1: 1, 2: 1, 3: 1, 4: 1}, True),
            ({2: 1}, True)]  # one token: replicated, one rank dispatches nothing; dp: rank 1 joins
CAPACITY = 8  # max_tokens_per_rank asked; DeepEP's runtime rounds it so that G*C is whole 128-row tiles (64)
MOE_LAYERS = 3  # the target's layers 1 and 2, and the MTP layer
TOLERANCE = 0.03  # of the reference's largest |logit| (bf16's 8 bits of mantissa, through 3 layers + MTP)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-deepseek-2048")
    save_tiny_deepseek(path, mtp=True, hidden=HIDDEN, max_positions=256)  # 8 experts of 32: a forward in ms
    return str(path)


def build_step(requests: dict[int, int], done: list[int], pages: list[list[int]], page_size: int):
    """Token ids [T], each one's next token (the MTP input) [T], and the step's attention metadata."""
    ids, nxt, positions, qo, kv, indices, last = [], [], [], [0], [0], [], []
    for i, n in requests.items():
        prompt, end = PROMPTS[i], done[i] + n
        assert end <= len(prompt), (i, done[i], n)
        ids += prompt[done[i]:end]
        nxt += (prompt + [0])[done[i] + 1:end + 1]
        positions += range(done[i], end)
        qo.append(qo[-1] + n)
        used = -(-end // page_size)
        indices += pages[i][:used]
        kv.append(kv[-1] + used)
        last.append(end - (used - 1) * page_size)
    t = torch.tensor
    return t(ids), t(nxt), AttentionMetadata(t(qo), t(kv), t(indices), t(last), t(positions), page_size)


def run_schedule(model, runtime: EPRuntime | None, own: set[int] | None = None, layers: list | None = None,
                 page_size: int = 4) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(step, target logits [T, V], MTP logits [T, V]) of each step that has tokens of the requests
    `own` (None: all), batched as SCHEDULE says. With a runtime, a step without any joins the other
    ranks' MoE layers (`layers`: the target's, then the MTP layer's), as data-parallel ranks do."""
    allocator = PageAllocator(64, page_size)
    cache = KVCache(model.kv_cache_spec(), 64, page_size, torch.bfloat16)
    pages = [allocator.allocate(allocator.pages_for(len(p))) for p in PROMPTS]
    done, out = [0] * len(PROMPTS), []
    for step, (requests, low_latency) in enumerate(SCHEDULE):
        mine = {i: n for i, n in requests.items() if own is None or i in own}
        with torch.no_grad():
            if not mine:
                if runtime is not None:
                    runtime.join(layers, torch.bfloat16, low_latency)
                continue
            ids, nxt, meta = build_step(mine, done, pages, page_size)
            ctx = plan_forward(TorchPagedAttention(), meta, cache.layers)
            with runtime.step(meta.qo_indptr.tolist(), low_latency) if runtime else contextlib.nullcontext():
                hidden = model(ids, meta.positions, ctx)
                mtp = model.forward_mtp(0, nxt, hidden, meta.positions, ctx)
            out.append((step, model.compute_logits(hidden).float(), model.compute_mtp_logits(0, mtp).float()))
        for i, n in mine.items():
            done[i] += n
    assert all(done[i] == len(p) for i, p in enumerate(PROMPTS) if own is None or i in own)
    return out


def own_requests(attention: str, rank: int) -> set[int] | None:
    """Replicated attention: every rank runs every request; data-parallel: the even ones on rank 0,
    the odd ones on rank 1 (rank 1 has none in steps 3 and 7: it joins the MoE layers of rank 0's
    forwards with no rows, in normal mode, then in low latency)."""
    return None if attention == "replicated" else {i for i in range(len(PROMPTS)) if i % 2 == rank}


def deepep_rank(rank: int, checkpoint: str, attention: str, microbatch: bool, fp8: bool = False) -> dict:
    """One rank: the fake installed, a DeepEP runtime and model, the schedule; what the Buffer saw."""
    import fake_deep_ep
    from moespec.parallel.ep_moe import DeepEPExperts
    fake_deep_ep.install()
    fake_deep_ep.TIMEOUT_S = 10  # a fake collective a peer never joins fails well within the test's limit
    ctx = init_parallel(ParallelSection(ep_size=2, timeout_s=10))
    runtime = EPRuntime(ctx, backend="deepep", microbatch=microbatch, max_tokens_per_rank=CAPACITY,
                        dp=attention == "dp")
    try:
        model = load_model(checkpoint, dtype=torch.bfloat16, show_progress=False,
                           experts_factory=ep_experts_factory(runtime))
        config = EngineConfig(parallel=ParallelSection(ep_size=2, moe_backend="deepep", attention=attention,
                                                       microbatch=microbatch, fp8_dispatch=fp8))
        runtime.configure(config, model.config, torch.bfloat16)  # check_deepep_model, unpatched
        layers = [m for m in model.modules() if isinstance(m, DeepEPExperts)]
        start = time.monotonic()
        logits = run_schedule(model, runtime, own_requests(attention, rank), layers)
        seconds = time.monotonic() - start
    except BaseException:
        with contextlib.suppress(Exception):  # the first error is the one to see, not the peer's at close
            runtime.close()
        with contextlib.suppress(Exception):
            destroy(ctx)
        raise
    runtime.close()  # destroys the Buffer (a collective of the fake's, as DeepEP's destroy is)
    destroy(ctx)
    buffers = fake_deep_ep.Buffer.instances
    return {"logits": logits, "seconds": seconds, "layers": len(layers), "capacity": runtime.max_tokens_per_rank,
            "buffers": len(buffers), "destroyed": [b.destroyed for b in buffers],
            "calls": dict(buffers[0].calls) if buffers else {}, "sized_for": buffers[0].sized_for if buffers else None,
            "released": runtime.buffer is None}


def expected_calls(attention: str, microbatch: bool, rank: int) -> dict[str, int]:
    """The Buffer calls each step's MoE layers make on a rank, from what the project documents:
    both halves of a microbatched forward always run (split at `split_point`, a joined step's at
    0); a half runs low latency when the step says so, or, left to the layers, with replicated
    attention when the largest rank's share of it fits the capacity (data-parallel: normal mode).
    Per layer, the halves send in turn, then take back in turn; a low-latency half's send is a
    dispatch and its take-back a combine (each through the buffer), a normal-mode half's send a
    layout, a dispatch and a combine (its take-back an all-gather alone). A low-latency use of the
    buffer after a normal-mode one cleans it first."""
    calls = dict.fromkeys(["get_dispatch_layout", "dispatch", "combine", "low_latency_dispatch",
                           "low_latency_combine", "clean_low_latency_buffer"], 0)
    own, last = own_requests(attention, rank), None
    for requests, low_latency in SCHEDULE:
        sizes = [n for i, n in requests.items() if own is None or i in own]
        bounds = [sum(sizes[:j]) for j in range(len(sizes) + 1)]
        split = split_point(bounds) if microbatch else None
        halves = [bounds[-1]] if split is None else [split, bounds[-1] - split]
        fits = [attention == "replicated" and -(-n // 2) <= 64 for n in halves]
        fast = [low_latency if low_latency is not None else fit for fit in fits]
        for _ in range(MOE_LAYERS):
            for use in fast + [True for f in fast if f]:  # sends, then the low-latency take-backs
                calls["clean_low_latency_buffer"] += use and last is False
                last = use
            calls["low_latency_dispatch"] += fast.count(True)
            calls["low_latency_combine"] += fast.count(True)
            for name in ("get_dispatch_layout", "dispatch", "combine"):
                calls[name] += fast.count(False)
    return calls


@pytest.mark.timeout(50)
@pytest.mark.parametrize("attention", ["replicated", "dp"])
@pytest.mark.parametrize("microbatch", [False, True])
def test_deepep_backend_matches_single_process(checkpoint, attention, microbatch):
    """Every rank's target and MTP logits equal one process's over the same requests and batches;
    each rank's one Buffer saw exactly the calls the steps make, and was destroyed at close."""
    outcomes = run_ranks(deepep_rank, 2, checkpoint, attention, microbatch, timeout_s=40)
    errors = [f"rank {o.rank}: {o.error}" for o in outcomes if o.error is not None]
    assert not errors, "\n".join(errors)  # every rank's: one's failure shows as a peer failure on the other
    model = load_model(checkpoint, dtype=torch.bfloat16, show_progress=False)
    for outcome in outcomes:
        got, reference = outcome.value, run_schedule(model, None, own_requests(attention, outcome.rank))
        assert got["layers"] == MOE_LAYERS and got["buffers"] == 1, got
        assert got["destroyed"] == [True] and got["released"], got
        assert got["sized_for"] == (got["capacity"], HIDDEN, 8) and got["capacity"] == 64, got
        assert got["calls"] == expected_calls(attention, microbatch, outcome.rank), got["calls"]
        assert [step for step, _, _ in got["logits"]] == [step for step, _, _ in reference]
        scale = max(max(t.abs().max().item(), m.abs().max().item()) for _, t, m in reference)
        for (step, target, mtp), (_, want_target, want_mtp) in zip(got["logits"], reference):
            error = max((target - want_target).abs().max().item(), (mtp - want_mtp).abs().max().item())
            assert error < TOLERANCE * scale, (attention, microbatch, outcome.rank, step, SCHEDULE[step], error, scale)


@pytest.mark.timeout(50)
def test_deepep_fp8_dispatch_feeds_the_experts_dequantized_rows(checkpoint):
    """parallel.fp8_dispatch: low-latency dispatches in FP8 (e4m3 rows, per-128 scales, DeepEP's
    column-major layout) reach the experts dequantized: the logits stay within FP8's rounding of
    one process's, exact where every MoE layer ran normal mode (bf16 rows: step 0)."""
    outcomes = run_ranks(deepep_rank, 2, checkpoint, "replicated", True, True, timeout_s=40)
    errors = [f"rank {o.rank}: {o.error}" for o in outcomes if o.error is not None]
    assert not errors, "\n".join(errors)
    reference = run_schedule(load_model(checkpoint, dtype=torch.bfloat16, show_progress=False), None)
    scale = max(max(t.abs().max().item(), m.abs().max().item()) for _, t, m in reference)
    for outcome in outcomes:
        got = outcome.value
        want = expected_calls("replicated", True, outcome.rank)
        assert got["calls"] == {**want, "low_latency_dispatch use_fp8": want["low_latency_dispatch"]}, got["calls"]
        relative = [max((t - wt).abs().max().item(), (m - wm).abs().max().item()) / scale
                    for (_, t, m), (_, wt, wm) in zip(got["logits"], reference)]
        assert relative[0] == 0 and 0 < max(relative) < 0.08, relative


# ------------------------------------------------------------- the engine across ranks

# (arrival step, prompt, max_tokens): greedy continuations without near-ties (the top two logits at
# least 2% of the largest apart at every step, in float32), so that bf16 rounding, which differs
# with the batching (one process's batch, each rank's own, the fixed exchange's rows), cannot flip
# a token; arrivals spread out, the last after the others finished (ranks idle, joining)
ENGINE_REQUESTS = [(0, [32, 15, 63], 3), (0, [44, 45, 46, 47, 48, 49], 9), (2, [90, 33, 11, 4], 7),
                   (3, [1, 112, 48, 87, 27, 54, 92, 3, 67, 28], 5), (14, [11, 12], 6)]
ENGINE_SCENARIOS = [{"attention": "dp", "spec": {"mode": "none"}, "microbatch": True},  # ranks idle at times
                    {"attention": "replicated", "spec": {"mode": "mtp", "num_speculative_tokens": 1,
                                                         "adaptive": False}, "microbatch": False}]


def engine_config(checkpoint: str, ep_size: int, scenario: dict, overlap: bool = False):
    from moespec.config import build_config
    return build_config({"model": {"path": checkpoint, "dtype": "bfloat16"},
                         "cache": {"page_size": 4, "num_kv_pages": 64 * (3 - ep_size)},
                         "scheduler": {"max_num_seqs": 8, "overlap": overlap},
                         "speculation": scenario["spec"],
                         "parallel": {"ep_size": ep_size, "timeout_s": 10, "attention": scenario["attention"],
                                      "microbatch": scenario["microbatch"],
                                      "moe_backend": "deepep" if ep_size > 1 else "torch"}})


def engine_rank(rank: int, checkpoint: str, scenarios: list[dict], overlap: bool = False,
                interleave: bool = False) -> list:
    """Each scenario an Engine (moe_backend: deepep) on the same ranks, so one DeepEP Buffer serves
    them in turn. `interleave`: force the interleaving where rank 0's first forward builds the
    Buffer before its overlap helper agrees on the next step, and rank 1's after."""
    import threading

    import fake_deep_ep
    import moespec.parallel.ep_moe as ep_moe
    from moespec.distributed import Lockstep, join_ranks
    from moespec.engine import Engine
    fake_deep_ep.install()
    fake_deep_ep.TIMEOUT_S = 10
    if interleave:
        gather, agree = ep_moe.gather_hosts, Lockstep.agree

        def late_gather(ctx):
            time.sleep(1.0 if rank == 1 else 0.0)
            return gather(ctx)

        delayed = []  # rank 0's helper: its first agreement only

        def late_agree(self, *args, **kwargs):
            if rank == 0 and not delayed and threading.current_thread() is not threading.main_thread():
                delayed.append(time.sleep(1.0))
            return agree(self, *args, **kwargs)
        ep_moe.gather_hosts, Lockstep.agree = late_gather, late_agree
    ranks = join_ranks(engine_config(checkpoint, 2, scenarios[0], overlap))
    results = []
    try:
        for scenario in scenarios:
            engine = Engine(engine_config(checkpoint, 2, scenario, overlap), ranks=ranks)
            if ranks.ctx.leader:
                results.append(serve_greedy(engine, ENGINE_REQUESTS)[0])
                engine.stop_ranks()
            else:
                engine.serve_forever()
                results.append(None)
        buffers = fake_deep_ep.Buffer.instances
        calls = dict(buffers[0].calls) if buffers else {}
    finally:
        ranks.close()
    return [results, len(buffers), [b.destroyed for b in buffers], calls]


@pytest.mark.timeout(50)
def test_deepep_engine_across_ranks_matches_one_process(checkpoint):
    """The engine with moe_backend: deepep on 2 ranks (join_ranks, attach_ranks' configure, the
    step agreement, joins of idle ranks, MTP verify steps through DeepEP): greedy outputs equal one
    process's, engine after engine on one Buffer, destroyed when the ranks close."""
    from moespec.engine import Engine
    outcomes = run_ranks(engine_rank, 2, checkpoint, ENGINE_SCENARIOS, timeout_s=40)
    errors = [f"rank {o.rank}: {o.error}" for o in outcomes if o.error is not None]
    assert not errors, "\n".join(errors)
    for scenario, got in zip(ENGINE_SCENARIOS, outcomes[0].value[0]):
        one = Engine(engine_config(checkpoint, 1, scenario))
        want = serve_greedy(one, [(0, p, n) for _, p, n in ENGINE_REQUESTS])[0]
        assert got == want, scenario
    for outcome in outcomes:
        _, buffers, destroyed, calls = outcome.value
        assert buffers == 1 and destroyed == [True], outcome.value[1:]
        assert calls["dispatch"] and calls["low_latency_dispatch"] and calls["clean_low_latency_buffer"], calls


@pytest.mark.timeout(50)
def test_deepep_buffer_built_while_an_overlap_helper_agrees(checkpoint):
    """scheduler.overlap: the helper thread agrees on step 2 (an all-gather on the control group)
    while step 1's first MoE layer builds the DeepEP Buffer. Had the Buffer gathered the ranks'
    hosts then (an all-gather on the same group, from the engine's thread), ranks interleaving the
    two differently (here forced by delays; on GPUs by timing alone) would pair the collectives
    up wrongly, and gloo aborted. The hosts are gathered when the runtime is built, before any
    helper thread exists."""
    outcomes = run_ranks(engine_rank, 2, checkpoint, ENGINE_SCENARIOS[:1], True, True, timeout_s=40)
    errors = [f"rank {o.rank}: {o.error or f'exit code {o.exitcode}'}" for o in outcomes
              if o.error is not None or o.value is None]
    assert not errors, "\n".join(errors)


# ------------------------------------------------------------- the fake's own contracts

def raises(match: str, call, *args, **kwargs) -> None:
    """call(*args, **kwargs) raises an error whose message contains `match` (on every rank alike:
    each check runs before the call's collectives)."""
    try:
        call(*args, **kwargs)
    except (AssertionError, RuntimeError) as error:
        assert match in str(error), (match, str(error))
        return
    raise AssertionError(f"no error matching {match!r}")


def contracts_rank(rank: int) -> dict:
    """The fake at the Buffer level, built by the project's `build_deepep_buffer`: normal mode's and
    low latency's results against what every rank sent, and the contracts it holds callers to."""
    import torch.distributed as dist

    import fake_deep_ep
    fake_deep_ep.install()
    fake_deep_ep.TIMEOUT_S = 10
    ctx = init_parallel(ParallelSection(ep_size=2, timeout_s=10))
    runtime = EPRuntime(ctx, backend="deepep", max_tokens_per_rank=CAPACITY)
    C, E, G, L = runtime.max_tokens_per_rank, 8, 2, 4
    try:
        buf = runtime.deepep_buffer(HIDDEN, E, low_latency=False)
        assert buf.sized_for == (C, HIDDEN, E) and buf.low_latency_mode and buf.explicitly_destroy
        gen = torch.Generator().manual_seed(rank)
        T = 5
        x = torch.randn(T, HIDDEN, generator=gen).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=gen)[:2] for _ in range(T)])
        ids[0, 1], ids[1] = -1, -1  # one slot, and one token, routed to no expert
        w = torch.rand(T, 2, generator=gen)
        every = [[torch.empty_like(t) for _ in range(G)] for t in (x, ids, w)]
        for parts, t in zip(every, (x, ids, w)):
            dist.all_gather(parts, t)  # what every rank sends (the project's group: the fake has its own)

        # normal mode: layout, dispatch (rows grouped by source rank, local ids), unweighted combine
        per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, E)
        assert per_rdma is None and per_rank.dtype == per_expert.dtype == torch.int32 and in_rank.dtype == torch.bool
        assert per_expert.tolist() == torch.bincount(ids[ids >= 0], minlength=E).tolist()
        layout = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                      num_tokens_per_expert=per_expert)
        raises("topk_weights is torch.bfloat16", buf.dispatch, x, **layout, topk_idx=ids,
               topk_weights=w.to(torch.bfloat16))
        raises("not topk_idx's", buf.dispatch, x, **{**layout, "num_tokens_per_rank": per_rank.flip(0)},
               topk_idx=ids, topk_weights=w)
        recv_x, recv_ids, recv_w, per_expert_list, handle, _ = buf.dispatch(x, **layout, topk_idx=ids, topk_weights=w)
        want_x, want_ids, want_w = [], [], []
        for src_x, src_ids, src_w in zip(*every):
            here = ((src_ids >= 0) & (src_ids // L == rank)).any(1)
            local = torch.where((src_ids >= 0) & (src_ids // L == rank), src_ids - rank * L, -1)[here]
            want_x.append(src_x[here])
            want_ids.append(local)
            want_w.append(torch.where(local >= 0, src_w[here], 0.0))
        assert torch.equal(recv_x, torch.cat(want_x)) and torch.equal(recv_ids, torch.cat(want_ids))
        assert torch.equal(recv_w, torch.cat(want_w)) and recv_w.dtype == torch.float32
        assert per_expert_list == [int((recv_ids == e).any(1).sum()) for e in range(L)]
        raises("bfloat16 only", buf.combine, recv_x.float(), handle)
        raises("rows for the", buf.combine, recv_x[1:].contiguous(), handle)
        combined, _, _ = buf.combine(recv_x, handle)  # identity experts: each token back once per rank it went to
        assert torch.equal(combined, (x.float() * in_rank.sum(1, keepdim=True)).to(torch.bfloat16))

        # low latency after normal mode: only once cleaned, at the sized-for shape
        raises("without clean_low_latency_buffer", buf.low_latency_dispatch, x, ids, C, E, use_fp8=False)
        raises("differ from the", buf.clean_low_latency_buffer, C // 2, HIDDEN, E)
        buf.clean_low_latency_buffer(C, HIDDEN, E)
        raises("differ from the", buf.low_latency_dispatch, x, ids, C // 2, E, use_fp8=False)
        raises("bfloat16", buf.low_latency_dispatch, x.float(), ids, C, E, use_fp8=False)
        raises("topk_idx is torch.int32", buf.low_latency_dispatch, x, ids.int(), C, E, use_fp8=False)
        raises("contiguous", buf.low_latency_dispatch, x.t().contiguous().t(), ids, C, E, use_fp8=False)
        raises("hidden 1024", buf.low_latency_dispatch, x[:, :1024].contiguous(), ids, C, E, use_fp8=False)
        recv, counts, ll_handle, _, hook = buf.low_latency_dispatch(x, ids, C, E, use_fp8=False, return_recv_hook=True)
        raises("pending", buf.dispatch, x, **layout, topk_idx=ids, topk_weights=w)
        hook()
        assert counts.tolist() == [int((torch.cat(every[1]) == rank * L + e).sum()) for e in range(L)]
        raises("float32", buf.low_latency_combine, recv, ids, w.to(torch.bfloat16), ll_handle)
        raises("differs from its dispatch's", buf.low_latency_combine, recv, ids.flip(0), w, ll_handle)
        out, _, hook = buf.low_latency_combine(recv, ids, w, ll_handle, return_recv_hook=True)
        hook()  # identity experts: each token's rows weighted and summed
        want = (x.float() * torch.where(ids >= 0, w, 0).sum(1, keepdim=True))
        torch.testing.assert_close(out.float(), want, atol=0.02, rtol=0.02)
        # the double buffer: dispatch A's receive after dispatch B was issued is refused
        _, _, _, _, hook_a = buf.low_latency_dispatch(x, ids, C, E, use_fp8=False, return_recv_hook=True)
        _, _, _, _, hook_b = buf.low_latency_dispatch(x, ids, C, E, use_fp8=False, return_recv_hook=True)
        raises("received after", hook_a)
        hook_b()
        # FP8 low latency (DeepEP's default use_fp8): e4m3 rows and per-128 scales
        (values, scales), _, _, _, hook = buf.low_latency_dispatch(x, ids, C, E, return_recv_hook=True)
        hook()
        assert values.dtype == torch.float8_e4m3fn and scales.shape == (L, G * C, HIDDEN // 128)

        # the table of EP sizes, DeepEP's byte alignment, one live low-latency Buffer per process
        raises("Unsupported number of EP ranks: 3", fake_deep_ep.Buffer.get_dispatch_config, 3)
        raises("multiple of 128", fake_deep_ep.Buffer, ctx.ep_group, num_nvl_bytes=100)
        raises("second live low-latency Buffer", fake_deep_ep.Buffer, ctx.ep_group, 0, buf.num_rdma_bytes, True)

        # close destroys it (collectively); every call after raises
        runtime.close()
        assert buf.destroyed and runtime.buffer is None
        raises("after destroy()", buf.get_dispatch_layout, ids, E)
        raises("after destroy()", buf.low_latency_dispatch, x, ids, C, E)
        raises("after destroy()", buf.destroy)

        # a capacity past NVSHMEM's default queue depth: the project raises NVSHMEM_QP_DEPTH first
        big = EPRuntime(ctx, backend="deepep", max_tokens_per_rank=600)
        try:
            buf = big.deepep_buffer(HIDDEN, E, low_latency=True)
            assert buf.nvshmem_qp_depth >= 2 * (big.max_tokens_per_rank + 1) > 1024
            _, _, _, _, hook = buf.low_latency_dispatch(x[:1], ids[:1], big.max_tokens_per_rank, E, use_fp8=False,
                                                        return_recv_hook=True)
            hook()
        finally:
            big.close()
        return {"ok": True, "instances": len(fake_deep_ep.Buffer.instances)}
    except BaseException:
        with contextlib.suppress(Exception):
            runtime.close()
        raise
    finally:
        destroy(ctx)


@pytest.mark.timeout(50)
def test_fake_deep_ep_holds_callers_to_deepeps_contracts():
    """The stand-in itself, on 2 ranks: DeepEP's results in both modes, and its refusals."""
    outcomes = run_ranks(contracts_rank, 2, timeout_s=40)
    errors = [f"rank {o.rank}: {o.error}" for o in outcomes if o.error is not None]
    assert not errors, "\n".join(errors)  # every rank's: one's failure shows as a peer failure on the other
    assert [outcome.value for outcome in outcomes] == [{"ok": True, "instances": 2}] * 2
