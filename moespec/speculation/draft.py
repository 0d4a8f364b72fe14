"""Draft-target speculation: a separate small model (e.g. a 1B Llama for a 70B one) with its
own KV cache on the target's page ids. It runs on the leader rank only.

The draft's cache runs one token ahead of the target's: it has seen the last sampled token,
and its logits there (carried between steps) give the first draft token of the next step.
Tokens it has not seen yet (the prompt after prefill, the token after verification, steps
that did not speculate) are caught up in one ragged forward at the start of `propose`.

Shapes legend: B requests, K draft tokens per request, V vocab.
"""
from __future__ import annotations

import torch

from moespec.batch import Batch, Span, pack_spans
from moespec.model_runner import ModelRunner
from moespec.sequence import Sequence
from moespec.speculation.base import DraftRows, Proposal, Speculator
from moespec.speculation.tree import (DraftTree, TreeResult, TreeShape, compact_path, grow_tree, page_table,
                                      path_positions, tree_level_batch)


class DraftModelSpeculator(Speculator):
    mode = "draft"

    def __init__(self, draft_model, num_tokens: int, num_pages: int, page_size: int, attention_backend: str,
                 device, static=None, pack: bool = False) -> None:
        # each target forward evicts the draft's weights: its forwards read them from memory
        self.runner = ModelRunner(draft_model, num_pages, page_size, attention_backend, device, weights_stream=True,
                                  static=static, pack=pack)
        self.max_tokens = num_tokens
        self.page_size = page_size
        self.computed: dict[str, int] = {}  # request -> tokens in the draft's KV
        self.kept: torch.Tensor | None = None  # [B] after a tree step: accepted drafts whose KV the draft kept

    def warm_up(self) -> float:
        return self.runner.warm_up([("draft_extend", 1, 1)])  # the draft's decode steps

    def release(self, seq: Sequence) -> None:
        self.computed.pop(seq.request_id, None)

    def kv_tokens(self, seq: Sequence) -> int:
        return self.computed.get(seq.request_id, 0)

    def start_at(self, seq: Sequence, num_tokens: int) -> None:
        self.computed[seq.request_id] = num_tokens

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], k: int, rows: DraftRows) -> Proposal:
        unseen = max(s.num_tokens - self.computed.get(s.request_id, 0) for s in seqs)
        logits = self.catch_up(seqs)  # [B, V] predicts each request's next token
        drafts, probs = [], []
        for j in range(k):
            token, p = rows.draw(logits, drafts)
            drafts.append(token)
            probs.append(p)
            if j + 1 < k:
                logits = self.step(seqs, token, j)
        # after a verify step the draft has 1 unseen token, or 2 when all k were accepted
        return Proposal(torch.stack(drafts, 1), torch.stack(probs, 1), steady=unseen <= 2)

    def catch_up(self, seqs: list[Sequence]) -> torch.Tensor:
        """Draft forward over each request's unseen tokens; logits at each last one [B, V]."""
        spans = []
        for seq in seqs:
            start = min(self.computed.get(seq.request_id, 0), seq.num_tokens - 1)
            spans.append(Span(seq.pages, start, seq.token_at(start, seq.num_tokens)))
            self.computed[seq.request_id] = seq.num_tokens
        batch = pack_spans(spans, self.page_size, "draft_extend", sampled=[True] * len(spans)).to(self.runner.device)
        return self.runner.forward(batch, self.runner.plan(batch))[1]

    def step(self, seqs: list[Sequence], token: torch.Tensor, j: int) -> torch.Tensor:
        """Run the draft on draft token j+1 (position m + j) -> logits for the next [B, V]."""
        spans = [Span(s.pages, s.num_tokens + j, [0]) for s in seqs]
        batch = pack_spans(spans, self.page_size, "draft_extend").to(self.runner.device)
        batch.input_ids = token
        return self.runner.forward(batch, self.runner.plan(batch))[1]

    @torch.inference_mode()
    def propose_tree(self, seqs: list[Sequence], shape: TreeShape, rows: DraftRows) -> DraftTree:
        """Expand a tree: each frontier level is one draft forward over K nodes per request, at
        rotary position m-1+level and KV slots past the draft's context (positions 0..m-1)."""
        unseen = max(s.num_tokens - self.computed.get(s.request_id, 0) for s in seqs)
        logits = self.catch_up(seqs)  # [B, V]
        K, B = shape.top_k, len(seqs)
        context = [s.num_tokens for s in seqs]

        def forward(level: int, tokens: torch.Tensor, parent: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
            batch = tree_level_batch(seqs, context, level, K, visible, self.page_size, self.runner.device)
            batch.input_ids = tokens.flatten()
            logits = self.runner.forward(batch, self.runner.plan(batch))[1]  # [B*K, V]
            return rows.expansion_logprobs(logits, K).view(B, K, -1)

        tree = grow_tree(shape, rows.expansion_logprobs(logits), forward)
        tree.steady = unseen <= 2
        return tree

    @torch.inference_mode()
    def accept_tree(self, seqs: list[Sequence], batch: Batch, tree: DraftTree, result: TreeResult) -> None:
        """Keep the draft's KV of the accepted drafts it ran (every path node but possibly the
        last), moved from its frontier slots to their positions m-1+d."""
        _, targets = path_positions(batch, result)  # [B, D+1] m-1+d
        root = targets[:, :1]
        slots = torch.cat([torch.full_like(tree.draft_slots[:, :1], -1), tree.draft_slots], 1).gather(1, result.path)
        depth = targets - root
        ran = (depth >= 1) & (depth <= result.num_accepted[:, None]) & (slots >= 0)  # [B, D+1]
        ran[:, 1:] = ran[:, 1:].long().cumprod(1).bool()
        compact_path(self.runner.cache.layers, page_table(seqs, root.device), self.page_size,
                     torch.where(ran, root + 1 + slots, targets), targets)
        self.kept = ran.long().sum(1)

    def commit_tree(self, seqs: list[Sequence], lengths_before: list[int], num_accepted: list[int],
                    tree: DraftTree) -> None:
        kept = self.kept.tolist()
        for seq, m, n in zip(seqs, lengths_before, kept):
            if seq.request_id in self.computed:
                self.computed[seq.request_id] = m + n

    def commit(self, seqs: list[Sequence], lengths_before: list[int], num_accepted: list[int], k: int) -> None:
        # the draft saw d_1 .. d_{k-1}: those that were accepted stay valid in its cache
        for seq, m, a in zip(seqs, lengths_before, num_accepted):
            if seq.request_id in self.computed:
                self.computed[seq.request_id] = m + min(a, k - 1)
