"""The packed batch of one step: what the model runner (and, with ranks, every rank) receives.

Shapes legend: T tokens (flattened batch), B requests, N sampled rows.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal, NamedTuple

import torch

from moespec.attention.base import AttentionMetadata
from moespec.scheduler import ScheduledChunk

Mode = Literal["prefill", "decode", "mixed", "verify", "draft_extend"]


@dataclass
class Batch:
    mode: Mode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    qo_indptr: torch.Tensor  # [B+1]
    kv_indptr: torch.Tensor  # [B+1]
    kv_indices: torch.Tensor  # [pages]
    kv_last_page_len: torch.Tensor  # [B]
    sample_indices: torch.Tensor  # [N] rows of T whose logits are sampled
    page_size: int
    qo_bounds: tuple[int, ...] = ()  # the host's copy of qo_indptr: splits a batch without reading the device
    host: "Batch | None" = None  # the batch as built on the host, once moved to a device
    # draft trees (speculation/tree.py): tokens sit at KV positions other than their rotary
    # positions (`positions`), and see only their ancestors among the batch's tokens
    kv_positions: torch.Tensor | None = None  # [T] where each token's KV goes; None: its position
    custom_mask: torch.Tensor | None = None  # flat bool, per request q_len x kv_len (attention.base)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def attention_metadata(self) -> AttentionMetadata:
        host = self.host.attention_metadata() if self.host is not None else None
        positions = self.positions if self.kv_positions is None else self.kv_positions
        return AttentionMetadata(self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_last_page_len,
                                 positions, self.page_size, custom_mask=self.custom_mask, host=host)

    def to(self, device: str | torch.device) -> "Batch":
        """The batch on `device`; it keeps the host original, so planning never copies back."""
        if self.input_ids.device == torch.device(device):
            return self
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor):
                moved[name] = value.to(device, non_blocking=True)
        moved["host"] = self.host or self
        return Batch(**moved)


def build_batch(chunks: list[ScheduledChunk], page_size: int, mode: Mode) -> Batch:
    """Flatten scheduled chunks: tokens of one request contiguous, pages covering its KV so far."""
    spans = [Span(c.seq.pages, c.start, c.seq.token_at(c.start, c.end)) for c in chunks]
    sampled = [c.completes_prompt for c in chunks]
    return pack_spans(spans, page_size, mode, sampled)


class Span(NamedTuple):
    """Tokens of one request at consecutive positions start.., reading KV through the last one."""

    pages: list[int]
    start: int
    token_ids: list[int]


def pack_spans(spans: list[Span], page_size: int, mode: Mode, sampled: list[bool] | None = None) -> Batch:
    """Flat token ids, positions and page metadata; `sampled` marks spans whose last row is sampled
    (default: every row is sampled, as in verify batches)."""
    ids, positions, qo, kv, indices, last, sample = [], [], [0], [0], [], [], []
    for i, span in enumerate(spans):
        end = span.start + len(span.token_ids)
        ids += span.token_ids
        positions += range(span.start, end)
        qo.append(qo[-1] + len(span.token_ids))
        used = -(-end // page_size)
        indices += span.pages[:used]
        kv.append(kv[-1] + used)
        last.append(end - (used - 1) * page_size)
        if sampled is None:
            sample += range(qo[-2], qo[-1])
        elif sampled[i]:
            sample.append(qo[-1] - 1)
    # one host tensor, viewed as the batch's fields (in field order)
    flat = torch.tensor(ids + positions + qo + kv + indices + last + sample, dtype=torch.int64)
    sizes = [len(part) for part in (ids, positions, qo, kv, indices, last, sample)]
    return Batch(mode, *flat.split(sizes), page_size=page_size, qo_bounds=tuple(qo))
