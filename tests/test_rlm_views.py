"""RLM's live views draw what the ReplCall events recorded: the call tree, the coverage map, the transcript."""

from __future__ import annotations

from lab.trace import ReplCall, RlmContext, RlmResult
from visualizers import strategy_figures, strategy_view
from visualizers.rlm import call_tree_figure, coverage_figure, transcript_figure

CONTEXT = RlmContext(0, "How many?", "count", "3", 1000, 300, "Log 0", "action", "full")


def call(call_id: int, parent: int, depth: int, role: str, ranges: list[list[int]], **extra) -> ReplCall:
    fields = dict(code=f"code {call_id}", action="", output=f"out {call_id}", error="", prompt_tokens=10,
                  output_tokens=2, latency_s=0.5)  # fmt: skip
    fields.update(extra)
    return ReplCall(call_id, call_id, parent, depth, role, ranges=ranges, **fields)


EVENTS = [
    CONTEXT,
    call(1, 0, 1, "sub", [[0, 100]]),
    call(2, 0, 1, "sub", [[100, 300]], error="sub-call limit reached"),
    call(0, -1, 0, "root", [[0, 300]], action='map("How many?", 2)', alternatives=["a", "b"], scores=[-0.1, -2.3]),
    call(3, -1, 0, "root", [], action="FINAL(3)", final="3"),
    RlmResult(0, "3", True, "final", 2, 2, 100, 300),
]


def test_call_tree_links_sub_calls_to_their_parent_turn() -> None:
    fig = call_tree_figure(EVENTS)
    edges, roots, subs = fig.data
    assert list(roots.x) == [0, 0] and list(subs.x) == [1, 1]
    assert len(list(edges.x)) == 3 * 3  # two sub-call edges and the root-to-root spine, None separated
    assert roots.marker.color[1] == "#ff7f0e" and subs.marker.color[1] == "#d62728"  # answer orange, error red
    assert "ranges read: [0:100]" in subs.hovertext[0]
    assert "REPL: full sandbox" in fig.layout.title.text


def test_the_isolation_level_is_shown_before_any_call() -> None:
    unisolated = RlmContext(0, "q", "count", "3", 1000, 300, "Log 0", "action", "unisolated")
    assert "NOT a sandbox" in call_tree_figure([unisolated]).layout.title.text


def test_coverage_map_rows_and_union() -> None:
    fig = coverage_figure(EVENTS)
    union = fig.data[0]
    assert list(union.base) == [0] and list(union.x) == [300]
    assert "30.0% of 1,000" in fig.layout.title.text
    assert len(fig.data) == 4  # union + the three calls that read something


def test_transcript_table_and_empty_states() -> None:
    table = transcript_figure(EVENTS).data[0]
    assert list(table.cells.values[0]) == [0, 1, 2, 3]  # tree order: root turn, its sub-calls, next turn
    assert "[error] sub-call limit reached" in table.cells.values[4][2]
    assert "a: -0.10" in table.cells.values[7][0]
    assert "✓ correct" in transcript_figure(EVENTS).layout.title.text
    for figure in (call_tree_figure, coverage_figure, transcript_figure):
        assert figure([]).layout.annotations  # the placeholder message
    assert len(strategy_view("rlm").figures) == 3 and len(strategy_figures("rlm", EVENTS)) == 3
