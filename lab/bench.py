"""The benchmark behind `python -m lab bench`: tokens/s of strategies against Hugging Face `generate`.

Covered: every strategy runs every prompt (chat template on) `repeat` times with its default parameters and
the given `max_new_tokens`; optionally `model.generate(do_sample=False)` runs the same prompt ids on the same
model, device and dtype as the reference row "hf-generate". Runs are interleaved round-robin (for each prompt
and repeat: every strategy, then hf-generate) so machine noise hits every row alike, after one untimed warm-up
run of each row. Per-strategy parameters override the defaults (`--params NAME.key=value`,
`parse_param_overrides`). `--hf-assist prompt-lookup|self-draft[:L]|MODEL` adds the row "hf-assist":
transformers' assisted generation (greedy) with prompt lookup (`prompt_lookup_num_tokens`) or an assistant model
(`assistant_model=`: the lab's self-drafter, the target's first L layers, or a model loaded like the target;
constant `num_assistant_tokens`), using the speculative (else ssd) row's gamma, max_ngram and draft_layers when
one is benched (else transformers' defaults: 10 tokens and n-gram 2, or 20 assistant tokens). The HF rows'
forwards/token count every call of the target module (draft calls too when the assistant is the target).
Per row: median tokens/s (new tokens / wall time of one run, prefill included), speedup against the first
strategy's median, mean new tokens, forwards per token and the mean of every other numeric
field of `lab.trace.Stats` (plus SSD's `lab.trace.speculation_stats`: cache hit rate, branches per round).
Both paths stop at the same EOS ids, and a strategy's stop reasons are noted. `--profile` adds one more, untimed
pass of every strategy with `lab.profile`'s module timer: the share of wall time in target forwards, drafting,
acceptance, KV compaction and the rest, and the cost of a target forward at the positions it scored.
Not covered: asserting speeds (tests never do), batching, memory use, sampling in the HF reference row.
"""

from __future__ import annotations

import copy
import dataclasses
import platform
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from lab.models import EMBEDDED_MODEL, LoadedModel
from lab.params import InputError
from lab.profile import ProfileRow, format_profile, module_timer, profile_row
from lab.prompts import load_prompts
from lab.runner import prepare, stream_run
from lab.speculative.proposers.draft_model import load_draft_model
from lab.speculative.proposers.self_draft import self_draft_view
from lab.trace import Stats, speculation_stats, summarize
from lab.validation import RunRequest, validate_request

HF_ROW = "hf-generate"
HF_ASSIST_ROW = "hf-assist"
HF_PROMPT_LOOKUP = "prompt-lookup"
HF_SELF_DRAFT = "self-draft"
MAX_REPEAT = 100
WARMUP_TOKENS = 16
COLUMNS = ("strategy", "median tok/s", "speedup vs first", "tokens", "forwards/token", "notes")

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class RunSample:
    """One timed run: its tokens/s and the numeric statistics of the run."""

    tokens_per_s: float
    new_tokens: int
    metrics: dict[str, float]
    stop_reason: str


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

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class BenchResult:
    """What was measured (config), one row per strategy (hf-generate last) and, with --profile, one profile
    row per strategy (`lab.profile`)."""

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
    """Run one strategy to the end; tokens/s = new_tokens / wall_s as folded by `summarize`."""
    events = list(stream_run(request, loaded, prompt_ids))
    stats = summarize(events)
    rate = stats.new_tokens / stats.wall_s if stats.wall_s > 0 else 0.0
    metrics = {**_numeric_stats(stats), **speculation_stats(events)}  # SSD: cache hit rate, branches per round
    return RunSample(rate, stats.new_tokens, metrics, stats.stop_reason)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def time_hf_generate(loaded: LoadedModel, prompt_ids: list[int], max_new_tokens: int, **assist: Any) -> RunSample:
    """Greedy `model.generate` on the same ids; stops at the same EOS ids as the strategies. `assist` goes to
    generate (prompt_lookup_num_tokens, max_matching_ngram_size or assistant_model); target calls are counted."""
    eos = list(loaded.eos_token_ids)
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=loaded.device)  # [1, T]
    attention_mask = torch.ones_like(input_ids)
    calls: list[int] = []
    hook = loaded.model.register_forward_pre_hook(lambda *_: calls.append(1))
    with torch.inference_mode():
        _synchronize(loaded.device)
        start = time.perf_counter()
        output = loaded.model.generate(
            input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=eos[0] if eos else None,
            **assist,
        )  # [1, T + n]
        _synchronize(loaded.device)
        wall = time.perf_counter() - start
    hook.remove()
    new_tokens = int(output.shape[1] - input_ids.shape[1])
    stop = "eos" if new_tokens and int(output[0, -1]) in eos else "max_new_tokens"
    rate = new_tokens / wall if wall > 0 else 0.0
    per_token = len(calls) / new_tokens if new_tokens else 0.0
    metrics = {"new_tokens": new_tokens, "wall_s": wall, "tokens_per_s": rate, "forwards_per_token": per_token}
    return RunSample(rate, new_tokens, metrics, stop)


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


