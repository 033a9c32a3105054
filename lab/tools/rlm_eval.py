"""`python -m lab eval rlm`: RLM (action mode) against the same model given the context directly.

Tasks: the generated needle / count / sum tasks of `lab.methods.rlm.tasks` (known answers), seeds 0, 1, ... and
sizes cycling through `DEFAULT_SIZES` tokens, `--limit` tasks in all (kinds interleaved), then `--tally` tasks
of the tally family (seeds 0, 1, ..., `TALLY_TOKENS` tokens: the answer needs every chunk, so these runs get the
sub-call and token budget `TALLY_PARAMS` that one llm_query per chunk takes). For each task:
- rlm: the `rlm` strategy with its defaults (action mode, the task's own question), scored by `answer_matches`;
- direct: one chat turn "<context>\n\nQuestion: <q>\nAnswer with the number only." with the context cut to
  what fits the model's window (the head of the document, window - question - 24 tokens), greedy, 16 tokens,
  scored the same way (the first number in the reply). `visible` = the share of direct runs whose answer-bearing
  lines all lie inside the part of the document that fitted.
The table has one row per kind and one for all: tasks, mean context tokens, accuracy of each, and the mean
tokens / seconds per task. The model loads once; progress goes to stderr.
Not covered: code mode (the embedded model cannot write the code), other models' sub-call pairing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass

from lab.app.runner import make_generator
from lab.engine.models import LoadedModel, load_model
from lab.methods.rlm import lm, tasks
from lab.methods.rlm.loop import answer_matches
from lab.params import InputError, build_params
from lab.registry import get_strategy
from lab.trace import RlmContext, RlmResult, Trace, to_json

DEFAULT_SIZES = (20_000, 100_000, 500_000)
DEFAULT_LIMIT = 9
DEFAULT_TALLY = 2
TALLY_TOKENS = 100_000
TALLY_PARAMS = {"max_sub_calls": 64, "sub_window": 4096, "max_total_tokens": 600_000}  # K = 35 chunks of 3.4k tokens
DIRECT_ANSWER_TOKENS = 16


@dataclass(frozen=True)
class TaskRun:
    kind: str
    seed: int
    context_tokens: int
    expected: str
    rlm_answer: str
    rlm_correct: bool
    rlm_tokens: int
    rlm_s: float
    sub_calls: int
    direct_answer: str
    direct_correct: bool
    direct_tokens: int
    direct_s: float
    visible: bool


def task_params(kind: str, size: int, seed: int, extra: dict | None = None):
    """The `rlm` strategy's Params for one task: its defaults, the task, plus `extra`."""
    values = {"task": kind, "context_tokens": size, "task_seed": seed, "use_task_question": True, **(extra or {})}
    return build_params(get_strategy("rlm").Params, values)


def run_rlm(loaded: LoadedModel, params, seed: int) -> tuple[RlmResult, RlmContext, float, list]:
    """One rlm run of `params` (from `task_params`), seeded; (result, context, seconds, events)."""
    strategy = get_strategy("rlm")
    start = time.perf_counter()
    events = list(strategy.run(loaded, loaded.encode("(task question)"), params, make_generator(seed, loaded.device)))
    result = next(e for e in events if isinstance(e, RlmResult))
    context = next(e for e in events if isinstance(e, RlmContext))
    return result, context, time.perf_counter() - start, events


def run_direct(loaded: LoadedModel, task: tasks.Task) -> tuple[str, int, bool, float]:
    """The baseline: the document's head that fits the window, then the question; (answer, tokens, visible, s)."""
    start = time.perf_counter()
    question = f"\n\nQuestion: {task.question}\nAnswer with the number only."
    overhead = len(loaded.encode(question)) + DIRECT_ANSWER_TOKENS + 8
    context_ids = loaded.tokenizer(task.context, add_special_tokens=False)["input_ids"]
    kept = loaded.decode(context_ids[: max(0, lm.window(loaded) - overhead)])
    ids = loaded.encode(kept + question)
    generation = lm.generate(loaded, ids, DIRECT_ANSWER_TOKENS)
    facts = [line for line in task.context.splitlines() if _is_fact(task, line)]
    visible = all(line in kept for line in facts)
    return generation.text, generation.prompt_tokens + generation.output_tokens, visible, time.perf_counter() - start


def _is_fact(task: tasks.Task, line: str) -> bool:
    """Whether a document line carries part of the answer."""
    subject = task.question.rstrip("?").split(" of ")[-1] if task.kind == "needle" else ""
    if task.kind == "needle":
        return line.startswith(f"The secret code of {subject} ")
    if task.kind == "count":
        return line.endswith(f"status {task.question.rstrip('?').rsplit(' ', 1)[1]}.")
    if task.kind == "tally":
        return line.startswith("Shipment ") and line.endswith(" of pears arrived.")
    customer = task.question.removeprefix("How many units did ").split(" buy in total")[0]
    return f": {customer} bought " in line


def _one(loaded: LoadedModel, kind: str, size: int, seed: int, extra: dict | None, keep: list | None) -> TaskRun:
    task = tasks.make_task(kind, size, seed)
    params = task_params(kind, size, seed, extra)
    result, context, rlm_s, events = run_rlm(loaded, params, seed)
    if keep is not None:
        keep.append((kind, seed, result.correct, events, dataclasses.asdict(params)))
    answer, direct_tokens, visible, direct_s = run_direct(loaded, task)
    return TaskRun(
        kind,
        seed,
        context.context_tokens,
        task.answer,
        result.answer,
        bool(result.correct),
        result.tokens,
        round(rlm_s, 2),
        result.sub_calls,
        answer.strip()[:40],
        answer_matches(answer, task.answer),
        direct_tokens,
        round(direct_s, 2),
        visible,
    )


