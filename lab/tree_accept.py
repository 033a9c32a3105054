"""Acceptance over a draft tree: which root-to-node path the target keeps, and the token that follows it.

Node 0 is the root: the last token already emitted (its logits come from this round's verify forward, like x_0
in chain verification); nodes 1.. are draft tokens whose parents come before them. `target_probs[i]` is the
target's distribution of the token following node i (after the processors, from `verify_tree`).

- Greedy (Medusa / EAGLE greedy; exact): from the root, move to the child whose token is argmax p(. | node);
  stop when no child matches and emit that argmax (recovered if the node had children, bonus at a leaf).
- Sampling (lossless; EAGLE-2 / SpecInfer multi-draft rule with deterministic candidates, i.e. q = one-hot):
  at the current node with distribution p, try its children in order: accept child x with probability p(x);
  on rejection set p(x) = 0 and renormalise; if every child is rejected, sample the next token from what is
  left. Each step outputs exactly a draw from p (Miao et al. 2024, SpecInfer, Alg. 2 with one-hot drafts;
  Li et al. 2024, EAGLE-2 evaluate_posterior), so the output distribution is the target's.
Not covered: stochastic drafts with q != one-hot over a tree (chain drafts with q use `lab.sampling.accept_draft`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TreeAcceptance:
    path: list[int]  # accepted node indices, root (0) first
    tokens: list[int]  # emitted this round: the draft tokens of path[1:], then next_token
    next_token: int  # the target's token after the path
    source: str  # "bonus" when the path ends at a leaf, else "recovered"
    rejected: list[int]  # children tried and rejected, in the order tried


def children_of(parents: list[int]) -> list[list[int]]:
    """Child lists per node, in node order (parents[0] of the root is ignored)."""
    children: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents[1:], start=1):
        if not 0 <= parent < node:
            raise ValueError(f"node {node} has parent {parent}; parents must come before their children")
        children[parent].append(node)
    return children


def accept_tree(
    tokens: list[int],
    parents: list[int],
    target_probs: torch.Tensor,  # [n_nodes, V]
    generator: torch.Generator | None,
    greedy: bool,
) -> TreeAcceptance:
    """Walk the tree from the root with the greedy or the lossless sampling rule (module docstring)."""
    children = children_of(parents)
    path, rejected, node = [0], [], 0
    while True:
        p = target_probs[node].float()
        chosen = None
        if greedy:
            best = int(torch.argmax(p))
            chosen = next((c for c in children[node] if tokens[c] == best), None)
            next_token = best
        else:
            for child in children[node]:
                x = tokens[child]
                u = torch.rand((), generator=generator, device=p.device)
                if float(u) < float(p[x]):
                    chosen = child
                    break
                rejected.append(child)
                p = p.clone()
                p[x] = 0.0
                total = p.sum()
                if float(total) <= 1e-12:  # float rounding only: p was one-hot on x, so x is the draw
                    chosen = child
                    rejected.pop()
                    break
                p = p / total
            next_token = -1
        if chosen is None:
            if not greedy:
                next_token = int(torch.multinomial(p, 1, generator=generator))
            source = "recovered" if children[node] else "bonus"
            emitted = [tokens[n] for n in path[1:]] + [next_token]
            return TreeAcceptance(path, emitted, next_token, source, rejected)
        path.append(chosen)
        node = chosen
