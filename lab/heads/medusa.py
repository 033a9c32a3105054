"""Medusa heads (Cai et al. 2024, Sec. 2.1.1) and the sparse candidate tree they draft (Sec. 2.1.2).

Head k (k = 1..K) reads the base model's last hidden state h_t (after the final norm) and predicts token
x_{t+k+1}, k tokens beyond the base model's own next token x_{t+1}:
    p_t^(k) = softmax(W_lm[V_d] (h_t + SiLU(W_k h_t + b_k)))            (Cai et al. 2024, Eq. 1)
with W_k initialised to zero, so every head starts as the LM head itself.
Deliberate differences from the paper, to fit the lab's 25 MB budget and keep drafting cheap on a CPU:
- the output layer is the base model's frozen LM head, shared by all heads (Medusa trains a copy per head);
- it scores only V_d, a frequency-ranked draft vocabulary (FR-Spec / EAGLE-3 style, `lab.heads.common`);
  verification always scores the full vocabulary, so outputs stay exact.
The candidate tree is given by `choices`, a list of paths like Medusa's `medusa_choices`: path (i_1, .., i_d)
is a node at depth d whose token is rank i_d of head d, under the node of path (i_1, .., i_{d-1}).
`tune_choices` orders paths by their estimated acceptance probability, prod_j acc_j[i_j] (Medusa's greedy tree
construction, Sec. 3.3.2 / App. C), so the first N paths of the list are the best N-node tree.
Not covered: Medusa-2 (joint fine-tuning of the base model), per-head LM-head copies, tree pruning at run time.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

Path = tuple[int, ...]


def residual_blocks(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """u_k = h + SiLU(W_k h + b_k) for every head k at once: h [N, H], weight [K, H, H], bias [K, H] -> [N, K, H]."""
    return h[:, None, :] + F.silu(torch.einsum("nh,kgh->nkg", h, weight) + bias)


@dataclass
class MedusaHeads:
    """Trained Medusa heads bound to a base model's LM-head rows V_d (float32, inference only)."""

    weight: torch.Tensor  # [K, H, H]
    bias: torch.Tensor  # [K, H]
    vocab: torch.Tensor  # [V_d] long, draft-vocabulary id -> model token id
    lm_weight: torch.Tensor  # [V_d, H] rows of the frozen LM head
    choices: list[Path] = field(default_factory=list)

    @property
    def num_heads(self) -> int:
        return int(self.weight.shape[0])

    @classmethod
    def from_tensors(cls, lm_head_weight: torch.Tensor, tensors: dict, config: dict) -> MedusaHeads:
        vocab = tensors["vocab"].long()
        lm_weight = lm_head_weight.detach().float().index_select(0, vocab.to(lm_head_weight.device))
        choices = [tuple(int(i) for i in path) for path in config.get("choices", [])]
        return cls(tensors["blocks.weight"].float(), tensors["blocks.bias"].float(), vocab, lm_weight, choices)

    @torch.inference_mode()
    def probs(self, h: torch.Tensor) -> torch.Tensor:
        """p^(k) over V_d for each head: h [H] -> [K, V_d]."""
        u = residual_blocks(h.float()[None], self.weight, self.bias)[0]  # [K, H]
        return torch.softmax(u @ self.lm_weight.T, dim=-1)  # [K, V_d]


