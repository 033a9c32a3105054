"""DoLa (Chuang et al. 2024): layer selection, divergence, contrasts, the decode loop, events and views.

Unit part: the candidate-layer rule against values read off transformers 4.52.4's `_dola_decoding`, the
divergence and both contrasts on hand-made distributions, a 6-layer tiny Llama checked against an independent
no-cache reimplementation of the reference loop, trace round trips and the four figures. Integration part
(marked `embedded`): token-for-token equality with transformers 4.52.4's `generate(dola_layers=...)` recorded
in tests/data/dola_golden.json by scripts/make_dola_golden.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import plotly.graph_objects as go
import pytest
import torch
import torch.nn.functional as F

from lab.params import InputError, build_params
from lab.trace import LayerContrast, RunFinished, TokenEmitted, Trace, from_json, to_json
from strategies import collect, dola, get_strategy
from tests.tiny import tiny_loaded_model
from visualizers import VIEWS
from visualizers import dola as views

DOLA = get_strategy("dola")
GOLDEN = Path(__file__).parent / "data" / "dola_golden.json"


def run(loaded, prompt_ids: list[int], seed: int = 0, **values) -> list:
    params = build_params(DOLA.Params, values)
    return collect(DOLA.run(loaded, prompt_ids, params, torch.Generator().manual_seed(seed)))


def of_kind(events: list, kind: type) -> list:
    return [e for e in events if isinstance(e, kind)]


# --- candidate layers: expected lists written out from the reference's rule (transformers 4.52.4) ---

REFERENCE_BUCKETS = [
    # (N, tied, 'low', 'high')
    (30, True, [2, 4, 6, 8, 10, 12, 14], [15, 17, 19, 21, 23, 25, 27, 29]),
    (32, False, [0, 2, 4, 6, 8, 10, 12, 14], [16, 18, 20, 22, 24, 26, 28, 30]),
    (16, True, [2, 4, 6], [8, 10, 12, 14]),
    (16, False, [0, 2, 4, 6], [8, 10, 12, 14]),
    (60, True, [2, 4, 6, 8, 10, 12, 14, 16, 18], [40, 42, 44, 46, 48, 50, 52, 54, 56, 58]),
    (60, False, [0, 2, 4, 6, 8, 10, 12, 14, 16, 18], [40, 42, 44, 46, 48, 50, 52, 54, 56, 58]),
    (40, True, [2, 4, 6, 8, 10, 12, 14, 16, 18], [20, 22, 24, 26, 28, 30, 32, 34, 36, 38]),
    (41, True, [2, 4, 6, 8, 10, 12, 14, 16, 18], [21, 23, 25, 27, 29, 31, 33, 35, 37, 39]),
    (4, True, [2], [2]),  # start layer == N // 2
    (2, True, [1], [1]),
    (2, False, [0], [1]),
    (6, False, [0, 2], [3, 5]),
]


@pytest.mark.parametrize(("n", "tied", "low", "high"), REFERENCE_BUCKETS)
def test_candidate_buckets_follow_the_reference_rule(n: int, tied: bool, low: list[int], high: list[int]) -> None:
    assert dola.candidate_layers("low", n, tied) == low
    assert dola.candidate_layers("high", n, tied) == high
    assert dola.candidate_layers(" HIGH ", n, tied) == high


def test_explicit_layer_lists() -> None:
    assert dola.candidate_layers("0,2,4,6,8", 30, True) == [0, 2, 4, 6, 8]
    assert dola.candidate_layers("8, 2, 8, 29, 30, 45", 30, True) == [8, 2, 29]  # >= N dropped, deduplicated
    for bad in ("30,31", "-1,2", "two", "", "1.5"):
        with pytest.raises(InputError):
            dola.candidate_layers(bad, 30, True)
    with pytest.raises(InputError):  # range(2, 1, 2) is empty: the reference would crash on it
        dola.candidate_layers("low", 3, True)


# --- divergence and contrasts on hand-made distributions ---


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log()


def test_divergence_known_value_symmetry_and_zero() -> None:
    p, q = [0.5, 0.3, 0.2], [0.1, 0.1, 0.8]
    m = [(a + b) / 2 for a, b in zip(p, q, strict=True)]
    kl_m_p = sum(mi * math.log(mi / pi) for mi, pi in zip(m, p, strict=True))
    kl_m_q = sum(mi * math.log(mi / qi) for mi, qi in zip(m, q, strict=True))
    expected = 0.5 * (kl_m_p + kl_m_q) / 3  # the reference averages each KL over the vocabulary
    got = dola.js_divergences(logits_of(p), logits_of(q)[None, :])
    assert got.shape == (1,)
    assert float(got[0]) == pytest.approx(expected, rel=1e-9)
    assert float(dola.js_divergences(logits_of(q), logits_of(p)[None, :])[0]) == pytest.approx(expected, rel=1e-9)
    assert float(dola.js_divergences(logits_of(p), logits_of(p)[None, :])[0]) == pytest.approx(0.0, abs=1e-15)
    shifted = logits_of(p) + 3.0  # logits, not probabilities: a constant shift changes nothing
    assert float(dola.js_divergences(shifted, logits_of(p)[None, :])[0]) == pytest.approx(0.0, abs=1e-12)


def test_divergence_is_vectorized_over_candidates() -> None:
    final = logits_of([0.5, 0.3, 0.2])
    rows = torch.stack([logits_of([0.5, 0.3, 0.2]), logits_of([0.1, 0.1, 0.8]), logits_of([0.3, 0.4, 0.3])])
    batched = dola.js_divergences(final, rows)
    single = [float(dola.js_divergences(final, row[None, :])[0]) for row in rows]
    assert batched.tolist() == pytest.approx(single, rel=1e-12)
    assert int(batched.argmax()) == 1 and float(batched[0]) == pytest.approx(0.0, abs=1e-15)


def test_divergence_agrees_with_the_reference_kl_div_form() -> None:
    """The one-pass form equals transformers 4.52's two `F.kl_div(..., reduction="none").mean(-1)` terms."""
    generator = torch.Generator().manual_seed(0)
    final = torch.randn(512, generator=generator) * 8  # peaked, like unnormalized early exits
    premature = torch.randn(5, 512, generator=generator) * torch.tensor([[0.5], [2.0], [8.0], [20.0], [60.0]])
    mean = 0.5 * (final.softmax(-1)[None] + premature.softmax(-1))
    kl_final = F.kl_div(final.log_softmax(-1)[None], mean, reduction="none").mean(-1)
    kl_premature = F.kl_div(premature.log_softmax(-1), mean, reduction="none").mean(-1)
    expected = 0.5 * (kl_final + kl_premature)
    got = dola.js_divergences(final, premature)
    assert got.tolist() == pytest.approx(expected.tolist(), rel=1e-5)
    assert int(got.argmax()) == int(expected.argmax())


