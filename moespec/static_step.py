"""Static steps: uniform batches run at bucketed batch sizes through a compiled forward.

A uniform batch is one where every request has the same number Q of queries and of sampled
rows: decode (Q = 1), verify (Q = 1 + k, every row sampled) and draft steps of one token (a
draft model's catch-up over several unseen tokens runs eager: its length varies). Its B
requests are padded to the smallest bucket >= B, so a step sees a handful of shapes, each
compiled once (`torch.compile`; the KV length is a dynamic dimension, marked as such after every
plan). A padded request holds one page, the cache's scratch page, which the allocator never
hands out: it writes its Q keys there, its queries attend to them alone, and its rows are cut
off before sampling. Prefill chunks, mixed batches and trees run eager. `Engine.warm_up`
compiles every shape that can run, and serving then compiles nothing: dynamo guards on more than
shapes (whether a tensor was made in inference mode), so plans never are inference tensors and
the compiled step's token ids always are.

With `model.cuda_graph` each shape is instead captured once and replayed (`CapturedStep`: a
CUDA graph on CUDA, a checked replay elsewhere, moespec.capture): its inputs and plan are copied
into buffers of its own before each replay, and its plan covers a fixed KV length, bucketed like
the batch sizes (`kv_lengths`) where the backend's plan has the KV length in its shapes (the
torch backend; FlashInfer's CUDA-graph wrappers do not, so there one length, the capacity, serves).

The attention backend plans the padded batch outside the compiled region (as FlashInfer's
CUDA-graph wrappers plan outside capture). The static backend is separate from the runner's
own, which still plans the real batch: the MTP layer's re-run over a verify batch reuses that plan.

Shapes legend: T tokens, B requests, Q queries per request, N sampled rows, M hidden, V vocab.
"""
from __future__ import annotations

import bisect
import contextlib
import copy
import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from moespec.attention import ForwardContext, create_backend
from moespec.batch import Batch, pack_spans
from moespec.capture import CaptureError, new_graphs
from moespec.models.layers import CAPTURING, REAL_ROWS

logger = logging.getLogger(__name__)

STATIC_MODES = ("decode", "verify", "draft_extend")
# the shortest KV length a captured step's plan covers: shorter batches pay a little padded
# attention rather than one more graph per batch size and query count
SMALLEST_KV_LENGTH = 256
COMPILE_BACKEND = "inductor"  # tests of the padding logic swap in "eager"


def batch_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (and max_num_seqs itself), as the serving
    stacks choose their CUDA-graph batch sizes."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8)) + [max_num_seqs]
    return tuple(sorted(set(sizes)))


@dataclass(frozen=True)
class StaticSpec:
    """How uniform batches run static (`model.compile`, `model.cuda_graph`)."""

    buckets: tuple[int, ...]  # the batch sizes they are padded to
    compile: bool = True  # through torch.compile
    capture: bool = False  # captured once per shape and replayed (CapturedStep)
    kv_capacity: int = 0  # captured: the most KV positions a request's plan covers (max_model_len, whole pages)
    smallest_kv_length: int = SMALLEST_KV_LENGTH  # captured: the shortest


