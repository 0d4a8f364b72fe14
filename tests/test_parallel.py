"""Expert parallelism on CPU: ranks are local processes joined over gloo.

EP=2 and EP=4 must reproduce the single-process target and MTP logits, with and without two-way
microbatching and a modelled slow link; a rank that dies must make the others fail clearly.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import time

import pytest
import torch

from moespec.attention import AttentionMetadata, TorchPagedAttention, plan_forward
from moespec.config import ParallelSection, load_config
from moespec.kv_cache import KVCache, PageAllocator
from moespec.models import load_model
from moespec.parallel import (Collectives, EPRuntime, LinkModel, ParallelContext, ParallelError, ThrottledCollectives, destroy,
                              ep_experts_factory, init_parallel, parse_nodelist, read_launch_env, split_point)
from moespec.parallel.ep_moe import DeepEPExperts, EPExperts
from moespec.parallel.local_launch import run_ranks
from tiny_models import save_tiny_deepseek

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [[5, 17, 3, 99, 42, 7, 8, 1, 60, 2, 11], [9, 4, 4, 30], [70, 71, 72, 73, 74, 75, 76], [1, 2]]
CHUNKS = (None, 2)  # whole prompts at once (prefill), then 2 tokens per request (1 + k verify, k = 1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-deepseek-mtp")
    save_tiny_deepseek(path, mtp=True)
    return str(path)


@pytest.fixture(scope="module")
def reference(checkpoint):
    model = load_model(checkpoint, show_progress=False)
    return {chunk: paged_target_and_mtp(model, PROMPTS, chunk, None) for chunk in CHUNKS}


def paged_target_and_mtp(model, prompts: list[list[int]], chunk: int | None, runtime: EPRuntime | None,
                         page_size: int = 4, low_latency: bool | None = None,
                         halved: list | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each prompt's target logits [L, V] and MTP logits [L, V] (MTP fed token i+1 at position i),
    all requests batched per step in chunks of `chunk` tokens each. `halved` gets, for each step
    planned as two halves (two-batch overlap), its request count and whether the forwards ran
    every layer's attention on each half's own plan, the halves taking turns."""
    allocator = PageAllocator(64, page_size)
    cache = KVCache(model.kv_cache_spec(), 64, page_size, torch.float32)
    pages = [allocator.allocate(allocator.pages_for(len(p))) for p in prompts]
    done, target, mtp = [0] * len(prompts), [[] for _ in prompts], [[] for _ in prompts]
    while any(d < len(p) for d, p in zip(done, prompts)):
        active = [i for i, p in enumerate(prompts) if done[i] < len(p)]
        ids, nxt, meta = build_step(prompts, pages, done, active, chunk or max(map(len, prompts)), page_size)
        split = runtime.two_batch_split(meta.qo_indptr.tolist()) if runtime else None
        ctx = plan_forward(TorchPagedAttention(), meta, cache.layers, split)  # split: two-batch overlap
        attended = record_attention(ctx) if split is not None else None
        with torch.no_grad(), (runtime.step(meta.qo_indptr.tolist(), low_latency) if runtime else contextlib.nullcontext()):
            hidden = model(ids, meta.positions, ctx)
            target_calls = list(attended or ())
            logits = model.compute_logits(hidden)
            mtp_logits = model.compute_mtp_logits(0, model.forward_mtp(0, nxt, hidden, meta.positions, ctx))
        if attended is not None and halved is not None:
            mtp_calls = attended[len(target_calls):]
            halved.append((len(active), took_turns(target_calls, model.config.num_hidden_layers)
                           and sorted(mtp_calls) == [0, 1]))
        qo = meta.qo_indptr.tolist()
        for j, i in enumerate(active):
            target[i].append(logits[qo[j]:qo[j + 1]])
            mtp[i].append(mtp_logits[qo[j]:qo[j + 1]])
            done[i] += qo[j + 1] - qo[j]
    return [torch.cat(t) for t in target], [torch.cat(m) for m in mtp]


def record_attention(ctx) -> list:
    """The plan each attention call of a two-batch forward runs on, in order: "whole", 0 or 1."""
    calls = []
    for name, backend in [("whole", ctx.backend)] + [(i, half.backend) for i, half in enumerate(ctx.halves)]:
        backend.run = lambda *args, run=backend.run, name=name: (calls.append(name), run(*args))[1]
    return calls


def took_turns(calls: list, layers: int) -> bool:
    """Every layer's attention ran once on each half's plan, none on the whole batch's, and the
    second half's first layer ran before the first half's last one (the halves took turns)."""
    last_first = len(calls) - 1 - calls[::-1].index(0) if 0 in calls else -1
    return calls.count(0) == calls.count(1) == layers and "whole" not in calls and calls.index(1) < last_first


