"""`python -m lab eval rlm`: RLM (action mode) against the same model given the context directly.

Tasks: the generated needle / count / sum tasks of `lab.rlm.tasks` (known answers), seeds 0, 1, ... and
sizes cycling through `DEFAULT_SIZES` tokens, `--limit` tasks in all (kinds interleaved). For each task:
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
import sys
import time
from dataclasses import dataclass

from lab.models import LoadedModel, load_model
from lab.params import InputError, build_params
from lab.registry import get_strategy
from lab.rlm import lm, tasks
from lab.rlm.loop import answer_matches
from lab.runner import make_generator
from lab.trace import RlmContext, RlmResult

DEFAULT_SIZES = (20_000, 100_000, 500_000)
DEFAULT_LIMIT = 9
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
    direct_answer: str
    direct_correct: bool
    direct_tokens: int
    direct_s: float
    visible: bool


def run_rlm(loaded: LoadedModel, kind: str, size: int, seed: int) -> tuple[RlmResult, RlmContext, float]:
    strategy = get_strategy("rlm")
    params = build_params(strategy.Params, {"task": kind, "context_tokens": size, "task_seed": seed})
    start = time.perf_counter()
    events = list(strategy.run(loaded, loaded.encode("(task question)"), params, make_generator(seed, loaded.device)))
    result = next(e for e in events if isinstance(e, RlmResult))
    return result, next(e for e in events if isinstance(e, RlmContext)), time.perf_counter() - start


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
    customer = task.question.removeprefix("How many units did ").split(" buy in total")[0]
    return f": {customer} bought " in line


def evaluate(loaded: LoadedModel, limit: int, sizes: tuple[int, ...], progress=None) -> list[TaskRun]:
    """Run `limit` tasks (kinds interleaved, sizes cycled per seed) with RLM and directly."""
    runs: list[TaskRun] = []
    for index in range(limit):
        kind, seed = tasks.KINDS[index % len(tasks.KINDS)], index // len(tasks.KINDS)
        size = sizes[(index // len(tasks.KINDS)) % len(sizes)]
        if progress:
            done = (
                f" (last: rlm {runs[-1].rlm_answer!r}, direct {runs[-1].direct_answer!r}, {runs[-1].expected})"
                if runs
                else ""
            )
            progress(index, limit, f"{kind} seed {seed}, {size} tokens{done}")
        task = tasks.make_task(kind, size, seed)
        result, context, rlm_s = run_rlm(loaded, kind, size, seed)
        answer, direct_tokens, visible, direct_s = run_direct(loaded, task)
        runs.append(
            TaskRun(
                kind, seed, context.context_tokens, task.answer, result.answer, bool(result.correct), result.tokens,
                round(rlm_s, 2), answer.strip()[:40], answer_matches(answer, task.answer), direct_tokens,
                round(direct_s, 2), visible,
            )
        )  # fmt: skip
    return runs


def table_rows(runs: list[TaskRun]) -> list[dict]:
    groups = [(kind, [r for r in runs if r.kind == kind]) for kind in tasks.KINDS] + [("all", runs)]
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


def cmd_eval_rlm(args: argparse.Namespace) -> int:
    from lab.validation import validate_model_spec

    try:
        limit = int(args.limit)
        sizes = tuple(int(s) for s in args.sizes.split(","))
    except ValueError:
        raise InputError("--limit and --sizes must be integers (sizes comma-separated).") from None
    if not 1 <= limit <= 300 or not all(tasks.MIN_TOKENS <= s <= tasks.MAX_TOKENS for s in sizes):
        raise InputError(f"--limit must be 1..300 and sizes in [{tasks.MIN_TOKENS}, {tasks.MAX_TOKENS}].")
    loaded = load_model(validate_model_spec(args.model), args.device, args.dtype)
    runs = evaluate(loaded, limit, sizes, lambda i, n, m: print(f"[{i + 1}/{n}] {m} ...", file=sys.stderr, flush=True))
    rows = table_rows(runs)
    if args.json:
        config = {"limit": limit, "sizes": sizes, "model": args.model, "dtype": str(loaded.dtype)}
        print(json.dumps({"config": config, "rows": rows, "runs": [dataclasses.asdict(r) for r in runs]}, indent=2))
    else:
        print(format_table(rows))
    return 0


def register(commands: argparse._SubParsersAction, evaluations: argparse._SubParsersAction, add_model_options) -> None:
    """`eval rlm` under `python -m lab eval`."""
    parser = evaluations.add_parser("rlm", help="Recursive LM: accuracy on generated long-context tasks vs direct")
    parser.add_argument("--limit", default=str(DEFAULT_LIMIT), help=f"tasks in all (default {DEFAULT_LIMIT})")
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="context sizes in tokens, cycled")
    parser.add_argument("--json", action="store_true", help="print {config, rows, runs} as JSON")
    add_model_options(parser)
    parser.set_defaults(handler=cmd_eval_rlm)
