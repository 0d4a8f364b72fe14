"""Structured outputs: a grammar (JSON schema, any JSON object, regex, choice, EBNF) decides
which tokens may come next, at every sampled position.

xgrammar compiles a grammar against the model's tokenizer (once per model: `Grammars`; each
compiled grammar is kept in its bounded LRU cache, keyed by the grammar's text). Each
constrained request holds a matcher that follows its output tokens (`GrammarState`) and
fills, on the host, a packed bitmask row [W] int32 of the tokens allowed next (bit b of word
w allows token 32w + b); the sampler masks logits with it (sampling.py). The grammar's stop
tokens are the engine's EOS ids: EOS is allowed only where the grammar accepts, and a
matcher that has accepted it ends the request.

Under speculation (`DraftMasks`): draft j of a request is drawn under the mask of its matcher
advanced over drafts d_1 .. d_j, and verify row j uses that same mask, so draft and target
distributions are both the constrained ones and lossless verification keeps the constrained
distribution. Once the last row is filled the matcher rolls back over the drafts: between
steps it has seen exactly the emitted tokens, and it advances only where the engine appends
them.

Shapes legend: N rows, B requests, K draft tokens per request, V vocab, W = ceil(V / 32).
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, fields

import torch

CACHE_BYTES = 256 << 20  # compiled grammars kept per model (LRU)
KINDS = ("json", "json_object", "regex", "choice", "grammar")
# JSON on one line with ", " and ": " between items: a model that likes blanks cannot stall a
# structure with endless whitespace (vLLM's disable_any_whitespace)
JSON_OPTIONS = dict(any_whitespace=False)
ENGINE_MESSAGE = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class GrammarError(ValueError):
    """A constraint that does not parse or compile; `field` names the StructuredOutputs field."""

    def __init__(self, field: str | None, reason: str) -> None:
        super().__init__(f"StructuredOutputs{'.' + field if field else ''}: {reason}")
        self.field, self.reason = field, reason


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one constraint: `json` a JSON schema (dict or JSON text), `json_object` any JSON
    object, `regex`, `choice` one of the given strings, `grammar` EBNF (xgrammar's dialect,
    root rule `root`). A constraint that does not parse is a ValueError naming its field."""

    json: str | None = None  # kept as canonical JSON text (a dict is accepted)
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        self.normalize()
        parse(self)

    @classmethod
    def unparsed(cls, **constraint) -> StructuredOutputs:
        """The same checks but xgrammar's parse, which can be slow (a deep schema): a caller that
        compiles the grammar elsewhere (the server's compile processes) learns of errors there."""
        spec = cls.__new__(cls)
        for f in fields(cls):
            object.__setattr__(spec, f.name, constraint.pop(f.name, f.default))
        if constraint:
            raise GrammarError(sorted(constraint)[0], f"unknown field; allowed: {', '.join(KINDS)}")
        spec.normalize()
        return spec

    def normalize(self) -> None:
        given = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise GrammarError(None, f"set exactly one of {', '.join(KINDS)}; got {', '.join(given) or 'none'}")
        if self.json is not None:
            object.__setattr__(self, "json", canonical_schema(self.json))
        if self.choice is not None:
            object.__setattr__(self, "choice", as_choices(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise GrammarError(name, f"must be a non-empty string, got {value!r}")
        if self.json_object is not True and self.json_object is not False:
            raise GrammarError("json_object", f"must be a bool, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        return next(name for name in KINDS if getattr(self, name) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """What the compiled grammar depends on: its kind and text."""
        if self.json_object:
            return "json_object", ""
        if self.choice is not None:
            return "grammar", choice_ebnf(self.choice)
        return self.kind, getattr(self, self.kind)

    @classmethod
    def of(cls, value: StructuredOutputs | dict) -> StructuredOutputs:
        """A StructuredOutputs, or one from a dict of its fields."""
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {f.name for f in fields(cls)}
            if unknown:
                raise GrammarError(sorted(unknown)[0], f"unknown field; allowed: {', '.join(KINDS)}")
            return cls(**value)
        raise ValueError(f"must be a StructuredOutputs or a dict of its fields, got {value!r}")


def canonical_schema(schema: object) -> str:
    """A schema as compact JSON text (its properties keep their order: the output follows it)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarError("json", f"not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("json", f"a JSON schema is an object (or a boolean), got {schema!r}")
    return json.dumps(schema, separators=(",", ":"))


def as_choices(choice: object) -> tuple[str, ...]:
    if not isinstance(choice, (list, tuple)) or not all(isinstance(c, str) and c for c in choice):
        raise GrammarError("choice", f"must be a list of non-empty strings, got {choice!r}")
    if not choice:
        raise GrammarError("choice", "needs at least one string")
    return tuple(choice)


def choice_ebnf(choices: tuple[str, ...]) -> str:
    """root ::= "a" | "b" ... (a JSON string literal is an EBNF string literal)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def import_xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError("structured outputs need the xgrammar package (pip install xgrammar)") from e
    return xgrammar


def engine_message(error: Exception) -> str:
    """xgrammar's message without its C++ source prefix."""
    return ENGINE_MESSAGE.sub("", str(error).strip())


def parse(spec: StructuredOutputs):
    """The grammar, tokenizer-free: checks that it parses (ValueError naming the field)."""
    xgr = import_xgrammar()
    try:
        if spec.json is not None:
            return xgr.Grammar.from_json_schema(spec.json, **JSON_OPTIONS)
        if spec.json_object:
            return xgr.Grammar.from_json_schema('{"type":"object"}', strict_mode=False, **JSON_OPTIONS)
        if spec.regex is not None:
            return xgr.Grammar.from_regex(spec.regex)
        return xgr.Grammar.from_ebnf(spec.grammar if spec.grammar is not None else choice_ebnf(spec.choice))
    except RuntimeError as e:
        raise GrammarError(spec.kind, engine_message(e)) from None


class TextGate:
    """Watches a request's output tokens for a marker text (`</think>`); `passed` once the text
    so far contains it. Keeps one entry per token seen, so drafts roll back."""

    def __init__(self, marker: str, token_text) -> None:
        self.marker, self.token_text = marker, token_text  # token_text: token id -> its text
        self.seen: list[tuple[str, bool]] = [("", False)]  # (text tail, passed) after each token

    @property
    def passed(self) -> bool:
        return self.seen[-1][1]

    def push(self, token: int) -> None:
        text = self.seen[-1][0] + self.token_text(token)
        passed = self.marker in text
        self.seen.append(("" if passed else text[-(len(self.marker) - 1):], passed))

    def pop(self) -> None:
        self.seen.pop()


class GrammarState:
    """One request's matcher: it has seen the request's output tokens (and, inside a
    speculative step, the drafts it is advanced over). With a gate, the matcher starts after the
    token that passes the gate; before that every token is allowed (the reasoning)."""

    def __init__(self, matcher, gate: TextGate | None = None) -> None:
        self.matcher = matcher
        self.gate = gate
        self.history: list[bool] = []  # with a gate: per accepted token, whether the matcher saw it

    @property
    def open(self) -> bool:
        """The grammar constrains the next token."""
        return self.gate is None or self.gate.passed

    def accept(self, token: int) -> bool:
        if self.gate is None:
            return self.matcher.accept_token(token)
        if not self.gate.passed:
            self.gate.push(token)
            self.history.append(False)
            return True
        accepted = self.matcher.accept_token(token)
        if accepted:
            self.history.append(True)
        return accepted

    def rollback(self, count: int) -> None:
        if not count:
            return
        if self.gate is None:
            self.matcher.rollback(count)
            return
        matched = 0
        for _ in range(count):
            if self.history.pop():
                matched += 1
            else:
                self.gate.pop()
        if matched:
            self.matcher.rollback(matched)

    @property
    def terminated(self) -> bool:
        """It accepted a stop token: the output is complete."""
        return self.open and self.matcher.is_terminated()


class Grammars:
    """The model's grammar compiler, built on first use (xgrammar is imported only then), and
    its compiled grammars (an LRU of `cache_bytes`, keyed by kind and text). The server compiles
    in killable processes (server/grammar_workers.py) and hands the results over with `load`."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: frozenset[int], cache_bytes: int = CACHE_BYTES) -> None:
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, sorted(stop_ids)
        self.cache_bytes = cache_bytes
        self.words = (vocab_size + 31) // 32  # W
        self.info = None
        self.compiler = None
        self.batch_matcher = None
        self.compiled: OrderedDict[tuple[str, str], object] = OrderedDict()  # key -> CompiledGrammar
        self.compiled_bytes = 0
        self.lock = threading.Lock()  # HTTP worker threads load grammars too
        self.texts: dict[int, str] = {}  # token id -> its text, for gates (TextGate)

    def start(self) -> None:
        with self.lock:
            if self.compiler is not None:
                return
            xgr = import_xgrammar()
            if self.tokenizer is None:
                raise ValueError("structured outputs: this model has no tokenizer to match a grammar to tokens")
            if not self.stop_ids:
                raise ValueError("structured outputs: this model has no EOS token to end an output with")
            self.info = tokenizer_info(xgr, self.tokenizer, self.vocab_size, self.stop_ids)
            self.batch_matcher = xgr.BatchGrammarMatcher()
            self.compiler = xgr.GrammarCompiler(self.info, cache_limit_bytes=0)  # our cache keeps them

    def cached(self, spec: StructuredOutputs):
        """The compiled grammar if it is in the cache (now most recently used), else None."""
        with self.lock:
            compiled = self.compiled.get(spec.key)
            if compiled is not None:
                self.compiled.move_to_end(spec.key)
            return compiled

    def compile(self, spec: StructuredOutputs):
        """The compiled grammar, from the cache or compiled here (in this process, unbounded)."""
        compiled = self.cached(spec)
        if compiled is None:
            self.start()
            compiled = self.keep(spec, compile_spec(self.compiler, spec))
        return compiled

    def load(self, spec: StructuredOutputs, serialized: str):
        """Cache a grammar compiled elsewhere (CompiledGrammar.serialize_json) and return it."""
        self.start()
        from xgrammar import CompiledGrammar

        return self.keep(spec, CompiledGrammar.deserialize_json(serialized, self.info))

    def keep(self, spec: StructuredOutputs, compiled):
        size = compiled.memory_size_bytes
        with self.lock:
            if spec.key not in self.compiled:
                self.compiled[spec.key] = compiled
                self.compiled_bytes += size
            while self.compiled_bytes > self.cache_bytes and len(self.compiled) > 1:
                _, old = self.compiled.popitem(last=False)
                self.compiled_bytes -= old.memory_size_bytes
            return self.compiled.get(spec.key, compiled)

    def matcher(self, spec: StructuredOutputs, after: str | None = None) -> GrammarState:
        """A matcher of `spec`, starting once the output shows the text `after` (if given)."""
        from xgrammar import GrammarMatcher

        gate = TextGate(after, self.token_text) if after else None
        return GrammarState(GrammarMatcher(self.compile(spec)), gate)

    def token_text(self, token: int) -> str:
        text = self.texts.get(token)
        if text is None:
            text = self.texts[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text

    def masks(self, states: list[GrammarState | None]) -> torch.Tensor:
        """[N, W] int32: row i allows what states[i] allows next. Rows without a grammar, or
        whose grammar has terminated (nothing after its stop token is emitted) or has not
        started (its gate is closed), allow every token. One call fills the batch (xgrammar spreads the rows over its threads)."""
        bitmask = torch.full((len(states), self.words), -1, dtype=torch.int32)
        rows = [i for i, s in enumerate(states) if s is not None and s.open and not s.terminated]
        if rows:
            self.batch_matcher.batch_fill_next_token_bitmask([states[i].matcher for i in rows], bitmask, rows)
        return bitmask


def compile_spec(compiler, spec: StructuredOutputs):
    """One constraint compiled by an xgrammar GrammarCompiler (a GrammarError naming its field)."""
    kind, text = spec.key
    try:
        if kind == "json":
            return compiler.compile_json_schema(text, **JSON_OPTIONS)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type":"object"}', strict_mode=False, **JSON_OPTIONS)
        if kind == "regex":
            return compiler.compile_regex(text)
        return compiler.compile_grammar(text)
    except RuntimeError as e:
        raise GrammarError(spec.kind, engine_message(e)) from None


def serve_compiles(connection, info_json: str) -> None:
    """A compile process: receives StructuredOutputs, sends back ("ok", serialized compiled
    grammar) or ("error", field, reason), until its connection closes. One thread: the process
    is the unit that is killed when a compile runs too long or its request goes away."""
    xgr = import_xgrammar()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(info_json), max_threads=1,
                                   cache_limit_bytes=0)
    connection.send("ready")
    while True:
        try:
            spec = connection.recv()
        except (EOFError, OSError):
            return
        try:
            connection.send(("ok", compile_spec(compiler, spec).serialize_json()))
        except GrammarError as e:
            connection.send(("error", e.field, e.reason))
        except Exception as e:  # noqa: BLE001  xgrammar's other failures on odd input (UnicodeDecodeError)
            connection.send(("error", spec.kind, f"xgrammar cannot compile it ({type(e).__name__}: {e})"))


def tokenizer_info(xgr, tokenizer, vocab_size: int, stop_ids: list[int]):
    """xgrammar's view of the vocabulary, padded to the model's vocab_size. Special tokens other
    than the stop tokens are blanked (never allowed): their text is not what the detokenizer
    shows (skip_special_tokens), so the grammar must not count on it."""
    detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
    special = set(getattr(tokenizer, "all_special_ids", ())) - set(stop_ids)
    encoded = [""] * vocab_size
    for token, i in tokenizer.get_vocab().items():
        if i < vocab_size and i not in special:
            encoded[i] = token
    return xgr.TokenizerInfo(encoded, vocab_type=detected.vocab_type, vocab_size=vocab_size,
                             stop_token_ids=stop_ids, add_prefix_space=detected.add_prefix_space)


def tree_masks(grammars: "Grammars", states: list[GrammarState | None], tokens: list[list[int]],
               parents: list[list[int]]) -> torch.Tensor:
    """[B * (1+N), W] masks of a draft tree's verify rows (speculation/tree.py): node i of request
    b allows what b's grammar allows after the drafts on i's path (node 0, the root, first; N
    drafts per request, parents[b][i-1] the parent of node i). A node whose path the grammar
    refuses is never reached (its parent's row excludes its token); its row allows every token.
    Each matcher is advanced down every path and rolled back."""
    B, N = len(tokens), len(tokens[0])
    masks = torch.full((B, 1 + N, grammars.words), -1, dtype=torch.int32)
    for b, state in enumerate(states):
        if state is None:
            continue
        children: list[list[int]] = [[] for _ in range(1 + N)]
        for node, parent in enumerate(parents[b], start=1):
            children[parent].append(node)

        def visit(node: int) -> None:  # depth first; recursion as deep as the tree
            masks[b, node] = grammars.masks([state])[0]
            for child in children[node]:
                if not state.terminated and state.accept(tokens[b][child - 1]):
                    visit(child)
                    state.rollback(1)

        visit(0)
    return masks.flatten(0, 1)


class DraftMasks:
    """The masks of one speculative step's B requests: row j of request b is what its grammar
    allows after drafts d_1 .. d_j. Rows 0 .. K-1 mask the drafts as they are drawn
    (`draft_row`); all K + 1 mask the target's verify rows (`verify_rows`), after which every
    matcher rolls back over the drafts it was advanced over."""

    def __init__(self, grammars: Grammars, states: list[GrammarState | None]) -> None:
        self.grammars = grammars
        self.states = list(states)  # a request leaves this list (None) where its grammar refused a draft
        self.owners = list(states)
        self.rows: list[torch.Tensor] = []  # [B, W] per filled row
        self.advanced = [0] * len(states)  # drafts each matcher has accepted this step

    def draft_row(self, drafts: list[torch.Tensor]) -> torch.Tensor:
        """Mask [B, W] for draft j = len(drafts); drafts[i] [B] are the tokens drawn so far."""
        while len(self.rows) <= len(drafts):
            if self.rows:
                self.advance(drafts[len(self.rows) - 1].tolist())
            self.rows.append(self.grammars.masks(self.states))
        return self.rows[len(drafts)]

    def verify_rows(self, drafts: torch.Tensor) -> torch.Tensor:
        """Masks [B * (K+1), W] of the verify rows for drafts [B, K]; then the matchers roll back."""
        K = drafts.shape[1]
        self.draft_row(list(drafts.unbind(1)))  # the row after the last draft
        for state, count in zip(self.owners, self.advanced):
            if state is not None:
                state.rollback(count)
        return torch.stack(self.rows[: K + 1], dim=1).flatten(0, 1)

    def advance(self, tokens: list[int]) -> None:
        for b, (state, token) in enumerate(zip(self.states, tokens)):
            if state is None or state.terminated:
                continue
            if state.accept(token):
                self.advanced[b] += 1
            else:  # only where the grammar allowed no token at all; the engine ends such a request
                self.states[b] = None
