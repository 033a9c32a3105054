"""Tree acceptance: the greedy walk and the lossless sibling-by-sibling sampling rule (vocabulary of 4)."""

from __future__ import annotations

import pytest
import torch

from lab.tree_accept import accept_tree, children_of
from tests.stats import assert_joint_matches

# root -> children tokens 1 (node 1) and 2 (node 2); node 1 -> child token 3 (node 3)
TOKENS, PARENTS = [0, 1, 2, 3], [-1, 0, 0, 1]


def one_hot(index: int) -> list[float]:
    return [1.0 if i == index else 0.0 for i in range(4)]


def test_children_must_follow_parents() -> None:
    assert children_of(PARENTS) == [[1, 2], [3], [], []]
    with pytest.raises(ValueError, match="parents must come before"):
        children_of([-1, 2, 0])


@pytest.mark.parametrize(
    ("rows", "path", "emitted", "source"),
    [
        ([one_hot(1), one_hot(3), one_hot(0), one_hot(2)], [0, 1, 3], [1, 3, 2], "bonus"),
        ([one_hot(2), one_hot(3), one_hot(1), one_hot(0)], [0, 2], [2, 1], "bonus"),
        ([one_hot(3), one_hot(3), one_hot(0), one_hot(0)], [0], [3], "recovered"),
        ([one_hot(1), one_hot(0), one_hot(0), one_hot(0)], [0, 1], [1, 0], "recovered"),
    ],
)
def test_greedy_walk_follows_the_argmax(rows, path, emitted, source) -> None:
    result = accept_tree(TOKENS, PARENTS, torch.tensor(rows), None, greedy=True)
    assert (result.path, result.tokens, result.source) == (path, emitted, source)
    assert result.next_token == emitted[-1]


def test_sampling_rule_reproduces_the_target_joint() -> None:
    """First two emitted tokens ~ p(x1) p(x2 | x1) whatever the tree offers (chi-square, 20k draws)."""
    generator = torch.Generator().manual_seed(3)
    p_root = torch.tensor([0.1, 0.4, 0.2, 0.3])
    p_after = {1: torch.tensor([0.5, 0.1, 0.1, 0.3]), 2: torch.tensor([0.25, 0.25, 0.25, 0.25])}
    # node 3 (token 3 after token 1): its row is the distribution after [1, 3]; only the first two tokens count
    rows = torch.stack([p_root, p_after[1], p_after[2], torch.tensor([0.7, 0.1, 0.1, 0.1])])
    # after token 0 or 3 the tree has no node, so the round ends with one token; after 1 or 2 a second follows
    pair_joint = torch.stack([p_root[1] * p_after[1], p_root[2] * p_after[2]])  # [2, 4]
    pairs, singles = [], torch.zeros(4)
    for _ in range(20000):
        tokens = accept_tree(TOKENS, PARENTS, rows, generator, greedy=False).tokens
        if len(tokens) == 1:
            singles[tokens[0]] += 1
        else:
            pairs.append((tokens[0], tokens[1]))
    assert singles[1] == 0 and singles[2] == 0  # an accepted node always gets a following token
    first = torch.tensor([singles[0], *(sum(1 for a, _ in pairs if a == t) for t in (1, 2)), singles[3]])
    assert torch.allclose(first / 20000, p_root, atol=0.015)
    assert_joint_matches([(a - 1, b) for a, b in pairs], pair_joint / pair_joint.sum())


def test_sampling_with_one_hot_target_never_fails() -> None:
    rows = torch.tensor([one_hot(2), one_hot(1), one_hot(0), one_hot(0)])
    result = accept_tree(TOKENS, PARENTS, rows, torch.Generator().manual_seed(0), greedy=False)
    assert result.path == [0, 2] and result.rejected == [1] and result.tokens == [2, 0]
