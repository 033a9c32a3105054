"""Medusa drafting (Cai et al. 2024, Sec. 2.1.2): the K heads read h, the target's last feature at the root's
predecessor (the accepted path's last row), and the sparse candidate tree takes, at node (i_1, .., i_d), rank i_d
of head d's distribution (`lab.heads.medusa.MedusaHeads`, Eq. 1). The tree's shape is the tuned `choices`
(best path first), cut to `tree_nodes` paths and to the remaining budget (`prune_choices`). `tree_from_choices`
takes the distribution of each node's children from a `conditional`, so MTPC reuses it with its circuit's
conditionals. Children of an EOS node are dropped (the target stops there). Candidates are deterministic (top-k):
q is None and the sibling rule keeps sampling lossless.
Not covered: Medusa-2 (joint fine-tuning), pruning the tree at run time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lab.heads.medusa import MedusaHeads, Path
from lab.speculative.draft import Draft, DraftContext, Verified

Conditional = Callable[[tuple[int, ...]], torch.Tensor]  # parent's path (V_d indices, root first) -> probs [V_d]


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


def tree_from_choices(
    choices: list[Path], conditional: Conditional, vocab: torch.Tensor, eos_ids: tuple[int, ...] = ()
) -> Draft:
    """Materialise a choices tree: node (i_1..i_d) = rank i_d of `conditional(prefix)`, where prefix holds the
    draft-vocabulary indices of the tokens on the path to its parent. `choices` must list parents first."""
    index: dict[Path, int] = {}
    tokens, parents, ranks, q, prefixes = [], [], [], [], []
    tops: dict[int, tuple[list[float], list[int]]] = {}
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
            top = torch.topk(probs, min(widest[path[:-1]], probs.numel()))
            tops[parent] = (top.values.tolist(), top.indices.tolist())
        values, ids = tops[parent]
        if path[-1] >= len(ids):
            continue
        index[path] = len(tokens)
        tokens.append(int(vocab[ids[path[-1]]]))
        prefixes.append(prefix + (ids[path[-1]],))
        parents.append(parent)
        ranks.append(path[-1])
        q.append(values[path[-1]])
    return Draft(tokens, parents, q_token=q, ranks=ranks)


def head_top(probs: torch.Tensor, vocab: torch.Tensor, k: int = 8) -> tuple[list[list[int]], list[list[float]]]:
    """Top-k token ids and probabilities of each row of [K, V_d] (for the per-head heatmap)."""
    values, ids = torch.topk(probs, min(k, probs.shape[-1]), dim=-1)
    return vocab[ids].tolist(), [[round(v, 5) for v in row] for row in values.tolist()]


class MedusaProposer:
    """Medusa heads over the target's last feature; reads it from `accept` (feature_layers = the last)."""

    name = "medusa"
    feature_layers = (-1,)
    forwards = 0  # the heads run no forward of a model

    def __init__(self, heads: MedusaHeads, tree_nodes: int) -> None:
        self.heads, self.tree_nodes = heads, tree_nodes
        self.hidden: torch.Tensor | None = None

    def accept(self, verified: Verified) -> None:
        self.hidden = verified.features[-1]  # [H] the feature at the last accepted position

    def propose(self, context: DraftContext) -> Draft:
        probs = self.heads.probs(self.hidden)  # [K, V_d]
        choices = prune_choices(self.heads.choices, self.tree_nodes, context.gamma, self.heads.num_heads)
        draft = tree_from_choices(choices, lambda prefix: probs[len(prefix)], self.heads.vocab, context.eos_token_ids)
        top_ids, top_probs = head_top(probs, self.heads.vocab)
        return Draft(
            draft.tokens, draft.parents, q_token=draft.q_token, ranks=draft.ranks, top_ids=top_ids, top_probs=top_probs
        )

    def close(self) -> None:
        self.hidden = None
