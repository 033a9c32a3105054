"""Game of 24: exact solver, legal moves, answer checking, the puzzle set, and constrained move proposals."""

from __future__ import annotations

import itertools
import math
import random
from fractions import Fraction

import pytest
import torch

from lab.methods.tot import game24
from lab.methods.tot.lm import CallModel
from lab.methods.tot.tasks import Game24, sample_distinct, scored_part
from lab.params import InputError
from tests.tiny import tiny_loaded_model


def brute_force(numbers: tuple[Fraction, ...]) -> bool:
    """Independent reference: every ordered pair, all six results (negatives allowed), no canonical order."""
    if len(numbers) == 1:
        return numbers[0] == 24
    for i, j in itertools.permutations(range(len(numbers)), 2):
        a, b = numbers[i], numbers[j]
        rest = [x for k, x in enumerate(numbers) if k not in (i, j)]
        results = [a + b, a - b, a * b] + ([a / b] if b else [])
        if any(brute_force(tuple(rest + [r])) for r in results):
            return True
    return False


def test_solver_finds_the_known_count_of_solvable_hands():
    hands = list(itertools.combinations_with_replacement(range(1, 14), 4))
    assert len(hands) == 1820
    assert sum(game24.solvable(list(h)) for h in hands) == 1362  # the known count for 1..13


def test_solver_agrees_with_unrestricted_brute_force():
    rng = random.Random(3)
    hands = [tuple(rng.randint(0, 13) for _ in range(4)) for _ in range(120)] + [
        (1, 5, 5, 5),
        (3, 3, 8, 8),
        (1, 1, 1, 1),
    ]
    for hand in hands:
        assert game24.solvable(list(hand)) == brute_force(tuple(Fraction(x) for x in hand)), hand


@pytest.mark.parametrize("hand", [(4, 9, 10, 13), (1, 5, 5, 5), (3, 3, 8, 8), (24,), (12, 12)])
def test_solutions_are_legal_move_sequences_that_reach_24(hand):
    moves = game24.solve(list(hand))
    assert moves is not None
    state = game24.as_state(list(hand))
    for move in moves:
        assert move in game24.legal_moves(state)
        state = move.left
    assert state == (Fraction(24),)
    assert game24.check_expression(game24.expression(game24.as_state(list(hand)), moves), list(hand))


def test_unsolvable_hands_have_no_solution():
    for hand in ([1, 1, 1, 1], [1, 1, 1, 2], [13, 13, 13, 13]):
        assert game24.solve(hand) is None and not game24.solvable(hand)


def test_legal_moves_are_correct_canonical_and_cover_every_nonnegative_result():
    state = game24.as_state([2, 3, 3, 0])
    moves = game24.legal_moves(state)
    texts = [m.text for m in moves]
    assert len(texts) == len(set(texts))
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a / b}
    for m in moves:
        assert m.result == ops[m.op](m.a, m.b) and m.result >= 0
        assert sorted([*m.left, m.a, m.b]) == sorted([*state, m.result])
        assert list(m.left) == sorted(m.left)
    reachable = {m.left for m in moves}
    for i, j in itertools.permutations(range(4), 2):
        a, b = state[i], state[j]
        rest = [x for k, x in enumerate(state) if k not in (i, j)]
        for value in [a + b, a - b, a * b] + ([a / b] if b else []):
            if value >= 0:
                assert tuple(sorted([*rest, value])) in reachable


def test_move_text_is_the_papers_thought_line():
    move = next(m for m in game24.legal_moves(game24.as_state([4, 9, 10, 13])) if m.text.startswith("13 - 9"))
    assert move.text == "13 - 9 = 4 (left: 4 4 10)"
    fraction = next(m for m in game24.legal_moves(game24.as_state([3, 7])) if m.op == "/" and m.a == 3)
    assert fraction.text == "3 / 7 = 3/7 (left: 3/7)"
    assert scored_part(move) == "13 - 9 = 4 (left:"


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("(13 - 9) * (10 - 4) = 24", True),
        ("4 * (9 - (13 - 10))", True),
        ("(13 - 9) * (10 - 4) = 25", True),  # the part after "=" is the model's claim, not checked
        ("13 - 9 * 10 - 4", False),
        ("(13 - 9) * (10 - 4) * 1", False),  # a number not in the puzzle
        ("(13 - 9) * 6", False),  # 10 and 4 not used
        ("(9 - 9) + 24", False),
        ("__import__('os')", False),
        ("13 ** 2", False),
        ("", False),
        ("10 / (13 - 13)", False),
    ],
)
def test_check_expression(text, ok):
    assert game24.check_expression(text, [4, 9, 10, 13]) is ok


def test_parse_puzzle_accepts_hands_and_rejects_other_text():
    assert game24.parse_puzzle(" 4 9, 10 13 ") == [4, 9, 10, 13]
    for bad in ("", "4 9 10 thirteen", "4", "1 2 3 4 5 6 7", "4 9 10 -13", "4 9.5 10 13", "4 9 10 1001"):
        with pytest.raises(InputError):
            game24.parse_puzzle(bad)


def test_the_evaluation_set_has_20_distinct_solvable_puzzles():
    puzzles = game24.load_puzzles()
    assert len(puzzles) == 20 and len({tuple(sorted(p)) for p in puzzles}) == 20
    assert all(len(p) == 4 and game24.solvable(p) for p in puzzles)


def test_sample_distinct_draws_without_replacement_from_the_tempered_softmax():
    generator = torch.Generator().manual_seed(0)
    logps = [math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]
    picks = sample_distinct(logps, 3, 1.0, generator)
    assert len(picks) == 3 and len(set(picks)) == 3
    assert sample_distinct(logps, 10, 1.0, generator) != [] and len(sample_distinct(logps, 10, 1.0, generator)) == 4
    firsts = [sample_distinct(logps, 1, 1.0, generator)[0] for _ in range(4000)]
    freq = [firsts.count(i) / 4000 for i in range(4)]
    assert all(abs(f - p) < 0.03 for f, p in zip(freq, (0.5, 0.3, 0.15, 0.05), strict=True))
    assert all(sample_distinct(logps, 2, 0.01, generator) == [0, 1] for _ in range(20))  # T -> 0: the top moves


def test_constrained_proposals_are_distinct_legal_moves_with_normalized_probabilities():
    loaded = tiny_loaded_model(seed=1)
    lm = CallModel(loaded)
    task = Game24("4 9 10 13")
    states = [task.start, game24.as_state([4, 4, 10])]
    proposals = task.propose_many(lm, states, 6, 1.0, torch.Generator().manual_seed(0))
    for state, thoughts in zip(states, proposals, strict=True):
        legal = {m.text: m.left for m in game24.legal_moves(state)}
        assert len(thoughts) == 6 and len({t.text for t in thoughts}) == 6
        assert all(t.text in legal and t.state == legal[t.text] and t.logprob < 0 for t in thoughts)
    everything = task.propose_many(lm, [task.start], 100, 1.0, torch.Generator().manual_seed(0))[0]
    assert len(everything) == len(game24.legal_moves(task.start))
    assert math.isclose(sum(math.exp(t.logprob) for t in everything), 1.0, rel_tol=1e-6)
    assert lm.usage.model_calls == 3 and lm.usage.forwards == 3  # one prefix prefill + two scoring forwards
