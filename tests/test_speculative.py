"""Vanilla speculative decoding: proposers, the verifier, the events and losslessness (views: *_views.py).

Unit part on tiny random Llamas (tests/tiny.py): greedy output equals plain greedy for every drafter, for an
always-right and an always-wrong drafter; sampling output is distributed as the target's own distribution
(chi-square against the exact softmax on a vocabulary of 8). The integration part (marked `embedded`) checks
greedy equality on the embedded SmolLM2 in fp32 for the three drafters on builtin prompts.
"""

from __future__ import annotations

import pytest
import torch

from lab.app.builtin_prompts import BUILTIN_PROMPTS
from lab.engine.models import wrap_model
from lab.engine.runtime import early_exit_logits, forward, new_state
from lab.params import InputError, build_params
from lab.speculative.acceptance import accept, accept_chain
from lab.speculative.chain import chain_loop, next_gamma
from lab.speculative.draft import Draft, DraftContext, Proposer, Verified
from lab.speculative.params import chain_settings
from lab.speculative.proposers import ModelProposer, PromptLookupProposer, check_same_tokenizer, make_chain_proposer
from lab.speculative.proposers.prompt_lookup import lookup
from lab.speculative.proposers.self_draft import self_draft_view
from lab.trace import DraftRound, RunFinished, TokenEmitted, Trace, from_json, summarize, to_json
from strategies import collect, get_strategy
from strategies.speculative import SpeculativeParams
from tests.stats import assert_joint_matches
from tests.tiny import ByteTokenizer, tiny_llama, tiny_loaded_model

pytestmark = pytest.mark.usefixtures("one_thread")

SD = get_strategy("speculative")
GREEDY = get_strategy("greedy")
N_DRAWS = 3000


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def tokens_of(events: list) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEmitted)]


def rounds_of(events: list) -> list[DraftRound]:
    return [e for e in events if isinstance(e, DraftRound)]


def params(**values) -> SpeculativeParams:
    return build_params(SpeculativeParams, values)


def greedy_tokens(loaded, prompt_ids: list[int], n: int, **values) -> list[int]:
    greedy_params = build_params(GREEDY.Params, {"max_new_tokens": n, **values})
    return tokens_of(collect(GREEDY.run(loaded, prompt_ids, greedy_params, gen())))


def run_sd(loaded, prompt_ids: list[int], proposer: Proposer | None = None, seed: int = 0, **values) -> list:
    built = params(**values)
    if proposer is None:
        return collect(SD.run(loaded, prompt_ids, built, gen(seed)))
    return collect(chain_loop(loaded, prompt_ids, proposer, gen(seed), chain_settings(built)))


class WrongProposer:
    """Always wrong: each drafted token is (target argmax + 1) mod V along the drafted chain (full forwards)."""

    name = "always-wrong"
    feature_layers = ()

    def __init__(self, target) -> None:
        self.target = target
        self.forwards = 0

    def propose(self, context: DraftContext) -> Draft:
        ids, drafted = list(context.tokens), []
        for _ in range(context.gamma):
            with torch.inference_mode():
                logits = self.target.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
            drafted.append((int(logits.argmax()) + 1) % logits.shape[-1])
            ids.append(drafted[-1])
        return Draft(drafted)

    def accept(self, verified: Verified) -> None:
        assert verified.n_accepted == 0

    def close(self) -> None:
        pass


class FixedProposer:
    """Deterministic: always drafts the same token (one-hot q); with `q_row` it reports that q instead."""

    name = "fixed"
    forwards = 0
    feature_layers = ()

    def __init__(self, token: int, q_row: torch.Tensor | None = None) -> None:
        self.token, self.q_row = token, q_row

    def propose(self, context: DraftContext) -> Draft:
        if context.gamma == 0:
            return Draft([])
        if self.q_row is None:
            return Draft([self.token] * context.gamma)
        tokens = [int(torch.multinomial(self.q_row, 1, generator=context.generator)) for _ in range(context.gamma)]
        return Draft(tokens, q=self.q_row.expand(context.gamma, -1).clone())

    def accept(self, verified: Verified) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def prompt_ids(repeating_prompt_ids: list[int]) -> list[int]:
    return repeating_prompt_ids


