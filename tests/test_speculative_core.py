"""The shared speculative core (lab/speculative): the defects an audit found, each with its test, and the deep
losslessness tests of the chain methods: the joint of three tokens drawn by one round of gamma = 3 (vanilla SD and
SSD), with a negative control that a deliberately wrong acceptance rule fails the same check."""

from __future__ import annotations

import pytest
import torch

from lab.params import build_params
from lab.speculative import chain
from lab.speculative.acceptance import Acceptance, accept_chain
from lab.speculative.draft import Draft
from lab.speculative.params import chain_settings
from lab.speculative.proposers import ModelProposer
from lab.speculative.schedules.ssd import Job, SSDSchedule, SSDSettings
from strategies import collect, get_strategy
from strategies.speculative import SpeculativeParams
from strategies.ssd import SSDParams, ssd_loop
from tests.stats import assert_joint_matches
from tests.test_speculative import exact_joint, gen, small_model, tokens_of

pytestmark = pytest.mark.usefixtures("one_thread")
N_DEEP = 2500  # runs per deep check


# --- defects found by the audit ---------------------------------------------------------------------------


def test_accept_chain_refuses_a_draft_token_that_q_gives_zero() -> None:
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="q\\(x\\) = 0"):
        accept_chain(p, q, [1], gen())  # token 1 cannot have been drawn from q
    assert accept_chain(p, q, [0], gen()).tokens[0] in (0, 1)


def test_a_draft_with_q_and_one_without_cannot_be_joined() -> None:
    sampled = Draft([1, 2], q=torch.full((2, 4), 0.25))
    deterministic = Draft([3])
    with pytest.raises(ValueError, match="has q with one that has none"):
        sampled.extended(deterministic)
    with pytest.raises(ValueError, match="has q with one that has none"):
        deterministic.extended(sampled)
    assert sampled.extended(Draft([3], q=torch.full((1, 4), 0.25))).q.shape == (3, 4)
    assert deterministic.extended(Draft([4])).tokens == [3, 4]


def test_ssd_does_not_count_an_empty_cached_draft_as_a_hit(tiny) -> None:
    proposer = ModelProposer(tiny, tiny.vocab_size)
    settings = chain_settings(build_params(SSDParams, {}))
    schedule = SSDSchedule(proposer, settings.config, (), SSDSettings(), gen(), True, 1)
    try:
        job = Job(1, [1, 2], Draft([5]), [1, 1], 0.5)
        job.cache[(0, 7)] = Draft([])  # a branch stopped before its first token
        schedule.job = job
        events = schedule.round_events(1, Acceptance([], [], [], 7, None), 0.0, (0.0, 0.0))
        assert schedule.cached is None and events[0].hit is False and events[0].hit_rank == -1
        job = Job(2, [1, 2], Draft([5]), [1, 1], 0.5)
        job.cache[(0, 7)] = Draft([9])
        schedule.job = job
        events = schedule.round_events(2, Acceptance([], [], [], 7, None), 0.0, (0.0, 0.0))
        assert schedule.cached is not None and events[0].hit is True
    finally:
        schedule.close()


# --- deep losslessness: three tokens from one round of gamma = 3 -------------------------------------------


def wrong_residual(draft, processed, rule, config, generator, typical=(0.09, 0.3)):
    """A classic bug: on a rejection, draw from p instead of norm(max(0, p - q))."""
    p = processed.softmax(-1)
    acc = accept_chain(p, draft.q, draft.tokens, generator)
    if acc.recovered is None:
        return acc
    k = len(acc.accepted)
    redrawn = int(torch.multinomial(p[k], 1, generator=generator))
    return Acceptance(acc.accepted, acc.uniforms, acc.ratios, redrawn, None, acc.path, acc.rejected)


def deep_samples(run_one, n: int) -> list[tuple[int, int, int]]:
    """(x2, x3, x4) of 5-token runs: x1 comes from the prefill, x2..x4 from a round of gamma = 3."""
    generator = gen(21)
    return [tuple(tokens_of(run_one(generator))[1:4]) for _ in range(n)]


