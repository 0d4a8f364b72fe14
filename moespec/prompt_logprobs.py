"""Prompt logprobs: the log-probability of each prompt token under the model's logits at the
position before it, computed from the prefill's hidden states as the prompt goes through.

The model runner projects only the sampled rows to logits; a request that asks for prompt
logprobs (SamplingParams.prompt_logprobs) has its prefill rows projected here too, a slice of
rows at a time (a [rows, V] float32 block each), whichever chunk of the prompt a step computes
(chunked prefill fills the entries chunk by chunk). Prompt token 0 has no position before it:
its entry stays None, as in vLLM. A cached prefix would have no hidden states: the scheduler
never serves such requests from the prefix cache (scheduler.find_cached); they compute their
whole prompt. A preempted request recomputes its prompt and writes the same entries again.

Shapes legend: T tokens of the batch, R rows of one slice, V vocab, K top alternatives.
"""
from __future__ import annotations

import torch

from moespec.scheduler import ScheduledChunk
from moespec.sequence import Sequence, TokenLogprob

ROWS_PER_SLICE = 256  # rows projected to logits at once: bounds the [R, V] float32 block


def wants_prompt_logprobs(seq: Sequence) -> bool:
    return seq.params.prompt_logprobs is not None


def prompt_logprob_slots(seq: Sequence) -> list[TokenLogprob | None]:
    """A request's empty prompt logprobs: one entry per prompt token, filled as its prefill runs."""
    return [None] * len(seq.prompt_ids)


def record_prompt_logprobs(model, hidden: torch.Tensor, chunks: list[ScheduledChunk], batch) -> None:
    """Fill the prompt logprobs of the chunks' requests that ask, from this step's hidden [T, M]
    (rows of chunk i at batch.qo_bounds[i]..qo_bounds[i+1]); a decode step has none."""
    if batch.mode == "decode":
        return
    qo_bounds = batch.qo_bounds
    for i, chunk in enumerate(chunks):
        seq = chunk.seq
        if not wants_prompt_logprobs(seq) or seq.prompt_logprobs is None:
            continue
        stop = min(chunk.end, len(seq.prompt_ids) - 1)  # the position scoring the last prompt token
        for first in range(chunk.start, stop, ROWS_PER_SLICE):
            last = min(first + ROWS_PER_SLICE, stop)
            row = qo_bounds[i] + first - chunk.start
            logits = model.compute_logits(hidden[row: row + last - first]).float()  # [R, V]
            targets = seq.prompt_ids[first + 1: last + 1]
            seq.prompt_logprobs[first + 1: last + 1] = score_tokens(logits, targets, seq.params.prompt_logprobs)


def score_tokens(logits: torch.Tensor, targets: list[int], num_top: int) -> list[TokenLogprob]:
    """Each row's target token scored under logits [R, V]: float32 log_softmax, the target's rank
    (1 = the most likely token), and the num_top most likely tokens, highest first."""
    logprobs = logits.float().log_softmax(-1)  # [R, V]
    index = torch.tensor(targets, device=logits.device)
    chosen = logprobs.gather(1, index.unsqueeze(1))  # [R, 1]
    ranks = (logprobs > chosen).sum(-1) + 1  # [R]
    top_lps, top_ids = logprobs.topk(num_top, dim=-1)  # [R, K]
    return [TokenLogprob(token, lp, dict(zip(ids, lps)), rank)
            for token, lp, rank, ids, lps in zip(targets, chosen.squeeze(1).tolist(), ranks.tolist(),
                                                 top_ids.tolist(), top_lps.tolist())]
