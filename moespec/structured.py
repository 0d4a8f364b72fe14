"""Structured outputs: a grammar (JSON schema, any JSON object, regex, choice, EBNF) decides
which tokens may come next, at every sampled position.

An engine (xgrammar or llguidance, moespec/grammar/; structured.backend chooses) compiles a
grammar against the model's tokenizer (once per model: `Grammars`; each compiled grammar is
kept in its bounded LRU cache, keyed by the grammar's text). A JSON schema with a keyword the
engine would not enforce exactly is refused (grammar/keywords.py), never served loosely. Each
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
import threading
from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch

from moespec.grammar import keywords, llguidance_engine, xgrammar_engine

CACHE_BYTES = 256 << 20  # compiled grammars kept per model (LRU)
KINDS = ("json", "json_object", "regex", "choice", "grammar")


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


def parse(spec: StructuredOutputs):
    """The grammar, tokenizer-free, with xgrammar: checks that it parses (ValueError naming the
    field). Where llguidance serves a schema its engine checks it when it compiles."""
    try:
        return xgrammar_engine.parse(*spec.key)
    except xgrammar_engine.CompileError as e:
        raise GrammarError(spec.kind, str(e)) from None


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

    def __init__(self, matcher, gate: TextGate | None = None, engine: str = xgrammar_engine.NAME) -> None:
        self.matcher = matcher  # accept_token, rollback, is_terminated (xgrammar's, or LLGuidanceMatcher)
        self.gate = gate
        self.engine = engine
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


class Compiled(NamedTuple):
    engine: str  # the engine that compiled it ("xgrammar" or "llguidance")
    grammar: object  # that engine's compiled grammar
    size: int  # bytes counted by the LRU


class Grammars:
    """The model's grammar engines, built on first use (each library is imported only then), and
    its compiled grammars (an LRU of `cache_bytes`, keyed by kind and text). `backend` is
    structured.backend (config.py): which engine compiles what (`compile_with`). The server
    compiles in killable processes (server/grammar_workers.py) and hands the results over with
    `load`."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: frozenset[int], cache_bytes: int = CACHE_BYTES,
                 backend: str = "xgrammar") -> None:
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, sorted(stop_ids)
        self.cache_bytes, self.backend = cache_bytes, backend
        self.words = (vocab_size + 31) // 32  # W
        self.engines: dict[str, object] = {}  # name -> XGrammarEngine | LLGuidanceEngine, once started
        self.compiled: OrderedDict[tuple[str, str], Compiled] = OrderedDict()
        self.compiled_bytes = 0
        self.lock = threading.Lock()  # HTTP worker threads load grammars too
        self.texts: dict[int, str] = {}  # token id -> its text, for gates (TextGate)

    def start(self) -> None:
        """Checks the model can be constrained and starts the engines the backend needs first."""
        for name in engine_names(self.backend, "json"):
            self.engine(name)

    def engine(self, name: str):
        with self.lock:
            if name not in self.engines:
                if self.tokenizer is None:
                    raise ValueError("structured outputs: this model has no tokenizer to match a grammar to tokens")
                if not self.stop_ids:
                    raise ValueError("structured outputs: this model has no EOS token to end an output with")
                self.engines[name] = ENGINES[name].for_model(self.tokenizer, self.vocab_size, self.stop_ids)
            return self.engines[name]

    def worker_args(self) -> tuple:
        """What a compile process needs to build the same engines (serve_compiles)."""
        self.start()
        return self.backend, {name: self.engine(name).worker_args() for name in engine_names(self.backend, "json")}

    def cached(self, spec: StructuredOutputs) -> Compiled | None:
        """The compiled grammar if it is in the cache (now most recently used), else None."""
        with self.lock:
            compiled = self.compiled.get(spec.key)
            if compiled is not None:
                self.compiled.move_to_end(spec.key)
            return compiled

    def compile(self, spec: StructuredOutputs) -> Compiled:
        """The compiled grammar, from the cache or compiled here (in this process, unbounded)."""
        compiled = self.cached(spec)
        if compiled is None:
            self.start()
            compiled = self.keep(spec, compile_with(self.engine, self.backend, spec))
        return compiled

    def load(self, spec: StructuredOutputs, answer: tuple[str, str]) -> Compiled:
        """Cache a grammar compiled elsewhere: (engine name, its serialized grammar)."""
        name, serialized = answer
        engine = self.engine(name)
        try:
            grammar = engine.load(serialized)
        except ValueError as e:
            raise GrammarError(spec.kind, str(e)) from None
        return self.keep(spec, Compiled(name, grammar, engine.size(grammar)))

    def keep(self, spec: StructuredOutputs, compiled: Compiled) -> Compiled:
        with self.lock:
            if spec.key not in self.compiled:
                self.compiled[spec.key] = compiled
                self.compiled_bytes += compiled.size
            while self.compiled_bytes > self.cache_bytes and len(self.compiled) > 1:
                _, old = self.compiled.popitem(last=False)
                self.compiled_bytes -= old.size
            return self.compiled.get(spec.key, compiled)

    def matcher(self, spec: StructuredOutputs, after: str | None = None) -> GrammarState:
        """A matcher of `spec`, starting once the output shows the text `after` (if given)."""
        compiled = self.compile(spec)
        gate = TextGate(after, self.token_text) if after else None
        return GrammarState(self.engine(compiled.engine).matcher(compiled.grammar), gate, compiled.engine)

    def token_text(self, token: int) -> str:
        text = self.texts.get(token)
        if text is None:
            text = self.texts[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text

    def masks(self, states: list[GrammarState | None]) -> torch.Tensor:
        """[N, W] int32: row i allows what states[i] allows next. Rows without a grammar, or
        whose grammar has terminated (nothing after its stop token is emitted) or has not
        started (its gate is closed), allow every token. One call per engine fills its rows."""
        bitmask = torch.full((len(states), self.words), -1, dtype=torch.int32)
        rows = [i for i, s in enumerate(states) if s is not None and s.open and not s.terminated]
        for name in sorted({states[i].engine for i in rows}):
            mine = [i for i in rows if states[i].engine == name]
            self.engines[name].fill([states[i].matcher for i in mine], bitmask, mine)
        return bitmask


ENGINES = {xgrammar_engine.NAME: xgrammar_engine.XGrammarEngine,
           llguidance_engine.NAME: llguidance_engine.LLGuidanceEngine}


def engine_names(backend: str, kind: str) -> list[str]:
    """The engines `backend` tries for a constraint of `kind`, in order. auto: a JSON schema with
    llguidance (if installed; on JSONSchemaBench it enforces the most schemas exactly and compiles
    them fastest, docs/structured-outputs.md), then xgrammar for what llguidance refuses; the rest
    with xgrammar (the EBNF dialect is xgrammar's)."""
    if backend != "auto":
        return [backend]
    if kind == "json" and llguidance_engine.available():
        return [llguidance_engine.NAME, xgrammar_engine.NAME]
    return [xgrammar_engine.NAME]


def compile_with(engine, backend: str, spec: StructuredOutputs) -> Compiled:
    """`spec` compiled by the first engine of the backend that enforces it exactly; `engine(name)`
    gives a started engine. A GrammarError gives the first engine's reason, or the refused keyword
    and its path."""
    kind, text = spec.key
    schema = json.loads(text) if kind == "json" else None
    errors = []
    for name in engine_names(backend, kind):
        try:
            if schema is not None:
                keywords.check(name, schema)
            started = engine(name)
            grammar = started.compile(kind, text)
            return Compiled(name, grammar, started.size(grammar))
        except keywords.Refusal as e:
            errors.append(e)
        except ValueError as e:  # either engine's CompileError
            refusal = keywords.llguidance_refusal(schema, str(e)) if name == llguidance_engine.NAME else None
            errors.append(refusal or e)
        errors[-1].engine = name
    errors.sort(key=lambda e: e.engine != xgrammar_engine.NAME)  # xgrammar's error first: it names what
    first = errors[0]                                              # is wrong with a grammar best
    raise GrammarError(spec.kind, "; ".join(map(str, errors)) if isinstance(first, keywords.Refusal) else str(first))


def serve_compiles(connection, backend: str, worker_args: dict) -> None:
    """A compile process: receives StructuredOutputs, sends back ("ok", (engine name, serialized
    grammar)) or ("error", field, reason), until its connection closes. One thread: the process
    is the unit that is killed when a compile runs too long or its request goes away."""
    engines = {name: ENGINES[name].from_info(args) for name, args in worker_args.items()}
    connection.send("ready")
    while True:
        try:
            spec = connection.recv()
        except (EOFError, OSError):
            return
        try:
            compiled = compile_with(engines.__getitem__, backend, spec)
            connection.send(("ok", (compiled.engine, engines[compiled.engine].serialize(compiled.grammar))))
        except GrammarError as e:
            connection.send(("error", e.field, e.reason))
        except Exception as e:  # noqa: BLE001  an engine's other failures on odd input
            connection.send(("error", spec.kind, f"cannot compile it ({type(e).__name__}: {e})"))


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