def sd_run(target, drafter, built):
    return lambda generator: collect(
        chain.chain_loop(target, [1], ModelProposer(drafter, 8), generator, chain_settings(built))
    )


def ssd_run(target, drafter, built):
    return lambda generator: collect(ssd_loop(target, [1], built, ModelProposer(drafter, 8), generator))


@pytest.mark.parametrize("method", ["speculative", "ssd"])
def test_three_token_joint_matches_the_target_with_gamma_3(method: str, monkeypatch) -> None:
    target, drafter = small_model(0), small_model(1)
    values = {"max_new_tokens": 5, "gamma": 3, "temperature": 1.0}
    built = build_params(SSDParams if method == "ssd" else SpeculativeParams, values)
    run_one = (ssd_run if method == "ssd" else sd_run)(target, drafter, built)
    joint = exact_joint(target, [1], built.sampling, skip=1, length=3)  # [8, 8, 8]
    assert_joint_matches(deep_samples(run_one, N_DEEP), joint)
    monkeypatch.setattr(chain, "accept", wrong_residual)  # negative control: the same check must fail
    with pytest.raises(AssertionError, match="chi2|probability 0"):
        assert_joint_matches(deep_samples(run_one, N_DEEP), joint)


# --- lossless in the dtype users run (bf16 on a CPU) --------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_bf16():
    from lab.engine.models import wrap_model
    from tests.tiny import ByteTokenizer, tiny_llama

    return wrap_model(tiny_llama(4, layers=3).to(torch.bfloat16), ByteTokenizer(), spec="tiny-llama-bf16")


def test_bf16_models_run_row_invariant_forwards(tiny_bf16) -> None:
    """A verify forward over n tokens computes each row bit for bit as a one-token decode step does."""
    from lab.engine import runtime
    from lab.engine.invariance import rows_invariant

    ids = [5, 9, 3, 7, 1, 2]
    state, _ = runtime.prefill(tiny_bf16, ids[:2])
    steps = [runtime.decode_step(state, t).logits[-1] for t in ids[2:]]
    state, _ = runtime.prefill(tiny_bf16, ids[:2])
    with rows_invariant(tiny_bf16):
        rows = runtime.verify(state, ids[2:]).logits
    assert all(torch.equal(row, step) for row, step in zip(rows, steps, strict=True))
    assert tiny_bf16.model.config._attn_implementation == "lab_rows"


def test_bf16_tree_rows_equal_decode_steps_along_their_paths(tiny_bf16) -> None:
    """Tree verification (all rows in one masked float64 attention call) gives every node, bit for bit, the
    logits a decode step gives after the same path. (With this 40-token prefix, plain masked SDPA gives node 1
    other logits than the decode steps do.)"""
    from lab.engine import runtime
    from lab.engine.invariance import rows_invariant
    from lab.engine.tree_attention import build_tree_attention

    prompt = [(7 * i + 3) % 250 + 1 for i in range(40)]
    parents, tokens = [-1, 0, 0, 0, 1, 1, 2, 4, 4, 5, 7], [7, 1, 2, 8, 4, 6, 3, 9, 11, 12, 13]
    state, _ = runtime.prefill(tiny_bf16, prompt)
    with rows_invariant(tiny_bf16):
        rows = runtime.verify_tree(state, build_tree_attention(parents), tokens).logits
    for node in range(len(parents)):
        path, i = [], node
        while i >= 0:
            path.insert(0, tokens[i])
            i = parents[i]
        state, _ = runtime.prefill(tiny_bf16, prompt)
        steps = [runtime.decode_step(state, token).logits[-1] for token in path]
        assert torch.equal(rows[node], steps[-1]), f"node {node} (path {path})"


