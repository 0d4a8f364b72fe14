"""Token streams for training: the corpus encoded once with the shared tokenizer and cached as
.npy files, then cut into fixed-length windows.

Shapes legend: N windows, B batch, L window length.
"""
from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moespec.training.corpus import CorpusSpec, cut_windows, load_corpus, tokenize_stream

log = logging.getLogger(__name__)

DEFAULT_TOKENIZER = Path(__file__).resolve().parents[2] / "checkpoints" / "tokenizer"


def cache_dir() -> Path:
    root = os.environ.get("MOESPEC_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "moespec"
    return Path(root) / "tokens"


def load_tokenizer(path: str | Path = DEFAULT_TOKENIZER):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def stream_key(spec: CorpusSpec, tokenizer_dir: Path, split: str) -> str:
    tokenizer_hash = hashlib.sha1((Path(tokenizer_dir) / "tokenizer.json").read_bytes()).hexdigest()[:12]
    spec_hash = hashlib.sha1(repr(spec).encode()).hexdigest()[:12]
    return f"{split}-{spec_hash}-{tokenizer_hash}.npy"


def load_streams(spec: CorpusSpec, tokenizer_dir: str | Path = DEFAULT_TOKENIZER) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) int32 token streams; encoded once per corpus spec and tokenizer, then cached."""
    tokenizer_dir = Path(tokenizer_dir)
    paths = {split: cache_dir() / stream_key(spec, tokenizer_dir, split) for split in ("train", "heldout")}
    if all(p.is_file() for p in paths.values()):
        return np.load(paths["train"]), np.load(paths["heldout"])
    corpus = load_corpus(spec)
    tokenizer = load_tokenizer(tokenizer_dir)
    streams = {"train": tokenize_stream(corpus.train_texts(), tokenizer),
               "heldout": tokenize_stream(corpus.heldout_texts(), tokenizer)}
    cache_dir().mkdir(parents=True, exist_ok=True)
    for split, stream in streams.items():
        np.save(paths[split], stream)
    log.info("tokenized corpus: %d train, %d held-out tokens", len(streams["train"]), len(streams["heldout"]))
    return streams["train"], streams["heldout"]


@dataclass
class WindowSampler:
    """Batches of windows [B, L+1] in a seeded order that is reshuffled every epoch; `batch(step)`
    depends only on the step, so a resumed run sees exactly the batches it would have seen."""

    stream: np.ndarray
    window: int  # L + 1 tokens: inputs row[:-1], targets row[1:]
    batch_size: int
    seed: int = 0

    def __post_init__(self) -> None:
        self.epoch = -1
        self.windows = np.zeros((0, self.window), dtype=np.int32)

    @property
    def batches_per_epoch(self) -> int:
        return max(1, (len(self.stream) - self.window) // self.window // self.batch_size)

    def batch(self, step: int) -> torch.Tensor:
        epoch, index = divmod(step, self.batches_per_epoch)
        if epoch != self.epoch:
            self.windows = cut_windows(self.stream, self.window, seed=self.seed + epoch)  # [N, L+1]
            self.epoch = epoch
        rows = self.windows[index * self.batch_size:(index + 1) * self.batch_size]  # [B, L+1]
        return torch.from_numpy(rows.astype(np.int64))


def heldout_windows(stream: np.ndarray, window: int, count: int) -> torch.Tensor:
    """`count` windows [count, window] spread evenly over the held-out stream (fixed, so every
    evaluation sees the same text, drawn from many files rather than the first few)."""
    count = min(count, len(stream) // window)
    stride = len(stream) // count  # >= window
    rows = np.stack([stream[i * stride:i * stride + window] for i in range(count)])
    return torch.from_numpy(rows.astype(np.int64))
