"""Speculative steps, chains and trees: drafting, the target's verify forward, acceptance
(greedy, lossless rejection sampling, relaxed), the drafter's accept, and emitting the accepted
tokens with their measurements. Owns the speculation figures (`spec_stats`) and whether plain
steps ran since the last speculative one; holds the model runner, the speculator and the
policy it reports to, and appends tokens through the requests (moespec.requests). A step's
device side (`speculate`) returns a `Verified` whose host side (`finish`) the engine runs after,
under overlap once the next step is prepared.

Shapes legend: B requests, k draft tokens per request, N tree nodes, D tree depth, V vocabulary,
M hidden size.
"""
from __future__ import annotations

import time

import torch

from moespec.batch import Batch, Span, pack_spans
from moespec.config import SpeculationSection, TreeShape
from moespec.distributed import Lockstep
from moespec.model_runner import ModelRunner
from moespec.overlap import Outcome
from moespec.requests import Requests
from moespec.sampling import (Sampler, SamplingBatch, compute_probs, draw_uniform, exact_tokens, greedy_tokens,
                              invert_cdf)
from moespec.sequence import Sequence
from moespec.speculation import DraftRows, select_rows, verify_greedy, verify_lossless, verify_relaxed
from moespec.speculation.adaptive import SpeculationPolicy
from moespec.speculation.tree import (DraftTree, TreeResult, compact_path, page_table, path_positions, tree_mask,
                                      walk_tree)
from moespec.step_state import EngineOutputs, PreparedStep, SpecStats, StepProgress, StepStats, Verified


COLD_STEPS = 2  # a draft length's (or tree's) first speculative steps in an engine: not measured