@dataclass(frozen=True)
class DraftTree:
    """A candidate tree below the root (the last committed token). Node i: tokens[i] (model ids), parents[i]
    (-1 = child of the root), depths[i], heads[i] (the head / draft position that proposed it), ranks[i] and
    q[i] (its probability under the drafter's distribution at that node)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    heads: list[int]
    ranks: list[int]
    q: list[float]
    head_top: tuple[list[list[int]], list[list[float]]] = ([], [])  # per draft position: top ids and probs
    q_rows: torch.Tensor | None = None  # [n, V] the distribution each node was drawn from (sampled chains)

    @property
    def size(self) -> int:
        return len(self.tokens)


def prune_choices(choices: list[Path], max_nodes: int, max_depth: int, num_heads: int) -> list[Path]:
    """The first `max_nodes` paths that fit the depth budget and the head count, parents kept before children."""
    kept: list[Path] = []
    present = set()
    for path in choices:
        if len(kept) >= max_nodes:
            break
        if len(path) > min(max_depth, num_heads) or (len(path) > 1 and path[:-1] not in present):
            continue
        kept.append(path)
        present.add(path)
    return sorted(kept, key=lambda p: (len(p), p))


Conditional = Callable[[tuple[int, ...]], torch.Tensor]  # parent's path (V_d indices, root first) -> probs [V_d]


def tree_from_choices(
    choices: list[Path], conditional: Conditional, vocab: torch.Tensor, eos_ids: tuple[int, ...] = ()
) -> DraftTree:
    """Materialise a choices tree: node (i_1..i_d) = rank i_d of `conditional(prefix)`, where prefix holds the
    draft-vocabulary indices of the tokens on the path to its parent.

    Medusa's conditional only looks at len(prefix) (independent heads); MTPC's conditions on the prefix.
    Children of an EOS node are dropped (the target stops there). `choices` must list parents first.
    """
    index: dict[Path, int] = {}
    tokens, parents, depths, ranks, q, prefixes = [], [], [], [], [], []
    tops: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    widest: dict[Path, int] = {}
    for path in choices:
        widest[path[:-1]] = max(widest.get(path[:-1], 0), path[-1] + 1)
    for path in choices:
        parent = index.get(path[:-1], -1) if len(path) > 1 else -1
        if len(path) > 1 and (path[:-1] not in index or tokens[parent] in eos_ids):
            continue
        prefix = prefixes[parent] if parent >= 0 else ()
        if parent not in tops:
            probs = conditional(prefix)  # [V_d]
            tops[parent] = torch.topk(probs, min(widest[path[:-1]], probs.numel()))
        values, ids = tops[parent]
        if path[-1] >= ids.numel():
            continue
        index[path] = len(tokens)
        tokens.append(int(vocab[ids[path[-1]]]))
        prefixes.append(prefix + (int(ids[path[-1]]),))
        parents.append(parent)
        depths.append(len(path) - 1)
        ranks.append(path[-1])
        q.append(float(values[path[-1]]))
    return DraftTree(tokens, parents, depths, list(depths), ranks, q)


def head_top(probs: torch.Tensor, vocab: torch.Tensor, k: int = 8) -> tuple[list[list[int]], list[list[float]]]:
    """Top-k token ids and probabilities of each row of [K, V_d] (for the per-head heatmap)."""
    values, ids = torch.topk(probs, min(k, probs.shape[-1]), dim=-1)
    return vocab[ids].tolist(), [[round(v, 5) for v in row] for row in values.tolist()]


def tune_choices(accuracy: list[list[float]], max_nodes: int = 64) -> list[Path]:
    """Medusa's tree construction: best-first over paths by estimated acceptance prod_j accuracy[j][i_j].

    accuracy[d][i] = P(the rank-i token of draft position d is the target's token | the prefix was right),
    measured on held-out data. The result lists paths best first; any prefix of it is a valid tree.
    """
    heap: list[tuple[float, Path]] = [(-accuracy[0][0], (0,))]
    chosen: list[Path] = []
    seen = {(0,)}
    while heap and len(chosen) < max_nodes:
        negative, path = heapq.heappop(heap)
        chosen.append(path)
        score = -negative
        depth = len(path) - 1
        candidates = [path[:-1] + (path[-1] + 1,)]  # next sibling
        if depth + 1 < len(accuracy):
            candidates.append(path + (0,))  # first child
        for nxt in candidates:
            d, rank = len(nxt) - 1, nxt[-1]
            if nxt in seen or rank >= len(accuracy[d]):
                continue
            parent_score = score if len(nxt) > len(path) else score / max(accuracy[depth][path[-1]], 1e-12)
            seen.add(nxt)
            heapq.heappush(heap, (-parent_score * accuracy[d][rank], nxt))
    return chosen


def rank_accuracy(ranks: torch.Tensor, max_rank: int) -> list[float]:
    """Share of rows whose true token has rank i (i < max_rank) in the drafter's distribution. ranks: [N]."""
    counts = torch.bincount(ranks.clamp(max=max_rank), minlength=max_rank + 1)[:max_rank].float()
    return [round(v, 5) for v in (counts / max(ranks.numel(), 1)).tolist()]