def test_plausibility_contrast_on_four_tokens() -> None:
    final, premature = [0.5, 0.3, 0.15, 0.05], [0.4, 0.1, 0.1, 0.4]
    original_final, original_premature = logits_of(final), logits_of(premature)
    a, b = original_final.clone(), original_premature.clone()
    got = dola.plausibility_contrast(a, b, alpha=0.2)  # V_head: q_N >= 0.2 * 0.5 = 0.1 -> tokens 0, 1, 2
    assert torch.equal(a, original_final) and torch.equal(b, original_premature)  # inputs untouched
    expected = [math.log(f / p) for f, p in zip(final[:3], premature[:3], strict=True)]
    assert got[:3].tolist() == pytest.approx(expected, rel=1e-9)
    assert got[3].item() == float("-inf")
    assert int(got.argmax()) == 1  # the contrast promotes the token the final layer gained most on
    assert torch.isinf(dola.plausibility_contrast(a, b, alpha=1.0)).sum() == 3  # alpha = 1 keeps the argmax only


def test_soft_contrast_on_four_tokens() -> None:
    final, premature, a = [0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4], 2.0
    got = dola.soft_contrast(logits_of(final), logits_of(premature), a)
    expected = [math.log(f) + a * max(0.0, math.log(f / p)) for f, p in zip(final, premature, strict=True)]
    assert got.tolist() == pytest.approx(expected, rel=1e-9)
    total = sum(math.exp(e) for e in expected)
    assert got.softmax(-1).tolist() == pytest.approx([math.exp(e) / total for e in expected], rel=1e-9)
    assert got[2:].tolist() == pytest.approx([math.log(0.2), math.log(0.1)], rel=1e-12)  # q_N < q_M: untouched
    unchanged = dola.soft_contrast(logits_of(final), logits_of(premature), 0.0).softmax(-1)
    assert unchanged.tolist() == pytest.approx(final, rel=1e-9)
    assert torch.isfinite(got).all()  # no token is removed


