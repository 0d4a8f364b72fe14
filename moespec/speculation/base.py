"""The interface every speculation mode implements, so the scheduler, KV allocator, engine and
server never branch on the mode.

Life of a decode step with speculation (see Engine.draft_and_verify):
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

Draft trees (speculation/tree.py) take the same course through `propose_tree`, `accept_tree`
(after which the engine compacts the target's KV to the accepted path and calls `accept` over
that path, laid out as a chain's verify batch) and `commit_tree`.

Prefix caching: `kv_tokens(seq)` says which positions of a request its caches hold for good
(a page is cached with them once they cover it), and `start_at(seq, n)` starts a request
admitted with n cached positions that its caches hold too.

Shapes legend: T tokens, B requests, K draft tokens per request, V vocab, M hidden.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from moespec.batch import Batch
from moespec.sampling import SamplingBatch, apply_penalties, compute_probs, sample
from moespec.scheduler import ScheduledChunk
from moespec.sequence import Sequence
from moespec.speculation.tree import DraftTree, TreeResult, TreeShape
from moespec.structured import DraftMasks, Grammars, tree_masks


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
    trees: tuple[TreeShape, ...] = ()  # the draft trees a step may ask for

    @property
    def lookahead(self) -> int:
        """KV slots a request needs beyond its next token (verify writes K, a draft may write one
        more; a tree as many as its nodes or the drafter's frontier slots)."""
        chain = self.max_tokens + 1 if self.max_tokens else 0
        return max([chain] + [shape.lookahead for shape in self.trees])

    def state_bytes(self) -> int:
        """Bytes the per-request draft state of all running requests may hold between steps, beyond
        KV caches (a memory planner counts them)."""
        return 0

    def needs_catch_up(self, seqs: list[Sequence]) -> bool:
        """Whether `propose` for these requests first runs a catch-up forward (counted by ranks in
        lockstep when the draft's forwards carry expert-parallel MoE layers)."""
        return False

    def behind(self, seqs: list[Sequence]) -> int:
        """Decoded positions of these requests that `propose` would first catch the draft up on,
        beyond a steady step's 1 + K, summed: what a switch from plain decoding costs (a prompt's
        positions are not counted: every new request's recur, a steady step's cost)."""
        return sum(max(0, min(s.num_tokens - self.kv_tokens(s), s.metrics.num_generated_tokens) - 1 - self.max_tokens)
                   for s in seqs)

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

    def propose_tree(self, seqs: list[Sequence], shape: TreeShape, rows: "DraftRows") -> DraftTree:
        """Catch up like `propose`, then expand and rerank a draft tree (tree.grow_tree)."""
        raise NotImplementedError(f"speculation mode {self.mode!r} drafts no trees")

    def accept_tree(self, seqs: list[Sequence], batch: Batch, tree: DraftTree, result: TreeResult) -> None:
        """Right after a tree's verification (`batch`), tensors only: a drafter that wrote KV for
        the tree's nodes keeps that of the accepted path. Then the engine compacts the target's
        KV and calls `accept` over the accepted path as if it had been a chain."""

    def commit_tree(self, seqs: list[Sequence], lengths_before: list[int], num_accepted: list[int],
                    tree: DraftTree) -> None:
        """Host bookkeeping after a tree step (by default, a chain's of the tree's depth)."""
        self.commit(seqs, lengths_before, num_accepted, tree.depth)

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
        self.needs_values = any(s.params.penalized for s in seqs)
        # without penalties and past min_tokens, the drafts so far do not change a draft row
        self.drafts_matter = self.needs_values or any(len(s.output_ids) < s.params.min_tokens for s in seqs)
        self.draft_rows: SamplingBatch | None = None
        self.repeats: dict[int, SamplingBatch] = {}  # repeat count -> rows (a tree's levels share them)
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
        params, prompts, outputs, counts = [], [], [], []
        for b, seq in enumerate(self.seqs):
            kept = seq.counts_for(self.vocab_size, self.device)
            for j in range(repeat):
                n = len(drafts) if repeat == 1 else j
                extra = values[b][:n] if values is not None else [0] * n  # lengths set min_tokens and positions
                params.append(seq.params)
                prompts.append(seq.prompt_ids)
                outputs.append(seq.output_ids + extra)
                counts.append(kept)
        return SamplingBatch.build(params, prompts, outputs, self.vocab_size, self.device,
                                   eos_token_ids=self.eos_ids, shared_generator=self.shared_generator, counts=counts)

    def repeated(self, repeat: int) -> SamplingBatch:
        """Each request's rows for its next token, `repeat` times over (a tree's frontier)."""
        if repeat not in self.repeats:
            seqs = [s for s in self.seqs for _ in range(repeat)]
            self.repeats[repeat] = SamplingBatch.build(
                [s.params for s in seqs], [s.prompt_ids for s in seqs], [s.output_ids for s in seqs],
                self.vocab_size, self.device, eos_token_ids=self.eos_ids, shared_generator=self.shared_generator,
                counts=[s.counts_for(self.vocab_size, self.device) for s in seqs])
        return self.repeats[repeat]

    def expansion_logprobs(self, logits: torch.Tensor, repeat: int = 1) -> torch.Tensor:
        """Draft log-probabilities [B*repeat, V] that rank a tree's candidates: the distribution a
        random row samples from; for greedy rows, the penalized softmax (their one-hot ranks nothing)."""
        sampling = self.repeated(repeat)
        if self.masks is not None and repeat == 1:  # the root's children: what each grammar allows now
            sampling = sampling.constrained(self.masks.draft_row([]), self.vocab_size)
        if sampling.all_greedy:
            return apply_penalties(logits.float(), sampling).log_softmax(-1)
        probs = compute_probs(logits.float(), sampling).log()
        if sampling.greedy is None:
            return probs
        return torch.where(sampling.greedy[:, None], apply_penalties(logits.float(), sampling).log_softmax(-1), probs)

    def tree_batch(self, tree: DraftTree) -> SamplingBatch:
        """Rows for the target at each of a tree's 1 + N nodes per request: the request's outputs
        followed by the drafts on the node's path (penalties, min_tokens, seeded positions and
        grammars see them)."""
        rows = self.tree_rows(tree)
        if self.masks is None:
            return rows
        masks = tree_masks(self.masks.grammars, self.masks.owners, tree.tokens.tolist(), tree.parents.tolist())
        return rows.constrained(masks, self.vocab_size)

    def tree_rows(self, tree: DraftTree) -> SamplingBatch:
        B, N = tree.tokens.shape
        if not self.drafts_matter:  # rows differ by the position a seeded row draws at only
            rows = self.repeated(1 + N)
            if rows.seeded_index is None:
                return rows
            depths = tree.node_depths().flatten().to(rows.positions.device)
            return replace(rows, positions=rows.positions + depths[rows.seeded_index])
        depths = tree.depths.tolist()
        paths = self.tree_paths(tree) if self.needs_values else None
        params, prompts, outputs, counts = [], [], [], []
        for b, seq in enumerate(self.seqs):
            kept = seq.counts_for(self.vocab_size, self.device)
            for i in range(1 + N):
                extra = paths[b][i] if paths is not None else [0] * (depths[b][i - 1] if i else 0)
                params.append(seq.params)
                prompts.append(seq.prompt_ids)
                outputs.append(seq.output_ids + extra)
                counts.append(kept)
        return SamplingBatch.build(params, prompts, outputs, self.vocab_size, self.device,
                                   eos_token_ids=self.eos_ids, shared_generator=self.shared_generator, counts=counts)

    @staticmethod
    def tree_paths(tree: DraftTree) -> list[list[list[int]]]:
        """Per request and node (the root first), the draft tokens from the root down to it."""
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        paths = []
        for toks, pars in zip(tokens, parents):
            nodes = [[]]
            for token, parent in zip(toks, pars):
                nodes.append(nodes[parent] + [token])
            paths.append(nodes)
        return paths

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