# --- proposers --------------------------------------------------------------------------------------------


def test_lookup_takes_the_most_recent_match_of_the_longest_ngram() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 4, 5, 7, 2, 3, 8, 1, 2]
    assert lookup(tokens, max_ngram=2, gamma=3) == [4, 5, 7]  # "1 2" last seen at 4: followed by 4 5 7
    assert lookup(tokens, max_ngram=1, gamma=2) == [3, 8]  # "2" last seen at 9
    assert lookup([5, 6, 7], max_ngram=3, gamma=4) == []  # no earlier occurrence
    assert lookup([7, 7, 7, 7], max_ngram=2, gamma=3) == [7]  # the match may run into the suffix
    proposer = PromptLookupProposer(max_ngram=3)
    assert isinstance(proposer, Proposer) and proposer.forwards == 0
    draft = proposer.propose(DraftContext(tokens, 2, params().sampling, gen()))
    assert draft.tokens == [4, 5] and draft.q is None and draft.parents is None


def test_model_proposer_syncs_its_cache_on_any_context(tiny) -> None:
    """SSD calls propose on diverging contexts: the cached proposer must equal a fresh one."""
    config = params().sampling
    drafter = tiny_loaded_model(seed=3)
    cached = ModelProposer(drafter, tiny.vocab_size)
    a, b = [5, 6, 7, 8, 9], [5, 6, 7, 10]
    first = cached.propose(DraftContext(a, 4, config, gen()))
    cached.accept(Verified(2, first.tokens[:2], len(a) - 1))
    assert cached.state.tokens == a + first.tokens[:2]
    again = cached.propose(DraftContext(b, 4, config, gen()))
    fresh = ModelProposer(drafter, tiny.vocab_size).propose(DraftContext(b, 4, config, gen()))
    assert again.tokens == fresh.tokens and again.q is None and fresh.q is None  # greedy: deterministic
    sampling = params(temperature=1.0).sampling
    again = cached.propose(DraftContext(a, 3, sampling, gen(5)))
    fresh = ModelProposer(drafter, tiny.vocab_size).propose(DraftContext(a, 3, sampling, gen(5)))
    assert again.tokens == fresh.tokens and torch.allclose(again.q, fresh.q, atol=1e-6)
    assert again.q.shape == (3, tiny.vocab_size)
    torch.testing.assert_close(again.q.sum(-1), torch.ones(3))


def test_self_draft_view_shares_weights_and_equals_the_early_exit(tiny) -> None:
    target = tiny_loaded_model(seed=0, layers=4)
    view = self_draft_view(target, 2)
    assert view.num_layers == 2 and target.num_layers == 4  # the target is untouched
    assert view.model.model.layers[1].mlp.up_proj.weight is target.model.model.layers[1].mlp.up_proj.weight
    assert view.lm_head is target.lm_head and view.final_norm is target.final_norm
    ids = [3, 1, 4, 1, 5, 9]
    mine = forward(new_state(view), ids).logits  # [T, V]
    hidden = forward(new_state(target), ids, hidden_states=True).hidden_states[2]
    torch.testing.assert_close(mine, early_exit_logits(target, hidden, apply_norm=True), rtol=1e-5, atol=1e-5)
    with pytest.raises(InputError, match="draft_layers"):
        self_draft_view(target, 5)


def test_a_different_tokenizer_is_refused(tiny) -> None:
    class OtherTokenizer(ByteTokenizer):
        eos_token_id = 2

    other = wrap_model(tiny_llama(seed=1), OtherTokenizer(), spec="other")
    with pytest.raises(InputError, match="does not share the target.*eos_token_id"):
        check_same_tokenizer(tiny, other)
    check_same_tokenizer(tiny, tiny_loaded_model(seed=1))  # same tokenizer: fine
    with pytest.raises(InputError, match="Unknown drafter"):
        make_chain_proposer(tiny, "medusa")


