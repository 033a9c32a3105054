"""Tree attention: the parent-list -> (ancestors, depths, retrieve indices) builder, and exact tree verification.

The exactness tests run a tiny random Llama: every node's logits from one tree-masked forward must equal the
logits of running that node's root-to-node path as a plain chain after the same prefix (docs/architecture.md section 4).
"""

from __future__ import annotations

import pytest
import torch

from lab.engine import runtime
from lab.engine.tree_attention import build_tree_attention

PROMPT = [5, 17, 42, 99, 3, 250, 64]


def rows(retrieve: torch.Tensor) -> set[tuple[int, ...]]:
    return {tuple(row) for row in retrieve.tolist()}


def test_chain_tree() -> None:
    tree = build_tree_attention([-1, 0, 1, 2])
    assert tree.size == 4
    assert tree.ancestors.dtype == torch.bool
    assert torch.equal(tree.ancestors, torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    assert tree.depths.tolist() == [0, 1, 2, 3]
    assert tree.retrieve_indices.tolist() == [[0, 1, 2, 3]]
    assert tree.path_to(3) == [0, 1, 2, 3]
    assert tree.path_to(0) == [0]


def test_star_tree() -> None:
    tree = build_tree_attention([-1, 0, 0, 0])
    expected = torch.eye(4, dtype=torch.bool)
    expected[:, 0] = True
    assert torch.equal(tree.ancestors, expected)
    assert tree.depths.tolist() == [0, 1, 1, 1]
    assert rows(tree.retrieve_indices) == {(0, 1), (0, 2), (0, 3)}
    assert tree.retrieve_indices.shape == (3, 2)


def test_single_node_tree() -> None:
    tree = build_tree_attention([-1])
    assert tree.ancestors.tolist() == [[True]]
    assert tree.depths.tolist() == [0]
    assert tree.retrieve_indices.tolist() == [[0]]


def test_medusa_like_tree_with_several_roots() -> None:
    # Two top-1/top-2 candidates of head 1 (roots), children from head 2, one grandchild from head 3.
    parents = [-1, -1, 0, 0, 1, 2, -1]
    tree = build_tree_attention(parents)
    assert tree.depths.tolist() == [0, 0, 1, 1, 1, 2, 0]
    expected = torch.zeros(7, 7, dtype=torch.bool)
    visible = {0: [0], 1: [1], 2: [0, 2], 3: [0, 3], 4: [1, 4], 5: [0, 2, 5], 6: [6]}
    for node, seen in visible.items():
        expected[node, seen] = True
    assert torch.equal(tree.ancestors, expected)
    # One row per leaf (3, 4, 5, 6), root to leaf, -1 padded to max depth + 1 = 3 columns.
    assert tree.retrieve_indices.dtype == torch.long
    assert tree.retrieve_indices.shape == (4, 3)
    assert rows(tree.retrieve_indices) == {(0, 3, -1), (1, 4, -1), (0, 2, 5), (6, -1, -1)}
    # Siblings and cousins never see each other; roots see only themselves.
    assert not tree.ancestors[3, 2] and not tree.ancestors[4, 0] and not tree.ancestors[6, 0]


def test_retrieve_rows_are_root_to_leaf_paths() -> None:
    parents = [-1, 0, 0, 1, 1, 2, 4, -1, 7]
    tree = build_tree_attention(parents)
    leaves = {i for i in range(len(parents)) if i not in parents}
    seen_leaves = set()
    for row in tree.retrieve_indices.tolist():
        path = [i for i in row if i != -1]
        assert row[len(path) :] == [-1] * (len(row) - len(path))  # padding only at the end
        assert parents[path[0]] == -1
        for parent, child in zip(path[:-1], path[1:], strict=True):
            assert parents[child] == parent
        assert path[-1] in leaves
        seen_leaves.add(path[-1])
    assert seen_leaves == leaves


def test_attention_mask_layout() -> None:
    tree = build_tree_attention([-1, 0, 0, 1])
    mask = tree.attention_mask(5)
    assert mask.shape == (1, 1, 4, 9)
    assert mask.dtype == torch.bool
    assert mask[0, 0, :, :5].all()
    assert torch.equal(mask[0, 0, :, 5:], tree.ancestors)
    assert tree.attention_mask(0).shape == (1, 1, 4, 4)


@pytest.mark.parametrize(
    "parents",
    [[], [0], [-2], [-1, 1], [-1, 2, 0], [1, -1], [-1, 0, 5]],
    ids=["empty", "self-root", "below-minus-one", "self-parent", "forward-ref", "child-before-parent", "out-of-range"],
)
def test_invalid_parent_lists_raise(parents: list[int]) -> None:
    with pytest.raises(ValueError):
        build_tree_attention(parents)


def chain_logits(tiny, path_tokens: list[int]) -> torch.Tensor:
    """Logits after PROMPT + path_tokens, computed as a plain chain in a fresh state."""
    state, _ = runtime.prefill(tiny, PROMPT)
    return runtime.verify(state, path_tokens).logits[-1]


@pytest.mark.parametrize(
    "parents, tokens",
    [
        ([-1, 0, 1, 2], [10, 11, 12, 13]),
        ([-1, 0, 0, 1, 1, 2, 3], [10, 20, 21, 30, 31, 32, 40]),
        # several roots, repeated token ids in different branches
        ([-1, -1, 0, 0, 1, 2, -1, 6], [7, 8, 9, 7, 9, 7, 8, 8]),
    ],
    ids=["chain", "binary", "medusa-multi-root"],
)
def test_verify_tree_matches_each_path_run_as_a_chain(tiny, parents: list[int], tokens: list[int]) -> None:
    tree = build_tree_attention(parents)
    state, _ = runtime.prefill(tiny, PROMPT)
    out = runtime.verify_tree(state, tree, tokens)
    assert out.logits.shape == (len(parents), tiny.vocab_size)
    assert state.length == len(PROMPT) + len(parents)
    for node in range(len(parents)):
        path_tokens = [tokens[i] for i in tree.path_to(node)]
        expected = chain_logits(tiny, path_tokens)
        torch.testing.assert_close(out.logits[node], expected, atol=1e-5, rtol=0, msg=f"node {node}")


def test_verify_tree_differs_from_unmasked_chain(tiny) -> None:
    """Sanity check that the mask matters: a sibling's logits are not those of the flattened sequence."""
    tree = build_tree_attention([-1, 0, 0])
    tokens = [10, 20, 21]
    state, _ = runtime.prefill(tiny, PROMPT)
    tree_out = runtime.verify_tree(state, tree, tokens).logits
    flat = chain_logits(tiny, tokens)  # node 2 would also see node 1
    assert (tree_out[2] - flat).abs().max() > 1e-3
