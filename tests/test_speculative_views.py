"""Speculative decoding's views (visualizers/speculative.py) and bench options (`--params`, `--hf-assist`).

The figures are drawn from a real run on the tiny random Llama with a different-seed tiny drafter; the speedup
formula (Leviathan et al. 2023, Thm. 3.8) and the measured costs are checked on hand-made rounds.
"""

from __future__ import annotations

import json

import pytest

from lab.params import InputError
from lab.speculative.proposers import ModelProposer
from lab.tools.bench import parse_param_overrides
from lab.trace import DraftRound, summarize
from tests.test_speculative import rounds_of, run_sd
from tests.tiny import tiny_loaded_model
from visualizers import VIEWS
from visualizers.speculative import (
    acceptance_figure,
    measured_costs,
    round_detail_figure,
    round_inspect,
    rounds_figure,
    running_stats,
    speedup_figure,
    theoretical_speedup,
)
from visualizers.ssd import timeline_figure


@pytest.fixture(scope="module")
def prompt_ids(repeating_prompt_ids: list[int]) -> list[int]:
    return repeating_prompt_ids


# --- bench options ----------------------------------------------------------------------------------------


def test_bench_param_overrides_parse() -> None:
    parsed = parse_param_overrides(["speculative.drafter=self-draft", "speculative.gamma=4", "greedy.x=1"])
    assert parsed == {"speculative": {"drafter": "self-draft", "gamma": "4"}, "greedy": {"x": "1"}}
    for bad in (["drafter=self-draft"], ["speculative.=1"], ["speculative.gamma"]):
        with pytest.raises(InputError):
            parse_param_overrides(bad)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--strategies", "greedy", "--params", "speculative.gamma=4"], "not among the benched"),
        (["--strategies", "speculative", "--params", "speculative.gamma=99"], "out of range"),
        (["--strategies", "speculative", "--params", "speculative.drafter=medusa"], "not one of"),
        (["--strategies", "speculative", "--params", "gamma=4"], "NAME.key=value"),
    ],
)
def test_bench_bad_params_exit_2_before_loading(args: list[str], fragment: str, capsys) -> None:
    from lab.tools import cli

    assert cli.main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and fragment in err


# --- views ------------------------------------------------------------------------------------------------


def test_views_draw_the_rounds(tiny, prompt_ids) -> None:
    events = run_sd(tiny, prompt_ids, ModelProposer(tiny_loaded_model(seed=1), tiny.vocab_size), max_new_tokens=20)
    rounds = rounds_of(events)
    strip = rounds_figure(events)
    by_status = {trace.name: trace for trace in strip.data}
    assert len(by_status["accepted"].x) == sum(r.accepted for r in rounds)
    assert len(by_status["rejected"].x) == len(by_status["recovered"].x) == sum(r.recovered is not None for r in rounds)
    assert len(by_status["bonus"].x) == sum(r.bonus is not None for r in rounds)
    last = rounds[-1]
    detail = round_detail_figure(events)
    bars = {trace.name: trace for trace in detail.data}
    assert list(bars["q(x)"].y) == last.q and list(bars["p(x)"].y) == last.p
    assert list(bars["u (kept iff u < ratio)"].y) == last.uniforms
    assert round_inspect(events, last.step).to_plotly_json() == detail.to_plotly_json()
    alphas, lengths = running_stats(rounds)
    stats = summarize(events)
    assert alphas[-1] == pytest.approx(stats.acceptance_rate, abs=1e-4)
    assert lengths[-1] == pytest.approx(stats.mean_accepted_length, abs=1e-4)
    assert acceptance_figure(events).data and speedup_figure(events).data
    expected = (rounds_figure, round_detail_figure, acceptance_figure, speedup_figure, timeline_figure)
    assert VIEWS["speculative"].figures == expected
    for figure in (rounds_figure, round_detail_figure, acceptance_figure, speedup_figure):
        empty = figure([])
        assert not empty.data and empty.layout.annotations and empty.layout.uirevision
    json.dumps(speedup_figure(events).to_plotly_json(), default=str)


def test_theoretical_speedup_and_measured_costs() -> None:
    assert theoretical_speedup(0.0, 5, 0.2) == pytest.approx(1 / 2)
    assert theoretical_speedup(1.0, 4, 0.0) == 5.0
    assert theoretical_speedup(0.8, 3, 0.1) == pytest.approx((1 - 0.8**4) / (0.2 * 1.3))
    rounds = [
        DraftRound(
            0,
            "m",
            4,
            [1, 2, 3, 4],
            ["a"] * 4,
            [1.0] * 4,
            [1.0] * 4,
            [0.1] * 4,
            4,
            None,
            9,
            "b",
            draft_s=0.4,
            verify_s=1.0,
        ),
        DraftRound(
            1, "m", 4, [1, 2], ["a"] * 2, [1.0] * 2, [0.0] * 2, [0.1], 0, 7, None, "r", draft_s=0.2, verify_s=1.0
        ),
    ]
    c, measured, mean_gamma = measured_costs(rounds)
    assert c == pytest.approx((0.6 / 6) / 1.0) and mean_gamma == 3.0
    assert measured == pytest.approx(3.0 * 1.0 / (0.3 + 1.0))  # 3 tokens per round
    stats = summarize(rounds)
    assert stats.acceptance_rate == pytest.approx(4 / 5) and stats.mean_accepted_length == 3.0
    assert summarize([]).acceptance_rate is None and summarize([]).mean_accepted_length is None


@pytest.mark.embedded
def test_bench_with_overrides_and_hf_assist_row(embedded) -> None:
    from lab.tools.bench import HF_ASSIST_ROW, HF_ROW, format_table, run_bench

    result = run_bench(
        ["greedy", "speculative"],
        max_new_tokens=12,
        limit=1,
        device="cpu",
        dtype="float32",
        params={"speculative": {"gamma": "3", "max_ngram": "2"}},
        hf_assist="prompt-lookup",
    )
    rows = {row.name: row for row in result.rows}
    assert list(rows) == ["greedy", "speculative", HF_ROW, HF_ASSIST_ROW]
    assert "prompt lookup (3 tokens, n-gram 2)" in rows[HF_ASSIST_ROW].notes
    assert rows[HF_ASSIST_ROW].mean_new_tokens == rows["greedy"].mean_new_tokens  # greedy-equivalent output
    assert 0 < rows["speculative"].forwards_per_token <= 1.0 + 1 / 12  # prefill + at most one forward per token
    assert "acceptance_rate" in rows["speculative"].metrics and "mean_accepted_length" in rows["speculative"].metrics
    assert result.config["params"] == {"speculative": {"gamma": "3", "max_ngram": "2"}}
    assert f"| {HF_ASSIST_ROW} |" in format_table(result)
    json.dumps(result.as_dict(), allow_nan=False)


def test_token_labels_escape_markup_but_not_quotes() -> None:
    """Plotly decodes &lt; &gt; &amp; but shows &quot; literally: quotes stay raw, markup is escaped."""
    round_ = DraftRound(3, "m", 2, [5, 6], [' "', "<b>"], [1.0, 1.0], [1.0, 0.0], [0.2, 0.9], 1, 7, None, "&")
    strip = rounds_figure([round_])
    texts = [t for trace in strip.data for t in (trace.text or ())]
    assert '␣"' in texts and "&lt;b&gt;" in texts and "&amp;" in texts
    assert not any("&quot;" in t or "<b>" in t for t in texts)
