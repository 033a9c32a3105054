"""Visualizers on hand-built events: the token view's escaping, colours and hover titles, the top-k heatmap's
grid, labels, hover text, layout and emitted-token markers, the empty states and strategy dispatch."""

from __future__ import annotations

import html
import re
from pathlib import Path

import plotly.graph_objects as go
import pytest

from lab.trace import RunFinished, TokenEmitted
from visualizers import VIEWS, alternatives_table, strategy_figure, strategy_token_view, token_view_html, topk_figure
from visualizers.style import ZWNJ, base_layout, display_token, distinct_labels, token_background

HOSTILE = "<script>alert('x')</script>"


def _events() -> list:
    """Six steps: greedy picks, a repeated token, a hostile token, a newline, a rank-3 sample, one outside top-k."""
    return [
        TokenEmitted(0, 10, "The", "target", 0.01, [10, 11, 12], ["The", "A", "In"], [0.6, 0.3, 0.1]),
        TokenEmitted(1, 20, " cat", "accepted", 0.02, [20, 21, 22], [" cat", " dog", " the"], [0.5, 0.4, 0.1]),
        TokenEmitted(2, 20, " cat", "recovered", 0.03, [20, 23, 24], [" cat", " sat", "&"], [0.7, 0.2, 0.1]),
        TokenEmitted(3, 30, HOSTILE, "bonus", 0.04, [30, 31, 32], [HOSTILE, "<b>", '"q"'], [0.8, 0.15, 0.05]),
        TokenEmitted(4, 40, "\n", "target", 0.05, [41, 42, 40], ["x", "y", "\n"], [0.5, 0.3, 0.2]),
        TokenEmitted(5, 50, "zz", "target", 0.06, [51, 52, 53], ["a", "b", "c"], [0.4, 0.35, 0.25]),
        RunFinished(6, "max_new_tokens", 0.07, 4, 6),
    ]


def _spans(page: str) -> list[str]:
    return re.findall(r"<span class=\"dl-token[^>]*>.*?</span>", page, flags=re.S)


# --- style helpers ---------------------------------------------------------------------------------------------


def test_display_token_makes_whitespace_visible_and_escapes() -> None:
    assert display_token(" a\nb\t") == "␣a⏎b⇥"
    assert display_token("") == "∅"
    assert display_token("<b>&") == "&lt;b&gt;&amp;"
    assert display_token("<b>", escape=False) == "<b>"


def test_distinct_labels_appends_zero_width_non_joiners() -> None:
    labels = distinct_labels(["a", "b", "a", "a"])
    assert len(set(labels)) == 4
    assert [label.replace(ZWNJ, "") for label in labels] == ["a", "b", "a", "a"]
    assert labels[3] == "a" + ZWNJ * 2


def test_base_layout_has_uirevision_and_no_width() -> None:
    layout = base_layout("t", 300)
    assert layout["uirevision"] and layout["height"] == 300 and "width" not in layout
    assert layout["template"] == "none"


# --- token view -----------------------------------------------------------------------------------------------


def test_token_view_escapes_hostile_tokens() -> None:
    page = token_view_html(_events())
    assert "<script>" not in page and "<b>" not in page
    assert html.escape(HOSTILE, quote=True) in page


def test_token_view_has_one_span_per_token_coloured_by_source() -> None:
    events = _events()
    spans = _spans(token_view_html(events))
    tokens = [e for e in events if isinstance(e, TokenEmitted)]
    assert len(spans) == len(tokens)
    for span, event in zip(spans, tokens, strict=True):
        assert f"background: {token_background(event.source)};" in span
        assert f'data-step="{event.step}"' in span
    assert len({token_background(s) for s in ("target", "accepted", "recovered", "bonus")}) == 4


def test_token_view_titles_list_alternatives_with_probabilities() -> None:
    spans = _spans(token_view_html(_events()))
    title = html.unescape(re.search(r'title="([^"]*)"', spans[1]).group(1))
    assert "' cat'" not in title  # spaces shown visibly
    assert "'␣cat'  p=0.5000" in title and "'␣dog'  p=0.4000" in title and "'␣the'  p=0.1000" in title
    hostile_title = re.search(r'title="([^"]*)"', spans[3]).group(1)
    assert "<" not in hostile_title and "&lt;b&gt;" in hostile_title


def test_token_view_shows_newline_and_legend() -> None:
    page = token_view_html(_events())
    assert "⏎\n" in _spans(page)[4]
    legend = re.search(r'<div class="dl-legend".*?</div>', page, flags=re.S).group(0)
    for source in ("target", "accepted", "recovered", "bonus"):
        assert source in legend
    assert "rejected" not in legend