def build_step(prompts: list[list[int]], pages: list[list[int]], done: list[int], active: list[int], chunk: int,
               page_size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Token ids [T], the next token of each (MTP input) [T], and the step's attention metadata."""
    ids, nxt, positions, qo, kv, indices, last = [], [], [], [0], [0], [], []
    for i in active:
        end = min(done[i] + chunk, len(prompts[i]))
        ids += prompts[i][done[i]:end]
        nxt += (prompts[i] + [0])[done[i] + 1:end + 1]
        positions += range(done[i], end)
        qo.append(qo[-1] + end - done[i])
        used = -(-end // page_size)
        indices += pages[i][:used]
        kv.append(kv[-1] + used)
        last.append(end - (used - 1) * page_size)
    tensor = torch.tensor
    meta = AttentionMetadata(tensor(qo), tensor(kv), tensor(indices), tensor(last), tensor(positions), page_size)
    return tensor(ids), tensor(nxt), meta


def ep_rank(rank: int, checkpoint: str, ep_size: int, variants: list[tuple], die: bool = False, hang: bool = False,
            timeout_s: float = 20) -> list[dict] | dict:
    """Each variant (microbatch, latency_s, low_latency) run in turn on one process group, a
    runtime and model of its own each. microbatch: False, True (within each MoE layer) or
    "two_batch" (across the whole forward)."""
    ctx = init_parallel(ParallelSection(ep_size=ep_size, timeout_s=timeout_s))
    start = time.monotonic()
    results = []
    try:
        for microbatch, latency_s, low_latency in variants:
            results.append(run_variant(rank, ctx, checkpoint, microbatch, latency_s, low_latency, die, hang, timeout_s))
        return results
    except ParallelError as error:
        return {"error": str(error), "seconds": time.monotonic() - start}
    finally:
        destroy(ctx)


def run_variant(rank: int, ctx: ParallelContext, checkpoint: str, microbatch: bool | str, latency_s: float,
                low_latency: bool | None, die: bool, hang: bool, timeout_s: float) -> dict:
    link = ThrottledCollectives(ctx, LinkModel(latency_s, 1e9)) if latency_s else None
    runtime = EPRuntime(ctx, link, microbatch=bool(microbatch), two_batch=microbatch == "two_batch")
    try:
        model = load_model(checkpoint, show_progress=False, experts_factory=ep_experts_factory(runtime))
        if die and rank == ctx.world_size - 1:
            os._exit(3)  # a crashed rank: no goodbye to its peers
        if hang and rank == ctx.world_size - 1:
            time.sleep(2 * timeout_s)  # a stuck rank: alive, silent
        # the fixed-capacity exchange takes at most max_tokens_per_rank (256) tokens per rank: every chunk fits
        halved = []
        out = {chunk: paged_target_and_mtp(model, PROMPTS, chunk, runtime, low_latency=low_latency, halved=halved)
               for chunk in CHUNKS}
        return {**out, "halved": halved}
    finally:
        runtime.close()


def max_error(got: tuple, want: tuple) -> float:
    return max((g - w).abs().max().item() for gs, ws in zip(got, want) for g, w in zip(gs, ws))


# (microbatch, latency_s, low_latency) run by each EP size's ranks in one process group:
EP_VARIANTS = {
    2: [(False, 0.0, None), (True, 0.002, None),  # the uneven exchange, sequential and microbatched
        (True, 0.002, True),  # the fixed-capacity exchange
        ("two_batch", 0.002, None)],  # two-batch overlap
    4: [(True, 0.0, None), (False, 0.0, True), ("two_batch", 0.0, True)]}


@pytest.mark.parametrize("ep_size", list(EP_VARIANTS))
def test_ep_matches_single_process(checkpoint, reference, ep_size):
    """Each variant's logits on every rank equal one process's; with them, microbatched equals sequential."""
    outcomes = run_ranks(ep_rank, ep_size, checkpoint, ep_size, EP_VARIANTS[ep_size], timeout_s=120)
    for outcome in outcomes:
        assert outcome.error is None, outcome.error
        assert isinstance(outcome.value, list), outcome.value
    for i, (microbatch, latency_s, low_latency) in enumerate(EP_VARIANTS[ep_size]):
        variant = (ep_size, microbatch, latency_s, low_latency)
        ranks = [outcome.value[i] for outcome in outcomes]
        if microbatch == "two_batch":  # batches of 2+ requests ran as halves in turns; the last steps' 1 request did not
            requests = [n for n, _ in ranks[0]["halved"]]
            assert requests.count(4) >= 2 and 1 not in requests, (variant, ranks[0]["halved"])
            assert all(turns for _, turns in ranks[0]["halved"]), (variant, ranks[0]["halved"])
        for chunk in CHUNKS:
            for values in ranks:  # every rank ends with the full batch's logits
                error = max_error(values[chunk], reference[chunk])
                assert error < 1e-5, (variant, chunk, error)


def test_dead_rank_fails_peers_clearly(checkpoint):
    start = time.monotonic()
    outcomes = run_ranks(ep_rank, 2, checkpoint, 2, [(True, 0.0, None)], True, timeout_s=50)
    survivor, dead = outcomes
    assert dead.exitcode == 3
    assert survivor.error is None and "error" in survivor.value, survivor
    assert "peer rank" in survivor.value["error"] and "rank 0 of 2" in survivor.value["error"]
    assert survivor.value["seconds"] < 30 and time.monotonic() - start < 50


def test_stuck_rank_fails_peers_after_timeout(checkpoint):
    outcomes = run_ranks(ep_rank, 2, checkpoint, 2, [(False, 0.0, None)], False, True, 4.0, timeout_s=20)
    survivor = outcomes[0]
    assert survivor.error is None and "error" in survivor.value, survivor
    assert "peer rank" in survivor.value["error"] and survivor.value["seconds"] < 15


def test_split_point_keeps_requests_whole():
    assert split_point([0, 2, 4, 6, 8]) == 4  # 2 * D verify tokens: D requests per half
    assert split_point((0, 1, 5)) == 1
    assert split_point([0, 7]) in (0, 7)  # one request: one half is empty
    assert split_point([0]) == 0


def test_launch_env_torchrun_and_slurm():
    env = read_launch_env({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "7"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port) == (1, 4, 1, "h", 7)
    env = read_launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                           "SLURM_NODELIST": "gpu[07-09,12],cpu1"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr) == (5, 8, 1, "gpu07")
    assert parse_nodelist("gpu[07-09,12],cpu1,n[8-10]") == ["gpu07", "gpu08", "gpu09", "gpu12", "cpu1", "n8", "n9",
                                                             "n10"]
    assert read_launch_env({}) is None


def test_layout_errors_name_both_values():
    with pytest.raises(ParallelError, match="needs a launcher"):
        init_parallel(ParallelSection(ep_size=2), env={})
    ctx = ParallelContext(0, 3, 0, None, 0, 3, True, torch.device("cpu"))
    with pytest.raises(ParallelError, match="n_routed_experts 8 is not divisible by parallel.ep_size 3"):
        EPExperts(8, 16, 8, fake_runtime(ctx), 2)


def fake_runtime(ctx: ParallelContext) -> EPRuntime:
    runtime = EPRuntime.__new__(EPRuntime)
    runtime.ctx = ctx
    return runtime


def test_ep2_config_loads():
    config = load_config(os.path.join(ROOT, "configs", "tiny-deepseek-mtp-ep2.yaml"))
    assert (config.parallel.ep_size, config.parallel.moe_backend, config.parallel.microbatch,
            config.parallel.dist_backend) == (2, "torch", True, "gloo")


DP_VARIANTS = [(False, None), (True, None), (False, True), (True, True)]  # (microbatch, low_latency)


def dp_experts_rank(rank: int) -> list[list[float]]:
    """Each variant of DP_VARIANTS on one process group, a runtime of its own each."""
    ctx = init_parallel(ParallelSection(ep_size=3, timeout_s=20))
    try:
        return [dp_experts_errors(rank, ctx, microbatch, low_latency) for microbatch, low_latency in DP_VARIANTS]
    finally:
        destroy(ctx)


def dp_experts_errors(rank: int, ctx: ParallelContext, microbatch: bool, low_latency: bool | None) -> list[float]:
    """Data-parallel attention: each rank's own rows (rank 1 has none; rank 2 has one) through the
    EP experts; the error against the same experts run locally over those rows."""
    from moespec.models.moe import LocalExperts
    runtime = EPRuntime(ctx, microbatch=microbatch, dp=True)
    torch.manual_seed(0)
    full = LocalExperts(6, 16, 8)  # the same weights on every rank
    experts = EPExperts(6, 16, 8, runtime, top_k=2)
    experts.w13.data.copy_(full.w13[experts.first: experts.first + experts.num_local])
    experts.w2.data.copy_(full.w2[experts.first: experts.first + experts.num_local])
    compiled = torch.compile(lambda *args: experts.forward_with_shared(*args, None), backend="eager", fullgraph=True)
    errors = []
    try:
        for step, T in enumerate(([5, 0, 1], [0, 3, 2], [0, 0, 4])):
            gen = torch.Generator().manual_seed(100 * step + rank)
            n = T[rank]
            x = torch.randn(n, 16, generator=gen)
            ids = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(n)]) if n else \
                torch.zeros(0, 2, dtype=torch.int64)
            weights = torch.rand(n, 2, generator=gen)
            qo = torch.tensor([0, n // 2, n])
            with runtime.step(qo.tolist(), low_latency):
                got = experts.forward_with_shared(x, ids, weights, None)
            errors.append((got - full(x, ids, weights)).abs().max().item() if n else float(got.shape[0]))
            # as a compiled step runs it: rows padded past the real ones, the layer an opaque op
            # that exchanges the real rows only and gives the padded ones zeros
            pad = torch.randn(2, 16, generator=gen), torch.randperm(6, generator=gen)[:4].view(2, 2), torch.rand(2, 2)
            with runtime.step(qo.tolist(), low_latency):
                got = compiled(torch.cat([x, pad[0]]), torch.cat([ids, pad[1]]), torch.cat([weights, pad[2]]))
            errors.append((got[:n] - full(x, ids, weights)).abs().max().item() if n else 0.0)
            errors.append(got[n:].abs().max().item())
        runtime.join([experts], torch.float32)  # every rank without work: the empty joins pair up
    finally:
        runtime.close()
    return errors


def test_dp_experts_each_rank_gets_its_own_rows_back():
    outcomes = run_ranks(dp_experts_rank, 3, timeout_s=120)
    for outcome in outcomes:
        assert outcome.error is None, outcome.error
        for variant, errors in zip(DP_VARIANTS, outcome.value):
            assert max(errors) < 1e-5, (variant, errors)


def test_deepep_backend_without_deepep_says_what_to_install():
    if importlib.util.find_spec("deep_ep") is not None:
        pytest.skip("DeepEP is installed here")
    runtime = fake_runtime(ParallelContext(0, 2, 0, None, 0, 2, True, torch.device("cpu")))
    runtime.buffer, runtime.max_tokens_per_rank = None, 64
    experts = DeepEPExperts(8, 16, 8, runtime, 2)
    assert (experts.first, experts.num_local) == (0, 4)
    with pytest.raises(ParallelError, match="DeepEP built from source"):
        runtime.deepep_buffer(16, 8, low_latency=True)


def test_deepep_refuses_models_its_kernels_do_not_take_at_engine_build():
    """DeepEP's kernels take bf16 rows, eight hidden sizes and at most 11 experts a token: other
    models are refused by name when the engine is built (`configure`), not by an assertion on one
    rank at the first MoE call while the others wait."""
    from types import SimpleNamespace

    from moespec.parallel.ep_moe import check_deepep_model
    check_deepep_model(7168, 8, torch.bfloat16, True)  # DeepSeek-V3
    for args, named in [((7168, 8, torch.float32, False), "model.dtype"), ((256, 2, torch.bfloat16, False), "hidden"),
                        ((4096, 12, torch.bfloat16, False), "num_experts_per_tok")]:
        with pytest.raises(ParallelError, match=named):
            check_deepep_model(*args)
    runtime = fake_runtime(ParallelContext(0, 2, 0, None, 0, 2, True, torch.device("cpu")))
    from moespec.config import EngineConfig
    runtime.backend, tiny = "deepep", SimpleNamespace(hidden_size=256, num_experts_per_tok=2)
    with pytest.raises(ParallelError, match="hidden size 256"):
        runtime.configure(EngineConfig(parallel=ParallelSection(ep_size=2, moe_backend="deepep")), tiny,
                          torch.bfloat16)
    runtime.backend = "torch"  # the emulated exchange takes any model
    runtime.configure(EngineConfig(parallel=ParallelSection(ep_size=2)), tiny, torch.float32)


@pytest.mark.parametrize("hosts,fits", [
    (["a", "a"], True), (["a"] * 8, True), (["a"] * 8 + ["b"] * 8, True), (["a"] * 4 + ["b"] * 4, False),
    (["a", "b"], False), (["a"] * 4 + ["b"] * 4 + ["c"] * 4 + ["d"] * 4, False)])
def test_deepep_needs_each_block_of_8_ranks_on_one_host(hosts, fits):
    """DeepEP takes each 8 consecutive ranks (all, if fewer) as one NVLink node and opens CUDA IPC
    handles between them: EP 2 over two single-GPU hosts, or 16 ranks on 4 hosts of 4, would
    fail inside the Buffer on every rank; it is refused naming the ranks and their hosts."""
    from moespec.parallel.ep_moe import check_deepep_hosts
    if fits:
        check_deepep_hosts(hosts)
    else:
        with pytest.raises(ParallelError, match="as one NVLink node"):
            check_deepep_hosts(hosts)


def test_deepep_ranks_pick_one_exchange_without_an_agreed_mode():
    """Without a mode agreed for the step, every rank must still pick the same DeepEP exchange (a
    rank in normal mode and one in low latency wait for each other forever): with replicated
    batches by the largest share, the same on every rank (2 ranks, T = 2C + 1: shares C and
    C + 1); under data-parallel attention, whose batches differ, normal mode."""
    C = 8
    for dp in (False, True):
        for T in (2 * C, 2 * C + 1):
            picks = []
            for rank in (0, 1):
                runtime = fake_runtime(ParallelContext(rank, 2, 0, None, rank, 2, rank == 0, torch.device("cpu")))
                runtime.buffer, runtime.low_latency, runtime.max_tokens_per_rank, runtime.dp = None, None, C, dp
                picks.append(DeepEPExperts(8, 16, 8, runtime, 2).fixed_exchange(T))
            assert picks == [not dp and T == 2 * C] * 2, (dp, T, picks)


def test_one_deepep_buffer_serves_one_model_shape():
    """The process's one DeepEP buffer was sized by DeepEP's hints for one (hidden, experts): a
    later engine of another shape is refused by name, not left to overrun it."""
    runtime = fake_runtime(ParallelContext(0, 2, 0, None, 0, 2, True, torch.device("cpu")))
    runtime.fixed, runtime.buffer, runtime.buffer_mode = None, object(), "low_latency"
    runtime.buffer_shape = (7168, 256)
    assert runtime.deepep_buffer(7168, 256, low_latency=True) is runtime.buffer
    with pytest.raises(ParallelError, match=r"sized for \(hidden, experts\) \(7168, 256\)"):
        runtime.deepep_buffer(4096, 256, low_latency=True)


def test_a_captured_step_cleans_deepeps_buffer_after_normal_mode():
    """A replay runs DeepEP's low-latency kernels without their Python: after normal-mode use
    (a prefill step) the buffer is cleaned before it, once, as the first eager low-latency call
    would; in low-latency mode already, nothing is done."""
    runtime = fake_runtime(ParallelContext(0, 2, 0, None, 0, 2, True, torch.device("cpu")))
    cleaned = []
    runtime.buffer = type("Buffer", (), {"clean_low_latency_buffer": lambda self, *args: cleaned.append(args)})()
    runtime.buffer_shape, runtime.buffer_mode, runtime.max_tokens_per_rank = (7168, 256), "normal", 64
    runtime.before_replay()
    runtime.before_replay()
    assert cleaned == [(64, 7168, 256)] and runtime.buffer_mode == "low_latency"


def test_a_captured_steps_padded_rows_take_no_room_in_the_exchange():
    """In a captured step the rows past the real ones route to no expert: the fixed-capacity
    exchange carries the real rows' (token, expert) pairs only, their outputs equal those of the
    real rows alone, and the padded rows come back as zeros."""
    from moespec.parallel.groups import single_process_context
    from moespec.static_step import run_captured
    runtime = EPRuntime(single_process_context(ParallelSection()), max_tokens_per_rank=8)
    try:
        torch.manual_seed(0)
        experts = EPExperts(8, 16, 8, runtime, 2)
        gen = torch.Generator().manual_seed(1)
        x, weights = torch.randn(6, 16, generator=gen), torch.rand(6, 2, generator=gen)
        ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(6)])
        dispatched = record_dispatches(runtime.exchange(8))
        with runtime.step([0, 4], low_latency=True):
            alone = experts(x[:4], ids[:4], weights[:4])
        with runtime.step([0, 6], low_latency=True):
            got = run_captured(experts, (x, ids, weights), torch.tensor(4))
        assert [int(counts.sum()) for counts in dispatched] == [8, 8]  # 4 real rows x top-2, both times
        torch.testing.assert_close(got[:4], alone)
        assert not got[4:].any()
    finally:
        runtime.close()


