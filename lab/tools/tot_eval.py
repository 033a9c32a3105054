"""`python -m lab eval tot`: Game of 24 solve rates on the project's 20 puzzles (Yao et al. 2023, Table 2 setup).

Rows, each run on every puzzle from its own seeded generator (seed + puzzle index) and a fresh `CallModel`
(so every row pays its own prompt prefills):
- ToT (model value): BFS with k thoughts per state, b kept, values from the model's sure / likely /
  impossible verdict (the agreement of that verdict with the exact solver is reported per judged thought,
  `lab.trace.verdict_agreement`, the definition the search and the view use, with the share of distinct
  states the solver calls unsolvable, i.e. what always answering "impossible" would score, and the AUC of V(s)
  for solvable vs unsolvable states: how well the value ranks, which is all BFS uses);
- ToT (model vote): the same search valued by the paper's vote prompt (V = share of n sampled votes over the
  full-sequence p(" i\n") of each choice id);
- ToT (solver value): the same search valued by the exact solver;
- CoT sampling: the paper's 5-shot chain-of-thought prompt, N free samples at T = 0.7 (no constraint), where
  N = the model calls ToT (model value) made on that puzzle; best-of-N counts a puzzle solved when any
  sample's "Answer:" line is a correct expression (`game24.check_expression`), per-sample is the mean
  success of single samples (the paper's CoT row).
Per row: puzzles solved, solve rate, and per puzzle the model calls, tokens (positions run), forwards and
wall seconds. Not covered: IO prompting, the paper's 100-sample oracle rows, other tasks (no exact check).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from lab.app.runner import make_generator
from lab.engine.models import LoadedModel, load_model
from lab.methods.tot import game24, prompts
from lab.methods.tot.lm import CallModel
from lab.methods.tot.search import SearchConfig, TreeSearch
from lab.methods.tot.tasks import Game24
from lab.params import InputError
from lab.trace import ThoughtNode, ThoughtResult, verdict_agreement

COT_TOKENS = 80
COT_TEMPERATURE = 0.7
METHODS = ("tot-model", "tot-vote", "tot-solver", "cot")
LABELS = {
    "tot-model": "ToT (model value)",
    "tot-vote": "ToT (model vote)",
    "tot-solver": "ToT (solver value)",
    "cot": "CoT sampling, best of N",
}
Progress = Callable[[int, int, str], None]


@dataclass
class PuzzleRun:
    puzzle: str
    method: str
    solved: bool
    model_calls: int
    tokens: int
    forwards: int
    seconds: float
    answer: str = ""
    sample_rate: float | None = None  # CoT: share of correct samples


@dataclass
class EvalResult:
    config: dict
    runs: list[PuzzleRun]
    judged: list[tuple[float, float]] = field(default_factory=list)  # (model value, solver value) per state
    agree: int = 0
    compared: int = 0

    def rows(self) -> list[dict]:
        rows = []
        for method in METHODS:
            runs = [r for r in self.runs if r.method == method]
            if runs:
                n = len(runs)
                row = {"method": LABELS[method], "solved": sum(r.solved for r in runs), "puzzles": n}
                row["solve_rate"] = round(row["solved"] / n, 3)
                for key in ("model_calls", "tokens", "forwards", "seconds"):
                    row[key + "_per_puzzle"] = round(sum(getattr(r, key) for r in runs) / n, 2)
                rates = [r.sample_rate for r in runs if r.sample_rate is not None]
                row["per_sample_rate"] = round(sum(rates) / len(rates), 4) if rates else None
                rows.append(row)
        return rows

    def value_stats(self) -> dict:
        unsolvable = sum(s == 0.0 for _, s in self.judged)
        return {
            "agree": self.agree,
            "compared": self.compared,
            "agreement": round(self.agree / self.compared, 3) if self.compared else None,
            "unsolvable_share": round(unsolvable / len(self.judged), 3) if self.judged else None,
            "auc": auc(self.judged),
        }

    def as_dict(self) -> dict:
        runs = [dataclasses.asdict(r) for r in self.runs]
        return {"config": self.config, "rows": self.rows(), "value_vs_solver": self.value_stats(), "runs": runs}


def auc(pairs: list[tuple[float, float]]) -> float | None:
    """P(V(solvable) > V(unsolvable)) over all pairs of judged states, ties counting one half."""
    pos = [v for v, s in pairs if s == 1.0]
    neg = [v for v, s in pairs if s == 0.0]
    if not pos or not neg:
        return None
    wins = sum((p > q) + 0.5 * (p == q) for p in pos for q in neg)
    return round(wins / (len(pos) * len(neg)), 3)


def run_tot(loaded: LoadedModel, numbers: list[int], config: SearchConfig, seed: int) -> tuple[PuzzleRun, list]:
    """One ToT search on one puzzle; returns its run and its ThoughtNode events."""
    start = time.perf_counter()
    lm = CallModel(loaded)
    search = TreeSearch(Game24(" ".join(map(str, numbers))), lm, config, make_generator(seed, loaded.device))
    try:
        events = list(search.run())
    finally:
        lm.close()
    result = next(e for e in events if isinstance(e, ThoughtResult))
    run = PuzzleRun(
        puzzle=" ".join(map(str, numbers)),
        method=f"tot-{config.value}",
        solved=bool(result.solved),
        model_calls=result.model_calls,
        tokens=result.tokens,
        forwards=result.forwards,
        seconds=round(time.perf_counter() - start, 2),
        answer=result.answer,
    )
    return run, [e for e in events if isinstance(e, ThoughtNode)]


def cot_answer_ok(text: str, numbers: list[int]) -> bool:
    """A chain-of-thought sample is correct when its "Answer:" line is a correct expression."""
    line = next((ln for ln in text.splitlines() if ln.strip().startswith("Answer:")), None)
    return line is not None and game24.check_expression(line.split("Answer:", 1)[1], numbers)


def run_cot(loaded: LoadedModel, numbers: list[int], samples: int, seed: int) -> PuzzleRun:
    """N chain-of-thought samples (the paper's 5-shot prompt), best-of-N and per-sample success."""
    start = time.perf_counter()
    lm = CallModel(loaded)
    puzzle = " ".join(map(str, numbers))
    try:
        generator = make_generator(seed, loaded.device)
        suffix = f"{puzzle}\nSteps:\n"
        texts = lm.sample(
            prompts.GAME24_COT,
            suffix,
            samples,
            temperature=COT_TEMPERATURE,
            max_tokens=COT_TOKENS,
            stops=("\nInput:",),
            generator=generator,
        )
    finally:
        lm.close()
    ok = [cot_answer_ok(t, numbers) for t in texts]
    best = next((t for t, good in zip(texts, ok, strict=True) if good), texts[0] if texts else "")
    u = lm.usage
    seconds = round(time.perf_counter() - start, 2)
    return PuzzleRun(puzzle, "cot", any(ok), u.model_calls, u.tokens, u.forwards, seconds, best, sum(ok) / len(ok))


def run_eval(
    loaded: LoadedModel,
    puzzles: list[list[int]],
    config: SearchConfig,
    seed: int,
    progress: Progress | None = None,
    cot: bool = True,
) -> EvalResult:
    """Every row on every puzzle (see the module docstring); `cot=False` skips the chain-of-thought row."""
    config_dict = {"puzzles": len(puzzles), "seed": seed, "model": loaded.spec, "dtype": str(loaded.dtype)}
    config_dict.update(dataclasses.asdict(config), cot_tokens=COT_TOKENS, cot_temperature=COT_TEMPERATURE)
    result = EvalResult(config_dict, [])
    for index, numbers in enumerate(puzzles):
        if progress:
            progress(index, len(puzzles), " ".join(map(str, numbers)))
        model_run, nodes = run_tot(loaded, numbers, dataclasses.replace(config, value="model"), seed + index)
        vote_run, _ = run_tot(loaded, numbers, dataclasses.replace(config, value="vote"), seed + index)
        solver_run, _ = run_tot(loaded, numbers, dataclasses.replace(config, value="solver"), seed + index)
        result.runs += [model_run, vote_run, solver_run]
        if cot:
            result.runs.append(run_cot(loaded, numbers, model_run.model_calls, seed + index))
        judged = {n.text: n for n in nodes if n.judgment and n.solver_value is not None}  # one per state
        result.judged += [(n.value, n.solver_value) for n in judged.values()]
        agree, compared = verdict_agreement(nodes)  # the search's and the view's definition: per thought
        result.agree += agree
        result.compared += compared
    return result


def format_table(result: EvalResult) -> str:
    header = ("method", "solved", "solve rate", "calls / puzzle", "tokens / puzzle", "forwards / puzzle", "s / puzzle")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in result.rows():
        cells = (
            row["method"],
            f"{row['solved']}/{row['puzzles']}",
            f"{row['solve_rate']:.0%}",
            f"{row['model_calls_per_puzzle']:.1f}",
            f"{row['tokens_per_puzzle']:.0f}",
            f"{row['forwards_per_puzzle']:.1f}",
            f"{row['seconds_per_puzzle']:.1f}",
        )
        lines.append("| " + " | ".join(cells) + " |")
    cot = next((r for r in result.rows() if r["method"] == LABELS["cot"]), None)
    if cot and cot["per_sample_rate"] is not None:
        lines.append(f"\nCoT per-sample success: {cot['per_sample_rate']:.2%}")
    stats = result.value_stats()
    if stats["compared"]:
        lines.append(
            f"Model value vs exact solver: verdict (sure/likely vs impossible) agrees on {stats['agree']}/"
            f"{stats['compared']} judged thoughts ({stats['agreement']:.0%}); {stats['unsolvable_share']:.0%} of "
            f"the distinct states are unsolvable; AUC of V(s) solvable vs unsolvable = {stats['auc']}"
        )
    c = result.config
    lines.append(
        f"k = {c['k']}, b = {c['breadth']}, T = {c['temperature']}, seed {c['seed']}, {c['model']} ({c['dtype']})"
    )
    return "\n".join(lines)


def _int(name: str, value: str, low: int, high: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise InputError(f"{name} must be an integer, got {value!r}.") from None
    if not low <= number <= high:
        raise InputError(f"{name} must be between {low} and {high}.")
    return number


def cmd_eval_tot(args: argparse.Namespace) -> int:
    """Load the model, run every row on the first --limit puzzles, print the table or JSON."""
    from lab.app.validation import validate_seed

    puzzles = game24.load_puzzles()
    limit = _int("--limit", args.limit, 1, len(puzzles)) if args.limit is not None else len(puzzles)
    config = SearchConfig(search="bfs", k=_int("--k", args.k, 1, 32), breadth=_int("--breadth", args.breadth, 1, 16))
    seed = validate_seed(args.seed)
    loaded = load_model(args.model, args.device, args.dtype)

    def progress(done: int, total: int, message: str) -> None:
        print(f"[{done + 1}/{total}] {message} ...", file=sys.stderr, flush=True)

    result = run_eval(loaded, puzzles[:limit], config, seed, progress, cot=not args.skip_cot)
    print(json.dumps(result.as_dict(), indent=2) if args.json else format_table(result))
    return 0


def register(commands: argparse._SubParsersAction, evaluations: argparse._SubParsersAction, add_model_options) -> None:
    """`eval tot` under `python -m lab eval`."""
    parser = evaluations.add_parser("tot", help="Tree of Thoughts: Game of 24 solve rates (ToT vs CoT sampling)")
    parser.add_argument("--limit", default=None, help="use only the first N of the 20 puzzles")
    parser.add_argument("--k", default=str(SearchConfig.k), help="thoughts per state (default 8)")
    parser.add_argument("--breadth", default=str(SearchConfig.breadth), help="b, states kept per step (default 5)")
    parser.add_argument("--skip-cot", action="store_true", help="leave out the chain-of-thought row (the slowest)")
    parser.add_argument("--json", action="store_true", help="print {config, rows, value_vs_solver, runs} as JSON")
    add_model_options(parser)
    parser.set_defaults(handler=cmd_eval_tot)
