"""The engine loop: schedule -> pack batch -> plan -> forward -> sample -> append/stop/free.

`step()` is split at the host/device seam: `prepare` (scheduling, page allocation, batch
packing, attention planning, sampling tensors: host work) and `execute` (model forward and
sampling: device work), then `postprocess` (host). On a GPU `execute` returns before the
device finishes, so the host can prepare step n+1 while step n runs; on CPU the phases run
in order and `stats` reports how the time splits.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from moespec.batch import Batch, build_batch
from moespec.config import EngineConfig
from moespec.detokenizer import IncrementalDetokenizer, StopChecker
from moespec.kv_cache import PageAllocator
from moespec.model_runner import ModelRunner
from moespec.models import load_model, load_tokenizer
from moespec.sampling import Sampler, SamplerOutput, SamplingBatch, SamplingParams, make_generator
from moespec.scheduler import Scheduler, SchedulerOutput
from moespec.sequence import Sequence, Status, TokenLogprob

logger = logging.getLogger(__name__)


@dataclass
class StepStats:
    """Cumulative wall time per phase, for the host-share measurement."""

    steps: int = 0
    host_s: float = 0.0
    device_s: float = 0.0
    decode_steps: int = 0
    decode_host_s: float = 0.0
    decode_device_s: float = 0.0
    tokens: int = 0

    @property
    def decode_host_share(self) -> float:
        total = self.decode_host_s + self.decode_device_s
        return self.decode_host_s / total if total else 0.0


@dataclass
class PreparedStep:
    scheduled: SchedulerOutput
    batch: Batch
    sampling: SamplingBatch
    sampled: list[Sequence]
    ctx: object = None
    host_s: float = 0.0


@dataclass
class EngineOutputs:
    updated: list[Sequence] = field(default_factory=list)  # got new tokens or finished this step


class Engine:
    def __init__(self, config: EngineConfig, model=None, tokenizer=None) -> None:
        self.config = config
        c = config
        self.model = model or load_model(c.model.path, c.model.dtype, c.model.device)
        self.tokenizer = tokenizer if model is not None else load_tokenizer(c.model.tokenizer or c.model.path)
        self.vocab_size = self.model.config.vocab_size
        self.allocator = PageAllocator(c.cache.num_kv_pages, c.cache.page_size)
        self.max_model_len = self.resolve_max_model_len()
        self.runner = ModelRunner(self.model, c.cache.num_kv_pages, c.cache.page_size, c.model.attention_backend,
                                  c.model.device)
        self.scheduler = Scheduler(c.scheduler, self.allocator)
        self.sampler = Sampler()
        self.generator = torch.Generator().manual_seed(c.model.seed)
        self.eos_ids = self.resolve_eos_ids()
        self.sequences: dict[str, Sequence] = {}
        self.stats = StepStats()
        self.ids = itertools.count()

    def resolve_max_model_len(self) -> int:
        model_max = self.model.config.max_position_embeddings
        wanted = self.config.model.max_model_len or model_max
        if wanted > model_max:
            logger.warning("max_model_len %d exceeds the model's max_position_embeddings %d", wanted, model_max)
        capacity = self.allocator.num_pages * self.allocator.page_size
        if wanted > capacity:
            logger.warning("max_model_len %d capped to the KV cache capacity of %d tokens", wanted, capacity)
        return min(wanted, capacity)

    def resolve_eos_ids(self) -> frozenset[int]:
        ids = set(self.model.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    # ------------------------------------------------------------------ requests

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids instead of text")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        ids = list(prompt)
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt: token ids must be ints in [0, {self.vocab_size}), got {bad[:3]}")
        return ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> Sequence:
        params = params or SamplingParams()
        prompt_ids = self.encode(prompt)
        if not prompt_ids:
            raise ValueError("prompt: must contain at least one token")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(prompt_ids)} tokens leave no room to generate within "
                             f"max_model_len {self.max_model_len}")
        request_id = request_id or f"req-{next(self.ids)}"
        if request_id in self.sequences:
            raise ValueError(f"request_id {request_id!r} is already running")
        seq = Sequence(request_id, prompt_ids, params, make_generator(params.seed),
                       prompt=prompt if isinstance(prompt, str) else None)
        seq.metrics.num_prompt_tokens = len(prompt_ids)
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
        seq.stop_checker = StopChecker(params.stop, params.include_stop_str_in_output)
        self.sequences[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is None or seq.is_finished:
            return
        self.scheduler.abort(request_id)
        self.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ one step

    def step(self) -> EngineOutputs:
        prepared = self.prepare()
        if prepared is None:
            return EngineOutputs()
        start = time.perf_counter()
        result = self.execute(prepared)
        device_s = time.perf_counter() - start
        start = time.perf_counter()
        outputs = self.postprocess(prepared, result)
        self.record(prepared, prepared.host_s + time.perf_counter() - start, device_s)
        return outputs

    def prepare(self) -> PreparedStep | None:
        start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if not scheduled.chunks:
            if self.scheduler.has_unfinished() and not self.scheduler.running:
                raise RuntimeError("no request fits in the KV cache; raise cache.num_kv_pages")
            return None
        for chunk in scheduled.chunks:
            if chunk.seq.metrics.first_scheduled_time is None:
                chunk.seq.metrics.first_scheduled_time = time.monotonic()
        batch = build_batch(scheduled.chunks, self.allocator.page_size)
        sampled = [c.seq for c in scheduled.chunks if c.completes_prompt]
        sampling = self.build_sampling(sampled)
        batch = batch.to(self.runner.device)
        ctx = self.runner.plan(batch)
        return PreparedStep(scheduled, batch, sampling, sampled, ctx, time.perf_counter() - start)

    def build_sampling(self, seqs: list[Sequence]) -> SamplingBatch:
        return SamplingBatch.build([s.params for s in seqs], [s.prompt_ids for s in seqs],
                                   [s.output_ids for s in seqs], [s.generator for s in seqs], self.vocab_size,
                                   self.runner.device, eos_token_ids=tuple(self.eos_ids),
                                   shared_generator=self.generator)

    def execute(self, prepared: PreparedStep) -> SamplerOutput:
        _, logits = self.runner.forward(prepared.batch, prepared.ctx)
        return self.sampler(logits, prepared.sampling)

    def postprocess(self, prepared: PreparedStep, result: SamplerOutput) -> EngineOutputs:
        for chunk in prepared.scheduled.chunks:
            chunk.seq.num_computed = chunk.end
        tokens = result.tokens.tolist()
        updated = []
        for row, seq in enumerate(prepared.sampled):
            lp = result.logprobs[row]
            self.append_tokens(seq, [tokens[row]], [lp])
            updated.append(seq)
        return EngineOutputs(updated)

    def append_tokens(self, seq: Sequence, tokens: list[int], logprobs: list) -> None:
        """Append tokens one by one, stopping exactly at EOS, stop ids, stop strings or limits."""
        now = time.monotonic()
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
        for token, lp in zip(tokens, logprobs):
            seq.output_ids.append(token)
            seq.metrics.num_generated_tokens += 1
            if lp is not None:
                seq.logprobs.append(TokenLogprob(token, lp.logprob, dict(zip(lp.top_ids, lp.top_logprobs))))
            seq.detokenizer.append([token])
            reason = self.check_stop(seq, token)
            if reason is not None:
                if not isinstance(seq.stop_reason, str):  # not cut at a stop string: all text is final
                    seq.detokenizer.flush()
                    seq.text = seq.detokenizer.text
                self.finish(seq, reason)
                return

    def check_stop(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        check = seq.stop_checker.check(seq.detokenizer.text)
        seq.text = check.text
        seq.streamable_chars = check.stream_len
        if len(seq.output_ids) >= params.min_tokens:
            if token in self.eos_ids and not params.ignore_eos:
                return "stop"
            if params.stop_token_ids and token in params.stop_token_ids:
                seq.stop_reason = token
                return "stop"
            if check.stopped:
                seq.stop_reason = seq.stop_checker.find_first(seq.detokenizer.text, 0)[1]
                return "stop"
        if params.max_tokens is not None and len(seq.output_ids) >= params.max_tokens:
            return "length"
        if seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.metrics.finished_time = time.monotonic()
        seq.streamable_chars = len(seq.text)  # a finished request's text is final
        self.scheduler.finish(seq)
        self.sequences.pop(seq.request_id, None)

    def record(self, prepared: PreparedStep, host_s: float, device_s: float) -> None:
        s = self.stats
        s.steps += 1
        s.host_s += host_s
        s.device_s += device_s
        s.tokens += len(prepared.sampled)
        if prepared.batch.mode == "decode":
            s.decode_steps += 1
            s.decode_host_s += host_s
            s.decode_device_s += device_s
