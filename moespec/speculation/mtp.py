"""MTP speculation: DeepSeek-V3's built-in MTP layer, or an external head trained for a target
without one. The draft consumes the target's hidden state at position i and token i+1 and
predicts token i+2; it shares the target's page ids (and, right after verification, its plan).

- After verification the MTP layer re-runs over the *whole* verify batch with the target's
  hidden states (`accept`): input tokens are the verify tokens shifted left with the new
  token plugged in at each request's accepted length, all with tensor ops, so nothing waits
  for the host to read accepted lengths. Rejected slots write KV that is overwritten later.
- Requests the MTP layer has not seen yet (after a prefill, a mixed batch, or steps that did
  not speculate) catch up in `propose` from the target hidden states kept per KV slot.
- k > 1 chains the layer on its own hidden states.

Shapes legend: T tokens, B requests, K draft tokens per request, V vocab, M hidden.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from moespec.attention import ForwardContext, create_backend
from moespec.batch import Batch, Span, pack_spans
from moespec.sequence import Sequence
from moespec.speculation.base import DraftRows, Proposal, Speculator, gather_rows


@dataclass
class MTPState:
    computed: int = 0  # positions whose MTP KV holds the target-hidden-state version
    logits: torch.Tensor | None = None  # [V] carried: predicts the token after the last one
    hidden: torch.Tensor | None = None  # [M] the MTP output that produced `logits`


class MTPSpeculator(Speculator):
    mode = "mtp"

    def __init__(self, mtp_model, caches, num_tokens: int, num_pages: int, page_size: int, hidden_size: int,
                 dtype: torch.dtype, device, attention_backend: str = "torch") -> None:
        """`mtp_model` offers forward_mtp / compute_mtp_logits; `caches` are the KV layers it writes
        (the target's own cache for a built-in layer, a separate one for an external head)."""
        self.mtp, self.caches = mtp_model, caches
        self.max_tokens = num_tokens
        self.page_size = page_size
        self.hidden_cache = torch.zeros(num_pages * page_size, hidden_size, dtype=dtype, device=device)
        self.backend = create_backend(attention_backend)  # for catch-up and chain steps
        self.states: dict[str, MTPState] = {}
        self.sync = None  # RankSync when a built-in MTP layer's experts are sharded over ranks

    def state(self, seq: Sequence) -> MTPState:
        return self.states.setdefault(seq.request_id, MTPState())

    def observe(self, batch: Batch, hidden: torch.Tensor) -> None:
        self.hidden_cache[batch.slot_mapping()] = hidden.to(self.hidden_cache.dtype)

    def release(self, seq: Sequence) -> None:
        self.states.pop(seq.request_id, None)

    # ------------------------------------------------------------------ draft

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], k: int, rows: DraftRows) -> Proposal:
        steady = not self.catch_up(seqs)
        states = [self.state(s) for s in seqs]
        logits = gather_rows([st.logits for st in states])  # [B, V]
        hidden = gather_rows([st.hidden for st in states])  # [B, M]
        drafts, probs = [], []
        for j in range(k):
            token, p = rows.draw(logits, drafts)
            drafts.append(token)
            probs.append(p)
            if j + 1 < k:  # chain: feed the MTP layer its own hidden state at the next position
                logits, hidden = self.chain_step(seqs, token, hidden, j)
        return Proposal(torch.stack(drafts, 1), torch.stack(probs, 1), steady=steady)

    def chain_step(self, seqs: list[Sequence], token: torch.Tensor, hidden: torch.Tensor,
                   j: int) -> tuple[torch.Tensor, torch.Tensor]:
        spans = [Span(s.pages, s.num_tokens - 1 + j, [0]) for s in seqs]
        batch = pack_spans(spans, self.page_size, "draft_extend").to(token.device)
        return self.run(batch, token, hidden)

    def catch_up(self, seqs: list[Sequence]) -> int:
        """MTP over positions [computed, m-1) from the kept target hidden states; m = num_tokens.
        Returns how many requests had to catch up (none in steady speculation)."""
        spans, lagging = [], []
        for seq in seqs:
            state = self.state(seq)
            end = seq.num_tokens - 1  # MTP at position p needs token p+1 and the target's hidden at p
            if state.computed >= end and state.logits is not None:
                continue
            start = min(state.computed, end - 1)
            spans.append(Span(seq.pages, start, seq.token_at(start + 1, end + 1)))
            lagging.append(seq)
        if not spans:
            return 0
        batch = pack_spans(spans, self.page_size, "draft_extend", sampled=[True] * len(spans))
        batch = batch.to(self.hidden_cache.device)
        hidden = self.hidden_cache[batch.slot_mapping()]
        logits, out = self.run(batch, batch.input_ids, hidden, rows=batch.sample_indices)
        for row, seq in enumerate(lagging):
            self.states[seq.request_id] = MTPState(seq.num_tokens - 1, logits[row], out[row])
        return len(lagging)

    def run(self, batch: Batch, token_ids: torch.Tensor, hidden: torch.Tensor,
            rows: torch.Tensor | None = None, ctx: ForwardContext | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP forward over a batch; returns (logits [N, V], hidden [N, M]) at `rows` (default: all)."""
        reuse_target = ctx is not None  # the verify re-run: the target's plan and hidden states
        if ctx is None:
            self.backend.plan(batch.attention_metadata())
            ctx = ForwardContext(self.backend, self.caches)
        with self.sync.mtp(batch, token_ids, hidden, reuse_target) if self.sync else contextlib.nullcontext():
            out = self.mtp.forward_mtp(0, token_ids, hidden, batch.positions, ctx)
        if rows is not None:
            out = out[rows]
        return self.mtp.compute_mtp_logits(0, out).float(), out

    # ------------------------------------------------------------------ after verification

    @torch.inference_mode()
    def accept(self, seqs: list[Sequence], batch: Batch, ctx, hidden: torch.Tensor, num_accepted: torch.Tensor,
               tokens: torch.Tensor) -> None:
        """Re-run MTP over the verify batch (same plan) with the target's hidden states.

        Verify row i of a request holds token s_{m-1+i}; the MTP input there is s_{m+i}: draft
        i+1 while i < accepted, the new token at i == accepted, anything after (overwritten).
        """
        B, K1 = tokens.shape
        shifted = torch.cat([batch.input_ids.view(B, K1)[:, 1:], tokens[:, -1:]], dim=1)  # [B, K+1]
        at_new = torch.arange(K1, device=tokens.device)[None, :] == num_accepted[:, None]
        new_token = tokens.gather(1, num_accepted[:, None])  # [B, 1]
        mtp_ids = torch.where(at_new, new_token, shifted).flatten()
        mtp_ctx = ForwardContext(ctx.backend, self.caches)  # the target's plan, the MTP layer's cache
        pick = torch.arange(B, device=tokens.device) * K1 + num_accepted  # [B] row of the new token
        carried_logits, carried_hidden = self.run(batch, mtp_ids, hidden, rows=pick, ctx=mtp_ctx)
        for b, seq in enumerate(seqs):
            state = self.state(seq)
            state.logits, state.hidden = carried_logits[b], carried_hidden[b]
            state.computed = -1  # resolved in commit once the host knows the accepted length

    def commit(self, seqs: list[Sequence], lengths_before: list[int], num_accepted: list[int], k: int) -> None:
        for seq, m, a in zip(seqs, lengths_before, num_accepted):
            if seq.request_id in self.states:
                self.states[seq.request_id].computed = m + a  # positions m-1 .. m-1+a now hold MTP KV
