"""Mirostat v1 / v2 (Basu et al. 2021): the control law, the Zipf estimate, the k formula, v2's truncation set,
numerical robustness, seeded runs on the tiny Llama (reproducible, trace round trip, EOS masking, comparison
replays), the figures, the evaluation's helpers and CLI errors, and on the embedded model the property that
the running mean surprise converges to tau."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from lab.methods.mirostat import (
    LN2,
    LoopSpec,
    MirostatSampler,
    TruncationSampler,
    baseline_steps,
    estimate_s_hat,
    update_mu,
    v2_keep_mask,
    v2_truncation_size,
    zipf_k,
    zipf_log_k,
)
from lab.params import InputError, build_params
from lab.tools.cli import main
from lab.tools.mirostat_eval import (
    EvalResult,
    RowSpec,
    format_table,
    parse_baselines,
    parse_floats,
    rep4,
    summarize_row,
)
from lab.trace import MirostatStep, RunFinished, TokenEmitted, Trace, from_json, to_json
from strategies import collect, get_strategy
from strategies.mirostat import MirostatParams, resolved_eta
from tests.tiny import tiny_loaded_model
from visualizers import VIEWS
from visualizers.mirostat import control_figure, log_ticks, running_mean_figure, running_means, truncation_figure

MIROSTAT = get_strategy("mirostat")


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def zipf_log_probs(s: float, vocab: int) -> torch.Tensor:
    """log p_i for p_i proportional to i^-s, i = 1..vocab (float32, descending)."""
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    return (-s * ranks.log()).log_softmax(-1).float()


def run(loaded, prompt_ids: list[int], seed: int = 0, **values) -> list:
    return collect(MIROSTAT.run(loaded, prompt_ids, build_params(MirostatParams, values), gen(seed)))


def steps_of(events: list, series: str = "mirostat") -> list[MirostatStep]:
    return [e for e in events if isinstance(e, MirostatStep) and e.series == series]


# --- the math ----------------------------------------------------------------------------------------------------


def test_control_law_on_hand_values() -> None:
    assert update_mu(6.0, 4.5, 3.0, 1.0) == pytest.approx(4.5)  # too surprising: mu falls by the error
    assert update_mu(6.0, 1.0, 3.0, 1.0) == pytest.approx(8.0)  # too predictable: mu rises
    assert update_mu(6.0, 4.5, 3.0, 0.1) == pytest.approx(5.85)
    assert update_mu(2.0, 3.0, 3.0, 0.7) == pytest.approx(2.0)  # on target: unchanged


def test_eta_defaults_follow_the_convention() -> None:
    assert resolved_eta(build_params(MirostatParams, {})) == 1.0
    assert resolved_eta(build_params(MirostatParams, {"convention": "llama.cpp"})) == 0.1
    assert resolved_eta(build_params(MirostatParams, {"convention": "llama.cpp", "eta": 0.5})) == 0.5
    with pytest.raises(InputError):
        build_params(MirostatParams, {"version": "v3"})
    with pytest.raises(InputError):
        build_params(MirostatParams, {"convention": "hf"})


@pytest.mark.parametrize("s", [1.1, 1.5, 2.0])
def test_s_hat_recovers_the_zipf_exponent(s: float) -> None:
    assert estimate_s_hat(zipf_log_probs(s, 49152), 100) == pytest.approx(s, abs=1e-4)


def test_s_hat_uses_only_the_top_m() -> None:
    log_p = zipf_log_probs(1.5, 1000)
    log_p[100:] = float(log_p[99])  # flat after rank 100: outside the m = 100 window (99 pairs)
    assert estimate_s_hat(log_p, 100) == pytest.approx(1.5, abs=1e-4)
    assert estimate_s_hat(log_p, 200) < 1.5 - 1e-3  # a wider window sees the flat tail


def test_k_formula_on_a_synthetic_zipf() -> None:
    s, mu, n = 1.5, 5.0, 50000
    expected = ((0.5 * 2**5) / (1 - n**-0.5)) ** (1 / 1.5)  # Alg. 1's k, written out
    assert math.exp(zipf_log_k(s, mu, n)) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(6.3687, abs=1e-3)
    assert zipf_k(s, mu, n, "paper") == 7  # round(6.37) + 1, as the reference code
    assert zipf_k(s, mu, n, "llama.cpp") == 6  # floor
    sampler = MirostatSampler("v1", tau=2.5, eta=1.0)  # mu_0 = 2 tau = 5
    log_p = zipf_log_probs(1.5, n)
    kept_lp, kept_ids, s_hat = sampler.truncate(log_p)
    assert s_hat == pytest.approx(1.5, abs=1e-4)
    assert kept_ids.tolist() == list(range(7))  # the 7 most probable tokens


def test_v2_truncation_set_on_six_tokens() -> None:
    probs = torch.tensor([0.0625, 0.5, 0.03125, 0.25, 0.03125, 0.125])  # surprises 4, 1, 5, 2, 5, 3 bits
    log_p = probs.log()
    assert v2_keep_mask(log_p, 3.5).tolist() == [False, True, False, True, False, True]
    assert v2_truncation_size(log_p, 2.5) == 2
    assert v2_truncation_size(log_p, 4.5) == 4
    assert v2_truncation_size(log_p, 5.5) == 6
    assert v2_keep_mask(log_p, 0.5).tolist() == [False, True, False, False, False, False]  # at least the argmax
    draws = []
    for seed in range(200):
        sampler = MirostatSampler("v2", tau=1.75, eta=1.0)  # mu = 3.5: keeps ids 1, 3, 5
        draws.append(sampler(log_p, gen(seed)))
    assert {c.token for c in draws} == {1, 3, 5}
    assert all(c.k == 3 and c.mu == 3.5 for c in draws)
    pick = next(c for c in draws if c.token == 3)  # p = 0.25 before, 0.25 / 0.875 after truncation
    assert pick.surprise == pytest.approx(2.0, abs=1e-5)  # paper: untruncated
    assert pick.mu_next == pytest.approx(3.5 - (2.0 - 1.75), abs=1e-5)
    llama = MirostatSampler("v2", tau=1.75, eta=0.1, convention="llama.cpp")
    seed = next(s for s in range(200) if draws[s].token == 3)
    assert llama(log_p, gen(seed)).surprise == pytest.approx(-math.log2(0.25 / 0.875), abs=1e-5)


# --- robustness --------------------------------------------------------------------------------------------------


def _finite_choice(choice, vocab: int) -> None:
    assert 1 <= choice.k <= vocab
    assert math.isfinite(choice.surprise) and math.isfinite(choice.mu_next)
    assert all(math.isfinite(p) for p in choice.top_probs)


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("convention", ["paper", "llama.cpp"])
def test_no_nan_when_probabilities_underflow(version: str, convention: str) -> None:
    vocab = 4096
    gaps = torch.cat([torch.tensor([0.0, -1000.0, -2000.0]), torch.full((vocab - 3,), float("-inf"))])
    peaked = torch.zeros(vocab).index_fill(0, torch.tensor([7]), 60.0)  # p_max = 1 - 4095 e^-60
    one = torch.full((vocab,), float("-inf")).index_fill(0, torch.tensor([5]), 0.0)  # a single finite token
    for logits, expected in ((gaps, 0), (peaked, 7), (one, 5)):
        for tau in (0.5, 3.0, 12.0):
            sampler = MirostatSampler(version, tau, 1.0, convention=convention)
            for _ in range(5):  # mu drifts far: the steps must stay finite
                choice = sampler(logits, gen(1))
                _finite_choice(choice, vocab)
                assert choice.token == expected
    assert estimate_s_hat(one.log_softmax(-1), 100) is None
    assert zipf_k(None, 3.0, vocab) == 1
    assert math.isfinite(estimate_s_hat(gaps.log_softmax(-1), 100))  # only the finite pairs count


def test_k_is_stable_near_s_hat_1_and_clamped() -> None:
    n = 49152
    limit = 5.0 * LN2 - math.log(math.log(n))  # s = 1: k = 2^mu / ln N
    assert zipf_log_k(1.0, 5.0, n) == pytest.approx(limit, abs=1e-12)
    for eps in (1e-15, -1e-15, 1e-9, -1e-9, 9e-8, 1.1e-7, -9e-8, -1.1e-7):  # both sides of the series switch
        assert zipf_log_k(1.0 + eps, 5.0, n) == pytest.approx(limit, abs=1e-5)
    for eps in (-1e-3, 1e-3):  # continuous through s_hat = 1
        assert zipf_log_k(1.0 + eps, 5.0, n) == pytest.approx(limit, abs=0.01)
    assert zipf_k(1.0, 1e4, n) == n and zipf_k(1.5, 1e4, n) == n  # 2^mu would overflow
    assert zipf_k(1.5, -1e4, n, "paper") == 1 and zipf_k(1.5, -1e4, n, "llama.cpp") == 1
    for s_hat in (0.0, -0.5, 1e-12):  # flat top: the limit s_hat -> 0+, all or nothing around mu = log2(N - 1)
        assert zipf_k(s_hat, 3.0, n) == 1 and zipf_k(s_hat, 16.0, n) == n
    assert zipf_k(0.9, 3.0, n) >= 1 and zipf_k(50.0, 3.0, n) == 2  # round(~1) + 1
    assert zipf_k(1.2, 3.0, 1) == 1


# --- runs on the tiny model ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompt_ids(tiny) -> list[int]:
    return tiny.encode("Mirostat holds", chat=False)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_tiny_run_is_reproducible_and_round_trips(tiny, prompt_ids, version: str) -> None:
    values = {"version": version, "tau": 7.0, "max_new_tokens": 24, "ignore_eos": True, "compare": True}
    events = run(tiny, prompt_ids, seed=3, **values)
    again = run(tiny, prompt_ids, seed=3, **values)
    other = run(tiny, prompt_ids, seed=4, **values)
    steps = [e for e in events if isinstance(e, MirostatStep)]
    assert steps == [e for e in again if isinstance(e, MirostatStep)]
    tokens = [e.token_id for e in events if isinstance(e, TokenEmitted)]
    assert tokens == [e.token_id for e in again if isinstance(e, TokenEmitted)]
    assert tokens != [e.token_id for e in other if isinstance(e, TokenEmitted)]
    assert len(tokens) == 24 and [e.token_id for e in steps_of(events)] == tokens
    assert len(steps_of(events, "top-k")) == len(steps_of(events, "top-p")) == 24
    mirostat = steps_of(events)
    assert mirostat[0].mu == 14.0  # mu_0 = 2 tau
    for before, after in zip(mirostat, mirostat[1:], strict=False):
        assert after.mu == before.mu_next
        assert before.mu_next == pytest.approx(before.mu - (before.surprise - 7.0))  # eta = 1 (paper)
    assert all((e.s_hat is not None) == (version == "v1") for e in mirostat)
    finished = events[-1]
    assert isinstance(finished, RunFinished) and finished.step == 24
    assert finished.target_forwards == 3 * 24  # the run plus two replays
    trace = Trace("mirostat", "tiny", "Mirostat holds", values, events)
    assert from_json(to_json(trace)) == trace


def test_compare_replays_use_the_same_seed(tiny, prompt_ids) -> None:
    events = run(tiny, prompt_ids, seed=5, version="v2", max_new_tokens=12, ignore_eos=True, compare=True)
    for method, value in (("top-k", 40), ("top-p", 0.9)):
        sampler = TruncationSampler(method, value)
        spec = LoopSpec(method, sampler.label, 3.0, 12, True, False)
        direct = list(baseline_steps(tiny, prompt_ids, sampler, spec, gen(5)))
        replay = steps_of(events, method)
        assert [e.token_id for e in direct] == [e.token_id for e in replay]
        assert all(e.mu is None and e.surprise == e.model_surprise for e in replay)
    assert sum(isinstance(e, TokenEmitted) for e in events) == 12  # the text stays Mirostat's


def test_ignore_eos_masks_end_of_sequence() -> None:
    loaded = tiny_loaded_model(seed=0)
    loaded.model.generation_config.eos_token_id = list(range(128))  # half the vocabulary ends the run
    ids = loaded.encode("Mirostat holds", chat=False)
    stopped = run(loaded, ids, seed=0, version="v2", tau=7.0, max_new_tokens=40)
    assert stopped[-1].stop_reason == "eos" and stopped[-1].step < 40
    masked = run(loaded, ids, seed=0, version="v2", tau=7.0, max_new_tokens=40, ignore_eos=True)
    tokens = [e.token_id for e in masked if isinstance(e, TokenEmitted)]
    assert len(tokens) == 40 and min(tokens) >= 128
    assert masked[-1].stop_reason == "max_new_tokens"


# --- figures ---------------------------------------------------------------------------------------------------------


def test_figures_draw_the_events(tiny, prompt_ids) -> None:
    events = run(tiny, prompt_ids, seed=2, version="v1", tau=6.0, max_new_tokens=16, ignore_eos=True, compare=True)
    mirostat = steps_of(events)
    control = control_figure(events)
    assert list(control.data[0].y) == [e.surprise for e in mirostat]
    assert list(control.data[1].y) == [e.mu for e in mirostat]
    assert control.layout.shapes[0].y0 == 6.0  # the tau line
    means = running_mean_figure(events)
    assert [t.name for t in means.data] == ["mirostat v1", "top-k (k=40)", "top-p (p=0.9)"]
    assert means.data[0].y[-1] == pytest.approx(statistics.fmean(e.model_surprise for e in mirostat))
    truncation = truncation_figure(events)
    assert list(truncation.data[0].y) == [e.k for e in mirostat]
    ticks = list(truncation.layout.yaxis.tickvals)
    assert ticks[0] >= min(e.k for e in mirostat) and ticks[-1] <= max(e.k for e in mirostat)
    assert running_means([1.0, 3.0, 2.0]) == [1.0, 2.0, 2.0]
    for figure in (control_figure, running_mean_figure, truncation_figure):
        empty = figure([])
        assert not empty.data and empty.layout.annotations[0].text == "No Mirostat steps yet"
    assert VIEWS["mirostat"].figures == (control_figure, running_mean_figure, truncation_figure)


def test_log_ticks_never_crowd() -> None:
    """Plotly's own log ticks label every digit of a short range ('9' over '10'); ours step 1-2-5, or only powers of
    ten over a wide range, and keep both ends of a range that holds no such value."""
    assert log_ticks(1, 10) == [1, 2, 5, 10]
    assert log_ticks(1, 49152) == [1, 10, 100, 1000, 10000]
    assert log_ticks(2, 2000) == [10, 100, 1000]
    assert log_ticks(3, 4) == [3, 4]
    assert log_ticks(7, 7) == [7]


# --- the evaluation's helpers and CLI errors ---------------------------------------------------------------------


def _step(step: int, s: float, k: int, token: int) -> MirostatStep:
    return MirostatStep(step, "v2", 3.0, 6.0, 6.0, s, s, k, None, token)


def test_evaluation_helpers_on_hand_values() -> None:
    assert rep4([1, 2, 3, 4, 1, 2, 3, 4]) == pytest.approx(1 - 4 / 5)
    assert rep4([1, 2, 3]) == 0.0
    assert parse_floats("2, 3,4.5", "--taus") == (2.0, 3.0, 4.5)
    assert [r.label for r in parse_baselines("top-k=40,top-p=0.9")] == [("top-k", "k=40"), ("top-p", "p=0.9")]
    for bad in ("top-k=0", "top-k=2.5", "top-p=1.5", "top-q=3", "top-k"):
        with pytest.raises(InputError):
            parse_baselines(bad)
    runs = [[_step(0, 1.0, 10, 1), _step(1, 2.0, 20, 2), _step(2, 3.0, 30, 3), _step(3, 4.0, 40, 4)]] * 2
    row = summarize_row(RowSpec("mirostat", "v2", 3.0), runs)
    assert (row.mean_first, row.mean_last, row.mean_k_last) == (1.5, 3.5, 35.0)
    assert row.rel_error == pytest.approx(0.5 / 3, abs=1e-4)
    table = format_table(EvalResult({"model": "m", "device": "cpu", "dtype": "f", "n_prompts": 2,
                                     "max_new_tokens": 4, "seed": 0}, [row]))  # fmt: skip
    assert "| mirostat v2 | tau=3 | 3 | 1.500 | 3.500 | +16.7% ✗ | 35.0 | 0.000 |" in table


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "mirostat", "--taus", "two"],
        ["eval", "mirostat", "--taus", "99"],
        ["eval", "mirostat", "--baselines", "top-q=3"],
        ["eval", "mirostat", "--max-new-tokens", "2"],
        ["eval", "dola"],
    ],
)
def test_eval_cli_rejects_bad_input_before_loading(argv: list[str], capsys) -> None:
    assert main(argv) == 2
    assert "error" in capsys.readouterr().err


# --- the embedded model --------------------------------------------------------------------------------------------


@pytest.mark.embedded
def test_embedded_v2_running_mean_surprise_moves_to_tau(embedded) -> None:
    ids = embedded.encode("Write a short poem about a lighthouse keeper.")
    events = run(embedded, ids, seed=0, version="v2", tau=3.0, max_new_tokens=64, ignore_eos=True)
    steps = steps_of(events)
    assert len(steps) == 64
    surprises = [e.surprise for e in steps]
    assert surprises == pytest.approx([e.model_surprise for e in steps], abs=1e-4)  # paper convention, T = 1
    # the control law telescopes: mean(S) - tau = (mu_0 - mu_T) / (eta T)
    assert statistics.fmean(surprises) - 3.0 == pytest.approx((steps[0].mu - steps[-1].mu_next) / 64, abs=1e-9)
    errors = [abs(m - 3.0) for m in running_means(surprises)]
    assert errors[-1] < max(errors[:8])  # closer to tau than early on
    assert errors[-1] <= 0.2 * 3.0  # within 20% after 64 tokens (a repetitive stretch winds mu up: see eval)
    assert all(e.mu_next > e.mu for e in steps if e.surprise < 3.0)  # the feedback's direction, on the model
    assert len({e.k for e in steps}) > 1  # the truncation actually moved