# --- the decode loop on a 6-layer tiny Llama, against an independent reimplementation of the reference ---


@pytest.fixture(scope="module")
def tiny6():
    """A 6-layer random Llama with scaled-up embeddings and LM head: at the default init every early exit is
    near uniform (DoLa would equal greedy); scaled, the layers disagree and DoLa changes tokens."""
    loaded = tiny_loaded_model(seed=3, layers=6)
    with torch.no_grad():
        loaded.embeddings.weight.mul_(50.0)
        loaded.lm_head.weight.mul_(20.0)
    return loaded


@pytest.fixture(scope="module")
def tiny_prompt(tiny6) -> list[int]:
    return tiny6.encode("Layers contrast", chat=False)


def reference_dola(loaded, prompt_ids: list[int], candidates: list[int], n: int, penalty: float) -> list:
    """transformers 4.52 `_dola_decoding` rewritten plainly: no cache, one lm_head call per candidate,
    HF's relative-top filter and repetition penalty, greedy; returns (token, chosen layer, greedy token)."""
    ids, out = list(prompt_ids), []
    with torch.inference_mode():
        for _ in range(n):
            result = loaded.model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
            final = result.logits[0, -1].float()  # [V]
            early = {j: loaded.lm_head(result.hidden_states[j][0, -1]).float() for j in candidates}
            js = []
            for j in candidates:
                m = 0.5 * (final.softmax(-1) + early[j].softmax(-1))
                kl1 = F.kl_div(final.log_softmax(-1), m, reduction="none").mean()
                kl2 = F.kl_div(early[j].log_softmax(-1), m, reduction="none").mean()
                js.append(float(0.5 * (kl1 + kl2)))
            chosen = candidates[js.index(max(js))]
            head, base = final.log_softmax(-1), early[chosen].log_softmax(-1)
            mask = head < head.max() + math.log(0.1)
            scores = head.masked_fill(mask, -math.inf) - base.masked_fill(mask, -1e-3)
            seen = torch.tensor(ids)

            def penalize(x: torch.Tensor, seen: torch.Tensor = seen) -> torch.Tensor:
                s = x.gather(0, seen)
                return x.scatter(0, seen, torch.where(s < 0, s * penalty, s / penalty))

            token = int(penalize(scores).argmax())
            out.append((token, chosen, int(penalize(final).argmax())))
            ids.append(token)
            if token in loaded.eos_token_ids:
                break
    return out


@pytest.mark.parametrize("layers", ["high", "low", "0,1,2,4"])
def test_tiny_dola_equals_reference_reimplementation(tiny6, tiny_prompt, layers: str) -> None:
    events = run(tiny6, tiny_prompt, dola_layers=layers, max_new_tokens=16)
    candidates = dola.candidate_layers(layers, 6, tied_embeddings=False)
    expected = reference_dola(tiny6, tiny_prompt, candidates, 16, 1.2)
    contrasts = of_kind(events, LayerContrast)
    assert [(e.token_id, e.chosen_layer, e.greedy_token_id) for e in contrasts] == expected
    assert [e.token_id for e in of_kind(events, TokenEmitted)] == [t for t, _, _ in expected]
    assert any(e.token_id != e.greedy_token_id for e in contrasts)  # the contrast really changes the output
    assert len({e.chosen_layer for e in contrasts}) >= min(2, len(candidates))  # M is chosen per step


