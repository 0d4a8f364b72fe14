"""llguidance behind structured outputs: the model's vocabulary as an LLTokenizer, grammars
checked once per text (a template matcher each, deep-copied per request), matchers that accept,
roll back and fill packed bitmask rows [W] int32 of a batch in one call (LLExecutor's
threads). In strict mode (its default, kept) llguidance refuses a JSON-schema keyword it does
not implement instead of ignoring it. Imported only where a config uses it."""
from __future__ import annotations

import json
from typing import NamedTuple

import torch

# the same JSON layout as xgrammar's (one line, ", " and ": "): endless blanks cannot stall a structure
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GRAMMAR_BYTES = 64 << 10  # what the LRU counts for one compiled grammar besides its text (a guess)
NAME = "llguidance"


class CompileError(ValueError):
    pass


class LLGrammar(NamedTuple):
    text: str  # llguidance's grammar (JSON)
    template: object | None  # an LLMatcher at the start, or None where no tokenizer is at hand


def import_llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError as e:
        raise ValueError("structured.backend llguidance needs the llguidance package (pip install llguidance)") from e
    return llguidance


def available() -> bool:
    try:
        import_llguidance()
    except ValueError:
        return False
    return True


def grammar_text(llg, kind: str, text: str) -> str:
    """kind: json, json_object, regex or grammar (EBNF, xgrammar's dialect read as GBNF)."""
    if kind == "json":
        return llg.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema('{"type":"object"}', defaults=JSON_OPTIONS)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(text)
    return llg.grammar_from("ebnf", text)


class LLGuidanceMatcher:
    """An LLMatcher with xgrammar's matcher interface. llguidance counts a grammar that can only
    end as stopped before the stop token comes; here it is terminated once a stop token is
    accepted, as with xgrammar (nothing after it is constrained). A stop token consumed where
    llguidance was already stopped is not in its history (its rollback would undo the token
    before it), so rollback leaves it out."""

    def __init__(self, matcher, stop_ids: frozenset[int]) -> None:
        self.matcher, self.stop_ids = matcher, stop_ids
        self.count = 0  # tokens accepted
        self.ended_at: int | None = None  # count once a stop token was accepted
        self.stop_in_history = False  # whether llguidance counted that stop token

    def accept_token(self, token: int) -> bool:
        if self.ended_at is not None:
            return False
        if token in self.stop_ids:  # try_consume_tokens refuses EOS once the grammar can only end
            stopped = self.matcher.is_stopped()
            if not (self.matcher.is_accepting() and self.matcher.consume_token(token)):
                return False
            self.ended_at, self.stop_in_history = self.count + 1, not stopped
        elif self.matcher.try_consume_tokens([token]) != 1:  # refused: the matcher stays as it was
            return False
        self.count += 1
        return True

    def rollback(self, count: int) -> None:
        undone = count
        if self.ended_at is not None and self.count - count < self.ended_at:
            undone -= 0 if self.stop_in_history else 1
            self.ended_at = None
        if undone:
            self.matcher.rollback(undone)
        self.count -= count

    def is_terminated(self) -> bool:
        return self.ended_at is not None


class LLGuidanceEngine:
    """One model's tokenizer for llguidance. Without a tokenizer (a compile process) it only
    checks grammars; the engine's process builds their matchers (`load`)."""

    name = NAME

    def __init__(self, tokenizer=None, stop_ids: list[int] = ()) -> None:
        self.llg = import_llguidance()
        self.tokenizer, self.stop_ids = tokenizer, frozenset(stop_ids)
        self.executor = self.llg.LLExecutor()

    @classmethod
    def for_model(cls, tokenizer, vocab_size: int, stop_ids: list[int]) -> LLGuidanceEngine:
        llg = import_llguidance()
        try:
            lltok = llg.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(stop_ids))
        except ValueError as e:
            raise ValueError(f"structured.backend llguidance: {e}") from None
        return cls(lltok, stop_ids)

    @classmethod
    def from_info(cls, info: None) -> LLGuidanceEngine:
        return cls()

    def worker_args(self) -> None:
        return None

    def compile(self, kind: str, text: str) -> LLGrammar:
        try:
            grammar = grammar_text(self.llg, kind, text)
        except ValueError as e:
            raise CompileError(str(e)) from None
        if self.tokenizer is None:
            error = self.llg.LLMatcher.validate_grammar(grammar)
            if error:
                raise CompileError(error.strip())
            return LLGrammar(grammar, None)
        return self.load(grammar)

    def serialize(self, compiled: LLGrammar) -> str:
        return compiled.text

    def load(self, grammar: str) -> LLGrammar:
        template = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise CompileError(template.get_error().strip())
        return LLGrammar(grammar, template)

    def size(self, compiled: LLGrammar) -> int:
        return len(compiled.text) + GRAMMAR_BYTES

    def matcher(self, compiled: LLGrammar) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(compiled.template.deep_copy(), self.stop_ids)

    def fill(self, matchers: list[LLGuidanceMatcher], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Row rows[i] of bitmask [N, W] int32 gets what matchers[i] allows next."""
        assert bitmask.is_contiguous() and bitmask.dtype == torch.int32
        N, W = bitmask.shape
        self.executor.unsafe_compute_mask_ptr([(m.matcher, row) for m, row in zip(matchers, rows)],
                                              bitmask.data_ptr(), W * 4, N)


