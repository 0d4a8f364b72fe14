"""Sampling: per-request parameters, batched logit processing, token draws, logprobs.

Kept apart from the models: a model returns logits, the engine builds one `SamplingBatch`
per step and calls the `Sampler`. Speculative verification reuses `compute_probs` (the
same pure transform on draft and target logits) and `draw_uniform`.

Seeded requests draw with noise keyed by (seed, position): the token at position p is the
Gumbel-max (exponential race) token argmax_v p(v) / E_v, with E_v = -log u_v and u a hash of
(seed, p, v). It is an exact sample of p, and a pure function of the request's seed, the
position and the distribution there, so no batch mate, step boundary, preemption or
speculation mode can change it: a draft token is accepted exactly when it equals the target's
own keyed draw (see speculation/verify.py). Unseeded requests draw from the engine's shared
generator (inverse CDF), and speculation verifies them by rejection sampling.

A request with a grammar (SamplingParams.structured, structured.py) samples under its mask:
`SamplingBatch.constrained` takes the rows' packed bitmasks, and `apply_penalties` sets the
logits of disallowed tokens to -inf, so greedy, seeded and random rows and both sides of
speculative verification all see the constrained distribution. Logprobs stay the raw model's.

Shapes: N rows of logits (one per request in a decode step; one per position when
verifying drafts), V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple, Sequence

import torch

from moespec.structured import StructuredOutputs

MAX_LOGPROBS = 20
GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily (dividing by them overflows)
FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0  # 0 (or below GREEDY_TEMPERATURE) = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = field(default=None, hash=False)  # equal params, equal bias
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # None = none; 0 = the chosen token's; k = also the top k
    prompt_logprobs: int | None = None  # the same, for every prompt token (moespec.prompt_logprobs)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None  # requests share cached KV pages only with requests of the same salt
    structured: StructuredOutputs | None = None  # a grammar every output token follows (a dict of its fields too)
    # the grammar applies only after the output has shown this text (a reasoning model's
    # "</think>"): tokens up to and including the one that completes it are unconstrained
    structured_after: str | None = None

    def __post_init__(self) -> None:
        # Frozen: normalization has to go through object.__setattr__.
        object.__setattr__(self, "stop", _as_tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids))
        if self.structured is not None:
            object.__setattr__(self, "structured", _as_structured(self.structured))
        if self.logit_bias is not None:  # a private copy: later edits by the caller can't leak in
            object.__setattr__(self, "logit_bias", _as_bias(self.logit_bias))
        self._validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Repetition, frequency or presence penalties: sampling reads the output tokens so far."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0 or self.presence_penalty != 0

    def _validate(self) -> None:
        _require(self.n >= 1, "n", self.n, "must be >= 1")
        _require(self.max_tokens is None or self.max_tokens >= 1 or self.max_tokens == 0 and self.prompt_logprobs
                 is not None, "max_tokens", self.max_tokens,
                 "must be >= 1 or None (0 only with prompt_logprobs: the prompt is scored, nothing generated)")
        _require(self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be >= 0")
        _require(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
                 self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")
        _require(self.temperature >= 0, "temperature", self.temperature, "must be >= 0 (0 = greedy)")
        _require(0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        _require(self.top_k >= -1, "top_k", self.top_k, "must be -1 or 0 (off) or >= 1")
        _require(0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]")
        _require(-2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty,
                 "must be in [-2, 2]")
        _require(-2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty,
                 "must be in [-2, 2]")
        _require(self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty,
                 "must be > 0 (1 = off)")
        for token, bias in (self.logit_bias or {}).items():
            _require(token >= 0, "logit_bias", token, "token ids must be >= 0")
            _require(-100 <= bias <= 100, "logit_bias", bias, f"value for token {token} must be in [-100, 100]")
        for s in self.stop or ():
            _require(isinstance(s, str) and s != "", "stop", s, "entries must be non-empty strings")
        for t in self.stop_token_ids or ():
            _require(isinstance(t, int) and t >= 0, "stop_token_ids", t, "entries must be ints >= 0")
        _require(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs", self.logprobs,
                 f"must be None or in [0, {MAX_LOGPROBS}]")
        _require(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
                 self.prompt_logprobs, f"must be None or in [0, {MAX_LOGPROBS}]")
        _require(self.cache_salt is None or isinstance(self.cache_salt, str) and self.cache_salt != "", "cache_salt",
                 self.cache_salt, "must be a non-empty string or None")
        _require(self.structured is None or self.min_tokens == 0, "min_tokens", self.min_tokens,
                 "must be 0 with structured outputs (the grammar decides where the output ends)")


def _as_tuple(value: object) -> tuple | None:
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    return tuple(value)  # type: ignore[call-overload]


def _as_bias(bias: dict) -> dict[int, float]:
    try:  # OpenAI clients send token ids as JSON string keys
        return {int(t): float(b) for t, b in bias.items()}
    except (TypeError, ValueError) as e:
        raise ValueError(f"SamplingParams.logit_bias={bias!r}: must map token ids to numbers") from e


def _as_structured(value: object) -> StructuredOutputs:
    try:
        return StructuredOutputs.of(value)
    except ValueError as e:
        raise ValueError(f"SamplingParams.structured: {e}") from None


def _require(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r}: {rule}")


# ---------------------------------------------------------------------- keyed noise

MASK32 = 0xFFFFFFFF
GUMBEL_STREAM, UNIFORM_STREAM = 0x5EED0001, 0x5EED0002  # separate noise for token draws and acceptance tests


def mix32(x: int) -> int:
    """A bijective 32-bit integer hash (Wellons' lowbias32)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """A request seed (any integer, taken mod 2^64) -> 32-bit key."""
    return mix32(mix32((seed & MASK32) ^ 0x9E3779B9) ^ ((seed >> 32) & MASK32))


def mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 tensors in [0, 2^32), with no intermediate above 2^49."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def mix32_tensor(x: torch.Tensor) -> torch.Tensor:
    """mix32 elementwise on int64 tensors in [0, 2^32): the same bits on every device."""
    x = x ^ (x >> 16)
    x = mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def as_words(x: torch.Tensor) -> torch.Tensor:
    """int64 in [0, 2^32) -> int32 holding the same 32 bits."""
    return (x - ((x >> 31) << 32)).to(torch.int32)


def mix32_words(x: torch.Tensor) -> torch.Tensor:
    """mix32 elementwise, in place, on an int32 tensor holding 32-bit words: products wrap mod
    2^32 (as int32 products do on every device) and shifts are made logical by a mask, so the
    bits are mix32_tensor's with half the memory and one operation per product (mul32 takes six)."""
    x ^= (x >> 16).bitwise_and_(0xFFFF)
    x *= 0x7FEB352D
    x ^= (x >> 15).bitwise_and_(0x1FFFF)
    x *= 0x846CA68B - (1 << 32)
    x ^= (x >> 16).bitwise_and_(0xFFFF)
    return x


def keyed_rows(seed_keys: torch.Tensor, positions: torch.Tensor, stream: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's key and salt [N] int32: a function of (seed key, position, stream)."""
    row = mix32_tensor(seed_keys ^ mix32_tensor((positions & MASK32) ^ stream))  # [N]
    return as_words(row), as_words(mix32_tensor(row ^ 0x68E31DA4))


def keyed_columns(rows: tuple[torch.Tensor, torch.Tensor], start: int, stop: int) -> torch.Tensor:
    """[N, stop - start] float64 in (0, 1): columns start..stop-1 of the rows' keyed uniforms."""
    row, salt = rows
    column = torch.arange(start, stop, dtype=torch.int32, device=row.device)
    bits = mix32_words(row[:, None] ^ column)  # [N, C]
    bits += salt[:, None]  # wraps mod 2^32
    bits = mix32_words(bits)
    return bits.to(torch.int64).bitwise_and_(MASK32).double().add_(0.5).mul_(2.0 ** -32)


def keyed_uniforms(seed_keys: torch.Tensor, positions: torch.Tensor, count: int, stream: int) -> torch.Tensor:
    """[N, count] float64 in (0, 1): a pure function of (seed key, position, stream, column)."""
    return keyed_columns(keyed_rows(seed_keys, positions, stream), 0, count)


KEYED_BLOCK = 1 << 18  # elements of noise made at a time: a few MB, in cache


def keyed_gumbel_max(probs: torch.Tensor, seed_keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The exponential race argmax_v probs[v] / -log(u_v), u keyed per row: an exact draw [N].
    Run over blocks of columns, the running maximum kept (the first index on a tie, as argmax)."""
    rows = keyed_rows(seed_keys, positions, GUMBEL_STREAM)
    num_rows, vocab = probs.shape
    width = max(256, KEYED_BLOCK // max(num_rows, 1))
    best = torch.full((num_rows,), -1.0, dtype=torch.float64, device=probs.device)  # [N] below any score
    winner = torch.zeros(num_rows, dtype=torch.int64, device=probs.device)  # [N]
    for start in range(0, vocab, width):
        stop = min(vocab, start + width)
        score, index = probs[:, start:stop].double().div_(keyed_columns(rows, start, stop).log_().neg_()).max(-1)  # [N]
        better = score > best
        best, winner = torch.where(better, score, best), torch.where(better, index + start, winner)
    return winner


@dataclass(frozen=True)
class SamplingBatch:
    """Per-step tensors for N rows of logits. A transform no row uses is None (skipped)."""

    shared_generator: torch.Generator | None  # unseeded rows draw from it; None = torch's default CPU generator
    device: torch.device
    random_rows: tuple[int, ...]  # rows that are neither greedy nor seeded (host)
    seeded_index: torch.Tensor | None  # [S] int64 rows with a seed; None when no row has one
    seed_keys: torch.Tensor | None  # [S] int64 32-bit key of each seeded row's seed
    positions: torch.Tensor | None  # [S] int64 position of the token each seeded row draws
    greedy: torch.Tensor | None  # [N] bool, None when no row is greedy
    all_greedy: bool
    temperature: torch.Tensor | None  # [N] float32, 1.0 on greedy rows
    top_k: torch.Tensor | None  # [N] int64, V where off, 1 on greedy rows
    max_top_k: int  # known on the host, so masking needs no device sync
    top_p: torch.Tensor | None  # [N] float32
    min_p: torch.Tensor | None  # [N] float32
    repetition_penalty: torch.Tensor | None  # [N] float32
    seen: torch.Tensor | None  # [N,V] bool, prompt + output tokens
    frequency_penalty: torch.Tensor | None  # [N] float32
    presence_penalty: torch.Tensor | None  # [N] float32
    output_counts: torch.Tensor | None  # [N,V] float32, output tokens only (as vLLM/OpenAI)
    logit_bias: torch.Tensor | None  # [N,V] float32
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) held back by min_tokens
    num_logprobs: tuple[int | None, ...]  # per row
    allowed: torch.Tensor | None = None  # [N,V] bool, what each row's grammar allows; None: no grammar

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: Sequence[int] = (),
        shared_generator: torch.Generator | None = None,
        counts: Sequence[TokenCounts | None] | None = None,
    ) -> SamplingBatch:
        """Row i samples the token at position len(prompt_ids[i]) + len(output_ids[i]).
        `counts`: per row, its request's tokens as penalties read them, kept across steps
        (TokenCounts, caught up with the request's outputs, which output_ids[i] may extend by a
        draft chain's tokens); a row without them (None, or no `counts`) counts its lists."""
        N, V, device = len(params), vocab_size, torch.device(device)
        if not len(prompt_ids) == len(output_ids) == N or (counts is not None and len(counts) != N):
            raise ValueError(f"SamplingBatch.build needs one entry per row: got {N} params, {len(prompt_ids)} "
                             f"prompts, {len(output_ids)} outputs"
                             + (f", {len(counts)} token counts" if counts is not None else ""))
        _check_token_ids(params, V)
        greedy = [p.greedy for p in params]
        sampled = [p for p in params if not p.greedy]
        rep = [p.repetition_penalty for p in params]
        freq = [p.frequency_penalty for p in params]
        pres = [p.presence_penalty for p in params]
        needs_counts = [f != 0 or q != 0 for f, q in zip(freq, pres)]
        # Greedy rows become one-hots later; k = 1 keeps them from widening the top-k pass.
        top_ks = [1 if g else min(p.top_k, V) if p.top_k > 0 else V for p, g in zip(params, greedy)]
        seeded = [row for row, p in enumerate(params) if p.seed is not None and not p.greedy]
        seen, output_counts = _penalty_counts(prompt_ids, output_ids, counts or [None] * N,
                                              [r != 1 for r in rep], needs_counts, V, device)
        return cls(
            shared_generator=shared_generator,
            device=device,
            random_rows=tuple(row for row, p in enumerate(params) if p.seed is None and not p.greedy),
            seeded_index=_row_tensor(seeded, torch.int64, device) if seeded else None,
            seed_keys=_row_tensor([seed_key(params[r].seed) for r in seeded], torch.int64, device) if seeded else None,
            positions=_row_tensor([len(prompt_ids[r]) + len(output_ids[r]) for r in seeded], torch.int64, device)
            if seeded else None,
            greedy=_row_tensor(greedy, torch.bool, device) if any(greedy) else None,
            all_greedy=all(greedy),
            temperature=_optional_row_tensor(
                [1.0 if g else p.temperature for p, g in zip(params, greedy)],
                any(p.temperature != 1 for p in sampled), device),
            top_k=_optional_row_tensor(top_ks, any(0 < p.top_k < V for p in sampled), device, torch.int64),
            max_top_k=max(top_ks, default=0),
            top_p=_optional_row_tensor([p.top_p for p in params], any(p.top_p < 1 for p in sampled), device),
            min_p=_optional_row_tensor([p.min_p for p in params], any(p.min_p > 0 for p in sampled), device),
            repetition_penalty=_optional_row_tensor(rep, any(r != 1 for r in rep), device),
            seen=seen,
            frequency_penalty=_optional_row_tensor(freq, any(needs_counts), device),
            presence_penalty=_optional_row_tensor(pres, any(needs_counts), device),
            output_counts=output_counts,
            logit_bias=_scatter_bias(params, V, device) if any(p.logit_bias for p in params) else None,
            banned=_banned_tokens(params, output_ids, eos_token_ids, device),
            num_logprobs=tuple(p.logprobs for p in params),
        )

    def constrained(self, bitmask: torch.Tensor, vocab_size: int) -> SamplingBatch:
        """The same rows under grammar masks: bitmask [N, W] int32, packed on the host (structured.py)."""
        return replace(self, allowed=unpack_bitmask(bitmask.to(self.device, non_blocking=True), vocab_size))

    def advanced(self, steps: int) -> SamplingBatch:
        """The same rows, each drawing the token `steps` positions further on (a draft chain)."""
        if self.positions is None or steps == 0:
            return self
        return replace(self, positions=self.positions + steps)


def _check_token_ids(params: list[SamplingParams], vocab_size: int) -> None:
    for p in params:
        for name, ids in (("logit_bias", p.logit_bias or {}), ("stop_token_ids", p.stop_token_ids or ())):
            for token in ids:
                if token >= vocab_size:
                    raise ValueError(f"SamplingParams.{name}: token id {token} is outside the vocabulary "
                                     f"[0, {vocab_size})")


def _row_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _optional_row_tensor(values: list, needed: bool, device: torch.device,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    return _row_tensor(values, dtype, device) if needed else None


class TokenCounts:
    """A request's tokens as penalties read them, on the device, kept across its steps: its
    prompt's tokens marked once, its outputs counted as they are appended (`catch_up`). A step
    then counts only the tokens new since the last one rather than the whole context, whose cost
    grew with every token on the engine thread, and so slowed every request in the batch
    (`benchmarks/bench_sampling_build.py`). V x 5 bytes per request with penalties, dropped when
    it finishes or is preempted."""

    # Normal tensors wherever made (engine steps and draft chains differ in inference mode): an
    # inference tensor could not be updated in place outside inference mode.
    @torch.inference_mode(False)
    def __init__(self, prompt_ids: list[int], vocab_size: int, device: torch.device | str) -> None:
        ids = torch.tensor(prompt_ids, dtype=torch.int64, device=device)
        self.prompt_seen = torch.zeros(vocab_size, dtype=torch.bool, device=device).index_fill_(0, ids, True)  # [V]
        self.outputs = torch.zeros(vocab_size, device=device)  # [V] float32: how often each token was output
        self.num_outputs = 0  # the leading outputs counted in it

    @torch.inference_mode(False)
    def catch_up(self, output_ids: list[int]) -> TokenCounts:
        """Count the outputs appended since the last call (a request's outputs only grow)."""
        new = output_ids[self.num_outputs:]
        if len(output_ids) < self.num_outputs or (new and min(new) < 0):
            raise ValueError(f"TokenCounts.catch_up: outputs of length {len(output_ids)} (smallest new id "
                             f"{min(new, default=None)}) do not extend the {self.num_outputs} counted")
        if new:
            ids = torch.tensor(new, dtype=torch.int64, device=self.outputs.device)
            self.outputs.index_put_((ids,), torch.ones(len(new), device=self.outputs.device), accumulate=True)
        self.num_outputs = len(output_ids)
        return self


def _penalty_counts(prompt_ids: list[list[int]], output_ids: list[list[int]], counts: Sequence[TokenCounts | None],
                    seen_needed: list[bool], counts_needed: list[bool], vocab_size: int,
                    device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """-> (seen [N,V] bool, prompt + output tokens of the rows in seen_needed; output counts [N,V]
    float32 of the rows in counts_needed), None where no row needs them. A row's kept TokenCounts
    cover its leading outputs; the rest (a draft chain's tokens) are counted for this step only."""
    needed = [s or c for s, c in zip(seen_needed, counts_needed)]
    if not any(needed):
        return None, None
    rows = [row for row, need in enumerate(needed) if need]
    kept = [counts[r] or TokenCounts(prompt_ids[r], vocab_size, device) for r in rows]
    for r, k in zip(rows, kept):
        if len(output_ids[r]) < k.num_outputs:
            raise ValueError(f"row {r}: {len(output_ids[r])} outputs, fewer than its TokenCounts counted "
                             f"({k.num_outputs})")
    extra = [output_ids[r][k.num_outputs:] for r, k in zip(rows, kept)]
    outputs = torch.stack([k.outputs for k in kept])  # [n, V]
    if any(extra):
        at = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([len(e) for e in extra]))
        ids = torch.tensor([t for e in extra for t in e], dtype=torch.int64)
        outputs.index_put_((at.to(device), ids.to(device)), torch.ones(len(ids), device=device), accumulate=True)
    seen = torch.stack([k.prompt_seen for k in kept]).logical_or_(outputs > 0) if any(seen_needed) else None
    if seen is not None and not all(seen_needed[r] for r in rows):  # rows with counts alone see nothing
        seen &= torch.tensor([seen_needed[r] for r in rows], device=device)[:, None]
    counted = outputs if any(counts_needed) else None
    if counted is not None and not all(counts_needed[r] for r in rows):  # rows with seen alone count nothing
        counted *= torch.tensor([counts_needed[r] for r in rows], device=device)[:, None]
    if len(rows) < len(needed):  # rows with neither stay zero
        index = torch.tensor(rows, device=device)
        seen = None if seen is None else seen.new_zeros(len(needed), vocab_size).index_copy_(0, index, seen)
        counted = None if counted is None else counted.new_zeros(len(needed), vocab_size).index_copy_(0, index, counted)
    return seen, counted


def _scatter_bias(params: list[SamplingParams], vocab_size: int, device: torch.device) -> torch.Tensor:
    entries = [(row, t, b) for row, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
    rows, ids, values = zip(*entries)
    bias = torch.zeros(len(params), vocab_size, device=device)  # [N,V]
    bias[torch.tensor(rows, device=device), torch.tensor(ids, device=device)] = torch.tensor(values, device=device)
    return bias


def _banned_tokens(params: list[SamplingParams], output_ids: list[list[int]], eos_token_ids: Sequence[int],
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    # vLLM's rule: below min_tokens outputs, every token that would end the request is masked.
    pairs = []
    for row, (p, out) in enumerate(zip(params, output_ids)):
        if len(out) < p.min_tokens:
            enders = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else set(eos_token_ids))
            pairs += [(row, t) for t in sorted(enders)]
    if not pairs:
        return None
    rows, ids = torch.tensor(pairs, dtype=torch.int64, device=device).unbind(1)
    return rows, ids


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, W] int32, bit b of word w allowing token 32w + b -> [N, V] bool. A row that allows no
    token at all (a grammar at a dead end) allows every token instead: the engine ends its request
    when the grammar refuses what it draws."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).flatten(1)[:, :vocab_size].bool()  # [N, V]
    return allowed | ~allowed.any(-1, keepdim=True)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logit_bias, repetition/frequency/presence penalties, min_tokens, then the grammar mask;
    [N,V] float32, out of place.

    The grammar mask comes after the transforms that change logits and before those that select
    tokens by rank or mass (top-k, top-p, min-p in compute_probs), so they choose among the
    tokens the grammar allows and never leave a row empty."""
    logits = logits.float()  # [N,V]; float() copies only when the model's dtype differs
    if batch.logit_bias is not None:
        logits = logits + batch.logit_bias
    if batch.seen is not None:
        penalty = batch.repetition_penalty.unsqueeze(1).clamp(min=torch.finfo(torch.float32).tiny)  # [N,1]
        # an extreme penalty overflows; a penalized token becomes unlikely, never impossible
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty).clamp(-FLOAT32_MAX, FLOAT32_MAX)
        logits = keep_finite(torch.where(batch.seen, penalized, logits))
    if batch.output_counts is not None:
        counts = batch.output_counts
        logits = logits - batch.frequency_penalty.unsqueeze(1) * counts
        logits = logits - batch.presence_penalty.unsqueeze(1) * (counts > 0)
    if batch.banned is not None:
        logits = logits.index_put(batch.banned, torch.tensor(float("-inf"), device=logits.device))
    if batch.allowed is not None:
        logits = logits.masked_fill(~batch.allowed, float("-inf"))
        # every token the grammar allows was held back (min_tokens): they stay possible
        empty = logits.amax(-1, keepdim=True) == float("-inf")  # [N,1]
        logits = torch.where(empty & batch.allowed, 0.0, logits)
    return logits


def keep_finite(logits: torch.Tensor) -> torch.Tensor:
    """Overflow to +inf (an extreme penalty or temperature) becomes the largest float, so that a
    softmax stays a distribution; -inf (masked tokens) stays."""
    return logits.nan_to_num(nan=float("-inf"), posinf=FLOAT32_MAX, neginf=float("-inf"))


def greedy_tokens(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """What greedy rows pick: the argmax after penalties, [N] int64 (the one-hot of it is what
    compute_probs gives greedy rows)."""
    return apply_penalties(logits, batch).argmax(-1)


def compute_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Raw logits [N,V] -> the distribution each row samples from, [N,V] float32.

    Penalties, temperature, then top-k, top-p and min-p masks, renormalized; greedy rows
    get the one-hot of their argmax. Deterministic, so draft and target logits can both
    go through it for lossless verification.
    """
    logits = apply_penalties(logits, batch)
    if batch.all_greedy:
        return one_hot_argmax(logits)
    one_hot = one_hot_argmax(logits) if batch.greedy is not None else None
    if batch.temperature is not None:
        logits = keep_finite(logits / batch.temperature.unsqueeze(1))
    if batch.top_k is not None:
        logits = mask_top_k(logits, batch.top_k, batch.max_top_k)
    if batch.top_p is not None:
        logits = mask_top_p(logits, batch.top_p)
    if batch.min_p is not None:
        logits = mask_min_p(logits, batch.min_p)
    probs = logits.softmax(-1)
    return probs if one_hot is None else torch.where(batch.greedy.unsqueeze(1), one_hot, probs)


def one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """[N,V] float32; ties go to the lowest id, as torch.argmax."""
    return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()


def mask_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
    """Keep each row's top_k largest logits (ties with the k-th are kept)."""
    largest = logits.topk(max_k, dim=-1).values  # [N,max_k], descending
    kth = largest.gather(1, (top_k - 1).unsqueeze(1))  # [N,1]
    return logits.masked_fill(logits < kth, float("-inf"))


def mask_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest high-probability set whose mass reaches top_p, including the token crossing it."""
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [N,V]
    sorted_probs = sorted_logits.softmax(-1)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    # top_p = 1 rows drop nothing, even where rounding pushes the cumulative mass to 1; the most
    # probable token always stays, however small top_p is.
    drop_sorted = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)  # back to vocab order
    return logits.masked_fill(drop, float("-inf"))


def mask_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability."""
    probs = logits.softmax(-1)  # [N,V]
    threshold = min_p.unsqueeze(1) * probs.amax(-1, keepdim=True)  # [N,1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def draw_uniform(batch: SamplingBatch, count: int) -> torch.Tensor:
    """[N,count] float64 uniforms in [0,1): random rows from the shared generator, seeded rows
    keyed by (seed, position, column), greedy rows 0 (their one-hot distributions need none)."""
    uniforms = torch.zeros(len(batch.num_logprobs), count, dtype=torch.float64)
    if batch.random_rows:
        uniforms[list(batch.random_rows)] = torch.rand(len(batch.random_rows), count,
                                                       generator=batch.shared_generator, dtype=torch.float64)
    uniforms = uniforms.to(batch.device)
    if batch.seeded_index is not None:
        keyed = keyed_uniforms(batch.seed_keys, batch.positions, count, UNIFORM_STREAM)
        uniforms = uniforms.index_copy(0, batch.seeded_index, keyed)
    return uniforms


def sample(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Tokens [N] int64: argmax on greedy rows, the keyed Gumbel-max on seeded rows, one
    inverse-CDF draw from the shared generator on the other rows."""
    tokens = probs.argmax(-1)
    if batch.random_rows:
        random_tokens = invert_cdf(probs, draw_uniform(batch, 1).squeeze(1))
        tokens = random_tokens if batch.greedy is None else torch.where(batch.greedy, tokens, random_tokens)
    return place_keyed_draws(probs, batch, tokens)


def exact_tokens(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[N] what each greedy or seeded row draws, a function of its distribution alone (argmax,
    keyed Gumbel-max); other rows get their argmax."""
    return place_keyed_draws(probs, batch, probs.argmax(-1))


def place_keyed_draws(probs: torch.Tensor, batch: SamplingBatch, tokens: torch.Tensor) -> torch.Tensor:
    if batch.seeded_index is None:
        return tokens
    keyed = keyed_gumbel_max(probs.index_select(0, batch.seeded_index), batch.seed_keys, batch.positions)
    return tokens.index_copy(0, batch.seeded_index, keyed)


def invert_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The token whose CDF interval holds each row's uniform; tokens with probability 0 are never hit."""
    cdf = probs.double().cumsum(-1)  # [N,V]
    # u < 1 keeps u * total strictly below the total (float64 rounding is monotone), so the
    # first CDF entry above the target always has positive mass.
    target = uniforms.unsqueeze(1) * cdf[:, -1:]  # [N,1]
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def compute_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                     num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw-model logprobs (before any sampling transform, the grammar mask included), float32.

    Returns the chosen tokens' logprobs [N], and the top num_top ids [N,num_top] with their
    logprobs [N,num_top], sorted by logprob, highest first.
    """
    logprobs = logits.float().log_softmax(-1)  # [N,V]
    token_logprob = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    return token_logprob, top_ids, top_logprobs


class TokenLogprobs(NamedTuple):
    logprob: float  # of the sampled token
    top_ids: list[int]  # highest logprob first
    top_logprobs: list[float]


class SamplerOutput(NamedTuple):
    tokens: torch.Tensor  # [N] int64
    logprobs: list[TokenLogprobs | None]  # per row; None where the request asked for none


class Sampler:
    """One step: logits -> probabilities -> tokens, plus logprobs for the rows that asked."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if batch.all_greedy:  # the argmax, without building one-hot distributions
            tokens = greedy_tokens(logits, batch)
        else:
            tokens = sample(compute_probs(logits, batch), batch)
        return SamplerOutput(tokens, self.gather_logprobs(logits, tokens, batch))

    def gather_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor,
                        batch: SamplingBatch) -> list[TokenLogprobs | None]:
        return self.gather_logprobs_for(logits, tokens, batch.num_logprobs)

    @staticmethod
    def gather_logprobs_for(logits: torch.Tensor, tokens: torch.Tensor,
                            num_logprobs: Sequence[int | None]) -> list[TokenLogprobs | None]:
        """Logprobs of tokens [N] under logits [N, V] for the rows that ask (num_logprobs per row)."""
        rows = [row for row, k in enumerate(num_logprobs) if k is not None]
        result: list[TokenLogprobs | None] = [None] * len(num_logprobs)
        if not rows:
            return result
        num_top = max(num_logprobs[row] for row in rows)
        index = torch.tensor(rows, device=logits.device)
        token_lp, top_ids, top_lps = compute_logprobs(logits[index], tokens[index], num_top)
        for row, lp, ids, lps in zip(rows, token_lp.tolist(), top_ids.tolist(), top_lps.tolist()):
            k = num_logprobs[row]
            result[row] = TokenLogprobs(lp, ids[:k], lps[:k])
        return result
