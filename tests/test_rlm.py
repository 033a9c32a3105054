"""RLM: constrained decoding over the action trie, the grammar, the task generator, the loop on a tiny model
and (embedded) the small model completing generated tasks in action mode."""

from __future__ import annotations

import pytest
import torch

from lab.app.runner import make_generator
from lab.engine import runtime
from lab.methods.rlm import actions, lm, tasks
from lab.methods.rlm.loop import answer_matches
from lab.params import InputError, build_params
from lab.trace import ReplCall, RlmContext, RlmResult, RunFinished, TokenEmitted, Trace, from_json, to_json
from strategies import get_strategy

RLM = get_strategy("rlm")


def constrained_reference(loaded, prompt_ids: list[int], candidates: list[str]) -> list[float]:
    """log p_c(candidate) the slow way: one chain forward per candidate, the mask rebuilt from the set."""
    sequences = [loaded.tokenizer(c, add_special_tokens=False)["input_ids"] for c in candidates]
    scores = []
    for sequence in sequences:
        state, out = runtime.prefill(loaded, prompt_ids)
        rows = [out.logits[-1]] + list(runtime.verify(state, sequence).logits[:-1])  # row t predicts token t
        state.cache.reset()
        total = 0.0
        for t, row in enumerate(rows):
            allowed = sorted({s[t] for s in sequences if len(s) > t and s[:t] == sequence[:t]})
            total += float(torch.log_softmax(row[allowed], dim=-1)[allowed.index(sequence[t])])
        scores.append(total)
    return scores


def test_trie_choice_matches_per_candidate_forwards(tiny) -> None:
    prompt = tiny.encode("Question: where? Action:", chat=False)
    candidates = [' grep("a")', ' grep("ab")', " peek(0, 10)", " FINAL(12)", " FINAL(1)", " FINAL(123)"]
    choice = lm.choose(tiny, prompt, candidates)
    reference = constrained_reference(tiny, prompt, candidates)
    assert choice.logprobs == pytest.approx(reference, abs=2e-3)
    assert choice.index == max(range(len(reference)), key=reference.__getitem__)
    assert abs(sum(torch.tensor(choice.logprobs).exp().tolist()) - 1.0) < 1e-3  # a distribution over the set


