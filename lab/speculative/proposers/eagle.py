"""EAGLE drafting with EAGLE-2's dynamic draft tree (Li et al. 2024, EAGLE, Sec. 4.1; EAGLE-2, Sec. 4).

The head (`lab.heads.eagle`) first reads the real pairs the last round committed (`EagleCache.extend`: the
target's features at the root and the accepted nodes, paired with the tokens that followed them; that is what
`accept` hands over) and predicts f_hat after the root. Expansion: the top-`branch` tokens of
q = softmax(W_lm[V_d] f_hat) are depth 0; at each further depth the `branch` frontier nodes with the highest
cumulative log-probability c(x) = sum of log q along the path (the draft's confidence, which EAGLE-2 shows
approximates the acceptance rate) are expanded at once (one head forward with the tree mask), each proposing its
top-`branch` children. Reranking: after `depth` levels the best `total_tokens` candidates by c(x) are kept (a
child never outscores its parent, so the kept set is a tree). Since a kept node's parent and its higher-scored
siblings and level-mates are kept too, expansion drafts only what can survive the rerank: at most
`total_tokens` - 1 frontier nodes per level and as many children of each (the kept tree is the one the full
expansion gives; the round's EagleDraft lists only these candidates). The head's cache drops its tree entries
(`EagleCache.rollback`) and re-reads the accepted path with real features next round, as EAGLE's reference does.
Candidates are deterministic (top-k): q is None and the sibling rule keeps sampling lossless.
Deliberate differences: EOS nodes are not expanded; the head scores its draft vocabulary V_d only.
EAGLE-3 heads (`lab.heads.eagle3`) plug in unchanged: their `feature_layers` name the fused target layers, and
published heads (`lab.heads.published_build`) set `reads_prompt`, so the loop hands over every prompt position.
Not covered: batching, sampled trees.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lab.heads.eagle import EagleCache, EagleHead
from lab.speculative.draft import Draft, DraftContext, Verified
from lab.trace import EagleDraft


@dataclass
class Candidates:
    """Every node drafted in one round, in creation order; parents index this list (-1 = the root)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # c(x): cumulative log q along the path
    q: list[float] = field(default_factory=list)  # q(x | parent path)
    ranks: list[int] = field(default_factory=list)  # rank of the token among its parent's children
    expanded: list[bool] = field(default_factory=list)

    def add(self, token: int, parent: int, logq: float, rank: int) -> None:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(0 if parent < 0 else self.depths[parent] + 1)
        self.scores.append(logq + (self.scores[parent] if parent >= 0 else 0.0))
        self.q.append(math.exp(logq))
        self.ranks.append(rank)
        self.expanded.append(False)

    def ancestors(self, node: int) -> set[int]:
        found, node = set(), self.parents[node]
        while node >= 0:
            found.add(node)
            node = self.parents[node]
        return found


def _add_children(c: Candidates, logq: torch.Tensor, parents: list[int], vocab: torch.Tensor, branch: int) -> None:
    """Top-`branch` children of each parent row: logq [n, V_d] (log q, clamped <= 0 so c(child) <= c(parent))."""
    top = logq.clamp_max(0.0).topk(min(branch, logq.shape[-1]), dim=-1)
    ids = vocab[top.indices].tolist()
    for row, parent in enumerate(parents):
        for rank, (token, value) in enumerate(zip(ids[row], top.values[row].tolist(), strict=True)):
            c.add(token, parent, value, rank)


def grow_tree(
    first_logq: torch.Tensor,  # [V_d] log q after the root
    expand: Callable[[Candidates, list[int]], torch.Tensor],  # frontier node ids -> log q of children [n, V_d]
    vocab: torch.Tensor,  # [V_d] draft index -> token id
    branch: int,
    depth: int,
    eos: tuple[int, ...],
    keep: int | None = None,
) -> Candidates:
    """EAGLE-2 expansion: top-`branch` at depth 0, then `depth - 1` times expand the best `branch` frontier nodes.

    With `keep` (the rerank's total_tokens), only candidates that can be among the `keep` best are drafted: a node
    at depth d is kept only with its d ancestors and every level-mate and sibling that outscores it, so depth 0
    takes at most `keep` children, each further level at most `keep` - 1 frontier nodes with as many children,
    and levels stop where a child would need more ancestors than `keep` allows."""
    width = branch if keep is None else min(branch, keep)
    c = Candidates()
    _add_children(c, first_logq[None], [-1], vocab, width)
    level = list(range(len(c.tokens)))
    for level_depth in range(depth - 1):
        if keep is not None and level_depth + 2 > keep:  # a child here sits below level_depth + 1 ancestors
            break
        width = branch if keep is None else min(branch, keep - 1)
        open_nodes = [i for i in level if c.tokens[i] not in eos]
        frontier = sorted(open_nodes, key=lambda i: (-c.scores[i], i))[:width]
        if not frontier:
            break
        for node in frontier:
            c.expanded[node] = True
        first_child = len(c.tokens)
        _add_children(c, expand(c, frontier), frontier, vocab, width)
        level = list(range(first_child, len(c.tokens)))
    return c


