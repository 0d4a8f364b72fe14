"""Training text every machine has: the Python standard library, or a user's own files.

Documents are split into train / held-out by a stable hash of their key (the path relative
to the corpus root), so the split never depends on file-system order, the machine or a
seed: the same Python version yields the same stdlib split everywhere.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

log = logging.getLogger(__name__)

STDLIB_SKIP_DIRS = frozenset({"site-packages", "test", "tests", "idlelib", "lib2to3"})
STDLIB_MAX_FILE_BYTES = 200_000
TEXT_SUFFIXES = (".txt", ".py", ".md")


@dataclass(frozen=True)
class CorpusSpec:
    """What to train on.

    source: "stdlib" for the running interpreter's standard library sources, or a sequence
        of paths: text files, directories (searched recursively for *.txt, *.py, *.md) and
        .jsonl files (one document per line, taken from `jsonl_field`).
    heldout_fraction: share of documents held out, chosen by a hash of each document's key.
    jsonl_field: the field of each .jsonl record that holds the text.
    max_bytes: if set, each split stops taking documents once it holds this many bytes
        (documents are taken in the corpus order, so a capped corpus is a stable prefix).
    """

    source: str | Sequence[str] = "stdlib"
    heldout_fraction: float = 0.05
    jsonl_field: str = "text"
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.source, str) and self.source != "stdlib":
            raise ValueError(f"source must be 'stdlib' or a list of paths, got {self.source!r}")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {self.heldout_fraction}")
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive or None, got {self.max_bytes}")


@dataclass(frozen=True)
class Document:
    key: str  # stable identity: path relative to the corpus root (plus ":line" for jsonl)
    text: str

    @property
    def num_bytes(self) -> int:
        return len(self.text.encode("utf-8"))


@dataclass(frozen=True)
class Corpus:
    spec: CorpusSpec
    train: tuple[Document, ...]
    heldout: tuple[Document, ...]

    def train_texts(self) -> Iterator[str]:
        return (doc.text for doc in self.train)

    def heldout_texts(self) -> Iterator[str]:
        return (doc.text for doc in self.heldout)

    def describe(self) -> str:
        return f"train {_describe(self.train)}, held-out {_describe(self.heldout)}"


def load_corpus(spec: CorpusSpec | None = None) -> Corpus:
    spec = spec or CorpusSpec()
    docs = read_stdlib() if spec.source == "stdlib" else read_user_paths(spec.source, spec.jsonl_field)
    train, heldout = split_documents(docs, spec.heldout_fraction)
    corpus = Corpus(spec, cap_bytes(train, spec.max_bytes), cap_bytes(heldout, spec.max_bytes))
    log.info("corpus %s: %s", _name_source(spec.source), corpus.describe())
    return corpus


# ---- splitting ----------------------------------------------------------------------------


def is_heldout(key: str, fraction: float) -> bool:
    """A key's place in [0, 1) from the first 8 bytes of its sha1: identical everywhere."""
    digest = hashlib.sha1(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_documents(docs: Iterable[Document], fraction: float) -> tuple[list[Document], list[Document]]:
    train: list[Document] = []
    heldout: list[Document] = []
    for doc in docs:
        (heldout if is_heldout(doc.key, fraction) else train).append(doc)
    return train, heldout


def cap_bytes(docs: Sequence[Document], max_bytes: int | None) -> tuple[Document, ...]:
    if max_bytes is None:
        return tuple(docs)
    kept: list[Document] = []
    total = 0
    for doc in docs:
        if total >= max_bytes:
            break
        kept.append(doc)
        total += doc.num_bytes
    return tuple(kept)


# ---- sources ------------------------------------------------------------------------------


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_stdlib_files(root: Path | None = None) -> list[Path]:
    """The stdlib *.py files in sorted relative-path order, minus tests, tools and huge files."""
    root = root or stdlib_root()
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if STDLIB_SKIP_DIRS.intersection(rel.parts[:-1]):
            continue
        if path.is_file() and path.stat().st_size <= STDLIB_MAX_FILE_BYTES:
            files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def read_stdlib() -> Iterator[Document]:
    root = stdlib_root()
    for path in list_stdlib_files(root):
        text = read_utf8(path)
        if text is not None:
            yield Document(path.relative_to(root).as_posix(), text)


def read_user_paths(paths: Sequence[str], jsonl_field: str) -> Iterator[Document]:
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            yield from read_directory(path)
        elif path.suffix == ".jsonl":
            yield from read_jsonl(path, jsonl_field)
        elif path.is_file():
            yield Document(path.name, read_text_or_raise(path))
        else:
            raise FileNotFoundError(f"corpus path {raw!r} is neither a file nor a directory")


def read_directory(root: Path) -> Iterator[Document]:
    """Files with a text suffix under `root`, recursively; non-UTF-8 files are skipped."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    for path in files:
        text = read_utf8(path)
        if text is None:
            log.warning("skipping %s: not UTF-8", path)
            continue
        yield Document(f"{root.name}/{path.relative_to(root).as_posix()}", text)


def read_jsonl(path: Path, field: str) -> Iterator[Document]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                raise ValueError(f"{path}:{lineno}: expected an object with a string field "
                                 f"{field!r} (set jsonl_field to the field that holds the text)")
            yield Document(f"{path.name}:{lineno}", record[field])


def read_utf8(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None


def read_text_or_raise(path: Path) -> str:
    text = read_utf8(path)
    if text is None:
        raise ValueError(f"corpus file {path} is not UTF-8 text")
    return text


def _describe(docs: Sequence[Document]) -> str:
    return f"{len(docs)} files ({sum(d.num_bytes for d in docs) / 1e6:.2f} MB)"


def _name_source(source: str | Sequence[str]) -> str:
    return source if isinstance(source, str) else ", ".join(source)


# ---- token streams and training windows ---------------------------------------------------


def tokenize_stream(texts: Iterable[str], tokenizer: PreTrainedTokenizerFast,
                    eos_id: int | None = None, batch_size: int = 64) -> np.ndarray:
    """Encode documents into one flat int32 stream, with EOS (default: the tokenizer's) after
    every document so that a training window spanning two files sees where one ends."""
    parts: list[np.ndarray] = []
    eos = np.array([tokenizer.eos_token_id if eos_id is None else eos_id], dtype=np.int32)
    for batch in _batched(texts, batch_size):
        # The backend encodes whole files without the model_max_length warning.
        for enc in tokenizer.backend_tokenizer.encode_batch(batch, add_special_tokens=False):
            parts += [np.asarray(enc.ids, dtype=np.int32), eos]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def cut_windows(stream: np.ndarray, window: int, seed: int = 0) -> np.ndarray:
    """Non-overlapping windows of `window` tokens, shape [num_windows, window], in a
    seed-determined order. The seed also picks the offset of the first window so that
    different seeds cut at different places. For next-token training pass seq_len + 1 and
    use row[:-1] as input and row[1:] as target."""
    if window <= 0:
        raise ValueError(f"window must be positive, got {window}")
    if len(stream) < window:
        raise ValueError(f"stream of {len(stream)} tokens is shorter than one window of {window}")
    rng = np.random.default_rng(seed)
    offset = int(rng.integers(0, min(window, len(stream) - window + 1)))
    count = (len(stream) - offset) // window
    windows = stream[offset:offset + count * window].reshape(count, window)  # [N, window]
    return windows[rng.permutation(count)]


def _batched(texts: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
