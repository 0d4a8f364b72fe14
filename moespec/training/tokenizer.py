"""Byte-level BPE tokenizer shared by every tiny moespec model, saved in Hugging Face format.

Command: `moespec train-tokenizer --out DIR [--vocab-size N] [--corpus stdlib|PATH...]
[--max-bytes N]`.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from moespec.training.corpus import Corpus, CorpusSpec, load_corpus

log = logging.getLogger(__name__)

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
END = "<|end|>"  # closes one chat message
# Order fixes the ids: <|bos|> 0, <|eos|> 1, <|pad|> 2, then the chat markers 3..6.
SPECIAL_TOKENS = (BOS, EOS, PAD, *ROLE_TOKENS, END)
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2

DEFAULT_VOCAB_SIZE = 4096
DEFAULT_MODEL_MAX_LENGTH = 2048

# Each message is "<|role|>\ncontent<|end|>\n"; a generation prompt opens the assistant turn.
# With tools, a system turn lists them first; an assistant's calls and a tool's results use
# DeepSeek-V3's markers (server/tool_calls.py parses them: tool_call_parser deepseek-v3).
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|system|>\\n## Tools\\nCall a function as <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
    "function<｜tool▁sep｜>NAME\\n```json\\nARGUMENTS\\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>\\n' }}"
    "{% for tool in tools %}{{ (tool['function'] if tool['function'] is defined else tool) | tojson }}{{ '\\n' }}"
    "{% endfor %}{{ '<|end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown chat role ' + message['role'] + '; allowed: system, user, assistant, tool') }}"
    "{% endif %}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|assistant|>\\n' + (message['content'] or '') + '<｜tool▁calls▁begin｜>' }}"
    "{% for call in message['tool_calls'] %}"
    "{{ '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + call['function']['name'] + '\\n```json\\n' }}"
    "{{ call['function']['arguments'] if call['function']['arguments'] is string "
    "else call['function']['arguments'] | tojson }}"
    "{{ '\\n```<｜tool▁call▁end｜>' }}"
    "{% endfor %}{{ '<｜tool▁calls▁end｜><|end|>\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|tool|>\\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜><|end|>\\n' }}"
    "{% else %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def build_bpe(vocab_size: int) -> tuple[Tokenizer, trainers.BpeTrainer]:
    # No post-processor: encoding never inserts <|bos|> by itself, so the ids of a prompt
    # are exactly the ids of its text and callers prepend BOS explicitly when they want it.
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        show_progress=False,
    )
    return tokenizer, trainer


def wrap_for_transformers(tokenizer: Tokenizer, model_max_length: int) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[*ROLE_TOKENS, END],
        model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # decode(encode(text)) must return text exactly
    )


def train_tokenizer(corpus: Corpus, vocab_size: int = DEFAULT_VOCAB_SIZE,
                    out_dir: str | Path | None = None,
                    model_max_length: int = DEFAULT_MODEL_MAX_LENGTH) -> PreTrainedTokenizerFast:
    """Train on the corpus's train split; save to `out_dir` when given."""
    min_vocab = len(SPECIAL_TOKENS) + 256
    if vocab_size < min_vocab:
        raise ValueError(f"vocab_size must be at least {min_vocab} (special tokens + 256 bytes), "
                         f"got {vocab_size}")
    tokenizer, trainer = build_bpe(vocab_size)
    tokenizer.train_from_iterator(corpus.train_texts(), trainer, length=len(corpus.train))
    wrapped = wrap_for_transformers(tokenizer, model_max_length)
    if out_dir is not None:
        save_tokenizer(wrapped, Path(out_dir))
    return wrapped


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    # Keep the chat template inside tokenizer_config.json rather than a separate .jinja file.
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)


def bytes_per_token(tokenizer: PreTrainedTokenizerFast, texts: Iterable[str]) -> float:
    texts = list(texts)
    encoded = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    num_tokens = sum(len(enc.ids) for enc in encoded)
    num_bytes = sum(len(text.encode("utf-8")) for text in texts)
    return num_bytes / max(num_tokens, 1)


# ---- command line -------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=Path, help="directory to save the tokenizer to")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--corpus", nargs="+", default=["stdlib"], metavar="stdlib|PATH",
                        help="'stdlib' or text files, directories and .jsonl files")
    parser.add_argument("--max-bytes", type=int, default=None,
                        help="cap each corpus split at this many bytes (quick runs)")


def run(args: argparse.Namespace) -> None:
    source = "stdlib" if args.corpus == ["stdlib"] else tuple(args.corpus)
    corpus = load_corpus(CorpusSpec(source=source, max_bytes=args.max_bytes))
    start = time.perf_counter()
    tokenizer = train_tokenizer(corpus, args.vocab_size, args.out)
    elapsed = time.perf_counter() - start
    log.info("trained a %d-token vocabulary in %.1f s; saved to %s", len(tokenizer), elapsed, args.out)
    if corpus.heldout:
        log.info("held-out: %.3f bytes/token", bytes_per_token(tokenizer, corpus.heldout_texts()))


def main(argv: list[str] | None = None) -> None:
    from moespec.arguments import run_standalone

    run_standalone("moespec train-tokenizer", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    main()