def test_greedy_walk_equals_alg1_with_one_hot_p_and_rolls_back(tiny) -> None:
    """The greedy walk decides exactly like Alg. 1 with one-hot p and q; commit keeps root + accepted tokens."""
    from lab.engine.runtime import prefill
    from lab.engine.sampling import target_distribution
    from lab.speculative.verify import commit, verify

    config, ids = params().sampling, [5, 6, 7, 8]
    g = greedy_tokens(tiny, [*ids, 0][:-1], 4)
    wrong = (g[1] + 1) % tiny.vocab_size
    for tokens in ([g[0], g[1], g[2]], [g[0], wrong, g[2]], [wrong], []):
        state = prefill(tiny, ids[:-1])[0]
        v = verify(state, ids[-1], Draft(tokens), config, ids)
        walk = accept(Draft(tokens), v.processed, "greedy", config, gen(1))
        full = accept_chain(target_distribution(v.processed, config), None, tokens, gen(1))
        assert (walk.accepted, walk.recovered, walk.bonus) == (full.accepted, full.recovered, full.bonus)
        assert walk.tokens == g[: len(walk.tokens)]
        commit(state, v, Draft(tokens), walk)
        assert state.length == len(ids) + len(walk.accepted) and state.tokens == ids + walk.accepted


# --- greedy losslessness ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values",
    [
        {"drafter": "prompt-lookup"},
        {"drafter": "prompt-lookup", "adaptive": True, "gamma": 2, "gamma_max": 5, "max_ngram": 1},
        {"drafter": "self-draft", "draft_layers": 1, "gamma": 3},
        {"drafter": "model", "gamma": 4},  # empty draft_model: the target itself
        {"drafter": "prompt-lookup", "repetition_penalty": 1.3},
    ],
    ids=["lookup", "lookup-adaptive", "self-draft", "model-self", "lookup-penalty"],
)
def test_greedy_sd_equals_greedy(tiny, prompt_ids, values) -> None:
    expected = greedy_tokens(tiny, prompt_ids, 30, repetition_penalty=values.get("repetition_penalty", 1.0))
    events = run_sd(tiny, prompt_ids, max_new_tokens=30, **values)
    assert tokens_of(events) == expected and len(set(expected)) > 1


def test_other_model_drafter_and_always_right_drafter(tiny, prompt_ids) -> None:
    expected = greedy_tokens(tiny, prompt_ids, 30)
    other = run_sd(tiny, prompt_ids, ModelProposer(tiny_loaded_model(seed=1), tiny.vocab_size), max_new_tokens=30)
    assert tokens_of(other) == expected
    right = run_sd(tiny, prompt_ids, ModelProposer(tiny, tiny.vocab_size), max_new_tokens=30, gamma=4)
    assert tokens_of(right) == expected
    right = run_sd(tiny, prompt_ids, ModelProposer(tiny, tiny.vocab_size), max_new_tokens=31, gamma=4)
    stats = summarize(right)
    assert stats.acceptance_rate == 1.0 and stats.mean_accepted_length == 5.0
    assert all(r.accepted == len(r.draft_tokens) and r.bonus is not None for r in rounds_of(right))
    assert {e.source for e in right if isinstance(e, TokenEmitted)} == {"target", "accepted", "bonus"}
    finished = right[-1]
    assert finished.target_forwards == 1 + len(rounds_of(right)) == 1 + 6  # prefill (1 token) + 30 / 5 rounds
    assert finished.draft_forwards > 0


