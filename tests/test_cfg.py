"""Classifier-free guidance (strategies.cfg) and its views (visualizers.cfg).

Unit part on the tiny random Llama: the guidance formula (Sanchez et al. 2023, Eq. 7) on a 4-token example
against hand computation and transformers' processor, gamma = 1 equals greedy, the batched two-row forward
equals two unbatched forwards (with left padding on either row), events and figures. Integration part
(marked `embedded`): greedy output equals `model.generate(guidance_scale=...)` token for token in fp32.
"""

from __future__ import annotations

import math

import plotly.graph_objects as go
import pytest
import torch
from transformers.generation.logits_process import UnbatchedClassifierFreeGuidanceLogitsProcessor
from transformers.modeling_outputs import CausalLMOutputWithPast

import strategies.cfg as cfg
from lab.app.builtin_prompts import BUILTIN_PROMPTS
from lab.engine import runtime
from lab.params import InputError, build_params
from lab.trace import GuidanceStep, RunFinished, TokenEmitted, Trace, from_json, to_json
from strategies import collect, get_strategy
from visualizers import VIEWS, strategy_figures
from visualizers.cfg import guidance_changed_steps, guidance_step_figure, reweighted_probs

CFG = get_strategy("cfg")
GREEDY = get_strategy("greedy")
NEGATIVE = "Answer in French, rudely."


def run(strategy, loaded, prompt_ids: list[int], seed: int = 0, **values) -> list:
    params = build_params(strategy.Params, values)
    return collect(strategy.run(loaded, prompt_ids, params, torch.Generator().manual_seed(seed)))


def tokens_of(events: list) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEmitted)]


def steps_of(events: list) -> list[GuidanceStep]:
    return [e for e in events if isinstance(e, GuidanceStep)]


@pytest.fixture(scope="module")
def prompt_ids(tiny) -> list[int]:
    return tiny.encode("The lab decodes", chat=False)


@pytest.fixture(scope="module")
def cfg_events(tiny, prompt_ids) -> list:
    values = {"max_new_tokens": 12, "gamma": 3.0, "unconditional": "negative-prompt", "negative_prompt": "zz"}
    return run(CFG, tiny, prompt_ids, **values)


# --- the guidance formula ----------------------------------------------------------------------------------------


