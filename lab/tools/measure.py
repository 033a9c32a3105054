"""The Measure tab's numbers: `lab.tools.bench.run_bench` on a small subset, plus a quality score per strategy.

Covered: `measure(...)` (1) smoke-runs every selected strategy for two tokens and leaves out, with the error
in the notes, any that cannot run here (e.g. heads not trained for this model); (2) benchmarks the rest with
`run_bench` (interleaved rows, greedy first when selected so speedups are against greedy); (3) re-runs each
strategy once per prompt with the bench's requests and seeds (so, for seeded strategies, the same outputs) and
scores the output with the target model: quality = mean log p_target(x_t | x_<t) per output token in nats,
at temperature 1 over the full vocabulary (one teacher-forced forward). It is the model's own likelihood of
the text, not a human judgement: higher means closer to what the model itself finds likely, and greedy-like
methods score highest by construction. Each row also carries the family, the acceptance rate and tau folded by
`lab.trace.summarize`, and the draft length gamma (declared default or override) for the speculative curves.
Not covered: task accuracy (see the strategies' own `lab eval` commands), memory use.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import DynamicCache

from lab.app.builtin_prompts import load_prompts
from lab.app.runner import prepare, stream_run
from lab.engine import runtime
from lab.engine.models import EMBEDDED_MODEL, ModelLoadError
from lab.params import InputError
from lab.tools.bench import BenchResult, build_requests, run_bench
from lab.trace import TokenEmitted

DEFAULT_STRATEGIES = ("greedy", "sample", "dola", "cfg", "mirostat", "speculative", "ssd", "medusa", "mtpc", "eagle")
DEFAULT_LIMIT = 3
DEFAULT_TOKENS = 48
SMOKE_TOKENS = 2

Progress = Callable[[float, str], None]


@torch.inference_mode()
def output_log_likelihood(loaded, prompt_ids: list[int], output_ids: list[int]) -> float:
    """Mean log p(x_t | x_<t) of the output tokens under the target at temperature 1 (nats per token)."""
    if not output_ids:
        return 0.0
    ids = torch.tensor([prompt_ids + output_ids], dtype=torch.long, device=loaded.device)  # [1, T]
    logits, _ = runtime.model_forward(loaded, ids, DynamicCache(config=loaded.config))  # [1, T, V]
    logits = logits[0, len(prompt_ids) - 1 : -1].float()  # [n, V]
    logp = torch.log_softmax(logits, dim=-1)
    target = torch.tensor(output_ids, device=loaded.device)
    return float(logp.gather(1, target[:, None]).mean())


def _smoke(names: list[str], prompt: str, **options: str) -> tuple[list[str], dict[str, str]]:
    """Strategies that produce two tokens here, and the error of each one that does not."""
    usable, skipped = [], {}
    for name in names:
        try:
            request = build_requests([name], [prompt], SMOKE_TOKENS, 0, **options)[name][0]
            loaded, ids = prepare(request)
            for _ in stream_run(request, loaded, ids):
                pass
            usable.append(name)
        except (InputError, ModelLoadError, RuntimeError, ValueError, OSError) as error:
            skipped[name] = str(error)[:300]
    return usable, skipped


def _quality(names: list[str], prompts: list[str], tokens: int, **options: str) -> dict:
    requests = build_requests(names, prompts, tokens, 0, **options)
    scores = {}
    for name, rows in requests.items():
        values = []
        for request in rows:
            loaded, ids = prepare(request)
            output = [e.token_id for e in stream_run(request, loaded, ids) if isinstance(e, TokenEmitted)]
            values.append(output_log_likelihood(loaded, ids, output))
        scores[name] = round(sum(values) / len(values), 4)
    return scores


def _gamma(request) -> int | None:
    value = getattr(request.params, "gamma", None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _rows(result: BenchResult, quality: dict, names: list[str], prompts: list[str], options: dict) -> list[dict]:
    requests = build_requests(names, prompts[:1], 1, 0, **options)
    rows = []
    for row in result.rows:
        request = requests[row.name][0]
        rows.append(
            {
                "name": row.name,
                "family": request.strategy.family,
                "tokens_per_s": row.median_tokens_per_s,
                "speedup": row.speedup,
                "forwards_per_token": row.forwards_per_token,
                "acceptance_rate": row.metrics.get("acceptance_rate"),
                "mean_accepted_length": row.metrics.get("mean_accepted_length"),
                "quality": quality.get(row.name),
                "gamma": _gamma(request),
                "notes": row.notes,
            }
        )
    return rows


def measure(
    strategies: list[str],
    *,
    limit: int = DEFAULT_LIMIT,
    max_new_tokens: int = DEFAULT_TOKENS,
    model: str = EMBEDDED_MODEL,
    device: str = "auto",
    dtype: str = "auto",
    precision: str = "auto",
    progress: Progress | None = None,
) -> dict:
    """{config, rows, skipped}: bench rows (greedy first when selected) with quality and gamma; raises
    InputError when nothing can run."""
    names = sorted(dict.fromkeys(strategies), key=lambda n: (n != "greedy", strategies.index(n)))
    if not names:
        raise InputError("Select at least one strategy to measure.")
    prompts = load_prompts("builtin")[:limit]
    options = {"model": model, "device": device, "dtype": dtype, "precision": precision}
    report = progress or (lambda _fraction, _message: None)
    report(0.0, "checking that every strategy runs here")
    usable, skipped = _smoke(names, prompts[0], **options)
    if not usable:
        raise InputError("None of the selected strategies can run here: " + "; ".join(skipped.values()))

    def bench_progress(done: int, total: int, message: str) -> None:
        report(0.05 + 0.7 * done / max(total, 1), f"bench: {message}")

    result = run_bench(usable, limit=limit, max_new_tokens=max_new_tokens, hf=False, progress=bench_progress, **options)
    report(0.8, "scoring outputs with the target model")
    quality = _quality(usable, prompts, max_new_tokens, **options)
    report(1.0, "done")
    config = {**result.config, "quality": "mean log p_target per output token (nats, T = 1)"}
    return {"config": config, "rows": _rows(result, quality, usable, prompts, options), "skipped": skipped}
