"""Logits processors (table tests on 4-token distributions), seeding, and the speculative acceptance rule.

The distribution tests check Leviathan et al. 2023, Alg. 1 by a chi-square goodness-of-fit test over many
seeded draws on a 5-token vocabulary: whatever q the drafter uses, the emitted token is distributed as p.
"""

from __future__ import annotations

import math

import pytest
import torch

from lab.engine.sampling import (
    SamplingConfig,
    apply_min_p,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    choose_token,
    process_logits,
    sample,
    target_distribution,
)
from lab.speculative.acceptance import accept_chain

INF = float("-inf")
PROBS_4 = torch.tensor([0.1, 0.2, 0.3, 0.4])
LOGITS_4 = PROBS_4.log()

# Upper 0.1% points of the chi-square distribution (p = 0.001), by degrees of freedom.
CHI2_CRITICAL_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def kept(logits: torch.Tensor) -> list[bool]:
    return (logits != INF).tolist()


# --- processors: table tests -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "temperature, expected",
    [(1.0, [1.0, 2.0, 3.0, 4.0]), (2.0, [0.5, 1.0, 1.5, 2.0]), (0.5, [2.0, 4.0, 6.0, 8.0])],
)
def test_temperature(temperature: float, expected: list[float]) -> None:
    out = apply_temperature(torch.tensor([1.0, 2.0, 3.0, 4.0]), temperature)
    assert out.tolist() == expected


@pytest.mark.parametrize(
    "logits, k, expected",
    [
        ([1.0, 3.0, 2.0, 4.0], 2, [INF, 3.0, INF, 4.0]),
        ([1.0, 3.0, 2.0, 4.0], 1, [INF, INF, INF, 4.0]),
        ([1.0, 3.0, 2.0, 4.0], 0, [1.0, 3.0, 2.0, 4.0]),
        ([1.0, 3.0, 2.0, 4.0], 4, [1.0, 3.0, 2.0, 4.0]),
        ([1.0, 3.0, 2.0, 4.0], 10, [1.0, 3.0, 2.0, 4.0]),
        ([1.0, 3.0, 3.0, 0.0], 2, [INF, 3.0, 3.0, INF]),  # exact tie at the k-th value
        ([3.0, 3.0, 3.0, 1.0], 1, [3.0, 3.0, 3.0, INF]),  # ties at the k-th value are all kept (as in HF)
        ([2.0, 5.0, 2.0, 1.0], 2, [2.0, 5.0, 2.0, INF]),
    ],
)
def test_top_k(logits: list[float], k: int, expected: list[float]) -> None:
    assert apply_top_k(torch.tensor(logits), k).tolist() == expected


@pytest.mark.parametrize(
    "top_p, expected_kept",
    [
        (1.0, [True, True, True, True]),
        (0.95, [True, True, True, True]),  # 0.9 < 0.95: all four needed
        (0.75, [False, True, True, True]),  # {0.4, 0.3, 0.2} = 0.9 >= 0.75; {0.4, 0.3} = 0.7 is not enough
        (0.65, [False, False, True, True]),  # {0.4, 0.3} = 0.7 >= 0.65
        (0.35, [False, False, False, True]),  # {0.4} alone suffices
        (0.05, [False, False, False, True]),  # the most likely token is always kept
    ],
)
def test_top_p(top_p: float, expected_kept: list[bool]) -> None:
    out = apply_top_p(LOGITS_4, top_p)
    assert kept(out) == expected_kept
    assert torch.equal(out[out != INF], LOGITS_4[out != INF])  # survivors unchanged


def test_top_p_with_unsorted_logits() -> None:
    logits = torch.tensor([0.4, 0.1, 0.3, 0.2]).log()
    assert kept(apply_top_p(logits, 0.65)) == [True, False, True, False]


@pytest.mark.parametrize(
    "min_p, expected_kept",
    [
        (0.0, [True, True, True, True]),
        (0.3, [False, True, True, True]),  # threshold 0.12
        (0.6, [False, False, True, True]),  # threshold 0.24
        (0.9, [False, False, False, True]),  # threshold 0.36
        (1.0, [False, False, False, True]),  # threshold 0.4: only the maximum survives
    ],
)
def test_min_p(min_p: float, expected_kept: list[bool]) -> None:
    out = apply_min_p(LOGITS_4, min_p)
    assert kept(out) == expected_kept
    assert torch.equal(out[out != INF], LOGITS_4[out != INF])


