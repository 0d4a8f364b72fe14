"""Draft trees (EAGLE-2's dynamic trees): several candidates per position, verified in one
target forward under a tree attention mask.

Expand: the drafter scores the children of a frontier of `top_k` nodes per request; each
frontier node keeps its `top_k` most probable children, and the `top_k` children with the
highest cumulative draft log-probability over the whole level become the next frontier.
Rerank: the `num_draft_tokens` candidates of every level with the highest cumulative
log-probability make the tree. A child never scores above its parent, so the chosen nodes
always form a tree rooted at the request's last token. Unlike EAGLE-2, the chain of top-1
drafts always stays in the frontier and is chosen first: a greedy target follows its argmax,
which is not always on the most probable path, and with the chain in it a tree accepts at
least what the chain of its depth (up to N nodes) accepts.

Layout of one request's tree in a verify batch: node 0 is the root (the last token, at
position m-1), nodes 1..N the drafts in breadth-first order. Node i sits at KV position
m-1+i and at rotary position m-1+depth(i); it attends to the context and to its ancestors.
The drafter's own forwards over frontier nodes write KV past its context: frontier node j of
level l at slot (l-1)*top_k + j after it.

Verification follows the target down the tree: at each node, the target's own draw there (the
argmax for greedy rows, the keyed Gumbel-max for seeded rows, an inverse-CDF draw with the
request's uniform of that depth for random rows) is the next token; when a child carries it,
the walk moves to that child, otherwise it ends and the draw is the step's final token. Every
emitted token is then a draw from the target's distribution at its position: the
multi-candidate rejection test against point-mass drafts is exactly this (docs/draft-trees.md
has the proof sketch). After acceptance the accepted path's KV is copied to consecutive
positions (`compact_path`); rejected branches leave nothing that is read again.

Shapes legend: B requests, N draft nodes per request, K top_k, D depth, V vocab, C candidates.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from moespec.attention.base import LayerKV
from moespec.batch import Batch, Span, pack_spans
from moespec.config import TreeShape  # noqa: F401 (a config's shape; trees grow here)
from moespec.sequence import Sequence

FLOOR_LOGPROB = -1e4  # draft log-probabilities are clamped here: impossible tokens keep a finite, ordered score
DEPTH_TIE_BREAK = 1e-6  # a child scores strictly below its parent even where the draft is certain
CHAIN_BONUS = 1e6  # the chain of top-1 drafts ranks above every other node: a tree holds the chain of its depth


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [B, N] drafts, breadth-first
    parents: torch.Tensor  # [B, N] node index of each one's parent (0: the root); nodes are 1..N
    depths: torch.Tensor  # [B, N] 1..D
    draft_slots: torch.Tensor  # [B, N] the drafter's KV slot of each node past its context; -1: not forwarded
    depth: int  # D, the deepest a node may be
    steady: bool = True

    def node_depths(self) -> torch.Tensor:
        """[B, 1+N] the depth of every node, the root (0) first."""
        return torch.cat([torch.zeros_like(self.depths[:, :1]), self.depths], 1)

    def ancestors(self) -> torch.Tensor:
        """[B, 1+N, 1+N] bool: node i sees node j (j is i, the root or an ancestor of i)."""
        B, N = self.tokens.shape
        parents = torch.cat([torch.zeros_like(self.parents[:, :1]), self.parents], 1)  # [B, 1+N]
        eye = torch.eye(1 + N, dtype=torch.bool, device=parents.device).expand(B, -1, -1)
        seen = eye
        for _ in range(self.depth):
            seen = eye | seen.gather(1, parents[:, :, None].expand(-1, -1, 1 + N))
        return seen


class TreeResult(NamedTuple):
    num_accepted: torch.Tensor  # [B] accepted drafts (the path's depth)
    path: torch.Tensor  # [B, D+1] node at each depth of the accepted path; past its end, its last node
    tokens: torch.Tensor  # [B, D+1] accepted drafts, then the target's token at index num_accepted


def grow_tree(shape: TreeShape, root_logprobs: torch.Tensor,
              forward: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> DraftTree:
    """Expand and rerank a tree from the drafter's log-probabilities at the root [B, V].

    `forward(level, tokens [B, K], parent [B, K], visible [B, K, level*K])` runs the drafter over
    a frontier (level 1..D-1): node j of it writes its KV at slot (level-1)*K + j, sees the slots
    marked in `visible` (its ancestors and itself) besides the context, and descends from node
    parent[b, j] of the previous frontier; it returns the children's log-probabilities [B, K, V].
    """
    K, D, N = shape.top_k, shape.depth, shape.num_draft_tokens
    B, device = root_logprobs.shape[0], root_logprobs.device
    scores, tokens = root_logprobs.double().clamp(min=FLOOR_LOGPROB).topk(K, dim=-1)  # [B, K]
    top1 = torch.arange(K, device=device).expand(B, K) == 0  # [B, K] the chain of top-1 drafts
    cand_tokens, cand_scores, cand_chain = [tokens], [scores], [top1]
    cand_parents = [torch.full((B, K), -1, dtype=torch.long, device=device)]
    cand_depths = [torch.ones(B, K, dtype=torch.long, device=device)]
    cand_slots = [torch.full((B, K), -1, dtype=torch.long, device=device)]
    frontier = torch.arange(K, device=device).expand(B, K)  # [B, K] candidate index of each frontier node
    on_chain = top1
    start = 0  # candidate index of the first one of the last level
    parent = torch.zeros(B, K, dtype=torch.long, device=device)
    visible = torch.zeros(B, K, 0, dtype=torch.bool, device=device)
    for level in range(1, D):
        own = torch.eye(K, dtype=torch.bool, device=device).expand(B, K, K)
        visible = torch.cat([visible, own], 2)  # [B, K, level*K]
        cand_slots[-1] = cand_slots[-1].scatter(1, frontier - start, (level - 1) * K
                                                + torch.arange(K, device=device).expand(B, K))
        logprobs = forward(level, tokens, parent, visible).double().clamp(min=FLOOR_LOGPROB)  # [B, K, V]
        child_lp, child_tokens = logprobs.topk(K, dim=-1)  # [B, K, K]
        child_scores = (scores[:, :, None] + child_lp).flatten(1)  # [B, K*K]
        child_chain = (on_chain[:, :, None] & top1[:, None, :]).flatten(1)  # [B, K*K]
        start = sum(c.shape[1] for c in cand_tokens)
        cand_tokens.append(child_tokens.flatten(1))
        cand_scores.append(child_scores)
        cand_chain.append(child_chain)
        cand_parents.append(frontier.repeat_interleave(K, dim=1))
        cand_depths.append(torch.full((B, K * K), level + 1, dtype=torch.long, device=device))
        cand_slots.append(torch.full((B, K * K), -1, dtype=torch.long, device=device))
        best = (child_scores + CHAIN_BONUS * child_chain).topk(K, dim=-1).indices  # [B, K] the next frontier
        scores, on_chain, parent = child_scores.gather(1, best), child_chain.gather(1, best), best // K
        tokens = child_tokens.flatten(1).gather(1, best)
        frontier = start + best
        visible = visible.gather(1, parent[:, :, None].expand(-1, -1, visible.shape[2]))
    candidates = (torch.cat(c, 1) for c in (cand_tokens, cand_scores, cand_chain, cand_parents, cand_depths, cand_slots))
    return rerank(N, D, *candidates)


def rerank(num_nodes: int, depth: int, tokens: torch.Tensor, scores: torch.Tensor, chain: torch.Tensor,
           parents: torch.Tensor, depths: torch.Tensor, slots: torch.Tensor) -> DraftTree:
    """The num_nodes best of C candidates [B, C] (parent: candidate index, -1 the root), the chain
    of top-1 drafts first, as a tree in breadth-first order (candidates are generated level by
    level, so index order is)."""
    key = scores + CHAIN_BONUS * chain - DEPTH_TIE_BREAK * depths
    chosen = key.topk(num_nodes, dim=-1).indices.sort(dim=-1).values  # [B, N] candidate indices
    node_of = torch.zeros(tokens.shape[0], tokens.shape[1] + 1, dtype=torch.long, device=tokens.device)
    node_of.scatter_(1, chosen + 1, torch.arange(1, num_nodes + 1, device=tokens.device).expand_as(chosen))
    parent_nodes = node_of.gather(1, parents.gather(1, chosen) + 1)  # the root (-1) maps to node 0
    return DraftTree(tokens.gather(1, chosen), parent_nodes, depths.gather(1, chosen), slots.gather(1, chosen), depth)


def walk_tree(draws: torch.Tensor, tree: DraftTree) -> TreeResult:
    """Follow the target's draws [B, 1+N] (its token at every node) down the tree."""
    B, N = tree.tokens.shape
    node = torch.zeros(B, dtype=torch.long, device=draws.device)
    alive = torch.ones(B, dtype=torch.bool, device=draws.device)
    path = [node]
    for _ in range(tree.depth):
        target = draws.gather(1, node[:, None])  # [B, 1]
        match = (tree.parents == node[:, None]) & (tree.tokens == target) & alive[:, None]  # [B, N]
        found = match.any(1)
        node = torch.where(found, match.long().argmax(1) + 1, node)
        alive = alive & found
        path.append(node)
    path = torch.stack(path, 1)  # [B, D+1]
    num_accepted = (path[:, 1:] != path[:, :-1]).long().sum(1)
    all_tokens = torch.cat([torch.zeros_like(tree.tokens[:, :1]), tree.tokens], 1)  # [B, 1+N]
    tokens = torch.cat([all_tokens.gather(1, path[:, 1:]), torch.zeros_like(path[:, :1])], 1)  # [B, D+1]
    final = draws.gather(1, path.gather(1, num_accepted[:, None]))  # [B, 1] at the path's last node
    return TreeResult(num_accepted, path, tokens.scatter(1, num_accepted[:, None], final))