def test_interleave_takes_turns_and_returns_each_result():
    """models/two_batch.py: generators stepped first, second, first, ... until each ends; a
    shorter one drops out; `drive` runs one alone."""
    from moespec.models.two_batch import drive, interleave
    log = []

    def run(name: str, stages: int):
        for i in range(stages):
            log.append(f"{name}{i}")
            yield
        log.append(f"{name}-end")
        return name * 2

    assert interleave([run("a", 2), run("b", 3)]) == ["aa", "bb"]
    assert log == ["a0", "b0", "a1", "b1", "a-end", "b2", "b-end"]
    assert drive(run("c", 2)) == "cc"


def record_dispatches(exchange) -> list[torch.Tensor]:
    """The received counts [L] of every dispatch through `exchange` (valid once each is received)."""
    counts, dispatch = [], exchange.dispatch

    def recorded(*args, **kwargs):
        call = dispatch(*args, **kwargs)
        counts.append(call.value.counts)
        return call
    exchange.dispatch = recorded
    return counts


# ------------------------------------------------------- DeepEP's low-latency contracts, emulated

def local_runtime(**options) -> EPRuntime:
    from moespec.parallel.groups import single_process_context
    return EPRuntime(single_process_context(ParallelSection()), **options)


def routed_batch(T: int, hidden: int = 16, experts: int = 8, seed: int = 1):
    """x [T, M], top-2 expert ids [T, 2], gate weights [T, 2]."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(T)])
    return torch.randn(T, hidden, generator=gen), ids, torch.rand(T, 2, generator=gen)


def test_emulated_buffer_refuses_a_receive_after_the_next_call():
    """DeepEP's low-latency Buffer flips between two buffers, and a call's send zeroes the other
    buffer's receive counters: a receive must finish before the next call is issued. The old
    microbatch order (A-dispatch sent, B-dispatch sent, A received) is refused, naming both calls;
    receive-then-issue passes, and so do DeepEP's other asserts."""
    from moespec.parallel.exchange import EmulatedBuffer
    runtime = local_runtime(max_tokens_per_rank=8)
    try:
        buffer = EmulatedBuffer(runtime, 8)
        x, ids, _ = routed_batch(3)
        _, _, _, _, hook_a = buffer.low_latency_dispatch(x, ids, 8, 8, return_recv_hook=True)
        _, _, _, _, hook_b = buffer.low_latency_dispatch(x, ids, 8, 8, return_recv_hook=True)
        with pytest.raises(ParallelError, match=r"dispatch #0 received after dispatch #1 was issued.*buffer 0"):
            hook_a()
        hook_b()
        recv, counts, handle, _, hook = buffer.low_latency_dispatch(x, ids, 8, 8, return_recv_hook=True)
        hook()
        with pytest.raises(ParallelError, match="ran twice"):
            hook()
        out, _, hook = buffer.low_latency_combine(recv, ids, torch.ones(3, 2), handle, return_recv_hook=True)
        hook()
        torch.testing.assert_close(out, 2 * x)  # each token back from its two experts, unweighted rows summed
        assert counts.tolist() == torch.bincount(ids.flatten(), minlength=8).tolist()
        for args, match in [((x, ids.int(), 8, 8), "topk_idx is torch.int32"), ((x, ids, 2, 8), "exceed its capacity"),
                            ((x, ids, 3, 8), "not a multiple of 4"), ((x.to("meta"), ids, 8, 8), "different devices")]:
            with pytest.raises(ParallelError, match=match):
                buffer.low_latency_dispatch(*args, return_recv_hook=True)
    finally:
        runtime.close()


