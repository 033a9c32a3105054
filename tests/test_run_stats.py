"""The numbers the stats say out loud (lab.app.run_stats): speedup against greedy with the reason below 1x, each
method's own quantity, the precision they are shown at, and the Compare table's speedup column."""

from __future__ import annotations

from lab.app import compare, run_stats
from lab.trace import (
    DraftRound,
    GuidanceStep,
    LayerContrast,
    MirostatStep,
    ReplCall,
    RlmContext,
    RlmResult,
    RunFinished,
    ThoughtNode,
    ThoughtResult,
    ThoughtStep,
    TokenEmitted,
    Trace,
    from_json,
)
from tests.appserver import ROOT


def _tokens(n: int, wall: float, forwards: int, per_step: int = 1) -> list:
    events = [TokenEmitted(i // per_step, i, "x", "target", wall * (i + 1) / n) for i in range(n)]
    return events + [RunFinished(n, "max_new_tokens", wall, 5, forwards)]


def _drafted(rounds: int, verify_s: float, draft_s: float, wall: float) -> list:
    events = []
    for r in range(rounds):
        events.append(DraftRound(r, "prompt-lookup", 4, [1, 2, 3, 4], list("abcd"), [1.0] * 4, [1.0] * 4, [0.1],
                                 1, recovered=9, draft_s=draft_s, verify_s=verify_s))  # fmt: skip
        events += [TokenEmitted(r, 1, "a", "accepted", 0.0), TokenEmitted(r, 9, "z", "recovered", 0.0)]
    return events + [RunFinished(rounds, "max_new_tokens", wall, 5, rounds)]


def test_speedup_against_greedy_and_the_reason_when_below_one():
    greedy = _tokens(20, wall=2.0, forwards=20)  # 10 tok/s, 0.1 s per decode step
    fast = run_stats.speed_vs_greedy(_drafted(10, 0.1, 0.02, wall=1.0), greedy)  # 20 tokens in 1 s
    assert fast.speedup == 2.0 and fast.greedy_tokens_per_s == 10.0 and fast.reason == ""
    slow = run_stats.speed_vs_greedy(_drafted(10, 0.45, 0.05, wall=5.0), greedy)  # 4 tok/s
    assert slow.speedup == 0.4
    assert slow.reason == (
        "a round cost 5.0 greedy decode steps (verify of 5 rows 4.5, drafting 0.5) and emitted τ = 2.00 tokens"
    )
    assert run_stats.speed_vs_greedy(_drafted(2, 0.1, 0.0, wall=0.0), greedy) is None
    assert run_stats.is_acceleration(_drafted(1, 0.1, 0.0, 1.0)) and not run_stats.is_acceleration(greedy)


def test_each_methods_key_quantity_is_named():
    miro = [MirostatStep(i, "v2", 3.0, 6.0, 6.0, s, s, 5, None, 1) for i, s in enumerate([2.0, 3.5])]
    miro.append(MirostatStep(0, "k=40", 3.0, None, None, 9.0, 9.0, 40, None, 1, series="top-k"))  # not the run's
    assert run_stats.key_quantities(miro) == [("observed surprise vs target τ", "2.75 vs 3.00 bits")]
    cfg = [GuidanceStep(0, 1.5, 1, [1], ["a"], [0.0], [0.0], [1.0], 0.1, 0.2, 0.1, 0.0)]
    assert run_stats.key_quantities(cfg) == [("guidance γ", "1.50")]
    dola = [LayerContrast(i, [2, 4], [0.1, 0.2], layer, "dola", 1, "a", 1, [], [], [], [], [], [])
            for i, layer in enumerate([4, 4, 2])]  # fmt: skip
    assert run_stats.key_quantities(dola) == [("chosen layer", "4 (2 of 3 steps)")]
    assert run_stats.key_quantities(_tokens(3, 1.0, 3)) == []


def test_numbers_are_shown_at_sensible_precision():
    assert run_stats.fmt(0.756789) == "0.76" and run_stats.fmt(45.8312, 1) == "45.8" and run_stats.fmt(None) == "-"
    assert run_stats.fmt(7) == "7"


def test_compare_has_a_speedup_column_against_the_greedy_run():
    example = from_json((ROOT / "examples" / "traces" / "speculative.json").read_text(encoding="utf-8"))
    greedy = Trace("greedy", "m", "p", {}, _tokens(20, wall=2.0, forwards=20))
    rows = compare.compare_rows([greedy, example])
    assert rows[0]["speedup vs greedy"] == "1.00x"
    expected = run_stats.speed_vs_greedy(example.events, greedy.events).speedup
    assert rows[1]["speedup vs greedy"] == f"{expected:.2f}x"
    assert len(rows[1]["acceptance"].split(".")[1]) == 2 and len(rows[1]["tau"].split(".")[1]) == 2
    assert compare.compare_rows([example])[0]["speedup vs greedy"] is None  # no greedy among them


def _call(call_id: int, role: str, parent: int, tokens: int) -> ReplCall:
    return ReplCall(call_id, call_id, parent, int(role == "sub"), role, "grep('x')", "", [], "out", "", tokens, 1, 0.5)


def test_rlm_stats_count_calls_and_sub_calls_and_put_the_answer_beside_the_expected_one():
    context = RlmContext(0, "How many | pipes?", "count", "12", 9000, 3000, "Log", "action", "full")
    live = [context, _call(0, "root", -1, 99), _call(1, "sub", 0, 49), _call(2, "sub", 0, 49)]
    rows = dict(run_stats.system2_quantities(live))
    assert (rows["root turns"], rows["sub-calls"], rows["tokens, all calls"]) == ("1", "2", "200")
    assert rows["answer"] == "…" and rows["expected"] == "12" and "verdict" not in rows
    assert run_stats.progress_line(live).startswith("Working: 1 root turns, 2 sub-calls, 200 tokens, all calls so")
    done = live + [RlmResult(0, "It is 12 | <b>", True, "final", 1, 2, 200, 9000)] + _tokens(3, 2.0, 40)
    rows = dict(run_stats.system2_quantities(done))
    assert rows["answer"] == "It is 12 \\| &lt;b&gt;" and rows["verdict"] == "correct"
    unknown = RlmContext(0, "Who?", "count", "", 9000, 3000, "Log", "action", "full")
    assert dict(run_stats.system2_quantities([unknown]))["expected"].startswith("unknown")


def test_tot_stats_read_the_counters_its_figure_shows():
    node = ThoughtNode(0, 0, -1, 0, "4 9 10 13", None, "kept", 0, 0)
    step = ThoughtStep(1, "bfs", [1, 2], 8, model_calls=50, tokens=2039)
    result = ThoughtResult(3, "game24", "bfs", "model", [0, 1], True, "(13-9)*(10-4)=24", 50, 2039, 7, 40)
    rows = dict(run_stats.system2_quantities([node, step, result, *_tokens(12, 3.0, 7)]))
    assert rows == {"model calls": "50", "tokens run": "2,039", "forwards": "7", "solved": "yes"}
    assert run_stats.system2_quantities(_tokens(3, 1.0, 3)) is None and run_stats.progress_line([node]) != ""