def page_table(seqs: list[Sequence], device) -> torch.Tensor:
    """[B, P] each request's page ids (padded with its last one)."""
    width = max(len(seq.pages) for seq in seqs)
    return torch.tensor([seq.pages + seq.pages[-1:] * (width - len(seq.pages)) for seq in seqs], device=device)


def compact_path(layers: list[LayerKV], pages: torch.Tensor, page_size: int, sources: torch.Tensor,
                 targets: torch.Tensor) -> None:
    """Copy the KV at positions sources [B, D] to positions targets [B, D] of each request (page
    table `pages` [B, P]) in every layer; all reads come before any write (a source may be
    another pair's target)."""
    def rows(positions: torch.Tensor) -> torch.Tensor:
        return (pages.gather(1, positions // page_size) * page_size + positions % page_size).flatten()

    src, dst = rows(sources), rows(targets)
    for layer in layers:
        for cache in (layer.k, layer.v):
            if cache is not None:
                flat = cache.view(-1, *cache.shape[2:])
                flat.index_copy_(0, dst, flat.index_select(0, src))


def tree_mask(context: list[int], seen: torch.Tensor) -> torch.Tensor:
    """Flat custom mask (attention.base) of requests with context[b] positions before their
    queries' block: queries see all context, and block slot j where seen[b, i, j]."""
    blocks = []
    for b, c in enumerate(context):
        rows = seen[b]
        blocks.append(torch.cat([torch.ones(rows.shape[0], c, dtype=torch.bool, device=rows.device), rows], 1).flatten())
    return torch.cat(blocks)


def tree_level_batch(seqs: list[Sequence], context: list[int], level: int, K: int, visible: torch.Tensor,
                     page_size: int, device) -> Batch:
    """A drafter's forward over one frontier level of a tree (tree.grow_tree): K nodes per request
    at KV slots context + (level-1)*K + j, rotary position context - 1 + level, seeing the context
    and the slots in `visible` [B, K, level*K]. Input ids are set by the caller."""
    spans = [Span(seq.pages, c + (level - 1) * K, [0] * K) for seq, c in zip(seqs, context)]
    batch = pack_spans(spans, page_size, "draft_extend").to(device)
    batch.kv_positions = batch.positions
    batch.positions = torch.tensor([c - 1 + level for c in context], device=device).repeat_interleave(K)
    batch.custom_mask = tree_mask(context, visible)
    return batch


def path_positions(batch: Batch, result: TreeResult) -> tuple[torch.Tensor, torch.Tensor]:
    """(sources, targets) [B, D+1] KV positions that move the accepted path of a tree's verify
    batch (node i at m-1+i) to consecutive positions m-1+d; past the path's end, nothing moves."""
    B, D1 = result.path.shape
    root = batch.kv_positions.view(B, -1)[:, :1]  # [B, 1] m-1
    depth = torch.arange(D1, device=root.device)[None, :]
    on_path = depth <= result.num_accepted[:, None]
    return root + torch.where(on_path, result.path, depth), root + depth