@pytest.mark.parametrize(
    "previous, penalty, expected",
    [
        ([0, 1, 1], 2.0, [1.0, -4.0, 1.0, -1.0]),  # positive / 2, negative * 2, each seen token once
        ([2, 3], 2.0, [2.0, -2.0, 0.5, -2.0]),
        ([0, 1, 2, 3], 1.0, [2.0, -2.0, 1.0, -1.0]),  # penalty 1 = off
        ([], 1.5, [2.0, -2.0, 1.0, -1.0]),  # nothing seen
        ([1, 3], 0.5, [2.0, -1.0, 1.0, -0.5]),  # penalty < 1 encourages repetition
    ],
)
def test_repetition_penalty(previous: list[int], penalty: float, expected: list[float]) -> None:
    out = apply_repetition_penalty(torch.tensor([2.0, -2.0, 1.0, -1.0]), previous, penalty)
    assert out.tolist() == expected


def test_repetition_penalty_zero_logit_stays_zero() -> None:
    assert apply_repetition_penalty(torch.tensor([0.0, 1.0, 2.0, 3.0]), [0], 3.0).tolist() == [0.0, 1.0, 2.0, 3.0]


def test_process_logits_chain_in_hf_order() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    config = SamplingConfig(temperature=0.5, top_k=3, repetition_penalty=2.0)
    # penalty on token 0: 2 -> 1; temperature 0.5: [2, -8, 2, 1]; top-3 drops -8
    assert process_logits(logits, config, [0]).tolist() == [2.0, INF, 2.0, 1.0]


def test_process_logits_greedy_only_applies_repetition_penalty() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    config = SamplingConfig(temperature=0.0, top_k=1, top_p=0.1, repetition_penalty=4.0)
    assert process_logits(logits, config, [0]).tolist() == [0.5, -2.0, 1.0, 0.5]


def test_processors_never_modify_inputs() -> None:
    logits = torch.tensor([[0.3, -1.2, 2.5, 0.0], [1.0, 1.0, -3.0, 0.2]])
    before = logits.clone()
    for out in (
        apply_repetition_penalty(logits, [0, 2], 1.7),
        apply_temperature(logits, 0.7),
        apply_top_k(logits, 2),
        apply_top_p(logits, 0.5),
        apply_min_p(logits, 0.3),
        process_logits(logits[0], SamplingConfig(0.7, 2, 0.9, 0.05, 1.3), [1, 2]),
        target_distribution(logits[0], SamplingConfig(temperature=0.0)),
        target_distribution(logits[0], SamplingConfig()),
    ):
        assert out is not None
        assert torch.equal(logits, before)
    probs = PROBS_4.clone()
    sample(probs, gen())
    choose_token(LOGITS_4, SamplingConfig(), gen())
    assert torch.equal(probs, PROBS_4)


def test_sampling_functions_never_modify_acceptance_inputs() -> None:
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25], [0.4, 0.3, 0.2, 0.1]])
    q = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]])
    p0, q0 = p.clone(), q.clone()
    for seed in range(20):
        accept_chain(p, q, [0, 3], gen(seed))
        accept_chain(p, None, [0, 3], gen(seed))
    assert torch.equal(p, p0) and torch.equal(q, q0)


# --- SamplingConfig ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"top_k": -1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_p": -0.2},
        {"min_p": -0.1},
        {"min_p": 1.1},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": -1.0},
    ],
)
def test_sampling_config_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": math.nan}, {"repetition_penalty": math.nan}, {"min_p": math.nan}, {"top_p": math.nan}],
)
def test_sampling_config_rejects_nan(kwargs: dict) -> None:
    """NaN passes a check written as `x < 0` and later poisons every logit (multinomial then raises)."""
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingConfig(**kwargs)


def test_sampling_config_defaults_and_greedy_flag() -> None:
    config = SamplingConfig()
    assert (config.temperature, config.top_k, config.top_p, config.min_p, config.repetition_penalty) == (
        1.0,
        0,
        1.0,
        0.0,
        1.0,
    )
    assert not config.greedy
    assert SamplingConfig(temperature=0.0).greedy


# --- seeds -------------------------------------------------------------------------------------------------


def draws(seed: int, n: int = 64) -> list[int]:
    generator = gen(seed)
    uniform = torch.full((4,), 0.25)
    return [sample(uniform, generator) for _ in range(n)]


def test_same_seed_same_draws() -> None:
    assert draws(1234) == draws(1234)


def test_different_seeds_differ() -> None:
    assert draws(1) != draws(2)
    assert len(set(draws(3))) == 4


