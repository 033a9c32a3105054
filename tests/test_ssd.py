"""SSD (speculative speculative decoding): the outcome planner, the drafter thread's cache, losslessness, views.

Unit part on tiny random Llamas: greedy SSD equals greedy decoding for every drafter and for an always-right and
an always-wrong drafter, both as timed (hits depend on timing) and with `full_speculation` (the target waits until
the drafter thread has pre-drafted every guess, so the cache path runs every round deterministically); sampling
output is distributed as the target's (chi-square of the 2nd and 3rd tokens, which come from cached drafts, on a
vocabulary of 8). The embedded part checks greedy equality on a few builtin prompts with the self-drafter.
"""

from __future__ import annotations

import pytest

from lab.app.builtin_prompts import BUILTIN_PROMPTS
from lab.params import build_params
from lab.speculative.chain import next_gamma
from lab.speculative.draft import Draft, DraftContext
from lab.speculative.params import chain_settings
from lab.speculative.proposers import ModelProposer, PromptLookupProposer
from lab.speculative.schedules.ssd import (
    PROBE,
    Job,
    Speculator,
    acceptance_estimate,
    next_gammas,
    plan_outcomes,
    split_threads,
)
from lab.trace import (
    DraftRound,
    PipelineSpan,
    SpeculationRound,
    Trace,
    from_json,
    speculation_stats,
    summarize,
    to_json,
)
from strategies import collect, get_strategy
from strategies.ssd import SSDParams, ssd_loop
from tests.stats import assert_joint_matches
from tests.test_speculative import WrongProposer, gen, greedy_tokens, small_model, tokens_of
from tests.tiny import tiny_loaded_model
from visualizers import strategy_figures
from visualizers.ssd import cache_figure, fanout_figure, timeline_figure

pytestmark = pytest.mark.usefixtures("one_thread")

SSD = get_strategy("ssd")
N_DRAWS = 3000


def params(**values) -> SSDParams:
    return build_params(SSDParams, values)


def run_ssd(loaded, prompt_ids: list[int], proposer=None, seed: int = 0, **values) -> list:
    built = params(**values)
    if proposer is None:
        return collect(SSD.run(loaded, prompt_ids, built, gen(seed)))
    return collect(ssd_loop(loaded, prompt_ids, built, proposer, gen(seed)))


@pytest.fixture
def full_speculation(monkeypatch):
    """Make `finish` wait until the drafter thread has pre-drafted every guess before stopping it."""
    original = Speculator.finish

    def finish(self, job: Job) -> Job:
        job.done.wait()
        return original(self, job)

    monkeypatch.setattr(Speculator, "finish", finish)


@pytest.fixture(scope="module")
def prompt_ids(repeating_prompt_ids: list[int]) -> list[int]:
    return repeating_prompt_ids


# --- planner, cache, helpers ------------------------------------------------------------------------------


def test_plan_ranks_outcomes_and_skips_the_drafted_token_and_eos() -> None:
    draft = Draft(
        [5, 6], top_ids=[[5, 7, 0, 8], [9, 6, 4, 3]], top_probs=[[0.6, 0.3, 0.05, 0.05], [0.5, 0.4, 0.05, 0.05]]
    )
    plan = plan_outcomes(draft, alpha=0.5, fanout=2, eos=(0,))
    keys = [(g.k, g.token) for g in plan]
    assert (0, 5) not in keys and (1, 6) not in keys and (0, 0) not in keys  # x_k and EOS are never guessed
    assert sorted(keys) == [(0, 7), (0, 8), (1, 4), (1, 9), (2, PROBE)]
    best = plan[0]  # (0, 7): 0.5 * 0.3 / 0.4 = 0.375 beats the probe (0.25) and (1, 9): 0.25 * 0.5 / 0.6
    assert (best.k, best.token) == (0, 7) and best.score == pytest.approx(0.375)
    assert [g.score for g in plan] == sorted((g.score for g in plan), reverse=True)
    assert plan_outcomes(Draft([5, 0], top_ids=[[1], [2]], top_probs=[[1.0], [1.0]]), 0.5, 2, (0,))[-1].token != PROBE
    assert acceptance_estimate(0, 0) == 0.5 and acceptance_estimate(3, 4) == pytest.approx(4 / 6)