def test_generated_tasks_are_deterministic_and_correct() -> None:
    for kind in tasks.ALL_KINDS:
        a, b = tasks.make_task(kind, 5_000, 3), tasks.make_task(kind, 5_000, 3)
        assert a == b and a != tasks.make_task(kind, 5_000, 4)
        assert 5_000 * 2.5 < len(a.context) < 5_000 * 3.5
    needle = tasks.make_task("needle", 5_000, 1)
    name = needle.question.removeprefix("What is the secret code of ").rstrip("?")
    assert f"The secret code of {name} is {needle.answer}." in needle.context
    count = tasks.make_task("count", 5_000, 1)
    label = count.question.rsplit(" ", 1)[1].rstrip("?")
    assert count.context.count(f"status {label}.") == int(count.answer)
    tally = tasks.make_task("tally", 30_000, 2)
    words = {w: i + 1 for i, w in enumerate(tasks.NUMBER_WORDS)}
    pears = [
        line.split(": ")[1].split()[0] for line in tally.context.splitlines() if line.endswith("of pears arrived.")
    ]
    assert sum(words[w] for w in pears) == int(tally.answer) and len(pears) == tally.facts
    tenths = [tally.context.find("Shipment", i * len(tally.context) // 10) for i in range(10)]
    assert all(0 <= a < b for a, b in zip(tenths, tenths[1:], strict=False))  # shipments in every tenth
    assert all(b - a < len(tally.context) / 5 for a, b in zip(tenths, tenths[1:], strict=False))
    with pytest.raises(ValueError):
        tasks.make_task("needle", 10, 0)


def test_grammar_offers_terms_peeks_map_add_and_a_generated_final() -> None:
    state = actions.ActionState("What is the secret code of Nora Falcon?", 90_000, "Log 00000")
    first = [a.text for a in actions.candidates(state, map_k=8)]
    assert 'grep("Nora Falcon")' in first and 'grep("Falcon")' in first and 'grep("the")' not in first
    assert not any(t.startswith("FINAL") or t == "add()" for t in first)  # nothing observed, nothing mapped yet
    observation = "[3343:3383] The secret code of Nora Falcon is 80036.\n"
    state.history.append((actions.Action("grep", ("Falcon",)), observation))
    second = [a.text for a in actions.candidates(state, map_k=0)]
    assert second.count("FINAL(") == 1 and not any(t.startswith("FINAL(") and t != "FINAL(" for t in second)
    assert 'grep("Falcon")' not in second and "peek(3193, 3533)" in second
    assert not any(t.startswith("map") for t in second) and "add()" not in second
    state.history.append((actions.Action("map", (state.question, 4)), "chunk 0 [0:10]: 3\n"))
    assert "add()" in [a.text for a in actions.candidates(state, map_k=0)]
    code = actions.Action("grep", ('x") + os.system("id',)).code()
    assert code == "_hits = grep(re.escape('x\") + os.system(\"id'))"  # arguments are quoted, never spliced
    assert "count" not in actions.INSTRUCTIONS and "total of" not in actions.EXAMPLES  # generic helpers only


def test_grep_prints_lines_and_offsets_only() -> None:
    from lab.methods.rlm.sandbox import Sandbox, SandboxLimits

    context = "".join(f"Ticket {i}: status urgent.\n" for i in range(30))
    with Sandbox(context, SandboxLimits(timeout_s=5)) as box:
        cell = box.execute("hits = grep('urgent')\nprint(len(hits), hits[0])")
        with pytest.raises(StopIteration) as stop:
            next(cell)
    lines = stop.value.value.output.splitlines()
    assert lines[0] == "[0:24] Ticket 0: status urgent." and lines[20] == "[more matches not shown]"
    assert all(actions.HIT.fullmatch(line) for line in lines[:20])  # lines and offsets only: no count, no total
    assert lines[21] == "30 (0, 24, 'Ticket 0: status urgent.')"  # code may count what grep returns


def test_final_answers_follow_the_reference_protocol() -> None:
    from lab.methods.rlm.loop import final_answer, final_var_name

    assert final_answer("FINAL(42)\nHope this helps (really).") == "42"
    assert final_answer("The code ran.\n  FINAL('Oslo') and more") == "Oslo"
    assert final_answer("The answer is FINAL(3)") is None  # not at the start of a line
    assert final_var_name("done\nFINAL_VAR(total)\n") == "total" and final_var_name("FINAL_VAR('x y')") is None
    assert final_var_name("see FINAL_VAR(total)") is None


def test_answer_matching() -> None:
    assert answer_matches(" 1,234 units", "1234") and not answer_matches("12345", "1234")
    assert answer_matches("Oslo.", "oslo") and not answer_matches("", "7")


def test_rlm_on_a_tiny_model_emits_a_complete_trace(tiny) -> None:
    params = build_params(
        RLM.Params, {"task": "count", "context_tokens": 2000, "max_iterations": 3, "max_sub_calls": 4}
    )
    question = RLM.task_prompt[1](params)  # what the Run tab's "Ask the task's question" button writes
    prompt_ids = tiny.encode(question, chat=False)
    events = list(RLM.run(tiny, prompt_ids, params, make_generator(0, tiny.device)))
    context = events[0]
    assert isinstance(context, RlmContext) and context.question == question and context.context_chars > 5000
    assert context.expected == tasks.make_task("count", 2000, 0).answer
    calls = [e for e in events if isinstance(e, ReplCall)]
    roots = [c for c in calls if c.role == "root"]
    assert 1 <= len(roots) <= 3 and all(c.alternatives and len(c.scores) == len(c.alternatives) for c in roots)
    by_id = {c.call_id: c for c in calls}
    assert all(by_id[c.parent_id].depth == c.depth - 1 for c in calls if c.role == "sub")
    result = next(e for e in events if isinstance(e, RlmResult))
    tokens = [e for e in events if isinstance(e, TokenEmitted)]
    assert "".join(t.text for t in tokens) == result.answer[: len("".join(t.text for t in tokens))]
    assert isinstance(events[-1], RunFinished) and events[-1].step == len(tokens)
    trace = Trace("rlm", "tiny", "How many?", {}, events)
    assert from_json(to_json(trace)).events == events


def test_the_prompt_is_the_question_unless_the_task_question_is_chosen(tiny) -> None:
    """The user's prompt is never replaced silently; the task's own question (typed, or chosen with
    use_task_question) carries its known answer."""
    own = tasks.make_task("needle", 1000, 3)
    assert RLM.task_prompt[1](build_params(RLM.Params, {"task": "needle", "context_tokens": 1000, "task_seed": 3}))
    assert RLM.task_prompt[1](build_params(RLM.Params, {"task": "pasted"})) is None
    for prompt, use_task_question, question, expected in [
        ("Who wrote the logs?", False, "Who wrote the logs?", ""),
        (own.question.upper().rstrip("?") + "  ?", False, own.question.upper().rstrip("?") + "  ?", own.answer),
        ("Who wrote the logs?", True, own.question, own.answer),
    ]:
        values = {"task": "needle", "context_tokens": 1000, "task_seed": 3, "use_task_question": use_task_question}
        params = build_params(RLM.Params, {**values, "max_iterations": 1})
        context = next(RLM.run(tiny, tiny.encode(prompt, chat=False), params, make_generator(0, tiny.device)))
        assert (context.question, context.expected) == (question, expected)


def test_pasted_context_and_bad_input(tiny) -> None:
    prompt_ids = tiny.encode("Who?", chat=False)
    pasted = build_params(RLM.Params, {"task": "pasted", "context_text": "Ada wrote it.\n" * 50, "max_iterations": 1})
    events = list(RLM.run(tiny, prompt_ids, pasted, make_generator(0, tiny.device)))
    assert events[0].question == "Who?" and events[0].expected == "" and events[0].task == "pasted"
    empty = build_params(RLM.Params, {"task": "pasted"})
    with pytest.raises(InputError):
        list(RLM.run(tiny, prompt_ids, empty, make_generator(0, tiny.device)))


@pytest.mark.embedded
@pytest.mark.parametrize("kind, seed, size", [("needle", 0, 20_000), ("count", 1, 20_000)])
def test_embedded_model_runs_generated_tasks_in_action_mode(embedded, kind: str, seed: int, size: int) -> None:
    """The mechanism on the 135M model: the root only ever sees metadata and REPL output, every sub-call hangs
    under the root turn that made it, and a FINAL answer is the model's own text (accuracy is the eval's job)."""
    values = {"task": kind, "context_tokens": size, "task_seed": seed, "max_iterations": 4, "use_task_question": True}
    params = build_params(RLM.Params, values)
    prompt_ids = embedded.encode("unused: the task's own question is asked")
    events = list(RLM.run(embedded, prompt_ids, params, make_generator(0, embedded.device)))
    result = next(e for e in events if isinstance(e, RlmResult))
    calls = [e for e in events if isinstance(e, ReplCall)]
    roots = [c for c in calls if c.role == "root"]
    assert events[0].context_tokens > 15_000 and max(c.prompt_tokens for c in roots) < 2_500
    assert all(c.parent_id in {r.call_id for r in calls} for c in calls if c.role == "sub")
    assert result.stop == "final" and roots[-1].action == f"FINAL({result.answer})" and roots[-1].final == result.answer


def test_code_mode_runs_repl_blocks_sub_calls_and_final_var(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """Code mode's plumbing with a scripted root (the tiny model cannot write code): ```repl blocks run in the
    sandbox, llm_query reaches the sub-model, output returns to the root, FINAL_VAR reads a REPL variable."""
    from lab.methods.rlm import loop

    script = iter(
        [
            "```repl\nwhile True:\n    pass\n```",
            "```repl\npart = context[0:40]\nnote = llm_query('Summarize', part)\nprint(len(context))\n```",
            "Done.\nFINAL_VAR(note)",
        ]
    )
    real_generate = loop.lm.generate
    seen_prompts = []

    def scripted(loaded, ids, max_new_tokens, stop=None):
        text = loaded.decode(ids)
        if "REPL environment" in text:  # a root turn
            seen_prompts.append(text)
            return lm.Generation(next(script), len(ids), 10, 1)
        return real_generate(loaded, ids, 4)

    monkeypatch.setattr(loop.lm, "generate", scripted)
    monkeypatch.setattr(loop.lm, "window", lambda loaded: 8192)  # the byte-level prompts outgrow the tiny 512
    monkeypatch.setattr("strategies.rlm.code_mode_refusal", lambda: None)
    params = build_params(RLM.Params, {"mode": "code", "task": "pasted", "context_text": "abc " * 500,
                                       "cell_timeout_s": 1.0})  # fmt: skip
    events = list(RLM.run(tiny, tiny.encode("What is it?", chat=False), params, make_generator(0, tiny.device)))
    roots = [e for e in events if isinstance(e, ReplCall) and e.role == "root"]
    subs = [e for e in events if isinstance(e, ReplCall) and e.role == "sub"]
    assert len(roots) == 3 and len(subs) == 1 and subs[0].parent_id == roots[1].call_id
    assert "timed out" in roots[0].error  # the REPL was restarted; the run went on
    assert subs[0].ranges == [[0, 40]] and roots[1].output.strip() == "2000"
    assert "abc " * 60 not in seen_prompts[0] and "2000 characters" in seen_prompts[0]  # a prefix, never the whole
    assert "REPL output:\n2000" in seen_prompts[2]
    result = next(e for e in events if isinstance(e, RlmResult))
    assert result.stop == "final" and result.answer == subs[0].output[: len(result.answer)]


def test_eval_traces_keep_the_run_params_and_the_first_tally_run(tmp_path) -> None:
    """`lab eval rlm --traces`: the first correct run of each kind and the first tally run whatever its answer,
    each saved with the Params that made it (a replayed trace shows the run's real settings)."""
    import dataclasses
    import json

    from lab.tools.rlm_eval import TALLY_PARAMS, save_traces, task_params

    def result(correct: bool) -> list:
        return [RlmResult(0, "7", correct, "final", 1, 2, 30, 400)]

    tally = dataclasses.asdict(task_params("tally", 100_000, 0, TALLY_PARAMS))
    kept = [
        ("needle", 0, False, result(False), dataclasses.asdict(task_params("needle", 20_000, 0))),
        ("needle", 1, True, result(True), dataclasses.asdict(task_params("needle", 20_000, 1))),
        ("tally", 0, False, result(False), tally),
    ]
    paths = save_traces(kept, str(tmp_path), "smollm2-135m")
    assert sorted(p.rsplit("/", 1)[1] for p in paths) == ["rlm-needle.json", "rlm-tally.json"]
    needle = json.loads((tmp_path / "rlm-needle.json").read_text())
    assert needle["params"]["task_seed"] == 1 and needle["events"][0]["correct"] is True
    saved = json.loads((tmp_path / "rlm-tally.json").read_text())["params"]
    assert saved == tally and saved["sub_window"] == TALLY_PARAMS["sub_window"]