def test_token_view_outlines_selected_step_only() -> None:
    spans = _spans(token_view_html(_events(), selected_step=2))
    outlined = [i for i, span in enumerate(spans) if "outline:" in span]
    assert outlined == [2]
    assert not any("outline:" in span for span in _spans(token_view_html(_events())))


@pytest.mark.parametrize("events", [[], [RunFinished(0, "eos", 0.0, 3, 1)]])
def test_token_view_empty_placeholder(events: list) -> None:
    page = token_view_html(events)
    assert "No tokens yet." in page and "dl-token" not in page


def test_alternatives_table_rows() -> None:
    assert alternatives_table(_events(), 1) == [[1, "␣cat", 0.5], [2, "␣dog", 0.4], [3, "␣the", 0.1]]
    assert alternatives_table(_events(), 3)[0] == [1, HOSTILE, 0.8]
    assert alternatives_table(_events(), 99) == []


# --- top-k figure ---------------------------------------------------------------------------------------------


def _heatmap(fig: go.Figure) -> go.Heatmap:
    return next(t for t in fig.data if isinstance(t, go.Heatmap))


def _markers(fig: go.Figure) -> go.Scatter:
    return next(t for t in fig.data if isinstance(t, go.Scatter))


def test_topk_grid_shape_and_axes() -> None:
    heat = _heatmap(topk_figure(_events()))
    assert list(heat.x) == [0, 1, 2, 3, 4, 5]
    assert list(heat.y) == [1, 2, 3]
    assert len(heat.z) == 3 and all(len(row) == 6 for row in heat.z)
    assert heat.z[0][0] == 0.6 and heat.z[2][3] == 0.05


def test_topk_cell_labels_distinct_for_repeats_and_escaped() -> None:
    heat = _heatmap(topk_figure(_events(), width_px=2000))  # cells wide enough for every token
    flat = [label for row in heat.text for label in row]
    assert len(set(flat)) == len(flat)
    assert heat.text[0][1] != heat.text[0][2]
    assert heat.text[0][1].replace(ZWNJ, "") == heat.text[0][2].replace(ZWNJ, "") == "␣cat"
    assert "<" not in "".join(flat) and "&lt;script&gt;" in heat.text[0][3]
    assert heat.text[2][4].replace(ZWNJ, "") == "⏎"


def test_topk_cells_write_tokens_only_when_they_fit() -> None:
    narrow = _heatmap(topk_figure(_events(), width_px=120))  # 6 cells of ~13 px: hover only
    assert all(label == "" for row in narrow.text for label in row)
    assert all("cat" in hover or "step" in hover for row in narrow.customdata for hover in row if hover)
    medium = _heatmap(topk_figure(_events(), width_px=280))  # ~40 px cells: long tokens shortened
    assert medium.text[0][3].startswith("&lt;s") and medium.text[0][3].endswith("…")


def test_topk_hover_carries_step_rank_token_probability() -> None:
    heat = _heatmap(topk_figure(_events()))
    hover = heat.customdata[1][0]
    assert "step 0" in hover and "rank 2" in hover and "A" in hover and "p = 0.3000" in hover
    assert "%{customdata}" in heat.hovertemplate


def test_topk_layout_height_only_with_uirevision() -> None:
    fig = topk_figure(_events())
    assert fig.layout.uirevision and fig.layout.height and fig.layout.width is None
    assert fig.layout.yaxis.autorange == "reversed"


def test_topk_marks_emitted_rank_and_skips_tokens_outside_topk() -> None:
    marks = _markers(topk_figure(_events()))
    # steps 0-3 emit rank 1, step 4 (the newline) was sampled at rank 3, step 5's token is not in its top-k
    assert list(marks.x) == [0, 1, 2, 3, 4]
    assert list(marks.y) == [1, 1, 1, 1, 3]


def test_topk_keeps_last_max_steps() -> None:
    fig = topk_figure(_events(), max_steps=2)
    assert list(_heatmap(fig).x) == [4, 5]
    assert list(_markers(fig).x) == [4]


def test_topk_empty_state() -> None:
    for events in ([], [RunFinished(0, "eos", 0.0, 3, 1)]):
        fig = topk_figure(events)
        assert not fig.data
        assert "No tokens yet" in fig.layout.annotations[0].text
        assert fig.layout.uirevision and fig.layout.width is None


def test_strategy_figure_dispatch_and_fallback() -> None:
    assert VIEWS["greedy"].figures == (topk_figure,) and VIEWS["sample"].figures == (topk_figure,)
    known = strategy_figure("greedy", _events())
    unknown = strategy_figure("no-such-strategy", _events())
    assert known.to_plotly_json() == unknown.to_plotly_json()
    assert isinstance(_heatmap(unknown), go.Heatmap)