def hf_assist_kwargs(loaded: LoadedModel, hf_assist: str, settings: dict[str, int]) -> tuple[dict, str]:
    """generate() keyword arguments and the row note for `--hf-assist` (prompt-lookup or a model spec)."""
    if hf_assist == HF_PROMPT_LOOKUP:
        tokens, ngram = settings.get("gamma", 10), settings.get("max_ngram", 2)
        kwargs = {"prompt_lookup_num_tokens": tokens, "max_matching_ngram_size": ngram}
        return kwargs, f"transformers assisted generation, prompt lookup ({tokens} tokens, n-gram {ngram})"
    if hf_assist.startswith(HF_SELF_DRAFT):  # self-draft or self-draft:L, the lab's self-drafter as the assistant
        layers = hf_assist.removeprefix(HF_SELF_DRAFT).lstrip(":") or str(settings.get("draft_layers", 8))
        if not layers.isdigit():
            raise InputError(f"--hf-assist self-draft:L needs an integer L, got {hf_assist!r}.")
        draft = self_draft_view(loaded, int(layers))
    else:
        draft = loaded if hf_assist == loaded.spec else load_draft_model(loaded, hf_assist)
    config = copy.deepcopy(draft.model.generation_config)
    config.num_assistant_tokens = settings.get("gamma", 20)
    config.num_assistant_tokens_schedule = "constant"
    draft.model.generation_config = config
    note = f"transformers assisted generation, assistant {hf_assist} ({config.num_assistant_tokens} tokens)"
    return {"assistant_model": draft.model}, note


def _check_count(name: str, value: int | None, low: int, high: int | None = None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low or high is not None and value > high:
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise InputError(f"{name} must be an integer {bound}, got {value!r}.")


def build_requests(
    strategies: list[str],
    prompts: list[str],
    max_new_tokens: int,
    seed: int,
    model: str,
    device: str,
    dtype: str,
    overrides: dict[str, dict[str, Any]] | None = None,
) -> dict[str, list[RunRequest]]:
    """One validated request per strategy and prompt (default params, max_new_tokens and any overrides)."""
    names = [name.strip() for name in strategies if name.strip()]
    if not names:
        raise InputError("No strategies given; pass e.g. --strategies greedy,sample.")
    if len(set(names)) != len(names) or HF_ROW in names or HF_ASSIST_ROW in names:
        raise InputError(f"Strategies must be distinct and not {HF_ROW!r}: got {', '.join(names)}.")
    unknown = sorted(set(overrides or {}) - set(names))
    if unknown:
        raise InputError(f"--params names {', '.join(unknown)}, which is not among the benched strategies.")
    options = {"chat": True, "seed": seed, "model": model, "device": device, "dtype": dtype}
    requests = {}
    for name in names:
        params = {**(overrides or {}).get(name, {}), "max_new_tokens": max_new_tokens}
        requests[name] = [validate_request(name, text, params, **options) for text in prompts]
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


def _warm_up(
    requests: dict[str, list[RunRequest]], loaded: LoadedModel, prompt_ids: list[int], hf_rows: dict[str, dict]
) -> None:
    """One untimed short run of every row, so lazy initialisation is not timed."""
    budget = min(WARMUP_TOKENS, requests[next(iter(requests))][0].params.max_new_tokens)
    for rows in requests.values():
        request = dataclasses.replace(rows[0], params=dataclasses.replace(rows[0].params, max_new_tokens=budget))
        time_strategy(request, loaded, prompt_ids)
    for kwargs in hf_rows.values():
        time_hf_generate(loaded, prompt_ids, budget, **kwargs)


def _measure(
    requests: dict[str, list[RunRequest]],
    loaded: LoadedModel,
    prompt_ids: list[list[int]],
    repeat: int,
    hf_rows: dict[str, dict],
    progress: Progress | None,
) -> dict[str, list[RunSample]]:
    """Round-robin: for each prompt and repeat, every strategy then the HF rows, back to back."""
    names = list(requests) + list(hf_rows)
    samples: dict[str, list[RunSample]] = {name: [] for name in names}
    total, done = len(prompt_ids) * repeat * len(names), 0
    max_new_tokens = requests[names[0]][0].params.max_new_tokens
    for index, ids in enumerate(prompt_ids):
        for r in range(repeat):
            for name in names:
                done += 1
                if progress:
                    progress(done, total, f"{name} prompt {index + 1}/{len(prompt_ids)} repeat {r + 1}/{repeat}")
                if name in hf_rows:
                    samples[name].append(time_hf_generate(loaded, ids, max_new_tokens, **hf_rows[name]))
                else:
                    samples[name].append(time_strategy(requests[name][index], loaded, ids))
    return samples


def _profile(
    requests: dict[str, list[RunRequest]], loaded: LoadedModel, prompt_ids: list[list[int]], progress: Progress | None
) -> list[ProfileRow]:
    """One more run of every strategy on every prompt with the module timer on (`lab.profile`)."""
    rows, total = [], len(requests) * len(prompt_ids)
    for name, runs in requests.items():
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
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }


