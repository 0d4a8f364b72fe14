"""Requests across ranks: rank 0 takes every request and places it; the owning rank runs it and
streams its tokens back.

- `parallel.attention: dp`: a request goes to one rank, the one with the fewest unfinished
  requests (then the lowest KV use, then the lowest rank); with prefix caching, rather one that
  was sent the same prompt prefix, unless that one is much busier (`place_by_prefix`). Rank 0 keeps a stand-in `Sequence`
  for each request on another rank and fills it from that rank's updates, so the HTTP server
  and `LLM.generate` see every request alike.
- `replicated`: every rank gets every request and runs the same batches; rank 0's own copy
  answers, the others send nothing back.

Transport: ZeroMQ (a ROUTER socket on rank 0, a DEALER on each other rank), pickled messages.
Commands (add, abort) are sent when rank 0 receives them, but a rank applies them only at the
start of the step after the agreement that counted them (`StepPlan.sent`), so replicated ranks
add and abort at the same step, and no rank waits on the socket for a command not yet sent.
Token updates are sent after every step without waiting for anyone, and rank 0 reads whatever
has arrived after its own step. The sockets never take part in a collective, so a slow HTTP
client or a burst of requests never holds up the ranks' lockstep.
"""
from __future__ import annotations

import logging
import os
import pickle
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

import torch.distributed as dist

from moespec.kv_cache import PageKeys
from moespec.sampling import SamplingParams
from moespec.sequence import Sequence, Status, TokenLogprob

logger = logging.getLogger(__name__)


@dataclass
class Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seq: Sequence | None = None  # rank 0's own requests: the object its caller already holds


@dataclass
class Abort:
    request_id: str


@dataclass
class Update:
    """New output of one request since its previous update."""

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    text_keep: int  # the text keeps its first text_keep characters ...
    text_tail: str  # ... followed by these
    streamable_chars: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # preemptions, draft, accepted tokens, spec steps, prompt tokens found in the prefix cache (-1: none yet)
    counts: tuple[int, int, int, int, int] = (0, 0, 0, 0, -1)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once, in the update that completes the prompt


class ChannelError(RuntimeError):
    pass


