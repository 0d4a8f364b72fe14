"""Incremental detokenization and stop strings, for streaming text as tokens arrive."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Prompt tokens decoded ahead of the first output token, so that tokenizers whose pieces
# depend on their left neighbour (SentencePiece's leading space) decode it right.
PROMPT_CONTEXT_TOKENS = 5
INCOMPLETE = "\ufffd"  # what a byte-level decode yields for a cut-off UTF-8 sequence


class IncrementalDetokenizer:
    """Turns a growing token stream into text, emitting only text that can no longer change.

    The prefix/read offset technique: decode a window of tokens with and without the
    tokens not yet emitted; the difference is new text unless it ends in an incomplete
    UTF-8 sequence (a multi-byte character split across byte-level tokens), in which case
    it waits for the next token.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, prompt_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.window = self.prompt_context(prompt_ids)  # emitted (or prompt) tokens + pending ones
        self.read_offset = len(self.window)  # window[:read_offset] has been emitted (or is prompt)
        self.text = ""

    def prompt_context(self, prompt_ids: list[int]) -> list[int]:
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        # A prompt cut inside a character would swallow the output's first bytes into it.
        if self.tokenizer is None or self.decode(context).endswith(INCOMPLETE):
            return []
        return context

    def append(self, new_ids: list[int]) -> str:
        """Adds tokens; returns the text that became stable (possibly "")."""
        if self.tokenizer is None:
            return ""
        self.window.extend(new_ids)
        prefix = self.decode(self.window[:self.read_offset])
        full = self.decode(self.window)
        if len(full) <= len(prefix) or full.endswith(INCOMPLETE):
            return ""
        new_text = full[len(prefix):]
        self.text += new_text
        # The tokens just emitted become the next step's decoding context.
        del self.window[:self.read_offset]
        self.read_offset = len(self.window)
        return new_text

    def flush(self) -> str:
        """Emits the pending tail even if it ends inside a character: the stream is over."""
        if self.tokenizer is None or len(self.window) == self.read_offset:
            return ""
        new_text = self.decode(self.window)[len(self.decode(self.window[:self.read_offset])):]
        self.text += new_text
        del self.window[:self.read_offset]
        self.read_offset = len(self.window)
        return new_text

    def decode(self, ids: list[int]) -> str:
        # No clean-up of tokenization spaces: it rewrites text around later tokens.
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)


class StopCheck(NamedTuple):
    stopped: bool
    text: str  # the generated text, cut at the stop string when stopped
    stream_len: int  # text[:stream_len] is safe to stream now


class StopChecker:
    """Finds stop strings in the generated text and says how much of it may be streamed.

    Call `check` with the full text after every append. Text that could still grow into a
    stop string is held back, so a stop string never reaches the client; when a request
    ends for another reason (EOS, max_tokens) all of its text is final.
    """

    def __init__(self, stop: tuple[str, ...] | None, include_stop_str_in_output: bool) -> None:
        self.stop = tuple(stop or ())
        self.include_stop_str_in_output = include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.checked_len = 0  # text[:checked_len] was searched by earlier calls

    def check(self, text: str) -> StopCheck:
        # Only the new tail can hold a new match, plus a match that began up to
        # max_stop_len - 1 characters before it.
        start = max(self.checked_len - self.max_stop_len + 1, 0)
        self.checked_len = len(text)
        match = self.find_first(text, start)
        if match is None:
            return StopCheck(False, text, len(text) - self.held_back(text))
        index, stop = match
        end = index + len(stop) if self.include_stop_str_in_output else index
        return StopCheck(True, text[:end], end)

    def find_first(self, text: str, start: int) -> tuple[int, str] | None:
        """The earliest stop string at or after start, as (index, stop string)."""
        found = [(text.find(s, start), s) for s in self.stop]
        found = [(i, s) for i, s in found if i >= 0]
        return min(found, key=lambda m: m[0]) if found else None

    def held_back(self, text: str) -> int:
        """Length of the longest tail of text that is the start of some stop string."""
        for n in range(min(self.max_stop_len - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
