"""Tree attention for draft trees (Medusa, EAGLE, MTPC share it; docs/architecture.md section 4).

A tree is a parent list: `parents[i]` is the index of node i's parent, or -1 when node i hangs directly off the
last committed token. Parents come before children (parents[i] < i). From it we build, once:
- the ancestor matrix (node i sees node j iff j is i or an ancestor of i), which becomes the boolean 4D mask
  [1, 1, N, n_past + N] with all prefix columns True;
- the depth of each node (position id = n_past + depth);
- the retrieve indices: one row per leaf listing the node indices from the root to that leaf, padded with -1.
Pure torch, CPU tensors; callers move them to the model's device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TreeAttention:
    parents: tuple[int, ...]
    ancestors: torch.Tensor  # [N, N] bool, row i = nodes visible from node i (itself included)
    depths: torch.Tensor  # [N] long, 0 for nodes whose parent is the committed prefix
    retrieve_indices: torch.Tensor  # [leaves, max_depth + 1] long, root-to-leaf node indices, -1 padded

    @property
    def size(self) -> int:
        return len(self.parents)

    def attention_mask(self, n_past: int) -> torch.Tensor:
        """Boolean mask [1, 1, N, n_past + N]: every node sees the whole prefix and its own ancestors."""
        prefix = torch.ones(self.size, n_past, dtype=torch.bool)
        return torch.cat([prefix, self.ancestors], dim=1)[None, None]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root down to `node`."""
        path = []
        while node != -1:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


def build_tree_attention(parents: list[int]) -> TreeAttention:
    """Mask, depths and retrieve indices of a draft tree given by its parent list."""
    n = len(parents)
    if n == 0:
        raise ValueError("a draft tree needs at least one node")
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"parents[{i}] = {parent}: a parent must be -1 or an earlier node")
    seen: list[list[int]] = []  # per node: its ancestors and itself, root side first (plain lists: every verify
    depth: list[int] = []  # round builds a tree, and tensor indexing element by element was most of its cost)
    for i, parent in enumerate(parents):
        seen.append((seen[parent] if parent >= 0 else []) + [i])
        depth.append(len(seen[i]) - 1)
    ancestors = torch.zeros(n, n, dtype=torch.bool)
    rows = [i for i, path in enumerate(seen) for _ in path]
    ancestors[rows, [j for path in seen for j in path]] = True
    has_child = set(p for p in parents if p >= 0)
    leaves = [i for i in range(n) if i not in has_child]
    width = max(depth) + 1
    retrieve = torch.tensor([seen[leaf] + [-1] * (width - len(seen[leaf])) for leaf in leaves], dtype=torch.long)
    return TreeAttention(tuple(parents), ancestors, torch.tensor(depth, dtype=torch.long), retrieve)