@pytest.mark.parametrize("captured", [False, True])
def test_microbatches_keep_one_low_latency_call_in_flight(captured, monkeypatch):
    """Two microbatches in turns through the fixed-capacity exchange, eager and as a captured
    step runs (transfers inline, padded rows): equal to the experts run locally, each call received
    before the next is issued. With the receive-before-issue taken out (the order before), the
    emulated double buffer refuses A's dispatch receive after B's dispatch was issued."""
    from moespec.models.moe import LocalExperts
    from moespec.parallel.exchange import LowLatencyExchange
    from moespec.static_step import run_captured
    runtime = local_runtime(microbatch=True, max_tokens_per_rank=8)
    try:
        torch.manual_seed(0)
        experts = EPExperts(8, 16, 8, runtime, 2)
        x, ids, weights = routed_batch(6)
        want = LocalExperts.forward(experts, x, ids, weights)

        def run():
            with runtime.step([0, 2, 3, 6], low_latency=True):
                if captured:
                    return run_captured(experts, (x, ids, weights), torch.tensor(6))
                return experts(x, ids, weights)
        torch.testing.assert_close(run(), want)
        assert runtime.captured_halves == int(captured)
        monkeypatch.setattr(LowLatencyExchange, "receive_in_flight", lambda self: None)
        with pytest.raises(ParallelError, match=r"dispatch #\d+ received after dispatch #\d+ was issued"):
            run()
    finally:
        runtime.close()