def test_choose_token_with_same_seed_is_reproducible() -> None:
    config = SamplingConfig(temperature=1.3, top_k=3)
    logits = torch.tensor([0.2, 1.5, -0.3, 0.9, 0.0])
    first = [choose_token(process_logits(logits, config, []), config, g) for g in [gen(7)] for _ in range(30)]
    second = [choose_token(process_logits(logits, config, []), config, g) for g in [gen(7)] for _ in range(30)]
    assert first == second
    assert set(first) <= {0, 1, 3}  # top-3 tokens only


def test_temperature_zero_is_argmax_independent_of_generator() -> None:
    config = SamplingConfig(temperature=0.0)
    logits = torch.tensor([0.2, 1.5, -0.3, 1.49])
    for seed in range(5):
        generator = gen(seed)
        state = generator.get_state()
        assert choose_token(process_logits(logits, config, []), config, generator) == 1
        assert torch.equal(generator.get_state(), state)  # no random draw consumed


def test_sample_never_draws_zero_probability_tokens() -> None:
    probs = torch.tensor([0.0, 0.5, 0.0, 0.5])
    generator = gen(0)
    assert {sample(probs, generator) for _ in range(200)} == {1, 3}


# --- accept_chain: structure -------------------------------------------------------------------------------


def test_all_accepted_sets_bonus() -> None:
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.0, 0.0, 1.0, 0.0]])
    result = accept_chain(p, p[:2].clone(), [3, 0], gen(0))  # q = p: ratio 1, never rejected
    assert result.accepted == [3, 0]
    assert result.recovered is None
    assert result.bonus == 2  # p_gamma is one-hot at 2
    assert result.tokens == [3, 0, 2]
    assert result.ratios == [1.0, 1.0]
    assert len(result.uniforms) == 2
    assert all(0.0 <= u < 1.0 for u in result.uniforms)


def test_rejection_sets_recovered() -> None:
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    for seed in range(10):
        result = accept_chain(p, None, [3], gen(seed))  # p(x) = 0: always rejected
        assert result.accepted == []
        assert result.bonus is None
        assert result.recovered in (1, 2)
        assert result.tokens == [result.recovered]
        assert result.ratios == [0.0]


def test_rejection_in_the_middle() -> None:
    p = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.5, 0.0, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    result = accept_chain(p, q, [1, 1], gen(3))
    assert result.accepted == [1]
    assert result.recovered in (0, 2)
    assert result.bonus is None
    assert result.tokens == [1, result.recovered]
    assert result.ratios == [1.0, 0.0]
    assert len(result.uniforms) == 2


def test_empty_draft_is_a_bonus_from_p0() -> None:
    result = accept_chain(torch.tensor([[0.0, 0.0, 1.0, 0.0]]), None, [], gen(0))
    assert result.accepted == [] and result.recovered is None and result.bonus == 2
    assert result.tokens == [2]


def test_ratio_is_p_over_q() -> None:
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.4, 0.3, 0.2]])
    result = accept_chain(p, q, [1], gen(0))
    assert result.ratios == [pytest.approx(0.5)]
    if result.accepted:
        assert result.uniforms[0] < 0.5
    else:
        assert result.uniforms[0] >= 0.5 and result.recovered == 3  # residual max(0, p - q) is one-hot at 3


def test_wrong_number_of_target_rows_raises() -> None:
    p = torch.full((2, 4), 0.25)
    with pytest.raises(ValueError, match="gamma"):
        accept_chain(p, None, [0, 1, 2], gen(0))


@pytest.mark.parametrize("seed", range(5))
def test_greedy_target_accepts_iff_draft_is_argmax(seed: int) -> None:
    logits = torch.tensor([[0.3, 2.0, -1.0, 0.5], [1.0, 0.0, 3.0, 0.0]])
    p = target_distribution(logits, SamplingConfig(temperature=0.0))  # [2, V] one-hot
    assert p.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]
    right = accept_chain(p, None, [1], gen(seed))
    assert right.accepted == [1] and right.bonus == 2 and right.tokens == [1, 2]
    for wrong_token in (0, 2, 3):
        wrong = accept_chain(p, None, [wrong_token], gen(seed))
        assert wrong.accepted == [] and wrong.recovered == 1 and wrong.tokens == [1]


# --- accept_chain: distributions (chi-square) --------------------------------------------------------------


