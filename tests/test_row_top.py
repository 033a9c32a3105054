"""The top tokens of logit rows (`lab.engine.sampling.top_tokens`, lab/engine/native/row_top.cpp): every variant
of the op and the ATen fallback give a stable descending sort's first k (NaN first, equal logits by id), so the
first id is torch.argmax's; a greedy round's one-hot trace detail equals the dense computation's."""

from __future__ import annotations

import pytest
import torch

from lab.engine import native_forward, sampling
from lab.engine.sampling import SamplingConfig, top_tokens
from lab.speculative.draft import Draft
from lab.speculative.events import _dense_detail, _one_hot_detail

needs_op = pytest.mark.skipif(not native_forward.build(), reason="no C++ compiler: the ATen fallback runs")
GREEDY = SamplingConfig(temperature=0.0)


def _rows(seed: int, r: int, v: int) -> torch.Tensor:
    """Small integers (many ties), some NaNs and infinities."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(-4, 4, (r, v), generator=g).float()
    rows[torch.rand(r, v, generator=g) < 0.03] = float("nan")
    rows[torch.rand(r, v, generator=g) < 0.03] = float("inf")
    rows[torch.rand(r, v, generator=g) < 0.03] = float("-inf")
    return rows


def _sorted_first(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = torch.sort(rows, dim=-1, descending=True, stable=True)
    return ids[:, :k], values[:, :k]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.nan_to_num(0.5), b.nan_to_num(0.5)) and torch.equal(a.isnan(), b.isnan())


def _variants() -> list[int]:
    return [v for v in torch.ops.decoding_lab.lowbit_variants() if v in (0, 1, 2)]  # plain, AVX2, AVX-512


@needs_op
@pytest.mark.parametrize("v", [1, 7, 16, 17, 100, 49152])
def test_every_variant_is_a_stable_descending_sort(v: int) -> None:
    assert 0 in _variants()
    for seed in range(6):
        rows = _rows(seed * 1000 + v, 3, v)
        if seed == 0:
            rows[1] = float("nan")  # a row of NaNs: the first k ids
            rows[2] = 1.0  # a constant row
        for k in sorted({1, min(8, v), v}):
            ids, values = _sorted_first(rows, k)
            for variant in _variants():
                got_ids, got_values = torch.ops.decoding_lab.row_top(rows, k, variant)
                assert torch.equal(got_ids, ids), (seed, k, variant)
                assert _same(got_values, values), (seed, k, variant)
                assert torch.equal(got_ids[:, 0], rows.argmax(-1))


@needs_op
def test_the_op_rejects_what_it_cannot_rank() -> None:
    with pytest.raises(RuntimeError, match="k = 9"):
        torch.ops.decoding_lab.row_top(torch.zeros(2, 8), 9)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.decoding_lab.row_top(torch.zeros(2, 8, dtype=torch.bfloat16), 2)
    with pytest.raises(RuntimeError, match="variant"):
        torch.ops.decoding_lab.row_top(torch.zeros(2, 8), 2, 4)


@pytest.mark.parametrize("native", [True, False])
def test_top_tokens_with_and_without_the_op(monkeypatch, native: bool) -> None:
    if native and not native_forward.build():
        pytest.skip("no C++ compiler")
    monkeypatch.setattr(sampling.native_forward, "available", lambda: native)
    for seed in range(8):
        rows = _rows(seed, 4, 300)
        if seed == 0:
            rows[0, :] = 2.0  # more than k tied at the k-th value
            rows[1, :] = float("-inf")  # three finite values, then a tie of the rest (top-k filtering)
            rows[1, [7, 90, 250]] = torch.tensor([1.0, 3.0, 1.0])
            rows[2, :] = float("nan")  # a NaN k-th
        ids, values = _sorted_first(rows, 8)
        top = top_tokens(rows, 8)
        assert torch.equal(top.ids, ids) and _same(top.logits, values)
        assert torch.equal(top_tokens(rows.reshape(2, 2, 300), 8).ids, ids)  # leading dims flattened
    distinct = torch.randn(3, 300, generator=torch.Generator().manual_seed(1))
    distinct[0, [20, 10]] = 9.0  # a tie inside the top k only
    assert torch.equal(top_tokens(distinct, 8).ids, _sorted_first(distinct, 8)[0])
    assert torch.equal(top_tokens(distinct, 1).ids[:, 0], distinct.argmax(-1))
    one = top_tokens(torch.tensor([0.5, 2.0, 2.0, -1.0]), 3)  # one row [V]; k above V is cut to V below
    assert one.ids.tolist() == [[1, 2, 0]]
    assert top_tokens(torch.tensor([[0.5, 2.0]]), 5).ids.tolist() == [[1, 0]]


def test_choose_token_and_the_greedy_distribution_follow_argmax() -> None:
    rows = _rows(3, 5, 64)
    assert [sampling.choose_token(row, GREEDY, torch.Generator()) for row in rows] == rows.argmax(-1).tolist()
    one_hot = sampling.target_distribution(rows, GREEDY)
    assert torch.equal(one_hot.argmax(-1), rows.argmax(-1)) and torch.equal(one_hot.sum(-1), torch.ones(5))
    assert torch.equal(sampling.target_distribution(rows[0], GREEDY), one_hot[0])
    assert torch.equal(sampling.target_distribution(rows[:4].reshape(2, 2, 64), GREEDY), one_hot[:4].reshape(2, 2, 64))


def test_a_greedy_rounds_one_hot_detail_equals_the_dense_one() -> None:
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        n, vocab = 1 + trial % 6, 50
        processed = torch.randn(n + 1, vocab, generator=g)
        best = processed.argmax(-1).tolist()
        tokens = [best[i] if (trial + i) % 3 else int(torch.randint(vocab, (1,), generator=g)) for i in range(n)]
        draft = Draft(tokens)
        assert _one_hot_detail(draft, processed) == _dense_detail(draft, processed, GREEDY)