class _FixedModel:
    """Stands in for the model inside HF's processor: its unconditional logits are fixed."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    def __call__(self, input_ids, **kwargs) -> CausalLMOutputWithPast:
        return CausalLMOutputWithPast(logits=self.logits.view(1, 1, -1))


@pytest.mark.parametrize("gamma", [0.0, 1.0, 1.5, 3.0])
def test_guided_scores_on_four_tokens(gamma: float) -> None:
    cond_logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    uncond_logits = torch.tensor([0.0, 2.0, 0.0, 0.5])
    cond_before, uncond_before = cond_logits.clone(), uncond_logits.clone()

    def log_softmax(z: list[float]) -> list[float]:
        norm = math.log(sum(math.exp(v) for v in z))
        return [v - norm for v in z]

    c, u = log_softmax(cond_logits.tolist()), log_softmax(uncond_logits.tolist())
    expected = [ui + gamma * (ci - ui) for ci, ui in zip(c, u, strict=True)]
    got = cfg.guided_scores(cond_logits.log_softmax(-1), uncond_logits.log_softmax(-1), gamma)
    assert got.tolist() == pytest.approx(expected, abs=1e-6)
    processor = UnbatchedClassifierFreeGuidanceLogitsProcessor(gamma, _FixedModel(uncond_logits))
    reference = processor(torch.tensor([[5, 7]]), cond_logits.view(1, -1))[0]
    assert torch.equal(got, reference)  # same operation order as HF: bitwise equal
    assert torch.equal(cond_logits, cond_before) and torch.equal(uncond_logits, uncond_before)
    if gamma == 3.0:  # the prompt prefers token 0 (delta +1.58 nats): guidance makes it the clear argmax
        assert int(got.argmax()) == 0 and got.softmax(-1)[0] > cond_logits.softmax(-1)[0]


# --- decoding on the tiny model ----------------------------------------------------------------------------------


def test_gamma_one_equals_greedy(tiny, prompt_ids) -> None:
    events = run(CFG, tiny, prompt_ids, max_new_tokens=20, gamma=1.0)
    expected = tokens_of(run(GREEDY, tiny, prompt_ids, max_new_tokens=20))
    assert tokens_of(events) == expected and len(set(expected)) > 1
    for step in steps_of(events):  # at gamma = 1 the guided distribution is the conditional one
        assert step.guided_probs == pytest.approx([math.exp(v) for v in step.cond_logprobs], rel=1e-5)
        assert step.kl_guided_cond == pytest.approx(0.0, abs=1e-6)


def test_guidance_changes_the_output(tiny, prompt_ids) -> None:
    plain = tokens_of(run(CFG, tiny, prompt_ids, max_new_tokens=20, gamma=1.0))
    guided = tokens_of(run(CFG, tiny, prompt_ids, max_new_tokens=20, gamma=4.0))
    assert plain != guided


@pytest.mark.parametrize("cond_text, uncond_text", [("The lab decodes tokens", "ab"), ("ab", "The lab decodes")])
def test_batched_forward_equals_two_unbatched_forwards(tiny, cond_text: str, uncond_text: str) -> None:
    cond_ids, uncond_ids = list(cond_text.encode()), list(uncond_text.encode())
    branches, logits = cfg.prefill_branches(tiny, cond_ids, uncond_ids)
    cond_state, cond_out = runtime.prefill(tiny, cond_ids)
    uncond_state, uncond_out = runtime.prefill(tiny, uncond_ids)
    assert logits.shape == (2, tiny.vocab_size)
    torch.testing.assert_close(logits[0], cond_out.logits[-1], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[1], uncond_out.logits[-1], atol=1e-5, rtol=0)
    for token in [5, 77, 120, 3, 200]:
        logits = cfg.step_branches(branches, token)
        torch.testing.assert_close(logits[0], runtime.decode_step(cond_state, token).logits[-1], atol=1e-5, rtol=0)
        torch.testing.assert_close(logits[1], runtime.decode_step(uncond_state, token).logits[-1], atol=1e-5, rtol=0)
    assert branches.state.forwards == 6
    assert branches.state.cache.get_seq_length() == max(len(cond_ids), len(uncond_ids)) + 5
    assert branches.next_positions.flatten().tolist() == [len(cond_ids) + 5, len(uncond_ids) + 5]


def test_one_forward_per_token_and_run_finished(tiny, prompt_ids, cfg_events) -> None:
    finished = cfg_events[-1]
    assert isinstance(finished, RunFinished) and sum(isinstance(e, RunFinished) for e in cfg_events) == 1
    n = len(tokens_of(cfg_events))
    assert finished.target_forwards == n == finished.step
    assert finished.prompt_tokens == len(prompt_ids)
    assert [s.step for s in steps_of(cfg_events)] == list(range(n))
    assert [s.token_id for s in steps_of(cfg_events)] == tokens_of(cfg_events)


def test_sampling_is_seeded(tiny, prompt_ids) -> None:
    values = {"max_new_tokens": 16, "gamma": 2.0, "temperature": 1.0, "top_k": 50}
    first = tokens_of(run(CFG, tiny, prompt_ids, seed=7, **values))
    assert first == tokens_of(run(CFG, tiny, prompt_ids, seed=7, **values))
    assert first != tokens_of(run(CFG, tiny, prompt_ids, seed=8, **values))
    greedy = {"max_new_tokens": 8, "gamma": 2.0}
    assert tokens_of(run(CFG, tiny, prompt_ids, seed=1, **greedy)) == tokens_of(run(CFG, tiny, prompt_ids, **greedy))


def test_unconditional_contexts_on_a_plain_prompt(tiny, prompt_ids) -> None:
    def uncond(**values) -> list[int]:
        return cfg.unconditional_ids(tiny, prompt_ids, build_params(cfg.CFGParams, values))

    assert uncond() == prompt_ids[-1:]
    assert uncond(unconditional="empty") == [tiny.eos_token_ids[0]]  # the byte tokenizer has no BOS
    assert uncond(unconditional="negative-prompt", negative_prompt="no") == list(b"no")
    assert not cfg.is_chat_prompt(tiny, prompt_ids)
    with pytest.raises(InputError, match="system turn"):  # raised when the run is created, not mid-stream
        CFG.run(tiny, prompt_ids, build_params(cfg.CFGParams, {"unconditional": "user-message"}), torch.Generator())


# --- events and views --------------------------------------------------------------------------------------------


def test_guidance_events_are_consistent_and_round_trip(cfg_events) -> None:
    steps = steps_of(cfg_events)
    for s in steps:
        n = len(s.token_ids)
        assert 8 <= n <= 24 and len(set(s.token_ids)) == n
        assert len(s.tokens) == len(s.cond_logprobs) == len(s.uncond_logprobs) == len(s.guided_probs) == n
        assert s.guided_probs == sorted(s.guided_probs, reverse=True) and sum(s.guided_probs) <= 1 + 1e-5
        assert all(v <= 0 for v in s.cond_logprobs + s.uncond_logprobs)
        assert s.token_id == s.token_ids[0]  # greedy: the emitted token is the guided argmax
        assert min(s.entropy_cond, s.entropy_uncond, s.entropy_guided, s.kl_guided_cond) >= 0
        assert s.gamma == 3.0
    trace = Trace("cfg", "tiny", "The lab decodes", {"gamma": 3.0}, cfg_events)
    loaded = from_json(to_json(trace))
    assert loaded.events == cfg_events


def test_step_figure_at_the_run_gamma_reproduces_the_guided_probs(cfg_events) -> None:
    for s in steps_of(cfg_events):
        recorded = [p / sum(s.guided_probs) for p in s.guided_probs]
        assert reweighted_probs(s, s.gamma) == pytest.approx(recorded, rel=1e-4, abs=1e-7)
        fig = guidance_step_figure(cfg_events, s.step, s.gamma)
        guided_bar = next(t for t in fig.data if t.name.startswith("guided"))
        assert list(guided_bar.y) == pytest.approx(recorded, rel=1e-4, abs=1e-7)
        other = guidance_step_figure(cfg_events, s.step, 1.0)
        assert list(next(t for t in other.data if t.name.startswith("guided")).y) != pytest.approx(recorded)
    first = steps_of(cfg_events)[0]  # gamma = 0: the uncond distribution, renormalized over the subset
    uncond = [math.exp(u) for u in first.uncond_logprobs]
    assert reweighted_probs(first, 0.0) == pytest.approx([u / sum(uncond) for u in uncond], rel=1e-5)


def test_figures_are_well_formed(cfg_events) -> None:
    steps = steps_of(cfg_events)
    last = steps[-1]
    figures = strategy_figures("cfg", cfg_events)
    assert len(figures) == 3 and all(isinstance(f, go.Figure) for f in figures)
    bars, delta, trace = figures
    assert [t.name for t in bars.data] == ["cond", "uncond", "guided"]
    assert list(bars.data[0].y) == pytest.approx([math.exp(v) for v in last.cond_logprobs])
    assert list(bars.data[2].y) == pytest.approx(last.guided_probs)
    assert all(len(t.x) == len(last.token_ids) for t in bars.data)
    expected_delta = [c - u for c, u in zip(last.cond_logprobs, last.uncond_logprobs, strict=True)]
    assert list(delta.data[0].y) == pytest.approx(expected_delta)
    assert [len(t.y) for t in trace.data] == [len(steps)] * 4
    assert list(trace.data[3].y) == pytest.approx([s.kl_guided_cond for s in steps])
    for fig in [*figures, guidance_step_figure(cfg_events, 0, 2.0)]:
        assert fig.layout.template.layout.to_plotly_json() == {} and fig.layout.height and fig.layout.width is None
        fig.to_json()  # serializable for the browser
    for fig in [f([]) for f in VIEWS["cfg"].figures] + [guidance_step_figure(cfg_events, 999, 2.0)]:
        assert not fig.data and fig.layout.annotations  # empty state with a message


def test_changed_steps_highlight(cfg_events) -> None:
    changed = guidance_changed_steps(cfg_events)
    for s in steps_of(cfg_events):
        top_cond = s.token_ids[max(range(len(s.token_ids)), key=lambda i: s.cond_logprobs[i])]
        assert (s.step in changed) == (top_cond != s.token_ids[0])


# --- integration: the embedded model ------------------------------------------------------------------------------


@pytest.mark.embedded
def test_unconditional_contexts_on_a_chat_prompt(embedded) -> None:
    text = BUILTIN_PROMPTS[0].text
    prompt_ids = embedded.encode(text, chat=True)
    assert cfg.is_chat_prompt(embedded, prompt_ids)
    assert not cfg.is_chat_prompt(embedded, embedded.encode(text, chat=False))
    values = {"unconditional": "user-message"}
    user = cfg.unconditional_ids(embedded, prompt_ids, build_params(cfg.CFGParams, values))
    assert "SmolLM" in embedded.tokenizer.decode(prompt_ids)  # the template's default system prompt
    assert embedded.tokenizer.decode(user) == f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    values = {"unconditional": "negative-prompt", "negative_prompt": NEGATIVE}
    negative = cfg.unconditional_ids(embedded, prompt_ids, build_params(cfg.CFGParams, values))
    assert negative == embedded.encode(NEGATIVE, chat=True)
    empty = cfg.unconditional_ids(embedded, prompt_ids, build_params(cfg.CFGParams, {"unconditional": "empty"}))
    assert empty == [embedded.tokenizer.bos_token_id]


@pytest.mark.embedded
@pytest.mark.parametrize("unconditional", ["last-token", "negative-prompt"])
@pytest.mark.parametrize("gamma", [1.5, 3.0])
@pytest.mark.parametrize("prompt", BUILTIN_PROMPTS[:5], ids=lambda p: p.text[:24])
def test_matches_hf_classifier_free_guidance(embedded, prompt, gamma: float, unconditional: str) -> None:
    """Greedy CFG equals generate(guidance_scale=gamma) with its default (last prompt token) unconditional
    context, and with negative_prompt_ids = the chat-wrapped negative prompt, token for token in fp32."""
    assert embedded.dtype == torch.float32
    prompt_ids = embedded.encode(prompt.text, chat=True)
    values = {"max_new_tokens": 40, "gamma": gamma, "unconditional": unconditional, "negative_prompt": NEGATIVE}
    kwargs = {}
    if unconditional == "negative-prompt":
        kwargs["negative_prompt_ids"] = torch.tensor([embedded.encode(NEGATIVE, chat=True)], device=embedded.device)
    with torch.inference_mode():
        output = embedded.model.generate(
            torch.tensor([prompt_ids], device=embedded.device),
            do_sample=False,
            max_new_tokens=40,
            guidance_scale=gamma,
            **kwargs,
        )
    expected = output[0, len(prompt_ids) :].tolist()
    events = run(CFG, embedded, prompt_ids, **values)
    assert tokens_of(events) == expected
    assert events[-1].target_forwards == len(expected)