def test_an_idle_rank_joins_on_the_weights_device():
    """A rank with no tokens (data-parallel attention) joins the others' MoE layers with zero-row
    inputs on its experts' device (NCCL and DeepEP take device tensors; DeepEP allocates its
    receive buffers like its input): here `meta`. An input on another device is refused by name."""
    runtime = local_runtime(max_tokens_per_rank=8, dp=True)
    try:
        with torch.device("meta"):
            experts = EPExperts(8, 16, 8, runtime, 2)
        runtime.join([experts], torch.float32, low_latency=True, capacity=4)
        x, ids, weights = routed_batch(2)
        with runtime.step([0, 2], low_latency=True), pytest.raises(ParallelError, match="input x is on cpu.*meta"):
            experts(x, ids.to("meta"), weights.to("meta"))
    finally:
        runtime.close()


def test_deepep_backend_needs_an_ep_size_in_deepeps_table():
    """Buffer.get_dispatch_config asserts for an EP size its table lacks (1 has no exchange)."""
    from moespec.config import ConfigError, EngineConfig
    for size in (1, 2, 16, 160):
        assert EngineConfig(parallel=ParallelSection(ep_size=size, moe_backend="deepep")).parallel.ep_size == size
    for size in (3, 6, 12, 256):
        with pytest.raises(ConfigError, match=rf"parallel.ep_size {size} .*allowed: 2, 4, 8, 16, 24, 32, 64, 128"):
            EngineConfig(parallel=ParallelSection(ep_size=size, moe_backend="deepep"))
    EngineConfig(parallel=ParallelSection(ep_size=6))  # the torch backend takes any size


