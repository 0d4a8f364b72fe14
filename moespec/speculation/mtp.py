"""MTP speculation: DeepSeek-V3's built-in MTP layer, or an external head trained for a target
without one. The draft consumes the target's hidden state at position i and token i+1 and
predicts token i+2; it shares the target's page ids (and, right after verification, its plan).

- After verification the MTP layer re-runs over the *whole* verify batch with the target's
  hidden states (`accept`): input tokens are the verify tokens shifted left with the new
  token plugged in at each request's accepted length, all with tensor ops, so nothing waits
  for the host to read accepted lengths. Rejected slots write KV that is overwritten later.
- Positions the MTP layer has not seen yet (a prefill, a mixed batch, steps that did not
  speculate) keep the target's hidden states per request, in its slot of one buffer sized by
  the hold limit (`take_slot`). A request holding more than `hold_limit` of them is flushed
  right after the target forward (`observe`): the MTP layer runs over those whose next token
  is known. The rest catch up in `propose`, when a draft is needed. So between steps a running
  request holds at most `hold_limit` hidden states, whatever the KV capacity:
  `speculation.mtp_hold_tokens` (the layer's work on a prompt and on plain decode steps waits
  for the next draft, and a request that finishes first never pays for it), or 1 + K where the
  layer's forwards run in lockstep across ranks and their exchange is sized for that many.
  With prefix caching a prompt's chunks are flushed at 1 + K as before, so its pages are cached
  with their MTP KV at once (pages of held decode steps are cached for the layer only once it
  has run over them).
- k > 1 chains the layer on its own hidden states.
- Prefix caching: the layer's KV at position p reads token p + 1, so a cached page's key
  includes the token after it (`kv_lookahead`); a hit then holds exact MTP KV, and the layer
  starts at the first uncached position like after any prefill chunk (`start_at`).

Shapes legend: T tokens, B requests, K draft tokens per request, V vocab, M hidden.
"""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass

import torch

from moespec.attention import ForwardContext, create_backend, plan_forward
from moespec.batch import Batch, Span, pack_spans
from moespec.scheduler import ScheduledChunk
from moespec.sequence import Sequence
from moespec.speculation.base import DraftRows, Proposal, Speculator, gather_rows
from moespec.speculation.tree import DraftTree, TreeShape, grow_tree, tree_level_batch
from moespec.static_step import StaticSteps, mtp_step


def hold_limit(k: int, hold_tokens: int, in_lockstep: bool) -> int:
    """Target hidden states a request may hold before a flush: `hold_tokens`, at least 1 + k;
    exactly 1 + k where the MTP layer's forwards run in lockstep across ranks."""
    return 1 + k if in_lockstep else max(1 + k, hold_tokens)


def mtp_state_bytes(max_num_seqs: int, held: int, hidden_size: int, dtype: torch.dtype) -> int:
    """The most target hidden states [M] the MTP speculator holds between steps: `held` per request."""
    return max_num_seqs * held * hidden_size * dtype.itemsize


@dataclass(slots=True)
class MTPState:
    computed: int = 0  # positions whose MTP KV holds the target-hidden-state version
    # the target's hidden states at positions computed .. computed+n-1: the first n rows of `slot`
    # [H, M] (H the hold limit), or `overflow` [n, M] where n is past H (flushed within the step)
    slot: torch.Tensor | None = None
    slot_index: int = -1  # the slot's row of the speculator's buffer (-1: a slot of its own)
    overflow: torch.Tensor | None = None
    num_pending: int = 0  # n
    logits: torch.Tensor | None = None  # [V] carried: predicts the token after the last one
    hidden: torch.Tensor | None = None  # [M] the MTP output that produced `logits`

    def held(self) -> torch.Tensor:
        """The held hidden states [n, M]."""
        return self.overflow if self.overflow is not None else self.slot[:self.num_pending]

    def hold(self, rows: torch.Tensor) -> None:
        """Copy rows [r, M] after the held ones, into the slot where they fit; past it, the held
        ones join them (a long prompt chunk alone stays a view of the step's hidden states)."""
        n, r = self.num_pending, rows.shape[0]
        if self.overflow is None and n + r <= self.slot.shape[0]:
            self.slot[n: n + r] = rows
        else:
            self.overflow = torch.cat([self.held(), rows]) if n else rows
        self.num_pending += r

    def drop(self, n: int) -> None:
        """Drop the first n held hidden states; the rest move to the slot's front."""
        rest = self.held()[n:]
        self.overflow = rest if rest.shape[0] > self.slot.shape[0] else None
        if self.overflow is None and rest.shape[0]:
            self.slot[:rest.shape[0]] = rest.clone()  # may overlap the slot's rows it comes from
        self.num_pending -= n