def test_tiny_events_are_well_formed_and_round_trip(tiny6, tiny_prompt) -> None:
    events = run(tiny6, tiny_prompt, max_new_tokens=10, lens_all_layers=True)
    contrasts, tokens = of_kind(events, LayerContrast), of_kind(events, TokenEmitted)
    assert len(contrasts) == len(tokens) == 10 and isinstance(events[-1], RunFinished)
    assert events[-1].target_forwards == 10  # prefill + 9 decode steps: one forward per token
    for c, t in zip(contrasts, tokens, strict=True):
        assert c.step == t.step and c.token_id == t.token_id and c.token_text == tiny6.token_text(t.token_id)
        assert c.candidate_layers == [3, 5] and c.mode == "dola"
        assert len(c.divergences) == 2 and all(d >= 0 for d in c.divergences)
        assert c.chosen_layer == c.candidate_layers[c.divergences.index(max(c.divergences))]
        assert c.lens_layers == [1, 2, 3, 4, 5, 6] and len(c.lens_tokens) == 6
        assert c.top_labels == ["final", "premature", "contrast", "after penalty"]
        sizes = [len(x) for x in c.top_ids]
        assert sizes == [len(x) for x in c.top_tokens] == [len(x) for x in c.top_probs]
        assert sizes[:2] == [8, 8] and all(1 <= k <= 8 for k in sizes)  # V_head may hold fewer than 8 tokens
        assert all(p > 0 for probs in c.top_probs for p in probs)
        assert c.top_ids[3][0] == c.token_id  # greedy: the emitted token tops the distribution it came from
        assert all(p[0] >= p[-1] for p in c.top_probs)
        assert c.lens_tokens[-1] == tiny6.token_text(c.top_ids[0][0])  # lens at N = final layer's argmax
    trace = Trace("dola", tiny6.spec, "Layers contrast", {"dola_layers": "high"}, events)
    assert from_json(to_json(trace)).events == events


def test_tiny_lens_candidates_only_and_final_norm_option(tiny6, tiny_prompt) -> None:
    slim = of_kind(run(tiny6, tiny_prompt, max_new_tokens=4, lens_all_layers=False), LayerContrast)
    assert all(c.lens_layers == [3, 5, 6] and len(c.lens_tokens) == 3 for c in slim)
    assert len(views.lens_figure(slim).data[0].z) == 3  # the grid shows the layers the run computed
    full = of_kind(run(tiny6, tiny_prompt, max_new_tokens=4, lens_all_layers=True), LayerContrast)
    for a, b in zip(slim, full, strict=True):  # the lens rows change float rounding only, never the contrast
        assert a.divergences == pytest.approx(b.divergences, rel=1e-3)
        assert (a.chosen_layer, a.token_id, a.top_ids) == (b.chosen_layer, b.token_id, b.top_ids)
    normed = of_kind(run(tiny6, tiny_prompt, max_new_tokens=4, apply_final_norm=True), LayerContrast)
    assert normed[0].divergences != full[0].divergences  # lm_head(norm(h_j)) differs from lm_head(h_j)


def test_soft_mode_and_sampling(tiny6, tiny_prompt) -> None:
    soft = of_kind(run(tiny6, tiny_prompt, mode="soft", soft_alpha=0.0, max_new_tokens=8), LayerContrast)
    # a = 0 leaves log q_N, so the token is greedy's (same repetition penalty)
    assert all(c.mode == "soft" and c.token_id == c.greedy_token_id for c in soft)
    first = run(tiny6, tiny_prompt, seed=5, temperature=1.0, top_p=0.9, max_new_tokens=12)
    again = run(tiny6, tiny_prompt, seed=5, temperature=1.0, top_p=0.9, max_new_tokens=12)
    other = run(tiny6, tiny_prompt, seed=6, temperature=1.0, top_p=0.9, max_new_tokens=12)
    ids = [[e.token_id for e in of_kind(x, TokenEmitted)] for x in (first, again, other)]
    assert ids[0] == ids[1] and ids[0] != ids[2]


def test_bad_params_are_input_errors(tiny6, tiny_prompt) -> None:
    with pytest.raises(InputError):
        run(tiny6, tiny_prompt, dola_layers="6,7")
    with pytest.raises(InputError):
        build_params(DOLA.Params, {"mode": "hard"})
    assert "soft" in next(f for f in DOLA.Params.__dataclass_fields__.values() if f.name == "mode").metadata["help"]