def test_capacity_is_aligned_for_deepep():
    """DeepEP asserts (num_ranks * C) % 4 == 0: the runtime rounds C up."""
    from moespec.parallel.exchange import aligned_capacity
    assert [aligned_capacity(c, 2) for c in (1, 2, 3, 4, 5)] == [2, 2, 4, 4, 6]
    assert [aligned_capacity(c, 1) for c in (1, 4, 5)] == [4, 4, 8]
    assert [aligned_capacity(c, g) for c, g in ((3, 4), (3, 16), (7, 6))] == [3, 3, 8]
    assert local_runtime(max_tokens_per_rank=5).max_tokens_per_rank == 8


def test_deepep_capacity_gives_every_expert_whole_deep_gemm_row_tiles():
    """With DeepEP each local expert receives G*C rows, which DeepGEMM's masked GEMM takes only as
    whole 128-row tiles (a partial tile writes into the next expert's rows): the runtime rounds C
    so that G*C is a multiple of 128, and the plan sizes DeepEP's buffer for that C."""
    from moespec.parallel.exchange import aligned_capacity, capacity_rows
    assert capacity_rows("deepep") == 128 and capacity_rows("torch") == 4
    cases = ((99, 2), (5, 16), (9, 16), (1, 128), (3, 6))
    assert [aligned_capacity(c, g, 128) for c, g in cases] == [128, 8, 16, 1, 64]
    assert local_runtime(max_tokens_per_rank=99, backend="deepep").max_tokens_per_rank == 128
    assert local_runtime(max_tokens_per_rank=99).max_tokens_per_rank == 100