def chi_square(counts: list[int], probs: list[float]) -> tuple[float, int]:
    """Pearson's statistic over the categories with positive probability, and its degrees of freedom."""
    n = sum(counts)
    for count, prob in zip(counts, probs, strict=True):
        if prob == 0:
            assert count == 0, f"a token of probability 0 was emitted {count} times"
    pairs = [(count, prob * n) for count, prob in zip(counts, probs, strict=True) if prob > 0]
    return sum((observed - expected) ** 2 / expected for observed, expected in pairs), len(pairs) - 1


def assert_distributed_as(tokens: list[int], probs: torch.Tensor) -> None:
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).tolist()
    statistic, dof = chi_square(counts, probs.tolist())
    assert statistic < CHI2_CRITICAL_001[dof], f"chi2 = {statistic:.1f} (dof {dof}); counts {counts} vs p {probs}"


def run_rounds(p: torch.Tensor, q: torch.Tensor | None, n: int, seed: int, fixed_draft: list[int] | None = None):
    """n acceptance rounds; draft tokens drawn from q with the same explicit generator (or fixed)."""
    generator = gen(seed)
    results = []
    for _ in range(n):
        draft = fixed_draft if fixed_draft is not None else [sample(row, generator) for row in q]
        results.append(accept_chain(p, q, draft, generator))
    return results


P5 = torch.tensor([0.1, 0.25, 0.3, 0.05, 0.3])
N_DRAWS = 20_000


def test_chi_square_detects_a_wrong_distribution() -> None:
    """The check can fail: draws from q are not accepted as draws from p."""
    q = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2])
    tokens = torch.multinomial(q, N_DRAWS, replacement=True, generator=gen(0)).tolist()
    counts = torch.bincount(torch.tensor(tokens), minlength=5).tolist()
    statistic, dof = chi_square(counts, P5.tolist())
    assert statistic > CHI2_CRITICAL_001[dof]
    assert_distributed_as(tokens, q)


def test_first_token_distribution_q_equals_p() -> None:
    p = torch.stack([P5, P5])
    results = run_rounds(p, P5[None].clone(), N_DRAWS, seed=1)
    assert all(r.recovered is None for r in results)  # ratio 1: never rejected
    assert_distributed_as([r.tokens[0] for r in results], P5)


def test_first_token_distribution_deterministic_drafter() -> None:
    p = torch.stack([P5, P5])
    results = run_rounds(p, None, N_DRAWS, seed=2, fixed_draft=[2])
    assert_distributed_as([r.tokens[0] for r in results], P5)


def test_first_token_distribution_explicit_one_hot_q() -> None:
    p = torch.stack([P5, P5])
    q = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0]])
    results = run_rounds(p, q, N_DRAWS, seed=3)
    assert all(r.accepted in ([], [2]) for r in results)
    assert_distributed_as([r.tokens[0] for r in results], P5)


def test_first_token_distribution_disjoint_supports() -> None:
    p_row = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0])
    q = torch.tensor([[0.0, 0.0, 0.0, 0.6, 0.4]])
    results = run_rounds(torch.stack([p_row, p_row]), q, N_DRAWS, seed=4)
    assert all(r.accepted == [] for r in results)  # p(x) = 0 for every draft token
    assert_distributed_as([r.tokens[0] for r in results], p_row)


def test_first_token_distribution_partial_overlap_with_zeros() -> None:
    p_row = torch.tensor([0.0, 0.6, 0.0, 0.3, 0.1])
    q = torch.tensor([[0.3, 0.1, 0.2, 0.4, 0.0]])
    results = run_rounds(torch.stack([p_row, p_row]), q, N_DRAWS, seed=5)
    assert_distributed_as([r.tokens[0] for r in results], p_row)


def test_distributions_random_q_two_draft_tokens() -> None:
    """Random p rows and q rows: token 1 ~ p_0; given x_0 accepted, token 2 ~ p_1; bonus ~ p_2."""
    generator = gen(6)
    p = torch.rand(3, 5, generator=generator) ** 2
    p = p / p.sum(-1, keepdim=True)
    q = torch.rand(2, 5, generator=generator)
    q = q / q.sum(-1, keepdim=True)
    results = run_rounds(p, q, N_DRAWS, seed=7)
    assert_distributed_as([r.tokens[0] for r in results], p[0])
    second = [r.tokens[1] for r in results if len(r.tokens) >= 2]
    assert len(second) > 2_000
    assert_distributed_as(second, p[1])
    bonus = [r.bonus for r in results if r.bonus is not None]
    assert len(bonus) > 1_000
    assert_distributed_as(bonus, p[2])