# --- the views on a short real run ---


def test_views_on_a_real_run(tiny6, tiny_prompt) -> None:
    events = run(tiny6, tiny_prompt, max_new_tokens=12, lens_all_layers=True)
    contrasts = of_kind(events, LayerContrast)
    last = contrasts[-1]
    view = VIEWS["dola"]
    assert view.figures[0] is views.divergence_figure and view.highlight_label == "DoLa differs from greedy"

    bars = views.divergence_figure(events)
    bar = bars.data[0]
    assert isinstance(bar, go.Bar) and list(bar.x) == [f"L{j}" for j in last.candidate_layers]
    assert list(bar.y) == last.divergences
    chosen = last.candidate_layers.index(last.chosen_layer)
    assert [c == views.CHOSEN_COLOR for c in bar.marker.color] == [i == chosen for i in range(len(bar.x))]
    assert bars.layout.annotations[0].text == f"M = {last.chosen_layer}"

    heat = views.divergence_heatmap_figure(events)
    z = heat.data[0].z
    assert len(z) == len(last.candidate_layers) and all(len(row) == len(contrasts) for row in z)
    assert [z[i][-1] for i in range(len(z))] == last.divergences
    assert list(heat.data[1].y) == [c.chosen_layer for c in contrasts]

    lens = views.lens_figure(events)
    assert len(lens.data[0].z) == 6 and len(lens.data[0].text[0]) == len(contrasts)
    assert lens.data[0].text[-1][-1].rstrip("\u200c") == views.display_token(last.lens_tokens[-1])

    tops = views.topk_compare_figure(events)
    assert len(tops.data) == 4 and all(isinstance(t, go.Bar) for t in tops.data)
    assert list(tops.data[3].x) == last.top_probs[3]
    assert tops.data[3].marker.color[0] == views.EMITTED_COLOR  # greedy: the emitted token is rank 1

    expected = {c.step for c in contrasts if c.token_id != c.greedy_token_id}
    assert views.highlight_steps(events) == expected
    for figure in view.figures:
        assert isinstance(figure([]), go.Figure)  # empty state before the first step


def test_highlight_steps_use_the_greedy_choice() -> None:
    def step(i: int, token: int, greedy: int) -> LayerContrast:
        return LayerContrast(i, [2], [0.1], 2, "dola", token, "x", greedy, [2, 3], ["a", "b"], [], [], [], [])

    assert views.highlight_steps([step(0, 5, 5), step(1, 6, 7), step(2, 1, 1), step(3, 9, 2)]) == {1, 3}


# --- integration: transformers 4.52.4's DoLa on the embedded model ---


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.mark.embedded
def test_golden_prompt_ids_match_our_tokenizer(embedded, golden) -> None:
    assert golden["transformers_version"] == "4.52.4" and len(golden["prompts"]) >= 5
    assert [embedded.encode(text, chat=True) for text in golden["prompts"]] == golden["prompt_ids"]
    assert golden["num_hidden_layers"] == embedded.num_layers and golden["tie_word_embeddings"] is True
    assert dola.tied_embeddings(embedded) and golden["eos_token_id"] in embedded.eos_token_ids


@pytest.mark.embedded
@pytest.mark.parametrize("setting", [0, 1, 2])
def test_dola_matches_transformers_4_52_token_for_token(embedded, golden, setting: int) -> None:
    recorded = golden["runs"][setting]
    layers = recorded["dola_layers"]
    spec = layers if isinstance(layers, str) else ",".join(str(j) for j in layers)
    for prompt_ids, expected in zip(golden["prompt_ids"], recorded["generated_ids"], strict=True):
        events = run(
            embedded,
            prompt_ids,
            dola_layers=spec,
            repetition_penalty=golden["repetition_penalty"],
            max_new_tokens=golden["max_new_tokens"],
            lens_all_layers=False,
        )
        assert [e.token_id for e in of_kind(events, TokenEmitted)] == expected