class Channel:
    """Rank 0 <-> every other rank, over ZeroMQ. The address rank 0 binds is broadcast once over
    the process group, and every other rank says hello before the first command is sent."""

    def __init__(self, ctx, socket, zmq_module) -> None:
        self.ctx, self.socket, self.zmq = ctx, socket, zmq_module

    @classmethod
    def connect(cls, ctx) -> "Channel":
        import zmq

        socket = zmq.Context.instance().socket(zmq.ROUTER if ctx.leader else zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        address = [None]
        if ctx.leader:
            socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
            address = [f"tcp://{ctx.host}:{socket.bind_to_random_port('tcp://*')}"]
        dist.broadcast_object_list(address, src=0)
        channel = cls(ctx, socket, zmq)
        if ctx.leader:
            channel.await_hellos()
        else:
            socket.setsockopt(zmq.IDENTITY, str(ctx.rank).encode())
            socket.connect(address[0])
            socket.send(b"hello")
        return channel

    def await_hellos(self) -> None:
        waiting = set(range(1, self.ctx.world_size))
        deadline = time.monotonic() + self.ctx.timeout_s
        while waiting:
            if not self.socket.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                raise ChannelError(f"ranks {sorted(waiting)} did not connect to rank 0's request channel within "
                                   f"{self.ctx.timeout_s:g} s")
            identity, _ = self.socket.recv_multipart()
            waiting.discard(int(identity))

    def send(self, rank: int, message: object) -> None:
        """Rank 0 -> rank; any other rank -> rank 0 (`rank` ignored)."""
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if self.ctx.leader:
            self.socket.send_multipart([str(rank).encode(), payload])
        else:
            self.socket.send(payload)

    def receive(self) -> object:
        """Next message from rank 0 (other ranks), waiting at most the collective timeout."""
        if not self.socket.poll(int(self.ctx.timeout_s * 1000)):
            raise ChannelError(f"rank {self.ctx.rank}: no command from rank 0 within {self.ctx.timeout_s:g} s, "
                               "although the step's agreement counted it")
        return pickle.loads(self.socket.recv())

    def poll(self) -> list[tuple[int, object]]:
        """Rank 0: every message that has arrived, as (rank, message), without waiting."""
        messages = []
        while self.socket.poll(0):
            identity, payload = self.socket.recv_multipart()
            messages.append((int(identity), pickle.loads(payload)))
        return messages

    def close(self) -> None:
        self.socket.close(linger=0)


@dataclass
class Remote:
    rank: int
    seq: Sequence


@dataclass
class Sent:
    """What a rank has sent rank 0 of one request so far."""

    tokens: int = 0
    logprobs: int = 0
    text: str = ""
    prompt: bool = False  # its prompt logprobs


@dataclass
class Cluster:
    """The engine's view of the other ranks: placement and stand-ins on rank 0, command
    application and updates on every rank."""

    channel: Channel
    rank: int
    size: int
    dp: bool
    sent: list[int] = field(default_factory=list)  # rank 0: commands sent to each rank so far
    applied: int = 0  # commands this rank has applied
    own: deque = field(default_factory=deque)  # rank 0: its own commands, not yet applied
    remote: dict[str, Remote] = field(default_factory=dict)  # rank 0: stand-ins of other ranks' requests
    progress: dict[str, Sent] = field(default_factory=dict)  # other ranks: what was sent of each request
    local_unfinished: int = 0  # rank 0's own running, waiting and queued requests (set by its engine)
    announced: tuple[int, ...] = ()  # rank 0: commands counted by the last agreement, per rank
    delivered: tuple[int, ...] = ()  # ... and by the one before: every rank has applied these
    keys: PageKeys | None = None  # prefix caching on: placement prefers a rank that holds the prefix
    slack: int = 4  # ... unless it has this many more unfinished requests than the least loaded rank
    holders: OrderedDict = field(default_factory=OrderedDict)  # rank 0: page key -> ranks it was sent to

    def __post_init__(self) -> None:
        self.sent = self.sent or [0] * self.size
        self.announced = self.delivered = (0,) * self.size

    def agreed(self, sent: tuple[int, ...]) -> None:
        """A step's agreement counted `sent`: ranks apply those at the next step's start."""
        self.delivered, self.announced = self.announced, sent

    @property
    def front(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ rank 0: requests in

    def submit(self, seq: Sequence, loads) -> None:
        """Place a validated request: one rank (dp) or every rank (replicated)."""
        ranks = [self.place_by_prefix(seq, loads)] if self.dp else list(range(self.size))
        for rank in ranks:
            self.send(rank, Add(seq.request_id, seq.prompt_ids, seq.params, seq if rank == 0 else None))
        if ranks[0] != 0:
            self.remote[seq.request_id] = Remote(ranks[0], seq)

    def place(self, loads, among: list[int] | None = None) -> int:
        """The rank with the fewest unfinished requests, then the lowest KV use, then the lowest id."""
        counts = self.unfinished()
        usage = [load.kv_usage for load in loads] if loads else [0.0] * self.size
        return min(among or range(self.size), key=lambda r: (counts[r], usage[r], r))

    def unfinished(self) -> Counter:
        counts = Counter(r.rank for r in self.remote.values())
        counts[0] = self.local_unfinished + self.num_queued()
        return counts

    def place_by_prefix(self, seq: Sequence, loads) -> int:
        """With prefix caching: the least loaded rank of those sent the longest run of seq's full
        prompt pages, unless it has `slack` more unfinished requests than the least loaded rank
        (which then computes the prefix and holds it too). Ranks evict on their own: this is
        where the prefix likely is, not a promise."""
        rank = self.place(loads)
        if self.keys is None:
            return rank
        keys = self.keys.update(seq)[: len(seq.prompt_ids) // self.keys.page_size]
        holders = self.prefix_holders(keys)
        if holders:
            best, counts = self.place(loads, holders), self.unfinished()
            rank = best if counts[best] <= counts[rank] + self.slack else rank
        self.remember(keys, rank)
        return rank

    def prefix_holders(self, keys: list[bytes]) -> list[int]:
        """The ranks sent the longest run of these page keys (none: no rank was sent the first)."""
        held: set[int] = set()
        for key in keys:
            ranks = self.holders.get(key, set())
            ranks = ranks & held if held else ranks
            if not ranks:
                break
            held = ranks
        return sorted(held)

    def remember(self, keys: list[bytes], rank: int, limit: int = 1 << 16) -> None:
        for key in keys:
            self.holders.setdefault(key, set()).add(rank)
            self.holders.move_to_end(key)
        while len(self.holders) > limit:
            self.holders.popitem(last=False)

    def abort(self, request_id: str) -> Sequence | None:
        """Rank 0: send the abort to the owning rank(s). A stand-in is finished at once (returned);
        rank 0's own request is when the command applies."""
        remote = self.remote.pop(request_id, None)
        if remote is not None:
            self.send(remote.rank, Abort(request_id))
            finish_stand_in(remote.seq, "abort")
            return remote.seq
        for rank in (range(self.size) if not self.dp else [0]):
            self.send(rank, Abort(request_id))
        return None

    def send(self, rank: int, command: Add | Abort) -> None:
        self.sent[rank] += 1
        if rank == 0:
            self.own.append(command)
        else:
            self.channel.send(rank, command)

    def has_unfinished(self) -> bool:
        """Rank 0: requests on other ranks, or commands some rank has not applied yet (an abort
        frees its pages only when applied, so rank 0 keeps stepping until then)."""
        return bool(self.own or self.remote) or tuple(self.sent) != self.delivered

    def num_queued(self) -> int:
        """Rank 0's requests not yet applied anywhere."""
        return sum(isinstance(c, Add) for c in self.own)

    # ------------------------------------------------------------------ every rank: commands applied

    def take_commands(self, announced: int) -> list[Add | Abort]:
        """The commands counted by the last agreement that this rank has not applied yet."""
        commands = []
        while self.applied < announced:
            commands.append(self.own.popleft() if self.front else self.channel.receive())
            self.applied += 1
        return commands

    # ------------------------------------------------------------------ updates back

    def send_updates(self, seqs: list[Sequence]) -> None:
        """Another rank (dp): the new output of its updated requests, one message per step."""
        if self.front or not self.dp or not seqs:
            return
        updates = [self.take_update(seq) for seq in seqs]
        self.channel.send(0, updates)

    def take_update(self, seq: Sequence) -> Update:
        sent = self.progress.setdefault(seq.request_id, Sent())
        keep = len(os.path.commonprefix([sent.text, seq.text]))  # text grows, or is cut back at a stop string
        m = seq.metrics
        known = seq.num_known_tokens - len(seq.prompt_ids)  # not the placeholders of a step in flight (overlap)
        update = Update(seq.request_id, seq.output_ids[sent.tokens:known], seq.logprobs[sent.logprobs:], keep,
                        seq.text[keep:], seq.streamable_chars, seq.finish_reason if seq.is_finished else None,
                        seq.stop_reason, (m.num_preemptions, m.num_draft_tokens, m.num_accepted_tokens,
                                          m.num_spec_steps,
                                          -1 if m.num_cached_tokens is None else m.num_cached_tokens))
        if seq.prompt_logprobs is not None and not sent.prompt and (known or seq.is_finished):
            update.prompt_logprobs, sent.prompt = seq.prompt_logprobs, True
        sent.tokens, sent.logprobs, sent.text = known, len(seq.logprobs), seq.text
        if seq.is_finished:
            del self.progress[seq.request_id]
        return update

    def forget(self, request_id: str) -> None:
        self.progress.pop(request_id, None)

    def receive_updates(self) -> tuple[list[Sequence], list[int]]:
        """Rank 0: apply the updates that arrived to their stand-ins -> the stand-ins that changed,
        and the verify steps, draft tokens and accepted tokens they add (for cluster-wide figures)."""
        changed, spec = [], [0, 0, 0]
        for rank, updates in self.channel.poll():
            for update in updates:
                remote = self.remote.get(update.request_id)
                if remote is None or remote.rank != rank:  # aborted here meanwhile
                    continue
                m = remote.seq.metrics
                before = (m.num_spec_steps, m.num_draft_tokens, m.num_accepted_tokens)
                apply_update(remote.seq, update)
                after = (m.num_spec_steps, m.num_draft_tokens, m.num_accepted_tokens)
                spec = [s + a - b for s, a, b in zip(spec, after, before)]
                if remote.seq.is_finished:
                    del self.remote[update.request_id]
                changed.append(remote.seq)
        return changed, spec


def apply_update(seq: Sequence, update: Update) -> None:
    now = time.monotonic()
    if update.token_ids and seq.metrics.first_token_time is None:
        seq.metrics.first_token_time = now
    seq.status = Status.RUNNING
    seq.output_ids += update.token_ids
    seq.logprobs += update.logprobs
    if update.prompt_logprobs is not None:
        seq.prompt_logprobs = update.prompt_logprobs
    seq.text = seq.text[:update.text_keep] + update.text_tail
    seq.streamable_chars = update.streamable_chars
    m = seq.metrics
    m.num_generated_tokens = len(seq.output_ids)
    m.num_preemptions, m.num_draft_tokens, m.num_accepted_tokens, m.num_spec_steps, cached = update.counts
    m.num_cached_tokens = None if cached < 0 else cached
    if update.finish_reason is not None:
        seq.stop_reason = update.stop_reason
        finish_stand_in(seq, update.finish_reason)


def finish_stand_in(seq: Sequence, reason: str) -> None:
    seq.status, seq.finish_reason = Status.FINISHED, reason
    seq.metrics.finished_time = time.monotonic()
    seq.streamable_chars = len(seq.text)