def test_fp8_dispatch_casts_rows_as_deepep():
    """Per 128 channels of a row: scale = max(|x|, 1e-4) / 448 and e4m3 values; dequantized,
    each value is within e4m3's rounding (3 mantissa bits: 1/16 relative, or the subnormal step)."""
    from moespec.models.fp8 import dequantize_rows
    from moespec.parallel.exchange import quantize_per_block
    x = torch.randn(5, 512) * torch.logspace(-3, 3, 5)[:, None]
    x[0, :128] = 0  # an all-zero block takes the margin
    values, scales = quantize_per_block(x)
    assert values.dtype == torch.float8_e4m3fn and scales.shape == (5, 4)
    amax = x.abs().view(5, 4, 128).amax(-1)
    torch.testing.assert_close(scales, amax.clamp(min=1e-4) / 448)
    back = dequantize_rows(values, scales, torch.float32)
    step = scales.repeat_interleave(128, 1) * 2.0 ** -9  # e4m3's smallest subnormal, scaled
    assert ((back - x).abs() <= x.abs() / 16 + step).all()
    assert (values.float().abs().view(5, 4, 128).amax(-1)[1:] == 448).all()  # each block's largest maps to 448


def test_fp8_dispatch_feeds_the_experts_fp8_rows_and_scales():
    """parallel.fp8_dispatch: the received rows are (e4m3 [L, G*C, M], float32 scales [L, G*C, M/128]
    in DeepEP's column-major layout), about half a bf16 dispatch's bytes; the layer's output is the
    experts over the dequantized rows. A hidden size DeepEP cannot cast (% 512) is refused."""
    from moespec.models.moe import LocalExperts
    from moespec.models.fp8 import dequantize_rows
    from moespec.parallel.exchange import quantize_per_block
    runtime = local_runtime(max_tokens_per_rank=8, fp8_dispatch=True)
    try:
        torch.manual_seed(0)
        experts = EPExperts(8, 512, 32, runtime, 2)
        x, ids, weights = routed_batch(5, hidden=512)
        sent, all_to_all = [], runtime.collectives.all_to_all_fixed
        runtime.collectives.all_to_all_fixed = lambda send, *rest: sent.append(send.shape) or all_to_all(send, *rest)
        received, dispatch = [], runtime.exchange(8).dispatch
        runtime.fixed.dispatch = lambda *args: received.append(dispatch(*args)) or received[-1]
        with runtime.step([0, 5], low_latency=True):
            got = experts(x, ids, weights)
        values, scales = received[0].value.x
        assert values.dtype == torch.float8_e4m3fn and values.shape == (8, 8, 512)
        assert scales.shape == (8, 8, 4) and scales.stride() == (32, 1, 8)  # [L, M/128, G*C] transposed
        assert sent[0][1] == 8 * (512 + 4 * 4) + 8  # C rows of e4m3 + scales, + the count: bf16 would be 8 * 1024
        want = LocalExperts.forward(experts, dequantize_rows(*quantize_per_block(x), torch.float32), ids, weights)
        torch.testing.assert_close(got, want)
        assert (got - LocalExperts.forward(experts, x, ids, weights)).abs().max() < 0.1 * want.abs().max()
        runtime.fixed.dispatch = dispatch
        small = EPExperts(8, 256, 32, runtime, 2)
        with runtime.step([0, 5], low_latency=True), pytest.raises(ParallelError, match="parallel.fp8_dispatch"):
            small(*routed_batch(5, hidden=256))
    finally:
        runtime.close()


