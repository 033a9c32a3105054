"""The benchmark behind `python -m lab bench`: tokens/s of strategies against Hugging Face `generate`.

Covered: every strategy runs every prompt (chat template on) `repeat` times with its default parameters and the
given `max_new_tokens`, at the bench's weight precision (`lab.engine.quant`) or its own (`NAME@PRECISION`, e.g.
greedy@int4: one model is loaded per precision); optionally `model.generate(do_sample=False)` runs the same prompt
ids on the same model, device, dtype and precision as the reference row "hf-generate", and `--llama-cpp` adds
llama-cpp-python's greedy decoding of the same GGUF (`lab.tools.bench_reference`). Runs are interleaved round-robin (for
each prompt and repeat: every strategy, then the reference rows) so machine noise hits every row alike, after one
untimed warm-up run of each row. Per-strategy parameters override the defaults (`--params NAME.key=value`,
`parse_param_overrides`); a labelled row (`LABEL=NAME`, e.g. `eagle3=eagle`) takes `--params LABEL.key=value` too,
so one strategy can be benched twice with different parameters (e.g. two heads).
`--hf-assist prompt-lookup|self-draft[:L]|MODEL` adds the row "hf-assist": transformers' assisted generation (greedy)
with prompt lookup (`prompt_lookup_num_tokens`) or an assistant model (`assistant_model=`: the lab's self-drafter, the
target's first L layers, or a model loaded like the target; constant `num_assistant_tokens`), using the speculative
(else ssd) row's gamma, max_ngram and draft_layers when one is benched (else transformers' defaults: 10 tokens and
n-gram 2, or 20 assistant tokens). The HF rows' forwards/token count every call of the target module (draft calls too
when the assistant is the target). Per row:
median tokens/s (new tokens / wall time of one run, prefill included), speedup against the first strategy's median,
median prefill ms (prompt to first new token) and median decode-only tokens/s (the tokens after the first over the
time after it; llama.cpp's both from its own counters), the decode ratio against the first row, bootstrap 95%
intervals of both ratios over prompts with two or more prompts (`lab.tools.bench_stats`), mean new tokens,
forwards per token and the mean of every other numeric field of `lab.trace.Stats` (plus SSD's
`lab.trace.speculation_stats`: cache hit rate, branches per round), and the forward path its runs took
(`lab.engine.forward_path`, fixed per run). Both paths stop at the same EOS ids, and a strategy's stop reasons are
noted. `--profile` adds one more, untimed pass of every strategy with `lab.engine.profile`'s
module timer: the share of wall time in target forwards, drafting, acceptance, KV compaction and the rest, and the
cost of a target forward at the positions it scored.
Not covered: asserting speeds (tests never do), batching, memory use, sampling in the reference rows.
"""

from __future__ import annotations

import dataclasses
import platform
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lab.app.builtin_prompts import load_prompts
from lab.app.runner import prepare, stream_run
from lab.app.validation import RunRequest, validate_request
from lab.engine import forward_path, native_forward
from lab.engine.models import EMBEDDED_MODEL, LoadedModel
from lab.engine.profile import ProfileRow, format_profile, module_timer, profile_row
from lab.params import InputError
from lab.tools.bench_reference import (  # noqa: I001
    HF_ASSIST_ROW,
    HF_ROW,
    LLAMA_CPP_ROW,
    LlamaCppRow,
    RunSample,
    decode_rate,
    hf_assist_kwargs,
    time_hf_generate,
)
from lab.tools.bench_stats import ratio_cell, split_fields
from lab.trace import Stats, TokenEmitted, speculation_stats, summarize

MAX_REPEAT = 100
WARMUP_TOKENS = 16
# the reference rows run outside the lab's runtime: transformers' generate calls model(...)
REFERENCE_PATHS = {HF_ROW: "model", HF_ASSIST_ROW: "model", LLAMA_CPP_ROW: "llama.cpp"}
COLUMNS = ("strategy", "median tok/s", "speedup vs first", "prefill ms", "decode tok/s", "decode vs first", "tokens")
COLUMNS += ("forwards/token", "notes")

Progress = Callable[[int, int, str], None]
Timer = Callable[[int, list[int]], RunSample]  # (prompt index, prompt ids) -> one timed run