def test_highlighted_steps_are_underlined_and_explained() -> None:
    html_text = token_view_html(_events(), highlight_steps={1}, highlight_label="differs from greedy")
    spans = html_text.split('<span class="dl-token')[1:]
    assert "underline" in spans[1] and not any("underline" in s for i, s in enumerate(spans) if i != 1)
    assert "differs from greedy" in html_text
    assert "underline" not in strategy_token_view("greedy", _events())


def test_inspect_step_draws_the_steps_alternatives_and_drops_unknown_knobs() -> None:
    from visualizers import inspect_step

    events = _events()
    first = next(e for e in events if isinstance(e, TokenEmitted))
    figure = inspect_step("greedy", events, first.step, gamma=3.0)  # greedy declares no knobs: ignored
    bar = figure.data[0]
    assert list(bar.x) == first.top_probs
    assert len(bar.y) == len(first.top_tokens)
    assert "No token at step 999" in inspect_step("greedy", events, 999).layout.annotations[0].text


def _example(name: str):
    from lab.trace import from_json

    return from_json((Path(__file__).resolve().parent.parent / "examples" / "traces" / f"{name}.json").read_text())


def test_the_token_detail_of_a_round_is_that_tokens_own_and_the_tooltip_agrees() -> None:
    """A token in the middle of a verified round: its own p (not the round's first), the draft's q at its position,
    and the same numbers in the tooltip, the table and the figure (one source: token_detail.ranked)."""
    from visualizers.token_detail import token_detail, token_figure, token_rows

    trace = _example("speculative")
    tokens = [e for e in trace.events if isinstance(e, TokenEmitted)]
    index = next(i for i in range(1, len(tokens)) if tokens[i].step == tokens[i - 1].step)
    detail = token_detail(trace.events, index)
    assert detail.offset >= 1 and detail.event is tokens[index]
    assert [r[2] for r in token_rows(detail)] == [round(p, 4) for p in tokens[index].top_probs]
    assert [(r[0], r[2]) for r in alternatives_table(trace.events, index)] == [(r[0], r[2]) for r in token_rows(detail)]
    assert detail.q, "an accepted draft token has the drafter's q at its position"
    figure = token_figure(trace.events, index)
    assert [round(p, 4) for p in figure.data[0].x] == [round(p, 4) for p in tokens[index].top_probs]
    assert figure.data[1].name == "draft q" and figure.layout.title.text.startswith(f"Token {index + 1} ")
    assert f"p={tokens[index].top_probs[0]:.4f}" in token_view_html(trace.events)
    assert token_detail(trace.events, len(tokens)) is None and token_rows(None) == []


def test_the_token_detail_of_a_tree_round_has_the_drafts_q_under_the_accepted_path() -> None:
    from visualizers.token_detail import token_detail

    trace = _example("eagle")
    tokens = [e for e in trace.events if isinstance(e, TokenEmitted)]
    accepted = next(i for i, e in enumerate(tokens) if e.source == "accepted")
    detail = token_detail(trace.events, accepted)
    assert tokens[accepted].text in detail.q and 0 < detail.q[tokens[accepted].text] <= 1


def test_fit_figure_wraps_long_titles_and_puts_legends_in_their_own_row() -> None:
    from visualizers.fit import fit_figure

    fig = go.Figure([go.Scatter(x=[0], y=[0], name="accepted"), go.Scatter(x=[0], y=[0], name="rejected")])
    fig.update_layout(**base_layout("A long title " * 8, 300), legend={"orientation": "h", "y": -0.3})
    fitted = fit_figure(fig, 440)
    assert "<br>" in fitted.layout.title.text and fitted.layout.legend.y == 1.0
    assert fitted.layout.legend.yanchor == "bottom" and fitted.layout.height > 300
    assert fitted.layout.margin.t >= 44 + 20 + 26 and fitted.layout.yaxis.automargin
    short = fit_figure(go.Figure(layout=base_layout("Short", 300)), 440)
    assert short.layout.title.text == "Short" and short.layout.height == 300


def test_fit_figure_wraps_each_line_of_a_title_that_has_several() -> None:
    """A title with a <br> (RLM's call tree: the figure's name, then the REPL's isolation) has each long line wrapped,
    and the top margin grows by the lines added."""
    from visualizers.fit import LINE_PX, fit_figure

    long = "RLM call tree: root turns → code → llm_query sub-calls"
    fig = go.Figure(layout=base_layout(f"{long}<br>REPL: full isolation", 300))
    top = fig.layout.margin.t
    fitted = fit_figure(fig, 300)
    lines = fitted.layout.title.text.split("<br>")
    assert len(lines) == 3 and lines[-1] == "REPL: full isolation" and " ".join(lines[:2]) == long
    assert fitted.layout.margin.t >= top + LINE_PX