def test_the_emulated_buffer_hands_over_what_deepep_does_and_takes_only_what_it_takes():
    """As DeepEP's low-latency dispatch: int32 counts, and rows past them as the buffer held them
    (here NaN, rows and FP8 scales alike: a path that read them would show); non-contiguous
    inputs are refused (DeepEP asserts them contiguous)."""
    from moespec.parallel.exchange import EmulatedBuffer
    runtime = local_runtime(max_tokens_per_rank=8)
    try:
        buffer = EmulatedBuffer(runtime, 8)
        x, ids, _ = routed_batch(5, hidden=512)
        for fp8 in (False, True):
            recv, counts, _, _, hook = buffer.low_latency_dispatch(x, ids, 8, 8, use_fp8=fp8, return_recv_hook=True)
            hook()
            rows, scales = recv if fp8 else (recv, None)
            assert counts.dtype == torch.int32 and counts.sum() == 10
            for e, count in enumerate(counts.tolist()):
                assert not rows[e, :count].float().isnan().any() and rows[e, count:].float().isnan().all()
                if fp8:
                    assert scales[e, count:].isnan().all() and not scales[e, :count].isnan().any()
        with pytest.raises(ParallelError, match="x .* is not contiguous"):
            buffer.low_latency_dispatch(x.t().contiguous().t(), ids, 8, 8)
        with pytest.raises(ParallelError, match="topk_idx .* is not contiguous"):
            buffer.low_latency_dispatch(x, ids.t().contiguous().t(), 8, 8)
    finally:
        runtime.close()


def test_helper_threads_run_on_this_ranks_cuda_device(monkeypatch):
    """torch.cuda.set_device holds per thread: the overlap scheduler's prepare thread and the EP
    comm thread set this rank's device before they build a tensor (a new thread is on cuda:0)."""
    import threading

    from moespec.overlap import HostWorker
    from moespec.parallel.comm import CommStream
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append((str(d), threading.current_thread().name)))
    worker = HostWorker()
    worker.submit(lambda: None).result()
    worker.close()
    ctx = ParallelContext(1, 2, 1, None, 1, 2, False, torch.device("cuda", 1))
    stream = CommStream(Collectives(ctx))
    stream.run("job", lambda: None)
    stream.close()
    assert [(d, name.split("_")[0]) for d, name in calls] == [("3", "moespec-prepare"), ("cuda:1", "ep-comm-1")]