def test_next_gammas_follow_the_adaptive_rule_and_the_budget() -> None:
    def rule(built):
        settings = chain_settings(built)
        return lambda gamma, drafted, accepted: next_gamma(gamma, drafted, accepted, settings)

    fixed = rule(params(max_new_tokens=10, gamma=3))
    assert next_gammas(3, 3, 0, 10, fixed) == [3, 3, 3, 3]
    assert next_gammas(3, 3, 6, 10, fixed) == [2, 1, 0, 0]  # 10 - (6 + k + 1) tokens left, minus the next x_0's slot
    adaptive = rule(params(max_new_tokens=100, gamma=3, adaptive=True, gamma_max=4))
    assert next_gammas(3, 3, 0, 100, adaptive) == [2, 2, 2, 4]
    assert split_threads(2, 1, 0, model_drafter=True) == 1 and split_threads(2, 1, 0, model_drafter=False) == 2
    assert split_threads(2, 1, 3, model_drafter=True) == 3


def test_speculator_caches_what_the_drafter_would_draft(tiny) -> None:
    """Every cached branch equals a fresh proposal on the guessed context (the drafter's cache is synced)."""
    config, eos = params().sampling, tiny.eos_token_ids
    drafter = tiny_loaded_model(seed=2)
    base = [5, 6, 7, 8]
    proposer = ModelProposer(drafter, tiny.vocab_size)
    draft = proposer.propose(DraftContext(base, 3, config, gen(), eos, fanout=2))
    assert len(draft.top_ids) == 3 and all(len(row) == 3 for row in draft.top_ids)  # fanout + 1 per position
    speculator = Speculator(proposer, config, eos, 2, 1, gen(1), 0.0)
    job = Job(0, base, draft, [3, 3, 3, 3], alpha=0.5)
    speculator.start(job)
    assert job.done.wait(30)
    speculator.finish(job)
    speculator.close()
    assert job.completed == sum(job.fanout) == len(job.cache) + (job.cache.get((3, -1)) is not None) >= 7
    assert job.fanout[:3] == [2, 2, 2] and job.fanout[3] == 2  # probe (its own guess) + 1 more bonus candidate
    for (k, t), cached in job.cache.items():
        fresh = ModelProposer(drafter, tiny.vocab_size).propose(
            DraftContext(base + draft.tokens[:k] + [t], 3, config, gen(), eos)
        )
        assert cached.tokens == fresh.tokens, (k, t)
    assert [s[0] for s in job.spans].count("probe") == 1


def test_a_stopped_branch_is_cut_short_but_valid(tiny) -> None:
    config = params().sampling
    calls = []

    def stop() -> bool:
        calls.append(1)
        return len(calls) >= 2

    proposer = ModelProposer(tiny_loaded_model(seed=2), tiny.vocab_size)
    draft = proposer.propose(DraftContext([5, 6, 7], 6, config, gen(), should_stop=stop))
    full = ModelProposer(tiny_loaded_model(seed=2), tiny.vocab_size).propose(DraftContext([5, 6, 7], 6, config, gen()))
    assert len(draft.tokens) == 2 and draft.tokens == full.tokens[:2]


def test_prompt_lookup_reports_continuations() -> None:
    from lab.speculative.proposers.prompt_lookup import continuations

    tokens = [1, 2, 3, 9, 1, 2, 4, 1, 2, 4, 1, 2]
    assert continuations(tokens, 2, 3) == ([4, 3], [pytest.approx(2 / 3), pytest.approx(1 / 3)])
    draft = PromptLookupProposer(2).propose(DraftContext(tokens, 2, params().sampling, gen(), fanout=2))
    assert draft.tokens == [4, 1] and draft.top_ids[0] == [4, 3]


# --- greedy losslessness ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values",
    [
        {"drafter": "self-draft", "draft_layers": 1, "gamma": 3},
        {"drafter": "model", "gamma": 4},  # the target itself: always right
        {"drafter": "prompt-lookup", "fanout": 2},
        {"drafter": "self-draft", "draft_layers": 1, "adaptive": True, "gamma": 2, "gamma_max": 5},
        {"drafter": "self-draft", "draft_layers": 1, "repetition_penalty": 1.3},
    ],
    ids=["self-draft", "always-right", "lookup", "adaptive", "penalty"],
)
@pytest.mark.parametrize("full", [False, True], ids=["timed", "full-speculation"])
def test_greedy_ssd_equals_greedy(tiny, prompt_ids, values, full, request) -> None:
    if full:
        request.getfixturevalue("full_speculation")
    expected = greedy_tokens(tiny, prompt_ids, 30, repetition_penalty=values.get("repetition_penalty", 1.0))
    events = run_ssd(tiny, prompt_ids, max_new_tokens=30, **values)
    assert tokens_of(events) == expected and len(set(expected)) > 1
    rounds = [e for e in events if isinstance(e, SpeculationRound)]
    assert len(rounds) == len([e for e in events if isinstance(e, DraftRound)])
    if full and values["drafter"] != "prompt-lookup":
        assert any(r.hit for r in rounds)