class MTPSpeculator(Speculator):
    mode = "mtp"
    kv_lookahead = 1  # its KV at position p is computed from token p + 1
    kv_from_tokens = False  # and from the target's hidden state at p, which a cache hit does not have

    def __init__(self, mtp_model, caches, num_tokens: int, max_num_seqs: int, page_size: int, hidden_size: int,
                 dtype: torch.dtype, device, attention_backend: str = "torch", static=None,
                 num_pages: int = 0, hold_tokens: int = 0, flush_prompts: bool = False) -> None:
        """`mtp_model` offers forward_mtp / compute_mtp_logits; `caches` are the KV layers it writes
        (the target's own cache for a built-in layer, a separate one for an external head).
        `static` (static_step.StaticSpec): chain steps and the verify re-run run as static steps
        (moespec.static_step); the caches then hold a scratch page, page `num_pages`.
        `hold_tokens`: target hidden states a request may hold before a flush (`hold_limit`);
        `flush_prompts`: a prompt's chunks hold at most 1 + K (prefix caching)."""
        self.mtp, self.caches = mtp_model, caches
        self.max_tokens, self.hold_tokens, self.flush_prompts = num_tokens, hold_tokens, flush_prompts
        self.max_num_seqs, self.page_size = max_num_seqs, page_size
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, torch.device(device)
        self.backend = create_backend(attention_backend, self.device)  # for flushes, catch-up and chain steps
        self.states: dict[str, MTPState] = {}
        self.buffer: torch.Tensor | None = None  # [S, H, M] every request's held hidden states (`take_slot`)
        self.free_slots: list[int] | None = None  # its rows free to take
        self.sync = None  # distributed.Lockstep when a built-in MTP layer's experts are sharded over ranks
        self.static = (StaticSteps(functools.partial(mtp_step, mtp_model), caches, attention_backend, self.device,
                                   static, num_pages, page_size, input_hidden=(hidden_size, dtype))
                       if static else None)

    @property
    def hold_limit(self) -> int:
        return hold_limit(self.max_tokens, self.hold_tokens, self.sync is not None)

    def state(self, seq: Sequence) -> MTPState:
        state = self.states.get(seq.request_id)
        if state is None:
            state = self.states[seq.request_id] = MTPState()
        return state

    def release(self, seq: Sequence) -> None:
        state = self.states.pop(seq.request_id, None)
        if state is not None and state.slot_index >= 0:
            self.free_slots.append(state.slot_index)

    def take_slot(self) -> tuple[torch.Tensor, int]:
        """A request's rows [H, M] for the target hidden states it holds, H = `hold_limit`: slots of
        one buffer [S, H, M] allocated at the first hold (S = max_num_seqs: the bytes
        `state_bytes` counts), given back on release. So holding allocates nothing per step: on
        the CPU, a small copy per request and step that outlived the step fragmented the heap
        (at batch 64, 20 MB more resident and 2,500 more page faults per plain decode step).
        Returns the slot and its row of the buffer (-1 for a slot of its own)."""
        if self.free_slots is None:
            self.buffer = torch.empty(self.max_num_seqs, self.hold_limit, self.hidden_size, dtype=self.dtype,
                                      device=self.device)
            self.free_slots = list(range(self.max_num_seqs - 1, -1, -1))
        if not self.free_slots:  # more requests than max_num_seqs hold states: not expected
            return torch.empty(self.hold_limit, self.hidden_size, dtype=self.dtype, device=self.device), -1
        index = self.free_slots.pop()
        return self.buffer[index], index

    def warm_up(self) -> float:
        """Compile the static steps of every bucket: the re-run over verify batches of each draft
        length, and the chain steps (one query per request)."""
        if self.static is None:
            return 0.0
        start = time.perf_counter()
        self.static.warm_up([("verify", 1 + j, 1 + j) for j in range(1, self.max_tokens + 1)], one_row_each=True)
        if self.max_tokens > 1:
            self.static.warm_up([("draft_extend", 1, 1)])
        return time.perf_counter() - start

    def kv_tokens(self, seq: Sequence) -> int:
        state = self.states.get(seq.request_id)
        return max(state.computed, 0) if state is not None else 0

    def start_at(self, seq: Sequence, num_tokens: int) -> None:
        self.release(seq)
        self.states[seq.request_id] = MTPState(computed=num_tokens)

    # ------------------------------------------------------------------ memory

    @property
    def max_pending_tokens(self) -> int:
        """Target hidden states held between steps: at most `hold_limit` per running request."""
        return self.max_num_seqs * self.hold_limit

    def state_bytes(self) -> int:
        return mtp_state_bytes(self.max_num_seqs, self.hold_limit, self.hidden_size, self.dtype)

    def pending_tokens(self) -> int:
        """Target hidden states held now, over all requests."""
        return sum(state.num_pending for state in self.states.values())

    # ------------------------------------------------------------------ after a target forward

    @torch.inference_mode()
    def observe(self, chunks: list[ScheduledChunk], batch: Batch, hidden: torch.Tensor) -> None:
        """Keep the target's hidden states [T, M] per request, then flush the requests that hold
        more than their limit. A verify batch's are consumed by `accept`. A decode chunk's one
        row that fits its slot is copied with the others in one indexed copy (a copy per request
        cost ~0.4 ms of a 40 ms step at batch 64); the loop touches each request once (its
        Python is the MTP engine's upkeep of a plain step)."""
        if batch.mode == "verify":
            return
        hidden, row, over, limit = hidden.to(self.dtype), 0, [], self.hold_limit
        prompt_limit = 1 + self.max_tokens if self.flush_prompts else limit
        rows, places = [], []  # per one-row chunk: its row of `hidden`, its place in the buffer's [S * H] rows
        for chunk in chunks:
            n, seq = chunk.num_tokens, chunk.seq
            if seq.is_finished:  # overlap scheduling: it finished with the step before, its row still here
                row += n
                continue
            state = self.holder(chunk)
            pending = state.num_pending
            if n == 1 and pending < limit and state.slot_index >= 0 and state.overflow is None:
                rows.append(row)
                places.append(state.slot_index * limit + pending)
                state.num_pending = pending = pending + 1
            else:
                state.hold(hidden[row: row + n])
                pending = state.num_pending
            if pending > limit or (pending > prompt_limit and not chunk.is_decode):
                over.append(seq)
            row += n
        if rows:
            self.buffer.view(-1, self.hidden_size).index_copy_(
                0, torch.tensor(places, device=self.device), hidden if len(rows) == hidden.shape[0] else hidden[rows])
        if over:
            self.flush(over)

    def needs_flush(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether `observe` will flush after a target forward over these (non-verify) chunks."""
        return any(self.state(c.seq).num_pending + c.num_tokens > self.hold_limit for c in chunks)

    def needs_catch_up(self, seqs: list[Sequence]) -> bool:
        return any(self.lags(seq) for seq in seqs)

    def holder(self, chunk: ScheduledChunk) -> MTPState:
        """The state of the request that holds a chunk's hidden states after its pending ones (a
        slot taken at its first), checked to start where they end."""
        state = self.state(chunk.seq)
        if chunk.start != state.computed + state.num_pending:
            raise RuntimeError(f"MTP: request {chunk.seq.request_id} has target hidden states up to position "
                               f"{state.computed + state.num_pending}, this chunk starts at {chunk.start}")
        if state.slot is None:
            state.slot, state.slot_index = self.take_slot()
        return state

    def flush(self, seqs: list[Sequence]) -> None:
        """MTP over each request's pending positions whose next token is known, in one forward.
        A chunk that reached the last known token keeps its last position pending; the carried
        logits are stale from here on and the request catches up in `propose`."""
        ends = []
        for seq in seqs:
            state = self.state(seq)
            ends.append(min(state.computed + state.num_pending, seq.num_known_tokens - 1))
            state.logits = state.hidden = None
        spans, hidden = self.take(seqs, ends)
        batch = pack_spans(spans, self.page_size, "draft_extend", sampled=[False] * len(spans)).to(self.device)
        self.forward(batch, batch.input_ids, hidden)

    def take(self, seqs: list[Sequence], ends: list[int]) -> tuple[list[Span], torch.Tensor]:
        """Per request, the span of positions [computed, end) with the tokens after them, and their
        pending hidden states [T, M]; they count as computed from now on and are dropped."""
        states = [self.state(seq) for seq in seqs]
        spans = [Span(seq.pages, state.computed, seq.token_at(state.computed + 1, end + 1))
                 for seq, state, end in zip(seqs, states, ends)]
        hidden = torch.cat([state.held()[:end - state.computed] for state, end in zip(states, ends)])
        for state, end in zip(states, ends):
            state.drop(end - state.computed)
            state.computed = end
        return spans, hidden

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

    @torch.inference_mode()
    def propose_tree(self, seqs: list[Sequence], shape: TreeShape, rows: DraftRows) -> DraftTree:
        """Expand a tree from the carried logits: each frontier level is one MTP forward over K
        nodes per request, fed its parents' MTP hidden states, at rotary position m-2+level and
        KV slots past the layer's context (positions 0..m-2), under a tree mask."""
        steady = not self.catch_up(seqs)
        states = [self.state(s) for s in seqs]
        logits = gather_rows([st.logits for st in states])  # [B, V]
        parent_hidden = gather_rows([st.hidden for st in states])[:, None]  # [B, 1, M]
        K, B = shape.top_k, len(seqs)
        context = [s.num_tokens - 1 for s in seqs]

        def forward(level: int, tokens: torch.Tensor, parent: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
            nonlocal parent_hidden
            hidden = parent_hidden.gather(1, parent[:, :, None].expand(-1, -1, parent_hidden.shape[2]))  # [B, K, M]
            batch = tree_level_batch(seqs, context, level, K, visible, self.page_size, self.device)
            logits, out = self.run(batch, tokens.flatten(), hidden.flatten(0, 1), static=False)
            parent_hidden = out.view(B, K, -1)
            return rows.expansion_logprobs(logits, K).view(B, K, -1)

        tree = grow_tree(shape, rows.expansion_logprobs(logits), forward)
        tree.steady = steady
        return tree

    def catch_up(self, seqs: list[Sequence]) -> int:
        """MTP over positions [computed, m-1) from the pending target hidden states; m = num_tokens.
        Returns how many requests had to catch up (none in steady speculation)."""
        lagging = [seq for seq in seqs if self.lags(seq)]
        if not lagging:
            return 0
        spans, hidden = self.take(lagging, [seq.num_tokens - 1 for seq in lagging])
        batch = pack_spans(spans, self.page_size, "draft_extend", sampled=[True] * len(spans)).to(self.device)
        logits, out = self.run(batch, batch.input_ids, hidden, rows=batch.sample_indices, static=False)
        for row, seq in enumerate(lagging):
            state = self.state(seq)
            state.logits, state.hidden = logits[row], out[row]
        return len(lagging)

    def lags(self, seq: Sequence) -> bool:
        """Whether the carried logits do not yet predict the token after seq's last one."""
        state = self.state(seq)
        end = seq.num_tokens - 1  # MTP at position p needs token p+1 and the target's hidden at p
        if state.computed >= end and state.logits is not None:
            return False
        if state.computed >= end or state.computed + state.num_pending != end:
            raise RuntimeError(f"MTP: request {seq.request_id} holds {state.num_pending} target hidden states from "
                               f"position {state.computed}, needs positions {state.computed} .. {end - 1}")
        return True

    def forward(self, batch: Batch, token_ids: torch.Tensor, hidden: torch.Tensor,
                target_ctx: ForwardContext | None = None) -> torch.Tensor:
        """MTP layer over a batch (writes its KV) -> hidden [T, M]; `target_ctx`: the verify
        re-run reuses the target forward's plan."""
        if target_ctx is None:
            split = self.sync.two_batch_split(batch) if self.sync else None
            ctx = plan_forward(self.backend, batch.attention_metadata(), self.caches, split)
        else:
            ctx = ForwardContext(target_ctx.backend, self.caches, target_ctx.halves)
        with self.sync.mtp(batch) if self.sync else contextlib.nullcontext():
            return self.mtp.forward_mtp(0, token_ids, hidden, batch.positions, ctx)

    def run(self, batch: Batch, token_ids: torch.Tensor, hidden: torch.Tensor, rows: torch.Tensor | None = None,
            target_ctx: ForwardContext | None = None, static: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP forward over a batch; returns (logits [N, V], hidden [N, M]) at `rows` (default: all).
        `static`: as a static step where one applies (catch-ups, rarely uniform, run eager)."""
        static = self.plan_static(batch, target_ctx) if static else None
        if static is not None:
            with self.sync.mtp(batch) if self.sync else contextlib.nullcontext():
                out, logits = self.static.forward(static, token_ids, hidden, rows,
                                                  fixed_exchange=self.sync is None or self.sync.low_latency)
            return logits, out if rows is None else out[rows]
        out = self.forward(batch, token_ids, hidden, target_ctx)
        if rows is not None:
            out = out[rows]
        return self.mtp.compute_mtp_logits(0, out).float(), out

    def plan_static(self, batch: Batch, target_ctx: ForwardContext | None):
        """The static step for a uniform batch (chain steps; the verify re-run takes the target's
        padded plan), or None: run eager."""
        if self.static is None:
            return None
        if target_ctx is None:
            return self.static.plan(batch)
        return self.static.reuse(target_ctx.static) if target_ctx.static is not None else None

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
        pick = torch.arange(B, device=tokens.device) * K1 + num_accepted  # [B] row of the new token
        # the target's plan, the MTP layer's cache
        carried_logits, carried_hidden = self.run(batch, mtp_ids, hidden, rows=pick, target_ctx=ctx)
        for b, seq in enumerate(seqs):
            state = self.state(seq)
            state.logits, state.hidden = carried_logits[b], carried_hidden[b]
            state.computed = -1  # resolved in commit once the host knows the accepted length

    def commit(self, seqs: list[Sequence], lengths_before: list[int], num_accepted: list[int], k: int) -> None:
        for seq, m, a in zip(seqs, lengths_before, num_accepted):
            if seq.request_id in self.states:
                self.states[seq.request_id].computed = m + a  # positions m-1 .. m-1+a now hold MTP KV