def kv_lengths(page_size: int, capacity: int, smallest: int) -> tuple[int, ...]:
    """The KV lengths a captured step's plan is padded to: `smallest` in whole pages, doubled
    until the capacity, and the capacity itself (a graph's shapes are fixed, so each length is
    captured apart)."""
    first = -(-smallest // page_size) * page_size
    sizes = [first << i for i in range(capacity.bit_length()) if first << i < capacity]
    return tuple(sizes) + (capacity,)


def static_spec(config, max_model_len: int) -> StaticSpec | None:
    """The config's static steps (None: model.compile and model.cuda_graph are off). A captured
    step plans its requests over at most max_model_len positions, rounded up to whole pages."""
    m = config.model
    if not (m.compile or m.cuda_graph):
        return None
    buckets = tuple(sorted(set(m.compile_batch_sizes or batch_buckets(config.scheduler.max_num_seqs))))
    if m.cuda_graph and not m.device.startswith("cuda"):
        logger.warning("model.cuda_graph on %s: each replay re-runs the step under a check against its capture "
                       "(moespec.capture), slower than eager; CUDA graphs need a CUDA device", m.device)
    S = config.cache.page_size
    return StaticSpec(buckets, m.compile, m.cuda_graph, -(-max_model_len // S) * S if m.cuda_graph else 0,
                      SMALLEST_KV_LENGTH)


def model_step(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, sample_indices: torch.Tensor,
               ctx: ForwardContext, hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A model's forward -> (hidden [T, M], logits [N, V] float32 at sample_indices)."""
    out = model(input_ids, positions, ctx)
    return out, model.compute_logits(out[sample_indices]).float()


def mtp_step(mtp: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, sample_indices: torch.Tensor,
             ctx: ForwardContext, hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """An MTP layer (or head) over the target's hidden states [T, M] -> (hidden [T, M], logits [N, V])."""
    out = mtp.forward_mtp(0, input_ids, hidden, positions, ctx)
    return out, mtp.compute_mtp_logits(0, out[sample_indices]).float()


@dataclass
class StaticBatch:
    """A uniform batch padded to its bucket; its first `num_requests` requests, `num_tokens`
    rows and `num_sampled` sampled rows are the real ones."""

    batch: Batch
    num_requests: int
    num_tokens: int
    num_sampled: int
    ctx: ForwardContext  # its plan (a snapshot: the next step may be planned while this one runs)
    kv_length: int = 0  # captured: the KV positions its plan covers per request (0: the batch's longest)


def uniform_shape(batch: Batch) -> tuple[int, int] | None:
    """(Q, sampled rows per request) of a uniform batch, read from host copies; None otherwise."""
    bounds = batch.qo_bounds
    B, T, N = len(bounds) - 1, batch.num_tokens, batch.sample_indices.numel()
    if B < 1 or T % B or N % B:
        return None
    Q = T // B
    if any(bounds[b + 1] - bounds[b] != Q for b in range(B)) or N // B not in (1, Q):
        return None
    return Q, N // B


def pad_batch(batch: Batch, size: int, scratch_page: int, shape: tuple[int, int] | None = None) -> Batch:
    """`batch` (uniform) with requests added up to `size`, each at the last Q positions of the
    scratch page (so every padded request reads S slots: no dimension of size 1, which a compiled
    graph would specialize on); their sampled rows follow the real ones. Everything comes from
    the host copy; the real rows' token ids as they are on the device when the step runs (drafts,
    overlap's placeholders) are passed to `StaticSteps.forward`.
    `shape` (Q, sampled rows per request) for an empty batch (warm-up)."""
    host = batch.host or batch
    B, T, S = len(host.qo_bounds) - 1, host.num_tokens, host.page_size
    Q, per = shape or uniform_shape(host)
    pads = size - B
    ends = [T + Q * i for i in range(1, pads + 1)]  # end row of each padded request
    kv_end = int(host.kv_indptr[-1])
    parts = [host.input_ids.tolist() + [0] * (pads * Q),
             host.positions.tolist() + list(range(S - Q, S)) * pads,
             list(host.qo_bounds) + ends,
             host.kv_indptr.tolist() + [kv_end + i for i in range(1, pads + 1)],
             host.kv_indices.tolist() + [scratch_page] * pads,
             host.kv_last_page_len.tolist() + [S] * pads,
             host.sample_indices.tolist() + (list(range(T, T + pads * Q)) if per == Q else [e - 1 for e in ends])]
    # one host tensor viewed as the fields, as pack_spans builds them (one small copy, not a cat per field)
    flat = torch.tensor([x for part in parts for x in part], dtype=torch.int64)
    padded = Batch(host.mode, *flat.split([len(part) for part in parts]), page_size=S,
                   qo_bounds=tuple(host.qo_bounds) + tuple(ends))
    return padded.to(batch.input_ids.device)


class StaticSteps:
    """The static step of one model (`step`: model_step, mtp_step), compiled or captured per
    shape, its own attention backend, and the buckets it pads to."""

    def __init__(self, step, caches: list, attention_backend: str, device: torch.device, spec: StaticSpec,
                 scratch_page: int, page_size: int, input_hidden: tuple[int, torch.dtype] | None = None) -> None:
        """`input_hidden`: (M, dtype) of the hidden states an MTP step takes as input."""
        self.step, self.input_hidden, self.spec = step, input_hidden, spec
        self.buckets = tuple(sorted(spec.buckets))
        self.scratch_page, self.page_size, self.device = scratch_page, page_size, device
        self.backend = create_backend(attention_backend, device)
        self.kv_lengths = (0,)  # compiled alone: the KV length is a dynamic dimension
        if spec.capture:  # captured: bucketed, unless the backend's shapes are the same at every length
            self.kv_lengths = (kv_lengths(page_size, spec.kv_capacity, spec.smallest_kv_length)
                               if self.backend.shapes_follow_kv_length else (spec.kv_capacity,))
        self.caches = caches
        self.compile_s = 0.0  # wall time of calls that compiled or captured
        # (B, T, N, L) -> its compiled step (`compiled_for`), its captured step (`captured_for`);
        # L: the captured plan's KV length, 0 for a compiled step alone (the KV length is dynamic)
        self.compiled: dict[tuple[int, int, int, int], object] = {}
        self.captured: dict[tuple[int, int, int, int], CapturedStep] = {}
        self.graphs = new_graphs(device) if spec.capture else None
        # across ranks: the EP runtime its MoE layers exchange through (set by Engine.attach_ranks)
        self.runtime = None
        self.warming = False  # in `warm_up`, the only time a step across ranks is captured
        self.eager_runs = 0  # captured shapes run eager instead (across ranks: see `forward`)

    @property
    def shapes(self) -> set[tuple[int, int, int]]:
        """(B, T, N) of the steps compiled or captured so far."""
        return {shape[:3] for shape in (*self.compiled, *self.captured)}

    @torch.inference_mode(False)
    def plan(self, batch: Batch) -> StaticBatch | None:
        """Pad and plan (host work, outside the compiled region); None: run eager (not a
        uniform batch, queries that overflow the scratch page, larger than every bucket, or, when
        captured, KV longer than the captured plan covers).
        Never inference tensors, wherever it is called from (an MTP chain step plans inside
        inference mode, a verify batch outside): the compiled step guards on the difference,
        and would compile each bucket again."""
        shape = uniform_shape(batch) if batch.mode in STATIC_MODES and batch.custom_mask is None else None
        if shape is None or shape[0] > self.page_size:
            return None
        if batch.mode == "draft_extend" and shape[0] > 1:  # a draft's catch-up over tokens it has not seen
            return None  # (any count): eager, so that serving compiles only what the warm-up did
        B = len(batch.qo_bounds) - 1
        i = bisect.bisect_left(self.buckets, B)
        longest = int((batch.host or batch).positions.max()) + 1 if self.spec.capture else 0
        j = bisect.bisect_left(self.kv_lengths, longest)  # the shortest captured KV length that holds it
        if i == len(self.buckets) or j == len(self.kv_lengths):
            return None
        return self.plan_padded(pad_batch(batch, self.buckets[i], self.scratch_page, shape), B, batch.num_tokens,
                                batch.sample_indices.numel(), self.kv_lengths[j])

    @torch.inference_mode(False)
    def plan_padded(self, padded: Batch, num_requests: int, num_tokens: int, num_sampled: int,
                    kv_length: int = 0) -> StaticBatch:
        """Plan a padded batch (`kv_length`: over that many KV positions per request, captured)."""
        if self.spec.capture:
            self.backend.kv_capacity = kv_length
        self.backend.plan(padded.attention_metadata())
        if not kv_length:
            mark_kv_dynamic(self.backend)
        return StaticBatch(padded, num_requests, num_tokens, num_sampled,
                           ForwardContext(copy.copy(self.backend), self.caches), kv_length)

    def reuse(self, static: StaticBatch) -> StaticBatch:
        """Another model's static batch with its plan, on this model's caches (the MTP layer's
        re-run over the target's padded verify batch)."""
        return StaticBatch(static.batch, static.num_requests, static.num_tokens, static.num_sampled,
                           ForwardContext(static.ctx.backend, self.caches), static.kv_length)

    def warm_up(self, shapes: list[tuple[str, int, int]], one_row_each: bool = False) -> None:
        """Compile or capture every bucket for each (mode, Q, sampled rows per request) now, on
        batches of padded requests alone, rather than at a serving step (`one_row_each`: as
        `forward` with `rows`, the MTP layer's verify re-run), and captured, at every KV length.
        The largest first: captured graphs share one memory pool, which the smaller ones reuse.
        Across ranks every rank warms up alike, and each capture's forwards exchange tokens through
        the fixed-capacity exchange with the others' (as a graph will at each replay)."""
        self.warming = True
        try:
            self.warm_up_buckets(shapes, one_row_each)
        finally:
            self.warming = False

    def warm_up_buckets(self, shapes: list[tuple[str, int, int]], one_row_each: bool) -> None:
        for size in reversed(self.buckets):
            for mode, Q, per in shapes:
                if Q > self.page_size:
                    continue
                empty = pack_spans([], self.page_size, mode, []).to(self.device)
                hidden = (None if self.input_hidden is None else
                          torch.zeros(0, self.input_hidden[0], dtype=self.input_hidden[1], device=self.device))
                rows = torch.zeros(0, dtype=torch.int64, device=self.device) if one_row_each else None
                for kv_length in reversed(self.kv_lengths):
                    padded = pad_batch(empty, size, self.scratch_page, (Q, per))
                    with self.exchange_step(padded):
                        self.forward(self.plan_padded(padded, 0, 0, 0, kv_length), hidden=hidden, rows=rows)

    def exchange_step(self, padded: Batch):
        """A warm-up forward's step across ranks when captured: the fixed-capacity exchange."""
        if self.runtime is None or not self.spec.capture:
            return contextlib.nullcontext()
        return self.runtime.step(padded.qo_bounds, low_latency=True)

    @torch.inference_mode()
    def forward(self, static: StaticBatch, input_ids: torch.Tensor | None = None, hidden: torch.Tensor | None = None,
                rows: torch.Tensor | None = None, fixed_exchange: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hidden [T, M], logits [N, V] float32) of the real rows. `input_ids` [T]: the real
        rows' token ids as they are now (placed on the device after planning: drafts, or the
        previous step's tokens under overlap scheduling); `hidden` [T, M]: an MTP layer's input
        (padded rows get zeros); `rows` [B]: sample these rows, one per request, instead.
        Across ranks a captured step replays only when the step's MoE layers take the
        fixed-capacity exchange (`fixed_exchange`: decode or verify on every rank), which its
        graph holds, and only shapes the warm-up captured (a capture runs the step three times,
        which the other ranks' collectives would not pair with); otherwise its padded batch runs
        eager."""
        b, T, B = static.batch, static.num_tokens, static.num_requests
        pads = b.num_tokens - T
        # always a new tensor made here (in inference mode), warm-up or not: the compiled step guards on the kind
        ids = torch.cat([b.input_ids[:T] if input_ids is None else input_ids, b.input_ids[T:]])
        if hidden is not None:
            hidden = torch.cat([hidden, hidden.new_zeros(pads, hidden.shape[1])])
        sample, num_sampled = b.sample_indices, static.num_sampled
        if rows is not None:  # one row per request: the padded requests' last rows
            sample, num_sampled = torch.cat([rows, b.qo_indptr[B + 1:] - 1]), B
        shape = (len(b.qo_bounds) - 1, b.num_tokens, sample.numel(), static.kv_length)
        inputs = (ids, b.positions, sample, static.ctx, hidden)
        if self.spec.capture and self.runtime is not None and not (
                fixed_exchange and (self.warming or shape in self.captured)):
            self.eager_runs += 1
            hidden, logits = self.run_model(*inputs)
            return hidden[:T], logits[:num_sampled]
        start = time.perf_counter() if shape not in self.compiled and shape not in self.captured else None
        if self.spec.capture:
            hidden, logits = self.replay(shape, inputs, b, T)
        else:
            hidden, logits = self.compiled_for(shape)(*inputs)
        if start is not None:
            self.compile_s += time.perf_counter() - start
            logger.info("%s the static step for %d requests x %d tokens (KV length %d) in %.1f s",
                        "captured" if self.spec.capture else "compiled", shape[0], shape[1] // shape[0],
                        shape[3], time.perf_counter() - start)
        return hidden[:T], logits[:num_sampled]

    def replay(self, shape: tuple[int, int, int, int], inputs: tuple, padded: Batch,
               real_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured step of `shape` over `inputs` (captured now if new). Across ranks its MoE
        layers split the padded batch where they split it at capture, and keep the padded rows
        (past `real_rows`) out of the exchange."""
        if self.runtime is None:
            return self.captured_for(shape, inputs, None).replay(*inputs, None)
        self.runtime.before_replay()
        with self.runtime.padded_split(padded.qo_bounds):
            return self.captured_for(shape, inputs, real_rows).replay(*inputs, real_rows)

    def compiled_for(self, shape: tuple[int, int, int, int]):
        """The compiled step of one shape (B, T, N, L): its own dynamo cache entry, replayed without
        evaluating guards, as a captured graph is replayed. One entry per callable makes that
        sound: a shape's inputs differ from call to call only in the KV length (dynamic) and in
        values. With one callable for every shape, dynamo's cache lookup (the guards over the
        model's parameters, the plan and the caches of each entry) took 440 us a call at batch 1
        and 634 us at batch 16 on this CPU (tiny-deepseek-v3, profiled)."""
        if shape not in self.compiled:
            options = {"guard_filter_fn": torch.compiler.skip_all_guards_unsafe}
            if COMPILE_BACKEND == "inductor" and self.device.type == "cpu":
                options["cpp_wrapper"] = True  # the graph's calls made from C++, not Python (docs/static-steps.md)
            self.compiled[shape] = torch.compile(self.run_model, backend=COMPILE_BACKEND, dynamic=False,
                                                 isolate_recompiles=True, options=options)
        return self.compiled[shape]

    def captured_for(self, shape: tuple[int, int, int, int], inputs: tuple, real_rows: int | None) -> CapturedStep:
        """The captured step of one shape (B, T, N, KV length), captured now from these inputs
        (`real_rows` of them before the padding) if it is new (the compiled step when
        model.compile is on too)."""
        if shape not in self.captured:
            run = self.compiled_for(shape) if self.spec.compile else self.run_model
            self.captured[shape] = CapturedStep(run, inputs, self.graphs, real_rows)
        return self.captured[shape]

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, sample_indices: torch.Tensor,
                  ctx: ForwardContext, hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.step(input_ids, positions, sample_indices, ctx, hidden)


class CapturedStep:
    """One shape's step captured once and replayed: input buffers of its own (token ids,
    positions, sampled rows, an MTP step's input hidden states, the attention plan) that each
    replay refills in place, the graph, and its outputs. The model's weights and KV cache are
    read where they are."""

    def __init__(self, run, inputs: tuple, graphs, real_rows: int | None) -> None:
        """`real_rows`: the rows before the padding, kept as a device scalar the graph reads (across
        ranks, where the MoE layers keep padded rows out of the exchange); None: not kept."""
        ids, positions, sample, ctx, hidden = inputs
        self.buffers = [t.clone() for t in (ids, positions, sample) + ((hidden,) if hidden is not None else ())]
        self.real_rows = None if real_rows is None else torch.tensor(real_rows, device=ids.device)  # []
        self.backend = ctx.backend.static_plan()  # the plan's tensors, at addresses of their own
        fixed = ForwardContext(self.backend, ctx.caches)
        args = (*self.buffers[:3], fixed, self.buffers[3] if hidden is not None else None)
        self.graph = graphs.capture(lambda: run_captured(run, args, self.real_rows))

    def replay(self, ids: torch.Tensor, positions: torch.Tensor, sample: torch.Tensor, ctx: ForwardContext,
               hidden: torch.Tensor | None, real_rows: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hidden [T, M], logits [N, V]) of this step's inputs, copies of the graph's outputs
        (the next replay overwrites those); `real_rows`: the batch's rows before its padding."""
        names = ("token ids", "positions", "sampled rows", "input hidden states")
        for name, buffer, value in zip(names, self.buffers, (ids, positions, sample, hidden)):
            if buffer.shape != value.shape:
                raise CaptureError(f"{name} {tuple(value.shape)} differ from the captured {tuple(buffer.shape)}")
            buffer.copy_(value)
        if self.real_rows is not None:
            self.real_rows.fill_(real_rows)
        self.backend.load_plan(ctx.backend)
        return tuple(out.clone() for out in self.graph.replay())


def run_captured(run, args: tuple, real_rows: torch.Tensor | None):
    """The step as it is captured (and, off CUDA, replayed): the model takes its fixed-shape paths,
    and `real_rows` [] (when kept) says where the padding starts."""
    token, rows_token = CAPTURING.set(True), REAL_ROWS.set(real_rows)
    try:
        return run(*args)
    finally:
        REAL_ROWS.reset(rows_token)
        CAPTURING.reset(token)


def mark_kv_dynamic(backend) -> None:
    """The KV length (dim L of the planned gather indices and masks) changes every step: mark it
    dynamic, so each bucket compiles once rather than once per length."""
    for tensor, dim in getattr(backend, "kv_length_dims", lambda: [])():
        torch._dynamo.maybe_mark_dynamic(tensor, dim)