def run_bench(
    strategies: list[str],
    prompts: str = "builtin",
    *,
    max_new_tokens: int = 128,
    repeat: int = 1,
    model: str = EMBEDDED_MODEL,
    device: str = "auto",
    dtype: str = "auto",
    seed: int = 0,
    limit: int | None = None,
    hf: bool = True,
    params: dict[str, dict[str, Any]] | None = None,
    hf_assist: str | None = None,
    profile: bool = False,
    progress: Progress | None = None,
) -> BenchResult:
    """Measure every strategy (and hf-generate unless `hf` is False, and hf-assist when `hf_assist` names
    prompt-lookup or a draft model); `params` overrides strategy parameters by strategy name; `profile` adds
    a profiled pass of every strategy after the timed one (`lab.profile`).
    Raises InputError / ModelLoadError."""
    _check_count("repeat", repeat, 1, MAX_REPEAT)
    _check_count("limit", limit, 1)
    texts = load_prompts(prompts)[:limit]
    requests = build_requests(strategies, texts, max_new_tokens, seed, model, device, dtype, params)
    first = requests[next(iter(requests))]
    loaded, _ = prepare(first[0])
    prompt_ids = [prepare(request)[1] for request in first]  # same ids for every row
    hf_rows, notes = ({HF_ROW: {}} if hf else {}), {HF_ROW: "transformers generate, greedy (reference)"}
    if hf_assist:
        name = next((n for n in ("speculative", "ssd") if n in requests), None)
        speculative = requests[name][0].params if name else None
        keys = ("gamma", "max_ngram", "draft_layers")
        settings = {k: getattr(speculative, k) for k in keys if hasattr(speculative, k)}
        hf_rows[HF_ASSIST_ROW], notes[HF_ASSIST_ROW] = hf_assist_kwargs(loaded, hf_assist.strip(), settings)
    if progress:
        progress(0, len(texts) * repeat * (len(requests) + len(hf_rows)), "warm-up")
    _warm_up(requests, loaded, prompt_ids[0], hf_rows)
    samples = _measure(requests, loaded, prompt_ids, repeat, hf_rows, progress)
    rows: list[BenchRow] = []
    for name, runs in samples.items():
        reference = rows[0].median_tokens_per_s if rows else None
        rows.append(_aggregate(name, runs, reference, notes.get(name, "")))
    settings = {"strategies": list(requests), "max_new_tokens": max_new_tokens, "repeat": repeat, "seed": seed}
    extra = {"params": params or {}, "hf_assist": hf_assist}
    config = _config(loaded, prompts, len(texts), **settings, limit=limit, hf=hf, **extra)
    return BenchResult(config, rows, _profile(requests, loaded, prompt_ids, progress) if profile else [])


def format_table(result: BenchResult) -> str:
    """A markdown table of the rows, preceded by a one-line description of the configuration."""
    c = result.config
    head = (
        f"{c['model']} on {c['device']} ({c['dtype']}, {c['threads']} threads), {c['n_prompts']} prompts x "
        f"{c['repeat']} repeat(s), max_new_tokens={c['max_new_tokens']}\n\n"
    )
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for row in result.rows:
        notes = "; ".join(part for part in (row.notes, _extra_metrics_note(row)) if part)
        cells = (
            row.name,
            f"{row.median_tokens_per_s:.2f}",
            f"{row.speedup:.3f}x",
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
