"""lab.tools.lookup_tune's replay of prompt-lookup rounds (pure functions; no model)."""

import pytest

from lab.tools.lookup_tune import kept, linear, measured, oracle, proposer_rule, replay, without_unigrams

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
COPY = [(PROMPT, [5, 6, 7, 8, 9, 10, 11, 12, 13])]  # the output copies the prompt, then leaves it


def test_kept_is_the_common_prefix_with_the_continuation():
    assert kept([1, 2, 3], [1, 2, 4, 5]) == 2
    assert kept([1, 2], [1]) == 1
    assert kept([], [1]) == 0
    assert kept([3], [1, 3]) == 0


def test_replay_follows_the_strategys_rounds_by_hand():
    # round 1 after [5]: a 1-gram match drafts 2 * 1 - 1 = 1 token (6), kept; round 2 after [5, 6, 7]: the 3-gram
    # match drafts 5 tokens (8..12, the budget 9 - 3 - 1 = 5), all kept, and 13 is the target's own token
    rule = proposer_rule(4, True)
    assert replay(COPY, rule, 6, linear(0.0)) == pytest.approx(8 / 2)
    assert replay(COPY, rule, 6, linear(0.5)) == pytest.approx(8 / (1.5 + 3.5))
    assert replay(COPY, rule, 6, linear(0.5), overhead=0.25) == pytest.approx(8 / (1.75 + 3.75))


def test_without_drafts_the_replay_is_greedy_at_any_cost():
    def nothing(tokens, gamma):
        return []

    for alpha in (0.0, 0.3, 2.0):
        assert replay(COPY, nothing, 6, linear(alpha)) == 1.0
    # 1-gram matches ignored: round 1 drafts nothing (a step), then rounds after [5, 6] find the 2-gram
    free = linear(0.0)
    assert replay(COPY, without_unigrams(None, 4), 6, free) < replay(COPY, proposer_rule(4, True), 6, free)


def test_the_oracle_drafts_only_what_is_kept():
    # its rounds: [5] -> 6 (1-gram match, 7 tokens long, 7 kept: 6..12, then 13 from the target) = one round
    assert oracle(COPY, 4, 8, linear(0.1)) == pytest.approx(8 / 1.7)
    assert oracle(COPY, 4, 8, linear(0.1)) > replay(COPY, proposer_rule(4, True), 8, linear(0.1))


def test_measured_costs_are_in_decode_steps_and_extrapolate_by_the_last_slope():
    cost = measured(0.010, {1: 0.012, 2: 0.015})
    assert cost(0) == 1.0
    assert cost(1) == pytest.approx(1.2)
    assert cost(2) == pytest.approx(1.5)
    assert cost(4) == pytest.approx(2.1)


def test_the_replay_counts_the_real_strategys_rounds(tiny, repeating_prompt_ids):
    """Greedy prompt-lookup SD on a tiny model: its rounds are the replay's (linear(0): tokens / rounds)."""
    import torch

    from lab.params import build_params
    from lab.registry import collect, get_strategy
    from lab.speculative.params import ChainParams
    from lab.tools.eagle_tune import verify_times
    from lab.tools.lookup_tune import greedy_outputs
    from lab.trace.speculative import DraftRound

    outputs = greedy_outputs(tiny, [repeating_prompt_ids], 40)
    speculative = get_strategy("speculative")
    params = build_params(speculative.Params, {"max_new_tokens": 40})
    events = collect(speculative.run(tiny, repeating_prompt_ids, params, torch.Generator()))
    rounds = sum(isinstance(e, DraftRound) for e in events)
    drafted = sum(bool(e.draft_tokens) for e in events if isinstance(e, DraftRound))
    defaults = ChainParams()
    rule = proposer_rule(defaults.max_ngram, defaults.lookup_scaling)
    tokens = len(outputs[0][1]) - 1
    assert drafted > 0  # the tiny model repeats itself, so the lookup matches
    assert replay(outputs, rule, defaults.gamma, linear(0.0)) == pytest.approx(tokens / rounds)
    times = verify_times(tiny, [0, 1, 3], context=6, repeats=1, chain=True)
    assert sorted(times) == [0, 1, 3] and all(0 < t < float("inf") for t in times.values())
