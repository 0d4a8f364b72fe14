"""Verification of drafted tokens against the target, all in tensor ops (no host sync).

Lossless rejection sampling (Leviathan et al.) over the *full* draft and target
distributions after the same sampling transforms: draft token d_i is accepted with
probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the token is drawn from
normalize(max(p - q, 0)); when all k are accepted a bonus token is drawn from p_k. Greedy
rows have one-hot p and q, so the same arithmetic is exact-match verification.

Seeded rows are verified by exact match too: the target's own draw at each verify position
is its keyed Gumbel-max token (sampling.py), the draft drew with the same keyed noise, and a
draft token is accepted when the two agree. Every emitted token is then the target's own
keyed draw, so the output equals that of decoding without speculation, token for token.

Shapes legend: B requests, K draft tokens per request, V vocab.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from moespec.sampling import invert_cdf


class VerifyResult(NamedTuple):
    num_accepted: torch.Tensor  # [B] int64, 0..K
    tokens: torch.Tensor  # [B, K+1]: accepted drafts, then the correction/bonus token at index num_accepted


def verify_lossless(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                    uniforms: torch.Tensor) -> VerifyResult:
    """target_probs [B,K+1,V], draft_probs [B,K,V], draft_tokens [B,K], uniforms [B,K+1] in [0,1)."""
    B, K = draft_tokens.shape
    p_draft = target_probs[:, :K].gather(2, draft_tokens[..., None]).squeeze(2).double()  # [B, K]
    q_draft = draft_probs.gather(2, draft_tokens[..., None]).squeeze(2).double()  # [B, K]
    accept = uniforms[:, :K] * q_draft < p_draft  # u < p/q without dividing by q
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B] leading accepts
    return VerifyResult(num_accepted, place_final_token(target_probs, draft_probs, draft_tokens, num_accepted,
                                                        uniforms[:, K]))


def verify_greedy(target_tokens: torch.Tensor, draft_tokens: torch.Tensor) -> VerifyResult:
    """All rows greedy: what verify_lossless computes from one-hot p and q, without building them.
    target_tokens [B,K+1] the target's argmax at each verify position, draft_tokens [B,K]."""
    K = draft_tokens.shape[1]
    num_accepted = (draft_tokens == target_tokens[:, :K]).long().cumprod(dim=1).sum(dim=1)  # [B]
    tokens = torch.cat([draft_tokens, torch.zeros_like(draft_tokens[:, :1])], dim=1)
    final = target_tokens.gather(1, num_accepted[:, None])  # [B, 1] the correction or bonus token
    return VerifyResult(num_accepted, tokens.scatter(1, num_accepted[:, None], final))


def select_rows(mask: torch.Tensor, chosen: VerifyResult, other: VerifyResult) -> VerifyResult:
    """Per request: `chosen` where mask [B] is true, else `other`."""
    return VerifyResult(torch.where(mask, chosen.num_accepted, other.num_accepted),
                        torch.where(mask[:, None], chosen.tokens, other.tokens))


def place_final_token(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                      num_accepted: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Draw the token after the accepted prefix and write it at index num_accepted of [B, K+1]."""
    B, K = draft_tokens.shape
    rows = torch.arange(B, device=target_probs.device)
    p = target_probs[rows, num_accepted].double()  # [B, V] target distribution at the first rejection
    q_padded = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)  # bonus slot has q = 0
    residual = (p - q_padded[rows, num_accepted].double()).clamp(min=0)
    # p == q exactly leaves no residual mass; a rejection is then impossible, keep p
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    final = invert_cdf(residual, uniform)  # [B]
    tokens = torch.cat([draft_tokens, torch.zeros_like(draft_tokens[:, :1])], dim=1)
    return tokens.scatter(1, num_accepted[:, None], final[:, None])


def verify_relaxed(target_logits: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor,
                   draft_tokens: torch.Tensor, uniforms: torch.Tensor, top_n: int, delta: float) -> VerifyResult:
    """Lossy, opt-in (as TRT-LLM offers for reasoning): additionally accept a draft token that
    is among the target's top-N with log-probability within `delta` of the best one."""
    B, K = draft_tokens.shape
    logprobs = target_logits[:, :K].float().log_softmax(-1)  # [B, K, V]
    top_lp, top_ids = logprobs.topk(top_n, dim=-1)  # [B, K, N]
    in_top = (top_ids == draft_tokens[..., None]).any(-1)
    draft_lp = logprobs.gather(2, draft_tokens[..., None]).squeeze(2)
    close = draft_lp >= top_lp[..., 0] - delta
    p_draft = target_probs[:, :K].gather(2, draft_tokens[..., None]).squeeze(2).double()
    q_draft = draft_probs.gather(2, draft_tokens[..., None]).squeeze(2).double()
    accept = (uniforms[:, :K] * q_draft < p_draft) | (in_top & close)
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)
    return VerifyResult(num_accepted, place_final_token(target_probs, draft_probs, draft_tokens, num_accepted,
                                                        uniforms[:, K]))
