"""Tree of Thoughts: model-call primitives, BFS / DFS plumbing on a tiny random model, the strategy's events,
the live views, the evaluation, and one embedded-model run."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from lab.app.runner import make_generator
from lab.engine import runtime
from lab.methods.tot import game24
from lab.methods.tot.lm import CallModel, build_trie
from lab.methods.tot.search import SearchConfig
from lab.params import InputError
from lab.tools.cli import main
from lab.tools.tot_eval import EvalResult, auc, cot_answer_ok, format_table, run_eval
from lab.trace import RunFinished, ThoughtNode, ThoughtResult, ThoughtStep, TokenEmitted, Trace, from_json, to_json
from strategies import get_strategy
from strategies.tot import ToTParams, prompt_text, run
from visualizers import inspect_step, strategy_figures
from visualizers.tot import agreement, counters_figure, frontier_figure, layered_layout, tree_figure

STATUSES = {"kept", "pruned", "solution"}


def reference_logprob(loaded, context: str, option: str) -> float:
    """log p(option | context) by plain chain forwards."""
    lm = CallModel(loaded)
    ids, n = lm.encode(context + option), len(lm.encode(context))
    state, out = runtime.prefill(loaded, ids[:1])
    logits = torch.cat([out.logits, runtime.forward(state, ids[1:]).logits]).log_softmax(-1)
    return sum(logits[i - 1, ids[i]].item() for i in range(n, len(ids)))


def run_tot(loaded, prompt: str = "4 9 10 13", seed: int = 0, **params) -> list:
    return list(run(loaded, loaded.encode(prompt), ToTParams(**params), make_generator(seed, loaded.device)))


def of(events: list, kind: type) -> list:
    return [e for e in events if isinstance(e, kind)]


def test_trie_merges_shared_prefixes_and_keeps_parents_first():
    parents, tokens, spans = build_trie([([5, 6], [[1, 2], [1, 3], [4]]), ([5, 7], [[1]])])
    assert tokens == [5, 6, 1, 2, 3, 4, 7, 1] and parents == [-1, 0, 1, 2, 2, 1, 0, 6]
    assert spans == [[(1, 3), (1, 4), (1, 5)], [(6, 7)]]
    with pytest.raises(ValueError):
        build_trie([([1], [[]])])


def test_score_matches_chain_forwards_and_restores_the_prefix_cache(tiny):
    lm = CallModel(tiny)
    options = ["ab", "abc", "b", "xyz 1"]
    scored = lm.score_many("hello ", [("wor", options), ("", options), ("wo", ["r" + o for o in options])])
    for option, a, b, c in zip(options, *scored, strict=True):
        assert math.isclose(a, reference_logprob(tiny, "hello wor", option), abs_tol=1e-4)
        assert math.isclose(b, reference_logprob(tiny, "hello ", option), abs_tol=1e-4)
        assert math.isclose(c, reference_logprob(tiny, "hello wo", "r" + option), abs_tol=1e-4)
    assert lm._prefixes["hello "].state.length == len(lm.encode("hello "))
    assert lm.usage.model_calls == 3 and lm.usage.forwards == 2


def test_sample_is_seeded_cut_at_stops_and_counted(tiny):
    def draw(seed: int) -> tuple[list[str], CallModel]:
        lm = CallModel(tiny)
        generator = make_generator(seed, tiny.device)
        texts = lm.sample("ab", "c", 20, temperature=1.0, max_tokens=6, stops=("e",), generator=generator)
        return texts, lm

    texts, lm = draw(0)
    assert texts == draw(0)[0] and texts != draw(1)[0]
    assert len(texts) == 20 and all("e" not in t for t in texts)
    assert lm.usage.model_calls == 20 and lm._prefixes["ab"].state.length == 2


def check_tree(events: list, k: int, breadth: int | None) -> None:
    nodes = of(events, ThoughtNode)
    ids = [n.node_id for n in nodes]
    assert isinstance(events[0], ThoughtNode) and events[0].parent == -1 and events[0].value is None
    assert len(ids) == len(set(ids)) and all(n.parent in ids[: ids.index(n.node_id)] for n in nodes[1:])
    assert all(n.status in STATUSES for n in nodes)
    children: dict[int, int] = {}
    for n in nodes[1:]:
        children[n.parent] = children.get(n.parent, 0) + 1
        assert n.depth == next(p.depth for p in nodes if p.node_id == n.parent) + 1
    assert max(children.values()) <= k
    for step in of(events, ThoughtStep):
        assert breadth is None or len(step.frontier) <= breadth
    calls = [n.model_calls for n in nodes]
    assert calls == sorted(calls)
    result = of(events, ThoughtResult)[0]
    assert result.path[0] == 0 and all(n.status != "pruned" for n in nodes if n.node_id in result.path)
    assert "".join(e.text for e in of(events, TokenEmitted)) == result.answer
    assert isinstance(events[-1], RunFinished) and events[-1].target_forwards == result.forwards


def test_bfs_with_model_value_events_statuses_and_limits(tiny):
    events = run_tot(tiny, k=4, breadth=2)
    check_tree(events, k=4, breadth=2)
    nodes = of(events, ThoughtNode)
    assert [s.step for s in of(events, ThoughtStep)] == [1, 2, 3] and max(n.depth for n in nodes) == 3
    assert [len([n for n in nodes if n.depth == d]) for d in (1, 2, 3)] == [4, 8, 8]
    for node in nodes[1:]:
        assert node.value_source == ("exact" if node.depth == 3 else "model")
        assert 0.0 <= node.value <= 1.0 and (node.depth == 3 or node.judgment in ("sure", "likely", "impossible"))
        assert node.depth == 3 or node.solver_value == float(game24.solvable(tuple(_left(node.text))))
    for step in (1, 2):
        level = [n for n in nodes if n.step == step]
        kept = sorted((n for n in level if n.status != "pruned"), key=lambda n: -n.value)
        assert len(kept) == 2 and min(n.value for n in kept) >= max(n.value for n in level if n.status == "pruned")
    result = of(events, ThoughtResult)[0]
    judged = [n for n in nodes if n.judgment]
    assert result.value_calls > 0 and result.compared == len(judged) and 0 <= result.agree <= result.compared
    assert (result.agree, result.compared) == agreement(events)  # one definition: search, eval and view
    assert result.solved == (nodes[result.path[-1]].status == "solution")


def _left(text: str) -> list[Fraction]:
    return [Fraction(x) for x in text.split("(left: ")[1].rstrip(")").split()]


@pytest.mark.parametrize("prompt", ["4 9 10 13", "2 3 6 13", "1 5 5 5"])
def test_solver_valued_bfs_over_every_legal_move_always_solves(tiny, prompt):
    events = run_tot(tiny, prompt, value="solver", k=32, breadth=1)
    check_tree(events, k=32, breadth=1)
    result = of(events, ThoughtResult)[0]
    assert result.solved and result.answer.splitlines()[-1].startswith("Answer: ")
    assert game24.check_expression(result.answer.splitlines()[-1].removeprefix("Answer: "), game24.parse_puzzle(prompt))
    assert result.value_calls == 0 and result.model_calls == 3  # three proposal calls, no value calls


def test_unsolvable_puzzle_reports_no_solution(tiny):
    result = of(run_tot(tiny, "1 1 1 1", value="solver", k=4, breadth=2), ThoughtResult)[0]
    assert result.solved is False and result.answer.endswith("No solution found.")


def test_dfs_prunes_below_the_threshold_backtracks_and_stops_at_a_solution(tiny):
    events = run_tot(tiny, search="dfs", value="solver", k=6, prune_below=0.5)
    check_tree(events, k=6, breadth=None)
    nodes = of(events, ThoughtNode)[1:]
    assert all((n.value < 0.5) == (n.status == "pruned") for n in nodes)
    result = of(events, ThoughtResult)[0]
    assert result.solved == any(n.status == "solution" for n in nodes)
    limited = run_tot(tiny, "1 1 1 1", search="dfs", value="model", k=3, prune_below=0.0, max_expansions=2)
    assert len(of(limited, ThoughtStep)) == 2 and of(limited, ThoughtResult)[0].solved is False


def test_vote_values_are_vote_shares(tiny):
    events = run_tot(tiny, value="vote", k=3, breadth=2, n_votes=7)
    for step in (1, 2):
        values = [n.value for n in of(events, ThoughtNode) if n.step == step]
        assert all(v * 7 == round(v * 7) for v in values) and math.isclose(sum(values), 1.0)


@pytest.mark.parametrize("task", ["question", "creative"])
@pytest.mark.parametrize("value", ["model", "vote"])
def test_text_tasks_run_to_their_depth(tiny, task, value):
    prompt = "Why is the sky blue? Because of scattering."
    events = run_tot(tiny, prompt, task=task, value=value, k=2, breadth=2, steps=2, max_new_tokens=6)
    check_tree(events, k=2, breadth=2)
    nodes = of(events, ThoughtNode)
    assert max(n.depth for n in nodes) <= 2 and of(events, ThoughtResult)[0].solved is None
    assert any(n.status == "solution" for n in nodes)


def test_bad_inputs_raise_input_error_before_any_model_call(tiny):
    with pytest.raises(InputError, match="whole numbers"):
        run_tot(tiny, "four nine ten thirteen")
    with pytest.raises(InputError, match="no exact solver"):
        run_tot(tiny, "Why?", task="question", value="solver")


def test_prompt_text_unwraps_the_chat_template(tiny):
    assert prompt_text(tiny, tiny.encode(" 4 9 10 13")) == " 4 9 10 13"


def test_trace_round_trips_and_views_draw_it(tiny):
    events = run_tot(tiny, k=3, breadth=2)
    trace = Trace("tot", "tiny", "4 9 10 13", {}, events)
    assert from_json(to_json(trace)).events == events
    figures = strategy_figures("tot", events)
    assert len(figures) == 3
    tree = tree_figure(events)
    names = {t.name for t in tree.data if t.name}
    assert {"root", "kept", "pruned", "final path"} <= names
    drawn = sum(len(t.x) for t in tree.data if t.mode == "markers+text")
    assert drawn == len(of(events, ThoughtNode))
    assert "model calls" in tree.layout.title.text
    assert frontier_figure(events).data and counters_figure(events).data
    for figure in (tree_figure, frontier_figure, counters_figure):  # empty state before the first node
        assert figure([]).layout.annotations
    inspected = inspect_step("tot", events, 0)  # token 0 lies in the first thought of the final path
    result = of(events, ThoughtResult)[0]
    assert len(inspected.data[0].x) == 3 and f"#{result.path[1]}" in " ".join(inspected.data[0].y)
    assert inspect_step("tot", events, 10_000).layout.annotations  # no such token: an empty figure


def test_layered_layout_centres_parents_over_children():
    def node(i: int, parent: int, depth: int) -> ThoughtNode:
        return ThoughtNode(depth, i, parent, depth, f"t{i}", None, "kept", 0, 0)

    nodes = {n.node_id: n for n in [node(0, -1, 0), node(1, 0, 1), node(2, 0, 1), node(3, 1, 2), node(4, 1, 2)]}
    pos = layered_layout(nodes)
    assert [pos[i][0] for i in range(5)] == [0, 1, 1, 2, 2]
    assert pos[1][1] == (pos[3][1] + pos[4][1]) / 2 and pos[0][1] == (pos[1][1] + pos[2][1]) / 2
    assert len({pos[i][1] for i in (2, 3, 4)}) == 3


def test_agreement_counts_model_verdicts_against_the_solver():
    def node(i: int, judgment: str, solver: float) -> ThoughtNode:
        return ThoughtNode(1, i, 0, 1, "x", 0.5, "kept", 0, 0, "model", judgment, solver)

    events = [node(1, "sure", 1.0), node(2, "impossible", 1.0), node(3, "impossible", 0.0), node(4, "likely", 0.0)]
    assert agreement(events) == (2, 4)
    assert auc([(0.9, 1.0), (0.1, 0.0), (0.5, 0.0)]) == 1.0 and auc([(0.5, 1.0), (0.5, 0.0)]) == 0.5
    assert auc([(0.5, 1.0)]) is None


def test_cot_answers_are_checked_exactly():
    assert cot_answer_ok("13 - 9 = 4 (left: 4 4 10)\nAnswer: (13 - 9) * (10 - 4) = 24", [4, 9, 10, 13])
    assert not cot_answer_ok("Answer: (13 - 9) * (10 - 3) = 24", [4, 9, 10, 13])
    assert not cot_answer_ok("(13 - 9) * (10 - 4) = 24", [4, 9, 10, 13])


def test_eval_rows_on_a_tiny_model(tiny):
    result = run_eval(tiny, [[4, 9, 10, 13], [1, 1, 1, 1]], SearchConfig(k=3, breadth=2), seed=0)
    assert isinstance(result, EvalResult) and len(result.runs) == 8
    rows = {row["method"]: row for row in result.rows()}
    assert set(rows) == {"ToT (model value)", "ToT (model vote)", "ToT (solver value)", "CoT sampling, best of N"}
    cot = [r for r in result.runs if r.method == "cot"]
    tot = [r for r in result.runs if r.method == "tot-model"]
    assert [r.model_calls for r in cot] == [r.model_calls for r in tot]  # same number of model calls
    assert rows["ToT (solver value)"]["solved"] <= 1  # 1 1 1 1 has no solution
    assert result.compared > 0 and "agrees on" in format_table(result)
    assert result.as_dict()["value_vs_solver"]["compared"] == result.compared
    without_cot = run_eval(tiny, [[4, 9, 10, 13]], SearchConfig(k=2, breadth=1), seed=0, cot=False)
    assert {r.method for r in without_cot.runs} == {"tot-model", "tot-vote", "tot-solver"}


def test_eval_cli_rejects_bad_options_before_loading(capsys):
    assert main(["eval", "tot", "--limit", "0"]) == 2
    assert main(["eval", "tot", "--k", "x"]) == 2
    assert "error" in capsys.readouterr().err


def test_strategy_is_registered_as_system_2():
    strategy = get_strategy("tot")
    assert strategy.family == "system 2" and strategy.Params is ToTParams


@pytest.mark.embedded
def test_embedded_model_solves_a_puzzle_with_solver_value(embedded):
    events = run_tot(embedded, "4 9 10 13", value="solver", k=8, breadth=3)
    result = of(events, ThoughtResult)[0]
    lines = result.answer.splitlines()
    assert result.solved and len(lines) == 4
    state = game24.as_state([4, 9, 10, 13])
    for line in lines[:3]:  # every step is a legal move of the state before it
        state = {m.text: m.left for m in game24.legal_moves(state)}[line]
    assert game24.check_expression(lines[3].removeprefix("Answer: "), [4, 9, 10, 13])
    assert embedded.decode(embedded.encode("4 9 10 13")) != "4 9 10 13"  # chat-wrapped, then unwrapped
    assert prompt_text(embedded, embedded.encode("4 9 10 13")) == "4 9 10 13"


def test_vote_and_value_options_are_full_sequences_none_a_prefix_of_another(tiny, monkeypatch):
    """SmolLM2 splits digits: p(" 1") would include " 10" ... " 19", so every scored option ends its line."""
    from lab.methods.tot.lm import CallModel
    from lab.methods.tot.prompts import VALUE_WORDS

    seen: list[list[str]] = []
    score_many = CallModel.score_many

    def record(self, prefix, queries):
        seen.extend(o for _, o in queries if all(x.strip().isdigit() or x.strip() in VALUE_WORDS for x in o))
        return score_many(self, prefix, queries)

    monkeypatch.setattr(CallModel, "score_many", record)
    run_tot(tiny, k=6, breadth=2, value="vote")
    run_tot(tiny, k=3, breadth=2, value="model")
    assert (
        any(len(options) >= 10 for options in seen) and [" sure\n", " likely\n", " impossible\n"] in seen
    )  # a vote over 12 choices: " 1\n" vs " 10\n" .. " 12\n"
    for options in seen:
        assert all(o.endswith("\n") for o in options)
        assert not any(a != b and b.startswith(a) for a in options for b in options)