class SpeculativeSteps:
    def __init__(self, spec_config: SpeculationSection, runner: ModelRunner, speculator, requests: Requests,
                 policy: SpeculationPolicy, sampler: Sampler, generator: torch.Generator, page_size: int,
                 stats: StepStats, progress: StepProgress, lockstep: Lockstep | None = None) -> None:
        self.spec_config, self.runner, self.speculator, self.requests = spec_config, runner, speculator, requests
        self.policy, self.sampler, self.generator = policy, sampler, generator
        self.page_size, self.stats = page_size, stats
        self.progress, self.lockstep = progress, lockstep
        self.vocab_size, self.eos_ids, self.grammars = requests.vocab_size, requests.eos_ids, requests.grammars
        self.spec_stats = SpecStats()
        self.ran_plain = False  # plain decode steps ran since the last speculative step
        self.behind = 0  # positions this step's draft catches up on beyond a steady step's
        self.runs: dict = {}  # draft length or tree -> speculative steps it ran (the first COLD_STEPS: cold)

    def draft_rows(self, seqs: list[Sequence]) -> DraftRows:
        """The sampling rows of a step's drafts and verification, for these requests."""
        return DraftRows(seqs, self.vocab_size, self.runner.device, tuple(self.eos_ids), self.generator, self.grammars)

    def speculate(self, prepared: PreparedStep) -> Verified:
        """The device side of a speculative step (a tree's: `grow`)."""
        start = time.perf_counter()
        # before propose catches the draft up; only a step after plain ones prices a switch
        self.behind = self.speculator.behind(prepared.sampled) if self.ran_plain else 0
        verified = self.grow(prepared) if prepared.tree is not None else self.draft_and_verify(prepared)
        verified.device_s = time.perf_counter() - start
        return verified

    def finish_speculative(self, prepared: PreparedStep, verified: Verified, call_start: float | None = None
                           ) -> EngineOutputs:
        """The host side of a speculative step, then its times (`call_start`: under overlap, the
        engine call's start; its wall time is less than host + device by the host work hidden)."""
        start = time.perf_counter()
        outputs = verified.finish()
        host_s = prepared.host_s + time.perf_counter() - start
        s = self.stats
        s.spec_steps += 1
        s.spec_host_s += host_s
        s.spec_device_s += verified.device_s
        s.spec_wall_s += host_s + verified.device_s if call_start is None else time.perf_counter() - call_start
        return outputs

    def draft_and_verify(self, prepared: PreparedStep) -> Verified:
        """propose k -> target verifies 1+k per request -> accept (tensors); the host appends in
        `finish`."""
        start = time.perf_counter()
        seqs, k, batch, ctx = prepared.sampled, prepared.num_spec, prepared.batch, prepared.ctx
        rows = self.draft_rows(seqs)
        self.progress.phase = f"{self.speculator.mode} propose"
        proposal = self.speculator.propose(seqs, k, rows)
        plan = prepared.plan
        if self.lockstep is not None:
            self.lockstep.pad_mtp(plan.mtp_before)
        self.place_drafts(batch, proposal.tokens)
        self.progress.phase = "target forward (verify)"
        hidden, logits = self.runner.forward(batch, ctx)  # logits [B*(k+1), V]
        self.speculator.observe(prepared.scheduled.chunks, batch, hidden)
        self.progress.phase = "verification"
        target_rows = rows.target_batch(proposal.tokens)  # the last grammar row is filled after the forward is launched
        result = self.verify(logits, target_rows, proposal, self.draw_verify_uniforms(seqs, rows, k))
        self.progress.phase = f"{self.speculator.mode} accept"
        self.speculator.accept(seqs, batch, ctx, hidden, result.num_accepted, result.tokens)
        if self.lockstep is not None:
            self.lockstep.pad_mtp(plan.mtp_before + plan.mtp_after)

        def finish() -> EngineOutputs:
            # the host reads accepted lengths only now, after the draft re-run was launched
            num_accepted, tokens = result.num_accepted.tolist(), result.tokens.tolist()
            self.progress.phase = "postprocess"
            logprobs = self.sampler.gather_logprobs(logits, result.tokens.flatten(), target_rows)
            lengths = [s.num_tokens for s in seqs]
            self.speculator.commit(seqs, lengths, num_accepted, k)
            self.spec_stats.add(k, num_accepted)
            self.emit(prepared, num_accepted, tokens, logprobs, lengths, k, k, proposal.steady, start)
            return EngineOutputs(list(seqs))

        return Verified(Outcome(result.tokens, result.num_accepted), finish)

    def emit(self, prepared: PreparedStep, num_accepted: list[int], tokens: list[list[int]], logprobs: list,
             lengths: list[int], drafted: int, choice: int | TreeShape, steady: bool, start: float) -> None:
        """Host side of a speculative step: per request its a accepted drafts and the target's
        token (tokens and logprobs in rows of len(tokens[b])), then the step's measurements."""
        seqs, kept = prepared.sampled, 0
        for b, (seq, a, m) in enumerate(zip(seqs, num_accepted, lengths)):
            seq.num_computed = m + a  # KV now holds the last token and the a accepted drafts
            seq.metrics.num_draft_tokens += drafted
            seq.metrics.num_accepted_tokens += a
            seq.metrics.num_spec_steps += 1
            width, before = len(tokens[b]), seq.metrics.num_generated_tokens
            self.requests.append_tokens(seq, tokens[b][: a + 1], logprobs[b * width: b * width + a + 1])
            kept += seq.metrics.num_generated_tokens - before  # fewer than a + 1 where the request ended
        self.requests.publish(seqs)
        elapsed = time.perf_counter() - start + prepared.host_s
        self.stats.steps += 1
        self.stats.tokens += sum(num_accepted) + len(seqs)
        self.policy.accept(choice, num_accepted)
        # a catch-up on tokens of plain decode steps measures switching, not speculating (adaptive.py);
        # a choice's first steps run its shapes for the first time and its draft's first catch-up
        # on every prompt at once (SmolLM2's head at batch 16: k=3 took 745 and 322 ms, then 187):
        # their time counts, and the policy measures the choice on the steps after them; a warm
        # catch-up after plain steps prices the next switch
        self.runs[choice] = self.runs.get(choice, 0) + 1
        warm, switched = self.runs[choice] > COLD_STEPS, not steady and self.ran_plain
        self.policy.record(len(seqs), choice, kept / len(seqs), elapsed, measures=warm and not switched,
                           caught_up=self.behind if warm and switched else 0)
        self.ran_plain = False

    def grow(self, prepared: PreparedStep) -> Verified:
        """propose a tree -> the target verifies its 1+N nodes per request in one forward (tree
        mask) -> walk the target's draws down the tree -> the drafter's and the target's KV of
        the accepted path compacted -> the path accepted as a chain (MTP re-run); the host
        appends in `finish`."""
        start = time.perf_counter()
        seqs, shape = prepared.sampled, prepared.tree
        rows = self.draft_rows(seqs)
        self.progress.phase = f"{self.speculator.mode} propose tree"
        tree = self.speculator.propose_tree(seqs, shape, rows)
        if self.lockstep is not None:
            self.lockstep.pad_mtp(prepared.plan.mtp_before)
        batch = self.build_tree_batch(seqs, tree)
        ctx = self.runner.plan(batch)
        self.progress.phase = "target forward (tree verify)"
        hidden, logits = self.runner.forward(batch, ctx)  # logits [B*(1+N), V]
        self.progress.phase = "verification"
        target_rows = rows.tree_batch(tree)
        uniforms = self.draw_verify_uniforms(seqs, rows, shape.depth)  # [B, D+1] one per depth
        result = walk_tree(self.tree_draws(logits, target_rows, tree, uniforms), tree)
        self.progress.phase = f"{self.speculator.mode} accept tree"
        self.accept_path(seqs, batch, hidden, tree, result)
        if self.lockstep is not None:
            self.lockstep.pad_mtp(prepared.plan.mtp_before + prepared.plan.mtp_after)

        def finish() -> EngineOutputs:
            num_accepted, tokens = result.num_accepted.tolist(), result.tokens.tolist()
            self.progress.phase = "postprocess"
            B, N1 = tree.tokens.shape[0], tree.tokens.shape[1] + 1
            path_rows = (torch.arange(B, device=logits.device)[:, None] * N1 + result.path).flatten()  # [B*(D+1)]
            num_logprobs = [n for n in target_rows.num_logprobs[::N1] for _ in range(shape.depth + 1)]
            logprobs = self.sampler.gather_logprobs_for(logits[path_rows], result.tokens.flatten(), num_logprobs)
            lengths = [s.num_tokens for s in seqs]
            self.speculator.commit_tree(seqs, lengths, num_accepted, tree)
            self.spec_stats.add(shape.depth, num_accepted, shape)
            self.emit(prepared, num_accepted, tokens, logprobs, lengths, shape.num_draft_tokens, shape, tree.steady,
                      start)
            return EngineOutputs(list(seqs))

        return Verified(Outcome(result.tokens, result.num_accepted), finish)

    def accept_path(self, seqs: list[Sequence], batch: Batch, hidden: torch.Tensor, tree: DraftTree,
                    result: TreeResult) -> None:
        """Move the accepted path's KV to consecutive positions (the drafter's, then the
        target's); from then on the path is a chain's verify batch of depth D, which the
        speculator accepts as one (the MTP re-run, over the target's hidden states along it)."""
        self.speculator.accept_tree(seqs, batch, tree, result)
        compact_path(self.runner.cache.layers, page_table(seqs, batch.input_ids.device), self.page_size,
                     *path_positions(batch, result))
        path = self.build_verify_batch(seqs, tree.depth)
        self.place_drafts(path, result.tokens[:, :-1])
        M = hidden.shape[-1]
        path_hidden = hidden.view(len(seqs), -1, M).gather(1, result.path[:, :, None].expand(-1, -1, M))  # [B, D+1, M]
        self.speculator.accept(seqs, path, self.runner.plan(path), path_hidden.flatten(0, 1), result.num_accepted,
                               result.tokens)

    def build_tree_batch(self, seqs: list[Sequence], tree: DraftTree) -> Batch:
        """Per request: its last token and the tree's N nodes, node i at KV position m-1+i and
        rotary position m-1+depth(i), seeing the context and its ancestors (tree.tree_mask)."""
        N = tree.tokens.shape[1]
        spans = [Span(s.pages, s.num_tokens - 1, [s.output_ids[-1]] + [0] * N) for s in seqs]
        batch = pack_spans(spans, self.page_size, "verify").to(self.runner.device)
        root = batch.input_ids.view(len(seqs), N + 1)[:, :1]
        batch.input_ids = torch.cat([root, tree.tokens.to(root.device)], 1).flatten()
        batch.kv_positions = batch.positions
        batch.positions = (batch.positions.view(len(seqs), N + 1)[:, :1] + tree.node_depths().to(root.device)).flatten()
        batch.custom_mask = tree_mask([s.num_tokens - 1 for s in seqs], tree.ancestors())
        return batch

    @staticmethod
    def tree_draws(logits: torch.Tensor, target_rows: SamplingBatch, tree: DraftTree,
                   uniforms: torch.Tensor) -> torch.Tensor:
        """The target's own draw at every node [B, 1+N]: greedy and seeded rows their exact draws,
        random rows an inverse-CDF draw with their request's uniform of the node's depth."""
        B, N1 = tree.tokens.shape[0], tree.tokens.shape[1] + 1
        if target_rows.all_greedy:
            return greedy_tokens(logits, target_rows).view(B, N1)
        probs = compute_probs(logits, target_rows)
        draws = exact_tokens(probs, target_rows)
        if target_rows.random_rows:
            random = invert_cdf(probs, uniforms.gather(1, tree.node_depths().to(uniforms.device)).flatten())
            is_random = torch.zeros(B * N1, dtype=torch.bool)
            is_random[list(target_rows.random_rows)] = True
            draws = torch.where(is_random.to(draws.device), random, draws)
        return draws.view(B, N1)

    @staticmethod
    def draw_verify_uniforms(seqs: list[Sequence], rows: DraftRows, k: int) -> torch.Tensor:
        """[B, k+1] uniforms for acceptance tests and the final token of random rows (rejection
        sampling); greedy and seeded rows are verified by their exact draws and need none."""
        if all(s.params.greedy or s.params.seed is not None for s in seqs):
            return torch.zeros(len(seqs), k + 1, dtype=torch.float64, device=rows.device)
        return draw_uniform(rows.batch([]), k + 1)

    def build_verify_batch(self, seqs: list[Sequence], k: int, extra: dict[int, int] | None = None) -> Batch:
        """Per request: its last token and k draft rows (`place_drafts`) at positions m-1 .. m-1+k.
        `extra`: tokens a step in flight may still add to a request (by id): planned for the most."""
        extra = extra or {}
        spans = [Span(s.pages, s.num_tokens - 1 + extra.get(id(s), 0), [s.output_ids[-1]] + [0] * k) for s in seqs]
        return pack_spans(spans, self.page_size, "verify").to(self.runner.device)

    @staticmethod
    def place_drafts(batch: Batch, drafts: torch.Tensor) -> None:
        """Drafts [B, K] into a verify batch's rows after each request's last token (on the device)."""
        B, K = drafts.shape
        batch.input_ids.view(B, K + 1)[:, 1:] = drafts.to(batch.input_ids.device)

    def verify(self, logits: torch.Tensor, target_rows: SamplingBatch, proposal, uniforms: torch.Tensor):
        """Greedy and seeded rows: the drafts that equal the target's own exact draws (argmax,
        keyed Gumbel-max), then the target's draw; other rows: rejection sampling."""
        B, k = proposal.tokens.shape
        spec = self.spec_config
        if target_rows.all_greedy and spec.acceptance == "lossless":
            return verify_greedy(greedy_tokens(logits, target_rows).view(B, k + 1), proposal.tokens)
        probs = compute_probs(logits, target_rows)  # [B*(k+1), V]
        if spec.acceptance == "relaxed":
            return verify_relaxed(logits.view(B, k + 1, -1), probs.view(B, k + 1, -1), proposal.probs,
                                  proposal.tokens, uniforms, spec.relaxed_top_n, spec.relaxed_delta)
        random_rows = target_rows.random_rows  # all k + 1 rows of each random request
        if len(random_rows) == B * (k + 1):  # no greedy or seeded request
            return verify_lossless(probs.view(B, k + 1, -1), proposal.probs, proposal.tokens, uniforms)
        exact = verify_greedy(exact_tokens(probs, target_rows).view(B, k + 1), proposal.tokens)
        if not random_rows:
            return exact
        is_random = torch.zeros(B, dtype=torch.bool)
        is_random[[row // (k + 1) for row in random_rows]] = True
        sampled = verify_lossless(probs.view(B, k + 1, -1), proposal.probs, proposal.tokens, uniforms)
        return select_rows(is_random.to(probs.device), sampled, exact)
