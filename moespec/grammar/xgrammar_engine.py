"""xgrammar behind structured outputs: a GrammarCompiler built once per model over the
tokenizer's vocabulary, compiled grammars that serialize (the server compiles in child
processes), matchers that accept, roll back and fill packed bitmask rows [W] int32 of a batch in
one call (spread over xgrammar's threads). Imported only where a config uses it."""
from __future__ import annotations

import re
from contextlib import contextmanager

import torch

# JSON on one line with ", " and ": " between items: a model that likes blanks cannot stall a
# structure with endless whitespace (vLLM's disable_any_whitespace)
JSON_OPTIONS = dict(any_whitespace=False)
ENGINE_MESSAGE = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")
NAME = "xgrammar"


class CompileError(ValueError):
    pass


def import_xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ValueError("structured outputs need the xgrammar package (pip install xgrammar)") from e
    return xgrammar


def engine_message(error: Exception) -> str:
    """xgrammar's message without its C++ source prefix."""
    return ENGINE_MESSAGE.sub("", str(error).strip())


def parse(kind: str, text: str):
    """The grammar, tokenizer-free: checks that it parses (CompileError). kind: json,
    json_object, regex or grammar (EBNF). What the compiler compiles (`XGrammarEngine.compile`)."""
    xgr = import_xgrammar()
    if kind == "json_object":
        kind, text, options = "json", '{"type":"object"}', dict(strict_mode=False, **JSON_OPTIONS)
    else:
        options = JSON_OPTIONS
    with compile_errors():
        if kind == "json":
            return xgr.Grammar.from_json_schema(text, **options)
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        return xgr.Grammar.from_ebnf(text)


@contextmanager
def compile_errors():
    """xgrammar's failures as CompileError with its reason."""
    try:
        yield
    except RuntimeError as e:
        raise CompileError(engine_message(e)) from None
    except Exception as e:  # noqa: BLE001  xgrammar's other failures on odd input (UnicodeEncodeError)
        raise CompileError(f"xgrammar cannot compile it ({type(e).__name__}: {e})") from None


class XGrammarEngine:
    """One model's compiler and batch matcher. `info` is xgrammar's view of the vocabulary
    (serialized, it starts a compile process's engine: `from_info`)."""

    name = NAME

    def __init__(self, info, max_threads: int | None = None) -> None:
        xgr = import_xgrammar()
        self.info = info
        options = {} if max_threads is None else {"max_threads": max_threads}
        self.compiler = xgr.GrammarCompiler(info, cache_limit_bytes=0, **options)  # our cache keeps them
        self.batch_matcher = xgr.BatchGrammarMatcher()

    @classmethod
    def for_model(cls, tokenizer, vocab_size: int, stop_ids: list[int]) -> XGrammarEngine:
        return cls(tokenizer_info(import_xgrammar(), tokenizer, vocab_size, stop_ids))

    @classmethod
    def from_info(cls, info_json: str) -> XGrammarEngine:
        """A compile process's engine (one thread: the process is what gets killed)."""
        return cls(import_xgrammar().TokenizerInfo.deserialize_json(info_json), max_threads=1)

    def worker_args(self) -> str:
        return self.info.serialize_json()

    def compile(self, kind: str, text: str):
        """kind: json, json_object, regex or grammar (EBNF); CompileError with xgrammar's reason."""
        grammar = parse(kind, text)
        with compile_errors():
            return self.compiler.compile_grammar(grammar)

    def serialize(self, compiled) -> str:
        return compiled.serialize_json()

    def load(self, serialized: str):
        return import_xgrammar().CompiledGrammar.deserialize_json(serialized, self.info)

    def size(self, compiled) -> int:
        return compiled.memory_size_bytes

    def matcher(self, compiled):
        """accept_token, rollback, is_terminated: what GrammarState uses."""
        return import_xgrammar().GrammarMatcher(compiled)

    def fill(self, matchers: list, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Row rows[i] of bitmask [N, W] int32 gets what matchers[i] allows next."""
        self.batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, rows)


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