def test_exact_attention_rows_do_not_depend_on_the_other_rows_or_the_masked_keys() -> None:
    """A row of one masked call over many rows equals, bit for bit, the same row computed alone over only the
    keys it sees (the decode step's call); and it is the float64 attention rounded once."""
    from lab.engine.invariance import exact_attention

    torch.manual_seed(0)
    heads, kv_heads, q_len, kv_len, dim = 6, 2, 9, 70, 16
    query = torch.randn(1, heads, q_len, dim).bfloat16()
    key, value = (torch.randn(1, kv_heads, kv_len, dim).bfloat16() for _ in range(2))
    seen = torch.rand(q_len, kv_len) < 0.6
    seen[:, :30] = True
    mask = torch.where(seen, 0.0, float("-inf")).bfloat16()[None, None]
    together = exact_attention(query, key, value, mask, 0.25)  # [1, q, heads, d]
    for row in range(q_len):
        keys = seen[row].nonzero()[:, 0]
        alone = exact_attention(query[:, :, row : row + 1], key[:, :, keys], value[:, :, keys], None, 0.25)
        assert torch.equal(together[0, row], alone[0, 0]), f"row {row}"
    grouped = torch.repeat_interleave(torch.arange(kv_heads), heads // kv_heads)
    scores = (query[0].double() @ key[0, grouped].double().transpose(1, 2) * 0.25).masked_fill(~seen, float("-inf"))
    reference = (scores.softmax(-1) @ value[0, grouped].double()).transpose(0, 1).bfloat16()
    assert torch.equal(together[0], reference)


@pytest.mark.parametrize(
    "name, values",
    [
        ("speculative", {"drafter": "self-draft", "draft_layers": 1, "gamma": 4}),
        ("speculative", {"drafter": "model", "gamma": 5}),
        ("ssd", {"drafter": "self-draft", "draft_layers": 2, "gamma": 3}),
    ],
    ids=["sd-self", "sd-model", "ssd"],
)
def test_greedy_chain_methods_equal_greedy_in_bf16(tiny_bf16, repeating_prompt_ids, name, values) -> None:
    from tests.test_speculative import greedy_tokens

    expected = greedy_tokens(tiny_bf16, repeating_prompt_ids, 40)
    strategy = get_strategy(name)
    params = build_params(strategy.Params, {"max_new_tokens": 40, **values})
    assert tokens_of(collect(strategy.run(tiny_bf16, repeating_prompt_ids, params, gen()))) == expected


def test_greedy_tree_methods_equal_greedy_in_bf16(tiny_bf16, repeating_prompt_ids) -> None:
    from lab.heads.eagle import build_head
    from lab.speculative.params import tree_settings
    from lab.speculative.proposers.eagle import EagleProposer, TreeShape
    from lab.speculative.proposers.medusa import MedusaProposer
    from lab.speculative.tree import TreeSettings, tree_loop
    from strategies.medusa import TreeParams
    from tests.test_medusa import random_heads
    from tests.test_speculative import greedy_tokens

    expected = greedy_tokens(tiny_bf16, repeating_prompt_ids, 40)
    settings = tree_settings(build_params(TreeParams, {"max_new_tokens": 40}), "medusa")
    medusa = MedusaProposer(random_heads(tiny_bf16), 8)
    assert tokens_of(collect(tree_loop(tiny_bf16, repeating_prompt_ids, medusa, gen(), settings))) == expected
    head = build_head(tiny_bf16, torch.arange(tiny_bf16.vocab_size))
    eagle = EagleProposer(head, TreeShape(16, 3, 4))
    settings = TreeSettings(40, settings.config, "greedy", method="eagle")
    assert tokens_of(collect(tree_loop(tiny_bf16, repeating_prompt_ids, eagle, gen(), settings))) == expected


def test_the_row_invariance_switch_turns_it_off(monkeypatch) -> None:
    from lab.engine.invariance import SWITCH, make_rows_invariant
    from tests.tiny import tiny_llama

    monkeypatch.setenv(SWITCH, "0")
    model = tiny_llama(5).to(torch.bfloat16)
    assert make_rows_invariant(model) == [] and model.config._attn_implementation != "lab_rows"
    monkeypatch.setenv(SWITCH, "1")
    assert make_rows_invariant(model) and model.config._attn_implementation == "lab_rows"