def test_always_wrong_drafter_reproduces_greedy(tiny, prompt_ids) -> None:
    expected = greedy_tokens(tiny, prompt_ids, 16)
    events = run_sd(tiny, prompt_ids, WrongProposer(tiny), max_new_tokens=16, gamma=3)
    assert tokens_of(events) == expected
    rounds, last = rounds_of(events)[:-1], rounds_of(events)[-1]
    assert len(rounds) == 14 and all(r.accepted == 0 and r.recovered is not None for r in rounds)
    assert all(r.p[0] == 0.0 and r.q[0] == 1.0 for r in rounds)  # one-hot p (greedy) vs deterministic q
    assert all(r.residual_top_ids[0] == r.recovered and r.residual_top_probs[0] == 1.0 for r in rounds)
    assert last.draft_tokens == [] and last.bonus is not None  # budget 1 left: no draft, the target's token
    sources = [e.source for e in events if isinstance(e, TokenEmitted)]
    assert sources == ["target"] + ["recovered"] * 14 + ["bonus"]  # the first token comes from the prefill
    assert summarize(events).acceptance_rate == 0.0 and summarize(events).mean_accepted_length == 1.0


# --- events, budget, bookkeeping --------------------------------------------------------------------------


def test_events_are_consistent_and_serialize(tiny, prompt_ids) -> None:
    events = run_sd(tiny, prompt_ids, ModelProposer(tiny_loaded_model(seed=1), tiny.vocab_size), max_new_tokens=25)
    rounds, tokens = rounds_of(events), [e for e in events if isinstance(e, TokenEmitted)]
    assert len(tokens) == 25 and 1 + sum(r.accepted + 1 for r in rounds) == 25 and tokens[0].source == "target"
    for r in rounds:
        mine = [e for e in tokens if e.step == r.step]
        assert [e.token_id for e in mine[: r.accepted]] == r.draft_tokens[: r.accepted]
        assert mine[-1].token_id == (r.recovered if r.recovered is not None else r.bonus)
        assert len(r.q) == len(r.p) == len(r.draft_tokens) == len(r.alt_texts) and r.gamma >= len(r.draft_tokens)
        assert r.uniforms == []  # greedy: the walk draws nothing
    finished = events[-1]
    assert isinstance(finished, RunFinished) and finished.target_forwards == 1 + len(rounds)
    assert finished.draft_forwards > len(rounds)  # the drafter ran its own forwards
    loaded = from_json(to_json(Trace("speculative", "tiny", "p", {}, events)))
    assert loaded.events == events


def test_budget_and_eos_helpers() -> None:
    draft = Draft([4, 0, 5], q=torch.eye(6)[[4, 0, 5]])
    cut = draft.cut_at_eos((0,))
    assert cut.tokens == [4, 0] and cut.q.shape == (2, 6)
    base = chain_settings(params(adaptive=True, gamma=3, gamma_max=4))
    assert next_gamma(3, 3, 3, base) == 4 and next_gamma(4, 4, 4, base) == 4
    assert next_gamma(3, 3, 1, base) == 2 and next_gamma(1, 1, 0, base) == 1
    assert next_gamma(3, 0, 0, base) == 3  # an empty draft changes nothing
    assert next_gamma(3, 3, 3, chain_settings(params(adaptive=False))) == 3


def test_budget_is_exact(tiny, prompt_ids) -> None:
    for n in (1, 2, 7):
        events = run_sd(tiny, prompt_ids, ModelProposer(tiny, tiny.vocab_size), max_new_tokens=n, gamma=5)
        assert len(tokens_of(events)) == n and events[-1].stop_reason == "max_new_tokens"
        assert all(len(r.draft_tokens) <= n - 1 for r in rounds_of(events))


# --- sampling losslessness (chi-square on a vocabulary of 8) ----------------------------------------------


def small_model(seed: int):
    """Vocabulary 8, LM head scaled x10 so p is far from uniform (seed 0 peaks on token 1, seed 1 on 2)."""
    model = tiny_llama(seed, vocab=8)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    model.generation_config.eos_token_id = 999  # never emitted: every run yields its two tokens
    return wrap_model(model, ByteTokenizer(), spec=f"tiny-v8-{seed}")