def evaluate(
    loaded: LoadedModel, limit: int, sizes: tuple[int, ...], progress=None, tally: int = 0, keep: list | None = None
) -> list[TaskRun]:
    """Run `limit` tasks (kinds interleaved, sizes cycled per seed) and `tally` tally tasks, with RLM and
    directly; `keep` (a list) receives (kind, seed, correct, events, params) of every RLM run."""
    plan = [
        (tasks.KINDS[i % len(tasks.KINDS)], sizes[(i // len(tasks.KINDS)) % len(sizes)], i // len(tasks.KINDS), None)
        for i in range(limit)
    ]
    plan += [("tally", TALLY_TOKENS, seed, TALLY_PARAMS) for seed in range(tally)]
    runs: list[TaskRun] = []
    for index, (kind, size, seed, extra) in enumerate(plan):
        if progress:
            last = runs[-1] if runs else None
            done = f" (last: rlm {last.rlm_answer!r}, direct {last.direct_answer!r}, {last.expected})" if last else ""
            progress(index, len(plan), f"{kind} seed {seed}, {size} tokens{done}")
        runs.append(_one(loaded, kind, size, seed, extra, keep))
    return runs


def table_rows(runs: list[TaskRun]) -> list[dict]:
    standard = [r for r in runs if r.kind in tasks.KINDS]
    groups = [(kind, [r for r in runs if r.kind == kind]) for kind in tasks.ALL_KINDS] + [("all", standard)]
    rows = []
    for name, members in groups:
        if not members:
            continue
        n = len(members)
        rows.append(
            {
                "task": name,
                "tasks": n,
                "context tokens (mean)": round(sum(r.context_tokens for r in members) / n),
                "rlm accuracy": round(sum(r.rlm_correct for r in members) / n, 3),
                "direct accuracy": round(sum(r.direct_correct for r in members) / n, 3),
                "answer in direct window": round(sum(r.visible for r in members) / n, 3),
                "rlm sub-calls/task": round(sum(r.sub_calls for r in members) / n, 1),
                "rlm tokens/task": round(sum(r.rlm_tokens for r in members) / n),
                "direct tokens/task": round(sum(r.direct_tokens for r in members) / n),
                "rlm s/task": round(sum(r.rlm_s for r in members) / n, 1),
                "direct s/task": round(sum(r.direct_s for r in members) / n, 1),
            }
        )
    return rows


def format_table(rows: list[dict]) -> str:
    """A markdown table."""
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(row[key]) for key in header) + " |" for row in rows]
    return "\n".join(lines)


def save_traces(kept: list, folder: str, model: str) -> list[str]:
    """The first correct run of each kind as <folder>/rlm-<kind>.json, and the first tally run whatever its answer
    (its call tree is the recursion to look at); returns the paths written."""
    os.makedirs(folder, exist_ok=True)
    chosen: dict[str, tuple] = {}
    for kind, _seed, correct, events, params in kept:
        if kind not in chosen and (correct or kind == "tally"):
            chosen[kind] = (params, events)
    paths = []
    for kind, (params, events) in chosen.items():
        path = os.path.join(folder, f"rlm-{kind}.json")
        trace = Trace("rlm", model, "(task question)", params, events)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(to_json(trace))
        paths.append(path)
    return paths


def cmd_eval_rlm(args: argparse.Namespace) -> int:
    from lab.engine.models import validate_model_spec

    try:
        limit = int(args.limit)
        sizes = tuple(int(s) for s in args.sizes.split(","))
    except ValueError:
        raise InputError("--limit and --sizes must be integers (sizes comma-separated).") from None
    if not 1 <= limit <= 300 or not all(tasks.MIN_TOKENS <= s <= tasks.MAX_TOKENS for s in sizes):
        raise InputError(f"--limit must be 1..300 and sizes in [{tasks.MIN_TOKENS}, {tasks.MAX_TOKENS}].")
    tally = int(args.tally) if str(args.tally).isdigit() else -1
    if not 0 <= tally <= 20:
        raise InputError("--tally must be an integer in 0..20.")
    loaded = load_model(validate_model_spec(args.model), args.device, args.dtype)
    keep: list | None = [] if args.traces else None
    progress = lambda i, n, m: print(f"[{i + 1}/{n}] {m} ...", file=sys.stderr, flush=True)  # noqa: E731
    runs = evaluate(loaded, limit, sizes, progress, tally, keep)
    if keep:
        save_traces(keep, args.traces, args.model)
    rows = table_rows(runs)
    if args.json:
        config = {"limit": limit, "sizes": sizes, "tally": tally, "model": args.model, "dtype": str(loaded.dtype)}
        print(json.dumps({"config": config, "rows": rows, "runs": [dataclasses.asdict(r) for r in runs]}, indent=2))
    else:
        print(format_table(rows))
    return 0


def register(commands: argparse._SubParsersAction, evaluations: argparse._SubParsersAction, add_model_options) -> None:
    """`eval rlm` under `python -m lab eval`."""
    parser = evaluations.add_parser("rlm", help="Recursive LM: accuracy on generated long-context tasks vs direct")
    parser.add_argument("--limit", default=str(DEFAULT_LIMIT), help=f"tasks in all (default {DEFAULT_LIMIT})")
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="context sizes in tokens, cycled")
    parser.add_argument("--tally", default=str(DEFAULT_TALLY), help=f"tally tasks at {TALLY_TOKENS} tokens (default 2)")
    parser.add_argument("--traces", default="", help="folder for traces of winning runs (and the first tally run)")
    parser.add_argument("--json", action="store_true", help="print {config, rows, runs} as JSON")
    add_model_options(parser)
    parser.set_defaults(handler=cmd_eval_rlm)