@dataclass
class BenchRow:
    """Aggregates of one strategy (or of hf-generate) over every prompt and repeat."""

    name: str
    median_tokens_per_s: float
    speedup: float
    mean_new_tokens: float
    forwards_per_token: float
    runs: int
    metrics: dict[str, float] = field(default_factory=dict)  # mean of every numeric Stats field
    notes: str = ""
    precision: str = ""  # weight format of the model the row ran on ("" for llama.cpp: the GGUF as stored)
    # prefill and decode-only figures, ratios' bootstrap intervals (None: first row, one prompt): bench_stats
    median_prefill_ms: float = 0.0
    median_decode_tokens_per_s: float = 0.0
    decode_speedup: float = 1.0
    speedup_interval: list[float] | None = None
    decode_speedup_interval: list[float] | None = None
    dtype: str = ""  # activation dtype of the row's model ("" for llama.cpp)
    choice: str = ""  # how the row's model got its dtype and precision, and why (lab.engine.defaults)
    forward_path: str = ""  # lab.engine.forward_path of the row's runs ("a/b" if they differed; see REFERENCE_PATHS)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class BenchResult:
    """What was measured (config), one row per strategy (hf-generate last) and, with --profile, one profile
    row per strategy (`lab.engine.profile`)."""

    config: dict
    rows: list[BenchRow]
    profile: list[ProfileRow] = field(default_factory=list)

    def as_dict(self) -> dict:
        result = {"config": self.config, "rows": [row.as_dict() for row in self.rows]}
        if self.profile:
            result["profile"] = [row.as_dict() for row in self.profile]
        return result