def exact_joint(loaded, prompt: list[int], config, skip: int = 1, length: int = 2) -> torch.Tensor:
    """p(x_{skip+1}, .., x_{skip+length}) [V] * length from full forwards through the same processors, the first
    `skip` tokens marginalised (the chain loop draws x1 from the prefill, so its rounds start at x2)."""
    from lab.engine.sampling import process_logits, target_distribution

    def p_next(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = loaded.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()
        return target_distribution(process_logits(logits, config, ids), config)

    def joint(ids: list[int], depth: int) -> torch.Tensor:
        p = p_next(ids)  # [V]
        if depth == 1:
            return p if len(ids) - len(prompt) >= skip else p.new_tensor(0.0)
        rows = [p[a] * joint(ids + [a], depth - 1) if p[a] > 0 else None for a in range(len(p))]
        shape = next(r.shape for r in rows if r is not None)
        stacked = torch.stack([r if r is not None else p.new_zeros(shape) for r in rows])
        return stacked.sum(0) if len(ids) - len(prompt) < skip else stacked

    return joint(prompt, skip + length)


def draw_pairs(target, make_proposer_fn, n: int, **values) -> list[tuple[int, int]]:
    """(x2, x3) of runs of 3 tokens: x1 comes from the prefill, x2 and x3 from one round with gamma = 1."""
    built = params(max_new_tokens=3, gamma=1, **values)
    generator, pairs = gen(11), []
    for _ in range(n):
        events = collect(chain_loop(target, [1], make_proposer_fn(), generator, chain_settings(built)))
        pairs.append(tuple(tokens_of(events)[1:3]))
    return pairs


def test_sampling_matches_the_target_with_a_model_drafter() -> None:
    target, drafter = small_model(0), small_model(1)
    pairs = draw_pairs(target, lambda: ModelProposer(drafter, 8), N_DRAWS, temperature=1.0)
    assert_joint_matches(pairs, exact_joint(target, [1], params(temperature=1.0).sampling))
    # the check can fail: the drafter's own distribution is rejected
    assert_joint_fails = exact_joint(drafter, [1], params(temperature=1.0).sampling)
    with pytest.raises(AssertionError):
        assert_joint_matches(pairs, assert_joint_fails)


@pytest.mark.parametrize("case", ["one-hot q", "q = p", "disjoint supports"])
def test_sampling_matches_the_target_with_processors(case: str) -> None:
    target = small_model(0)
    values = {"temperature": 0.8, "top_k": 4}
    config = params(**values).sampling
    joint = exact_joint(target, [1], config)
    first = joint.sum(1)  # p(x2) [8] (x1 marginalised)
    if case == "one-hot q":
        proposer = FixedProposer(int(first.argmax()))
    elif case == "q = p":
        proposer = FixedProposer(0, q_row=first)
    else:  # q lives where p is 0: every draft is rejected and x1 is drawn from norm(max(0, p - q)) = p
        outside = (first == 0).float()
        proposer = FixedProposer(0, q_row=outside / outside.sum())
    pairs = draw_pairs(target, lambda: proposer, N_DRAWS, **values)
    assert_joint_matches(pairs, joint)


# --- embedded model ---------------------------------------------------------------------------------------

EMBEDDED_PROMPTS = [p.text for p in BUILTIN_PROMPTS[::3]]  # 8 prompts, one per category
EMBEDDED_TOKENS = 48


@pytest.fixture(scope="module")
def embedded_greedy(embedded) -> dict[str, list[int]]:
    return {text: greedy_tokens(embedded, embedded.encode(text), EMBEDDED_TOKENS) for text in EMBEDDED_PROMPTS}


@pytest.mark.embedded
@pytest.mark.parametrize(
    "values",
    [
        {"drafter": "prompt-lookup"},
        {"drafter": "self-draft", "draft_layers": 8, "gamma": 3},
        {"drafter": "model", "draft_model": "smollm2-135m", "gamma": 4},
    ],
    ids=["prompt-lookup", "self-draft", "model"],
)
def test_embedded_greedy_sd_equals_greedy(embedded, embedded_greedy, values) -> None:
    for text, expected in embedded_greedy.items():
        events = run_sd(embedded, embedded.encode(text), max_new_tokens=EMBEDDED_TOKENS, **values)
        assert tokens_of(events) == expected, text
        assert events[-1].target_forwards <= len(expected) + 1
