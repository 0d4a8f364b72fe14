"""The interface every speculation mode implements, so the scheduler, KV allocator, engine and
server never branch on the mode.

Life of a decode step with speculation (see Engine.run_speculative):
  propose(seqs, k)      catch the draft up on tokens it has not seen, then draft k tokens
                        per request from the carried state -> Proposal (tokens + full q,
                        and whether the step was steady: no catch-up beyond the last verify)
  target verifies       1+k tokens per request in one forward; the engine calls
  observe(chunks, batch, hidden) after every target forward (MTP keeps the target's hidden
                        states of positions its layer has not run over, at most 1+K per request)
  accept(...)           right after verification, tensors only (MTP re-runs over the verify
                        batch with the target's hidden states: no device-to-host sync)
  commit(seqs, ...)     host bookkeeping once accepted lengths are read
  release(seq)          a request finished or was preempted: its draft state is gone

Prefix caching: `kv_tokens(seq)` says which positions of a request its caches hold for good
(a page is cached with them once they cover it), and `start_at(seq, n)` starts a request
admitted with n cached positions that its caches hold too.

Shapes legend: T tokens, B requests, K draft tokens per request, V vocab, M hidden.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moespec.batch import Batch
from moespec.sampling import SamplingBatch, compute_probs, sample
from moespec.scheduler import ScheduledChunk
from moespec.sequence import Sequence
from moespec.structured import DraftMasks, Grammars


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, K] drafted tokens
    probs: torch.Tensor  # [B, K, V] the full draft distributions they were sampled from
    steady: bool = True  # False when the draft first caught up on skipped tokens (a costlier step)


class Speculator:
    """No speculation: every hook is a no-op. Modes subclass this."""

    mode = "none"
    max_tokens = 0  # the most draft tokens a step may ask for
    kv_lookahead = 0  # tokens after a position that this mode's KV there depends on
    kv_from_tokens = True  # can compute its KV of cached pages that lack it from their tokens alone

    @property
    def lookahead(self) -> int:
        """KV slots a request needs beyond its next token (verify writes K, a draft may write one more)."""
        return self.max_tokens + 1 if self.max_tokens else 0

    def state_bytes(self) -> int:
        """Bytes the per-request draft state of all running requests may hold between steps, beyond
        KV caches (a memory planner counts them)."""
        return 0

    def needs_catch_up(self, seqs: list[Sequence]) -> bool:
        """Whether `propose` for these requests first runs a catch-up forward (counted by ranks in
        lockstep when the draft's forwards carry expert-parallel MoE layers)."""
        return False

    def needs_flush(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether `observe` after a plain target forward over these chunks runs a draft forward."""
        return False

    def observe(self, chunks: list[ScheduledChunk], batch: Batch, hidden: torch.Tensor) -> None:
        """After a target forward: `chunks` are the step's requests in batch order, `hidden` [T, M]
        its hidden states (a verify batch has 1 + K rows per chunk)."""

    def propose(self, seqs: list[Sequence], k: int, rows: "DraftRows") -> Proposal:
        raise NotImplementedError

    def accept(self, seqs: list[Sequence], batch: Batch, ctx, hidden: torch.Tensor, num_accepted: torch.Tensor,
               tokens: torch.Tensor) -> None:
        pass

    def commit(self, seqs: list[Sequence], lengths_before: list[int], num_accepted: list[int], k: int) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass

    def warm_up(self) -> float:
        """Compile this mode's own static steps (model.compile); returns the seconds it took."""
        return 0.0

    def kv_tokens(self, seq: Sequence) -> int:
        """Leading positions of seq whose KV in this mode's caches is final (accepted tokens only)."""
        return seq.num_tokens

    def start_at(self, seq: Sequence, num_tokens: int) -> None:
        """seq was admitted with its first num_tokens positions in this mode's caches already."""


class DraftRows:
    """Sampling state for drafting: the same transforms as the target (penalties see the drafts
    so far). Draft row j of a seeded request draws with the noise of its position, m + j, which
    is the noise the target draws with there: the draft token is accepted when both agree."""

    def __init__(self, seqs: list[Sequence], vocab_size: int, device, eos_ids: tuple[int, ...],
                 shared_generator: torch.Generator, grammars: Grammars | None = None) -> None:
        self.seqs, self.vocab_size, self.device = seqs, vocab_size, device
        self.eos_ids, self.shared_generator = eos_ids, shared_generator
        self.needs_values = any(s.params.repetition_penalty != 1 or s.params.frequency_penalty
                                or s.params.presence_penalty for s in seqs)
        # without penalties and past min_tokens, the drafts so far do not change a draft row
        self.drafts_matter = self.needs_values or any(len(s.output_ids) < s.params.min_tokens for s in seqs)
        self.draft_rows: SamplingBatch | None = None
        states = [s.grammar for s in seqs]
        self.masks = DraftMasks(grammars, states) if grammars is not None and any(states) else None

    def batch(self, drafts: list[torch.Tensor], repeat: int = 1) -> SamplingBatch:
        """Rows for each sequence (repeated `repeat` times) with drafts[:j] appended for row j."""
        if repeat == 1 and not self.drafts_matter:
            if self.draft_rows is None:
                self.draft_rows = self.build([], repeat)
            return self.draft_rows.advanced(len(drafts))
        return self.build(drafts, repeat)

    def build(self, drafts: list[torch.Tensor], repeat: int) -> SamplingBatch:
        values = torch.stack(drafts, 1).tolist() if drafts and self.needs_values else None
        params, prompts, outputs = [], [], []
        for b, seq in enumerate(self.seqs):
            for j in range(repeat):
                n = len(drafts) if repeat == 1 else j
                extra = values[b][:n] if values is not None else [0] * n  # lengths set min_tokens and positions
                params.append(seq.params)
                prompts.append(seq.prompt_ids)
                outputs.append(seq.output_ids + extra)
        return SamplingBatch.build(params, prompts, outputs, self.vocab_size, self.device,
                                   eos_token_ids=self.eos_ids, shared_generator=self.shared_generator)

    def target_batch(self, drafts: torch.Tensor) -> SamplingBatch:
        """Rows for the target's 1 + K verify positions of each request, for drafts [B, K]."""
        rows = self.batch(list(drafts.unbind(1)), repeat=drafts.shape[1] + 1)
        return rows if self.masks is None else rows.constrained(self.masks.verify_rows(drafts), self.vocab_size)

    def draw(self, logits: torch.Tensor, drafts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample the next draft token from draft logits [B, V] -> (tokens [B], probs [B, V]),
        under each request's grammar advanced over its drafts so far."""
        sampling = self.batch(drafts)
        if self.masks is not None:
            sampling = sampling.constrained(self.masks.draft_row(drafts), self.vocab_size)
        probs = compute_probs(logits.float(), sampling)
        return sample(probs, sampling), probs


def gather_rows(values: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(values) if len(values) > 1 else values[0][None]