def test_other_drafter_and_always_right_hit_every_round(tiny, prompt_ids, full_speculation) -> None:
    expected = greedy_tokens(tiny, prompt_ids, 30)
    other = run_ssd(tiny, prompt_ids, ModelProposer(tiny_loaded_model(seed=1), tiny.vocab_size), max_new_tokens=30)
    assert tokens_of(other) == expected
    right = run_ssd(tiny, prompt_ids, ModelProposer(tiny, tiny.vocab_size), max_new_tokens=31, gamma=4)
    assert tokens_of(right) == greedy_tokens(tiny, prompt_ids, 31)  # the prefill's token, then 6 rounds of 5
    rounds = [e for e in right if isinstance(e, SpeculationRound)]
    assert all(r.hit and r.hit_rank == 0 and r.accepted == 4 for r in rounds[:-1])  # the probe guessed the bonus
    assert all(r.cached_tokens == 4 for r in rounds[1:])
    assert summarize(right).acceptance_rate == 1.0 and speculation_stats(right)["ssd_hit_rate"] == 1.0


def test_always_wrong_drafter_reproduces_greedy(tiny, prompt_ids, full_speculation) -> None:
    expected = greedy_tokens(tiny, prompt_ids, 16)
    events = run_ssd(tiny, prompt_ids, WrongProposer(tiny), max_new_tokens=16, gamma=3)
    assert tokens_of(events) == expected
    assert summarize(events).acceptance_rate == 0.0
    assert not any(r.hit for r in events if isinstance(r, SpeculationRound))  # no candidates: only the probe


def test_events_serialize_and_views_render(tiny, prompt_ids, full_speculation) -> None:
    events = run_ssd(tiny, prompt_ids, ModelProposer(tiny_loaded_model(seed=1), tiny.vocab_size), max_new_tokens=20)
    spans = [e for e in events if isinstance(e, PipelineSpan)]
    assert {(s.who, s.thread) for s in spans} >= {("target", "main"), ("drafter", "worker")}
    assert all(s.end >= s.start >= 0 for s in spans)
    loaded = from_json(to_json(Trace("ssd", "tiny", "p", {}, events)))
    assert loaded.events == events
    figures = strategy_figures("ssd", events)
    assert len(figures) == 7 and figures[0].data
    assert cache_figure(events).data and fanout_figure(events).data
    assert len(timeline_figure([]).data) == 0 and len(cache_figure([]).data) == 0
    sd_events = collect(
        get_strategy("speculative").run(
            tiny, prompt_ids, build_params(get_strategy("speculative").Params, {"max_new_tokens": 12}), gen()
        )
    )
    assert {s.what for s in sd_events if isinstance(s, PipelineSpan)} == {"draft", "verify"}
    assert len(strategy_figures("speculative", sd_events)) == 5


# --- sampling losslessness --------------------------------------------------------------------------------


def test_sampling_matches_the_target_through_the_cache(full_speculation) -> None:
    """(x3, x4) of 4-token runs: x1 from the prefill, x2 from a round drafted on the main thread, whose drafter
    thread pre-drafts the round that emits x3 (and x4): the cached drafts are really used and stay lossless."""
    from tests.test_speculative import exact_joint

    target, drafter = small_model(0), small_model(1)
    built = params(max_new_tokens=4, gamma=1, fanout=3, temperature=1.0)
    generator, pairs, hits = gen(11), [], 0
    for _ in range(N_DRAWS):
        events = collect(ssd_loop(target, [1], built, ModelProposer(drafter, 8), generator))
        tokens = tokens_of(events)
        pairs.append((tokens[2], tokens[3]))
        hits += sum(r.hit for r in events if isinstance(r, SpeculationRound))
    assert hits > N_DRAWS // 4  # the cached drafts were really used
    assert_joint_matches(pairs, exact_joint(target, [1], built.sampling, skip=2))
    with pytest.raises(AssertionError):  # the check can fail: the drafter's own distribution is rejected
        assert_joint_matches(pairs, exact_joint(drafter, [1], built.sampling, skip=2))


# --- embedded model ---------------------------------------------------------------------------------------


@pytest.mark.embedded
def test_embedded_greedy_ssd_equals_greedy(embedded) -> None:
    for prompt in BUILTIN_PROMPTS[::8]:  # 3 prompts
        ids = embedded.encode(prompt.text)
        expected = greedy_tokens(embedded, ids, 24)
        events = run_ssd(embedded, ids, max_new_tokens=24, drafter="self-draft", draft_layers=12, gamma=3)
        assert tokens_of(events) == expected, prompt.text
