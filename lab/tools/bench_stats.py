"""Statistics of the benchmark's rows (`lab.tools.bench`): medians of the end-to-end, prefill and decode-only
figures, and bootstrap intervals of each row's ratio against the first row.

Covered: `split_fields` (a row's prefill and decode fields), `row_figures` (median end-to-end tokens/s,
median prefill ms, median decode-only tokens/s over the runs that have a decode part, i.e. at least two tokens)
and `ratio_interval`, a percentile bootstrap of the ratio of medians paired by prompt: the prompts are resampled
with replacement, and each resample keeps every repeat of a chosen prompt for both rows, so the prompt-to-prompt
spread (not only the run-to-run noise) sets the width. The resampling is seeded, so the same samples give the
same interval.
`mean_difference_interval`: the mean of paired per-prompt differences (e.g. tau of two heads on the same prompts)
with its percentile bootstrap 95% interval over prompts.
Not covered: intervals of the other Stats fields, tests between more than two rows at once.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lab.tools.bench_reference import RunSample

RESAMPLES = 2000
CONFIDENCE = 0.95

Figure = Callable[[RunSample], float]


def end_to_end(sample: RunSample) -> float:
    return sample.tokens_per_s


def decode_only(sample: RunSample) -> float:
    """Decode-only tokens/s; NaN for a run without a decode part (fewer than two tokens)."""
    return sample.decode_tokens_per_s if sample.new_tokens > 1 and sample.decode_tokens_per_s > 0 else math.nan


def _median(values: Sequence[float]) -> float:
    """Median of the defined values (NaN when none is)."""
    array = np.asarray(values, dtype=float)
    return float(np.nanmedian(array)) if np.isfinite(array).any() else math.nan


def row_figures(samples: Sequence[RunSample]) -> dict[str, float]:
    """Median end-to-end tokens/s, prefill ms and decode-only tokens/s of one row (0.0 where undefined)."""
    figures = {
        "median_tokens_per_s": _median([end_to_end(s) for s in samples]),
        "median_prefill_ms": _median([1000 * s.prefill_s for s in samples]),
        "median_decode_tokens_per_s": _median([decode_only(s) for s in samples]),
    }
    return {key: round(value, 2) if math.isfinite(value) else 0.0 for key, value in figures.items()}


def _by_prompt(samples: Sequence[RunSample], prompts: int, figure: Figure) -> np.ndarray:
    """The figure of every run as [prompts, repeats] (the bench orders runs prompt by prompt)."""
    if prompts < 1 or len(samples) % prompts:
        raise ValueError(f"{len(samples)} runs do not split into {prompts} prompts")
    return np.asarray([figure(s) for s in samples], dtype=float).reshape(prompts, -1)


def ratio_interval(
    first: Sequence[RunSample],
    row: Sequence[RunSample],
    prompts: int,
    figure: Figure = end_to_end,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> list[float] | None:
    """The percentile bootstrap 95% interval of median(row) / median(first), resampling prompts (paired:
    one draw of prompts serves both rows). None with fewer than two prompts or no defined ratio."""
    if prompts < 2:
        return None
    base, other = _by_prompt(first, prompts, figure), _by_prompt(row, prompts, figure)
    picks = np.random.default_rng(seed).integers(0, prompts, size=(resamples, prompts))  # [B, P]
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN resample: dropped below
        numerator = np.nanmedian(other[picks].reshape(resamples, -1), axis=1)  # [B]
        denominator = np.nanmedian(base[picks].reshape(resamples, -1), axis=1)  # [B]
        ratios = numerator / denominator
    ratios = ratios[np.isfinite(ratios)]
    if ratios.size == 0:
        return None
    tail = 100 * (1 - CONFIDENCE) / 2
    low, high = np.percentile(ratios, [tail, 100 - tail])
    return [round(float(low), 3), round(float(high), 3)]


def mean_difference_interval(
    first: Sequence[float], other: Sequence[float], resamples: int = RESAMPLES, seed: int = 0
) -> tuple[float, list[float] | None]:
    """mean(other - first) over paired values (one per prompt) and its percentile bootstrap 95% interval
    (resampling prompts; None with fewer than two)."""
    if len(first) != len(other) or len(first) == 0:
        raise ValueError(f"paired values need equal, non-zero lengths, got {len(first)} and {len(other)}")
    differences = np.asarray(other, dtype=float) - np.asarray(first, dtype=float)
    mean = round(float(differences.mean()), 4)
    if differences.size < 2:
        return mean, None
    picks = np.random.default_rng(seed).integers(0, differences.size, size=(resamples, differences.size))
    tail = 100 * (1 - CONFIDENCE) / 2
    low, high = np.percentile(differences[picks].mean(axis=1), [tail, 100 - tail])
    return mean, [round(float(low), 4), round(float(high), 4)]


def split_fields(
    runs: Sequence[RunSample], first_runs: Sequence[RunSample], prompts: int, first_decode: float | None
) -> dict[str, Any]:
    """A row's prefill and decode fields (`lab.tools.bench.BenchRow`): its medians, the decode ratio against the
    first row's decode median `first_decode` (None for the first row itself) and both ratios' intervals."""
    figures = row_figures(runs)
    fields: dict[str, Any] = {key: figures[key] for key in ("median_prefill_ms", "median_decode_tokens_per_s")}
    if first_decode is None:
        return fields | {"decode_speedup": 1.0, "speedup_interval": None, "decode_speedup_interval": None}
    decode = figures["median_decode_tokens_per_s"]
    return fields | {
        "decode_speedup": round(decode / first_decode, 3) if first_decode > 0 else 0.0,
        "speedup_interval": ratio_interval(first_runs, runs, prompts),
        "decode_speedup_interval": ratio_interval(first_runs, runs, prompts, decode_only),
    }


def ratio_cell(ratio: float, interval: list[float] | None) -> str:
    """A ratio for the table, with its interval when there is one: 1.234x [1.100, 1.350]."""
    return f"{ratio:.3f}x" + (f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "")