def rerank(c: Candidates, total_tokens: int) -> list[int]:
    """EAGLE-2 reranking: the `total_tokens` candidates of highest c(x), parents before children.

    Ties go to the shallower node, and c(child) <= c(parent), so every kept node's parent is kept."""
    best = sorted(range(len(c.tokens)), key=lambda i: (-c.scores[i], c.depths[i], i))[:total_tokens]
    return sorted(best, key=lambda i: (c.depths[i], i))


@dataclass(frozen=True)
class TreeShape:
    """EAGLE-2's knobs: nodes kept after reranking, levels (head forwards), children per expanded node."""

    total_tokens: int = 16
    depth: int = 3
    branch: int = 8


class EagleProposer:
    """The head, its cache and the committed pairs it has not read yet."""

    name = "eagle"

    def __init__(self, head: EagleHead, shape: TreeShape) -> None:
        self.head, self.shape = head, shape
        self.feature_layers = tuple(getattr(head, "feature_layers", (-1,)))
        self.reads_prompt = bool(getattr(head, "reads_prompt", False))  # published heads: the whole prompt
        self.cache = EagleCache(head)
        self.forwards = 0
        self.pending: tuple[torch.Tensor, list[int], int] | None = None

    def accept(self, verified: Verified) -> None:
        self.pending = (verified.features, verified.tokens, verified.first_position)

    def propose(self, context: DraftContext) -> Draft:
        depth = min(self.shape.depth, self.shape.total_tokens, context.gamma)
        if depth <= 0 or self.pending is None:
            return Draft([])
        start, forwards = time.perf_counter(), self.forwards
        features, tokens, first = self.pending
        f_hat = self.cache.extend(features, tokens, first)  # the head reads the committed pairs
        self.forwards += 1
        c = self.grow(f_hat, first + len(tokens) - 1, depth, context.eos_token_ids)
        kept = rerank(c, self.shape.total_tokens)
        node = {candidate: i for i, candidate in enumerate(kept)}
        event = self.draft_event(context, c, kept, self.forwards - forwards, time.perf_counter() - start)
        return Draft(
            [c.tokens[i] for i in kept],
            [node.get(c.parents[i], -1) for i in kept],
            q_token=[c.q[i] for i in kept],
            ranks=[c.ranks[i] for i in kept],
            events=(event,),
        )

    def grow(self, f_hat: torch.Tensor, pair_position: int, depth: int, eos: tuple[int, ...]) -> Candidates:
        """Grow this round's candidate tree from f_hat (the head's prediction after the root)."""
        outputs: dict[int, torch.Tensor] = {-1: f_hat}

        def expand(c: Candidates, frontier: list[int]) -> torch.Tensor:
            features = torch.stack([outputs[c.parents[i]] for i in frontier])  # [n, H]
            positions = [pair_position + 1 + c.depths[i] for i in frontier]
            tokens = [c.tokens[i] for i in frontier]
            out = self.cache.tree_step(features, tokens, positions, frontier, [c.ancestors(i) for i in frontier])
            self.forwards += 1
            outputs.update(zip(frontier, out, strict=True))
            return self.head.logits(out).float().log_softmax(-1)  # [n, V_d]

        first = self.head.logits(f_hat).float().log_softmax(-1)
        return grow_tree(first, expand, self.head.vocab, self.shape.branch, depth, eos, self.shape.total_tokens)

    def draft_event(self, context: DraftContext, c: Candidates, kept: list[int], forwards: int, seconds: float):
        """The EagleDraft of a round: every candidate and where the rerank cut fell."""
        node_of = {candidate: node for node, candidate in enumerate(kept)}
        s, text = self.shape, context.text_of
        return EagleDraft(
            step=context.step, branch=s.branch, depth=s.depth, total_tokens=s.total_tokens,
            tokens=list(c.tokens), texts=[text(t) for t in c.tokens], parents=list(c.parents), depths=list(c.depths),
            scores=[round(x, 5) for x in c.scores], q=[round(x, 6) for x in c.q], ranks=list(c.ranks),
            expanded=list(c.expanded), kept=[node_of.get(i, -1) for i in range(len(c.tokens))],
            threshold=round(min((c.scores[i] for i in kept), default=0.0), 5), head_forwards=forwards,
            draft_s=round(seconds, 6),
        )  # fmt: skip

    def close(self) -> None:
        self.cache.reset()
        self.pending = None