def _numeric_stats(stats: Stats) -> dict[str, float]:
    """Every int/float field of Stats (new fields such as acceptance rates are picked up automatically)."""
    values = stats.as_dict()
    return {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def time_strategy(request: RunRequest, loaded: LoadedModel, prompt_ids: list[int]) -> RunSample:
    """Run one strategy to the end; tokens/s = new_tokens / wall_s as folded by `summarize`; prefill = the
    time of the first token event, decode tokens/s = the other tokens over the rest of the wall time."""
    path = forward_path.choose(loaded)  # fixed for the run, recorded in the row
    events = list(stream_run(request, loaded, prompt_ids, path))
    stats = summarize(events)
    rate = stats.new_tokens / stats.wall_s if stats.wall_s > 0 else 0.0
    metrics = {**_numeric_stats(stats), **speculation_stats(events)}  # SSD: cache hit rate, branches per round
    emitted = [e for e in events if isinstance(e, TokenEmitted)]
    tokens = tuple(e.token_id for e in emitted)
    prefill = emitted[0].t if emitted else stats.wall_s  # the first token comes out of the prefill forward
    decode = decode_rate(stats.new_tokens, stats.wall_s, prefill)
    return RunSample(
        rate, stats.new_tokens, metrics, stats.stop_reason, tokens, prefill, decode, forward_path=path.name
    )


def parse_param_overrides(items: list[str]) -> dict[str, dict[str, str]]:
    """`NAME.key=value` items (e.g. speculative.drafter=self-draft) as {name: {key: value}}; values are checked
    later by the strategy's Params."""
    overrides: dict[str, dict[str, str]] = {}
    for item in items:
        target, sep, value = item.partition("=")
        name, dot, key = target.strip().partition(".")
        if not sep or not dot or not name or not key.strip():
            raise InputError(f"--params expects NAME.key=value (e.g. speculative.gamma=4), got {item!r}.")
        overrides.setdefault(name, {})[key.strip()] = value.strip()
    return overrides


def _check_count(name: str, value: int | None, low: int, high: int | None = None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low or high is not None and value > high:
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise InputError(f"{name} must be an integer {bound}, got {value!r}.")


def parse_row(spec: str, precision: str) -> tuple[str, str, str]:
    """`[LABEL=]NAME[@PRECISION]` -> (LABEL, NAME, PRECISION). The label names the row in the table and in
    `--params` (e.g. `eagle3=eagle` with `--params eagle3.heads_path=...` benches a second EAGLE head beside
    `eagle`); without one the row is called by its spec."""
    label, sep, rest = spec.partition("=")
    if not sep:
        label, rest = spec, spec
    name, _, row_precision = rest.partition("@")
    if not name.strip() or not label.strip() or sep and "@" in label:
        raise InputError(f"A --strategies row is [LABEL=]NAME[@PRECISION], got {spec!r}.")
    label = label.strip()
    return label, name.strip(), row_precision.strip() or precision


def build_requests(
    strategies: list[str],
    prompts: list[str],
    max_new_tokens: int,
    seed: int,
    model: str,
    device: str,
    dtype: str,
    overrides: dict[str, dict[str, Any]] | None = None,
    precision: str = "bf16",
) -> dict[str, list[RunRequest]]:
    """One validated request per row (`[LABEL=]NAME[@PRECISION]`, keyed by its label) and prompt: default
    params, max_new_tokens and any overrides, those keyed by the strategy name for every row of it, then those keyed
    by a row's label for that row only."""
    specs = [spec.strip() for spec in strategies if spec.strip()]
    if not specs:
        raise InputError("No strategies given; pass e.g. --strategies greedy,sample.")
    rows = [parse_row(spec, precision) for spec in specs]
    labels = [label for label, _, _ in rows]
    if len(set(labels)) != len(labels) or {HF_ROW, HF_ASSIST_ROW, LLAMA_CPP_ROW} & set(labels):
        raise InputError(f"Strategies must be distinct and not {HF_ROW!r}: got {', '.join(labels)}.")
    unknown = sorted(set(overrides or {}) - {name for _, name, _ in rows} - set(labels))
    if unknown:
        raise InputError(f"--params names {', '.join(unknown)}, which is not among the benched strategies.")
    options = {"chat": True, "seed": seed, "model": model, "device": device, "dtype": dtype}
    requests = {}
    for label, strategy, row_precision in rows:
        keyed = overrides or {}
        params = {**keyed.get(strategy, {}), **keyed.get(label, {}), "max_new_tokens": max_new_tokens}
        row = {**options, "precision": row_precision}
        requests[label] = [validate_request(strategy, text, params, **row) for text in prompts]
    return requests


def _aggregate(name: str, samples: list[RunSample], reference: float | None, note: str = "") -> BenchRow:
    """Fold the samples of one row; `reference` is the first strategy's median tok/s (None for that row)."""
    median = statistics.median(s.tokens_per_s for s in samples)
    keys = sorted({k for s in samples for k in s.metrics})
    metrics = {k: round(statistics.fmean(s.metrics.get(k, 0.0) for s in samples), 4) for k in keys}
    stops = Counter(s.stop_reason for s in samples)
    stop_note = "stops: " + ", ".join(f"{reason} {count}" for reason, count in sorted(stops.items()))
    return BenchRow(
        name=name,
        median_tokens_per_s=round(median, 2),
        speedup=1.0 if reference is None else (round(median / reference, 3) if reference > 0 else 0.0),
        mean_new_tokens=round(statistics.fmean(s.new_tokens for s in samples), 2),
        forwards_per_token=metrics.get("forwards_per_token", 0.0),
        runs=len(samples),
        metrics=metrics,
        notes="; ".join(part for part in (note, stop_note) if part),
    )


def _extra_metrics_note(row: BenchRow) -> str:
    """Numeric Stats fields not already shown in a column (e.g. acceptance rates of speculative methods)."""
    shown = {"new_tokens", "wall_s", "tokens_per_s", "forwards_per_token", "target_forwards"}
    extra = {k: v for k, v in row.metrics.items() if k not in shown}
    return ", ".join(f"{k} {v:g}" for k, v in extra.items())


def _timers(
    requests: dict[str, list[RunRequest]], models: dict[str, LoadedModel], budget: int | None = None
) -> dict[str, Timer]:
    """One timer per strategy row, on its precision's model; `budget` shortens max_new_tokens (warm-up)."""

    def timer(runs: list[RunRequest], loaded: LoadedModel) -> Timer:
        def run(index: int, ids: list[int]) -> RunSample:
            request = runs[index]
            if budget is not None:
                request = dataclasses.replace(
                    request, params=dataclasses.replace(request.params, max_new_tokens=budget)
                )
            return time_strategy(request, loaded, ids)

        return run

    return {name: timer(runs, models[runs[0].precision]) for name, runs in requests.items()}


def _measure(
    rows: dict[str, Timer], prompt_ids: list[list[int]], repeat: int, progress: Progress | None
) -> dict[str, list[RunSample]]:
    """Round-robin: for each prompt and repeat, every strategy then the reference rows, back to back."""
    samples: dict[str, list[RunSample]] = {name: [] for name in rows}
    total, done = len(prompt_ids) * repeat * len(rows), 0
    for index, ids in enumerate(prompt_ids):
        for r in range(repeat):
            for name, timer in rows.items():
                done += 1
                if progress:
                    progress(done, total, f"{name} prompt {index + 1}/{len(prompt_ids)} repeat {r + 1}/{repeat}")
                samples[name].append(timer(index, ids))
    return samples


def _profile(
    requests: dict[str, list[RunRequest]],
    models: dict[str, LoadedModel],
    prompt_ids: list[list[int]],
    progress: Progress | None,
) -> list[ProfileRow]:
    """One more run of every strategy on every prompt with the module timer on (`lab.engine.profile`)."""
    rows, total = [], len(requests) * len(prompt_ids)
    for name, runs in requests.items():
        loaded = models[runs[0].precision]
        timers, wall, tokens = [], 0.0, 0
        for index, ids in enumerate(prompt_ids):
            if progress:
                progress(len(rows) * len(prompt_ids) + index + 1, total, f"profile {name} prompt {index + 1}")
            with module_timer(loaded) as times:
                sample = time_strategy(runs[index], loaded, ids)
            timers.append(times)
            wall += sample.metrics.get("wall_s", 0.0)
            tokens += sample.new_tokens
        rows.append(profile_row(name, wall, tokens, timers))
    return rows


def _config(loaded: LoadedModel, prompts_source: str, n_prompts: int, **settings: object) -> dict:
    import transformers

    return {
        **settings,
        "prompts": prompts_source,
        "n_prompts": n_prompts,
        "model": loaded.spec,
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "precision": loaded.precision,
        "choice": loaded.choice,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }


def _reference_rows(
    loaded: LoadedModel, requests: dict, hf: bool, hf_assist: str | None, llama_cpp: bool, tokens: int
) -> tuple[dict[str, Callable[[list[int], int], RunSample]], dict[str, str]]:
    """hf-generate, hf-assist and llama.cpp as (ids, max_new_tokens) -> RunSample, with their notes."""
    rows: dict[str, Callable[[list[int], int], RunSample]] = {}
    notes = {HF_ROW: f"transformers generate, greedy (reference), {loaded.precision} weights"}
    if hf:
        rows[HF_ROW] = lambda ids, n: time_hf_generate(loaded, ids, n)
    if hf_assist:
        name = next((n for n, runs in requests.items() if runs[0].strategy.name in ("speculative", "ssd")), None)
        speculative = requests[name][0].params if name else None
        keys = ("gamma", "max_ngram", "draft_layers")
        settings = {k: getattr(speculative, k) for k in keys if hasattr(speculative, k)}
        kwargs, notes[HF_ASSIST_ROW] = hf_assist_kwargs(loaded, hf_assist.strip(), settings)
        rows[HF_ASSIST_ROW] = lambda ids, n: time_hf_generate(loaded, ids, n, **kwargs)
    if llama_cpp:
        runner = LlamaCppRow(loaded, tokens)
        rows[LLAMA_CPP_ROW], notes[LLAMA_CPP_ROW] = runner.time, runner.note
    return rows, notes


def run_bench(
    strategies: list[str],
    prompts: str = "builtin",
    *,
    max_new_tokens: int = 128,
    repeat: int = 1,
    model: str = EMBEDDED_MODEL,
    device: str = "auto",
    dtype: str = "auto",
    precision: str = "bf16",
    seed: int = 0,
    limit: int | None = None,
    hf: bool = True,
    params: dict[str, dict[str, Any]] | None = None,
    hf_assist: str | None = None,
    llama_cpp: bool = False,
    profile: bool = False,
    progress: Progress | None = None,
) -> BenchResult:
    """Measure every strategy row (and hf-generate unless `hf` is False, hf-assist when `hf_assist` names
    prompt-lookup or a draft model, llama.cpp when `llama_cpp`); `params` overrides strategy parameters by
    strategy name; `profile` adds a profiled pass of every strategy after the timed one (`lab.engine.profile`).
    The reference rows run on the model of the bench's `precision`. Raises InputError / ModelLoadError."""
    _check_count("repeat", repeat, 1, MAX_REPEAT)
    _check_count("limit", limit, 1)
    texts = load_prompts(prompts)[:limit]
    requests = build_requests(strategies, texts, max_new_tokens, seed, model, device, dtype, params, precision)
    first = requests[next(iter(requests))]
    base = validate_request("greedy", texts[0], {}, model=model, device=device, dtype=dtype, precision=precision)
    loaded = prepare(base)[0]
    native = loaded.device.type == "cpu" and native_forward.enabled()  # built before anything is timed
    models = {precision: loaded} | {runs[0].precision: prepare(runs[0])[0] for runs in requests.values()}
    prompt_ids = [prepare(request)[1] for request in first]  # same ids for every row
    longest = max(len(ids) for ids in prompt_ids) + max_new_tokens + 8
    references, notes = _reference_rows(loaded, requests, hf, hf_assist, llama_cpp, longest)
    timed = _timers(requests, models) | {n: (lambda i, ids, f=f: f(ids, max_new_tokens)) for n, f in references.items()}
    warm = _timers(requests, models, min(WARMUP_TOKENS, max_new_tokens))
    warm |= {n: (lambda i, ids, f=f: f(ids, min(WARMUP_TOKENS, max_new_tokens))) for n, f in references.items()}
    if progress:
        progress(0, len(texts) * repeat * len(timed), "warm-up")
    for timer in warm.values():  # one untimed short run of every row, so lazy initialisation is not timed
        timer(0, prompt_ids[0])
    samples = _measure(timed, prompt_ids, repeat, progress)
    rows: list[BenchRow] = []
    for name, runs in samples.items():
        reference = rows[0].median_tokens_per_s if rows else None
        rows.append(_aggregate(name, runs, reference, notes.get(name, "")))
        own = requests[name][0].precision if name in requests else loaded.precision
        rows[-1].precision = "" if name == LLAMA_CPP_ROW else own
        row_model = models[requests[name][0].precision] if name in requests else loaded
        if name != LLAMA_CPP_ROW:
            rows[-1].dtype, rows[-1].choice = str(row_model.dtype).removeprefix("torch."), row_model.choice
        first_decode = rows[0].median_decode_tokens_per_s if len(rows) > 1 else None
        vars(rows[-1]).update(split_fields(runs, next(iter(samples.values())), len(prompt_ids), first_decode))
        paths = "/".join(sorted({run.forward_path for run in runs if run.forward_path}))
        rows[-1].forward_path = paths or REFERENCE_PATHS.get(name, "")
    settings = {"strategies": list(requests), "max_new_tokens": max_new_tokens, "repeat": repeat, "seed": seed}
    extra = {"params": params or {}, "hf_assist": hf_assist, "llama_cpp": llama_cpp, "native_layers": native}
    config = _config(loaded, prompts, len(texts), **settings, limit=limit, hf=hf, **extra)
    return BenchResult(config, rows, _profile(requests, models, prompt_ids, progress) if profile else [])


def format_table(result: BenchResult) -> str:
    """A markdown table of the rows, preceded by a one-line description of the configuration."""
    c = result.config
    native = ", native decoder layers" if c.get("native_layers") else ""
    head = (
        f"{c['model']} on {c['device']} ({c['dtype']}, {c.get('precision', 'bf16')} weights unless a row says "
        f"otherwise, {c['threads']} threads{native}), {c['n_prompts']} prompts x "
        f"{c['repeat']} repeat(s), max_new_tokens={c['max_new_tokens']}\n\n"
    )
    if c.get("choice"):
        head += f"dtype and precision: {c['choice']}\n\n"
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for row in result.rows:
        own = f"model: {row.choice}" if row.choice and row.choice != c.get("choice") else ""
        path = f"path {row.forward_path}" if row.forward_path else ""
        notes = "; ".join(part for part in (row.notes, own, _extra_metrics_note(row), path) if part)
        cells = (
            row.name,
            f"{row.median_tokens_per_s:.2f}",
            ratio_cell(row.speedup, row.speedup_interval),
            f"{row.median_prefill_ms:.1f}",
            f"{row.median_decode_tokens_per_s:.2f}",
            ratio_cell(row.decode_speedup, row.decode_speedup_interval),
            f"{row.mean_new_tokens:.1f}",
            f"{row.forwards_per_token:.3f}",
            notes,
        )
        lines.append("| " + " | ".join(cells) + " |")
    table = head + "\n".join(lines)
    if result.profile:
        table += "\n\nWhere the time goes (a separate profiled pass, share of wall time):\n\n"
        table += format_profile(result.profile)
    return table
