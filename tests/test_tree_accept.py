"""Tree acceptance (`lab.speculative.acceptance`): the greedy walk and the lossless sibling-by-sibling sampling rule
over a `Draft` with parents (vocabulary of 4). The root is not a node: rows of p are [root, node 0, node 1, ...]
and a path lists node indices. Distribution tests of whole tree rounds on tiny models: tests/test_deep_distribution.py.
"""

from __future__ import annotations

import pytest
import torch

from lab.speculative.acceptance import accept_greedy, accept_tree_sampled
from lab.speculative.draft import Draft
from tests.stats import assert_joint_matches

# root -> node 0 (token 1) and node 1 (token 2); node 0 -> node 2 (token 3)
DRAFT = Draft([1, 2, 3], [-1, -1, 0])


def one_hot(index: int) -> list[float]:
    return [1.0 if i == index else 0.0 for i in range(4)]


def test_children_must_follow_parents() -> None:
    assert [DRAFT.children(node) for node in (-1, 0, 1, 2)] == [[0, 1], [2], [], []]
    assert DRAFT.depths == [0, 0, 1] and not DRAFT.is_chain
    with pytest.raises(ValueError, match="a parent must be -1 or an earlier node"):
        Draft([1, 2], [1, -1])
    with pytest.raises(ValueError, match="a parent must be -1 or an earlier node"):
        Draft([1, 2], [-1, 1])  # its own parent


@pytest.mark.parametrize(
    ("rows", "path", "emitted", "source"),
    [
        ([one_hot(1), one_hot(3), one_hot(0), one_hot(2)], [0, 2], [1, 3, 2], "bonus"),
        ([one_hot(2), one_hot(3), one_hot(1), one_hot(0)], [1], [2, 1], "bonus"),
        ([one_hot(3), one_hot(3), one_hot(0), one_hot(0)], [], [3], "recovered"),
        ([one_hot(1), one_hot(0), one_hot(0), one_hot(0)], [0], [1, 0], "recovered"),
    ],
)
def test_greedy_walk_follows_the_argmax(rows, path, emitted, source) -> None:
    result = accept_greedy(DRAFT, torch.tensor(rows))
    assert (result.path, result.tokens, result.source) == (path, emitted, source)
    assert result.next_token == emitted[-1]


def test_sampling_rule_reproduces_the_target_joint() -> None:
    """First two emitted tokens ~ p(x1) p(x2 | x1) whatever the tree offers (chi-square, 20k draws)."""
    generator = torch.Generator().manual_seed(3)
    p_root = torch.tensor([0.1, 0.4, 0.2, 0.3])
    p_after = {1: torch.tensor([0.5, 0.1, 0.1, 0.3]), 2: torch.tensor([0.25, 0.25, 0.25, 0.25])}
    # node 2 (token 3 after token 1): its row is the distribution after [1, 3]; only the first two tokens count
    rows = torch.stack([p_root, p_after[1], p_after[2], torch.tensor([0.7, 0.1, 0.1, 0.1])])
    # after token 0 or 3 the tree has no node, so the round ends with one token; after 1 or 2 a second follows
    pair_joint = torch.stack([p_root[1] * p_after[1], p_root[2] * p_after[2]])  # [2, 4]
    pairs, singles = [], torch.zeros(4)
    for _ in range(20000):
        tokens = accept_tree_sampled(DRAFT, rows, generator).tokens
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
    result = accept_tree_sampled(DRAFT, rows, torch.Generator().manual_seed(0))
    assert result.path == [1] and result.rejected == [0] and result.tokens == [2, 0]
