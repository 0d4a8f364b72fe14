"""The token endpoints in vLLM's shapes: `POST /tokenize` (a prompt, or chat messages rendered
through the chat template), `POST /detokenize`, `GET /tokenizer_info`. Evaluation harnesses
use them to count context tokens and to learn the EOS token (lm-evaluation-harness's remote
tokenizer). They run on rank 0, which holds the tokenizer; no rank's engine is involved.

Bounded like every request (limits.py): text by the prompt's character bound, messages by
the chat roles and characters, token ids by the vocabulary and max_model_len.
"""
from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field, RootModel

from moespec.server.errors import ApiError
from moespec.server.protocol import STRICT, ChatMessage, TokenId


class TokenizePrompt(BaseModel):
    model_config = STRICT

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # the tokenizer's BOS and the like, as vLLM adds them by default
    return_token_strs: bool = False


class TokenizeChat(BaseModel):
    model_config = STRICT

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message left open, to be continued
    add_special_tokens: bool = False  # the chat template writes them
    return_token_strs: bool = False


class TokenizeRequest(RootModel[TokenizePrompt | TokenizeChat]):
    """A prompt, or chat messages (vLLM's two forms)."""

    @property
    def model(self) -> str | None:
        return self.root.model


class DetokenizeRequest(BaseModel):
    model_config = STRICT

    model: str | None = None
    tokens: Annotated[list[TokenId], Field(max_length=1 << 20)]  # limits.py: within max_model_len


def tokenize(tokenizer, body: TokenizeRequest, max_model_len: int) -> dict:
    """vLLM's answer: count, max_model_len, tokens, token_strs (null unless asked)."""
    request = body.root
    text = request.prompt if isinstance(request, TokenizePrompt) else render_messages(tokenizer, request)
    ids = encode(tokenizer, text, request.add_special_tokens)
    strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def render_messages(tokenizer, request: TokenizeChat) -> str:
    if request.add_generation_prompt and request.continue_final_message:
        raise ApiError(400, "continue_final_message: needs add_generation_prompt false", "continue_final_message")
    messages = [m.as_template_input() for m in request.messages]
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=request.add_generation_prompt,
                                             continue_final_message=request.continue_final_message)
    except Exception as e:  # jinja's TemplateError, raise_exception() in the template, a final message not found
        raise ApiError(400, f"messages: {e}", "messages") from None


def encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except Exception as e:  # text that is not valid Unicode, and its kin
        raise ApiError(400, f"prompt: the tokenizer cannot take this text ({type(e).__name__}: {e})",
                       "prompt") from None


def detokenize(tokenizer, body: DetokenizeRequest) -> dict:
    return {"prompt": tokenizer.decode(body.tokens)}


def tokenizer_info(tokenizer, max_model_len: int, vocab_size: int) -> dict:
    """The tokenizer's class, special tokens and chat template (what a remote tokenizer client
    reads: lm-eval takes eos_token and chat_template), and the server's max_model_len."""
    return {"tokenizer_class": type(tokenizer).__name__, "eos_token": tokenizer.eos_token,
            "bos_token": tokenizer.bos_token, "pad_token": tokenizer.pad_token, "unk_token": tokenizer.unk_token,
            "chat_template": getattr(tokenizer, "chat_template", None), "model_max_length": max_model_len,
            "max_model_len": max_model_len, "vocab_size": vocab_size}


def require_tokenizer(tokenizer) -> None:
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer: the token endpoints need one")
