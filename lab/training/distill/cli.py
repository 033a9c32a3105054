"""`python -m lab distill`: make (or resume) the self-distillation data set (`lab.training.distill.generate`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from lab.params import InputError
from lab.training.distill.generate import DistillSettings, eagle3_layers, run_distill

DEFAULT_OUT = "data/distill/{slug}"


def _progress_bar(total_hint: int = 0):
    if not sys.stderr.isatty():  # a log file (nohup): one timestamped line per shard
        return lambda done, total, message: print(
            f"[{time.strftime('%H:%M:%S')}] {done}/{total} {message}", file=sys.stderr, flush=True
        )
    from tqdm import tqdm

    bar = tqdm(total=total_hint or None, unit="batch", file=sys.stderr)

    def report(done: int, total: int, message: str) -> None:
        bar.total = total
        bar.n = done
        bar.set_postfix_str(message)
        bar.refresh()

    return report


def _layers(text: str, num_layers: int) -> tuple[int, ...]:
    """--layers: "none", "eagle3" (2, L // 2, L - 3) or comma-separated indices into hidden_states (0..L)."""
    if text in ("", "none"):
        return ()
    if text == "eagle3":
        return eagle3_layers(num_layers)
    try:
        layers = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise InputError(f"--layers must be none, eagle3 or indices like 2,15,27, not {text!r}.") from None
    if not all(0 <= layer <= num_layers for layer in layers):
        raise InputError(f"--layers must be between 0 and {num_layers}.")
    return layers


def check_overlap(folder: Path) -> dict:
    """Overlap check of a data folder: its prompts (an ids folder's shard manifests, a feature folder's Magpie
    chunks, else the hand-written set) against the benchmark prompts; printed as JSON by `--check-overlap`."""
    from lab.app.builtin_prompts import BUILTIN_PROMPTS
    from lab.training.distill.prompt_filter import overlap_report
    from lab.training.distill.prompts import distill_prompts
    from lab.training.distill.store import is_ids_folder, stored_prompts

    chunks = sorted((folder / "prompts").glob("chunk_*.json"))
    if is_ids_folder(folder):  # the prompts of the shards made (their manifests)
        prompts = stored_prompts(folder)
    else:
        prompts = [t for c in chunks for t in json.loads(c.read_text())] or [t for _, t in distill_prompts()]
    return {"folder": str(folder), **overlap_report(prompts, [p.text for p in BUILTIN_PROMPTS])}


def cmd_distill(args: argparse.Namespace) -> int:
    from lab.app.validation import validate_seed
    from lab.engine.models import load_model
    from lab.heads.common import model_slug
    from lab.tools.cli import _int_option

    if args.check_overlap:
        report = check_overlap(Path(args.store or args.out or DEFAULT_OUT.format(slug=model_slug(args.model))))
        print(json.dumps(report, indent=2))
        return 1 if report["near_benchmark"] else 0
    limit = _int_option("--limit", args.limit)
    settings = DistillSettings(
        model=args.model,
        max_new_tokens=_int_option("--max-new-tokens", args.max_new_tokens) or 256,
        samples=_int_option("--samples", args.samples),
        temperature=float(args.temperature),
        top_k=_int_option("--top-k", args.top_k),
        batch_size=_int_option("--batch-size", args.batch_size),
        rows=_int_option("--rows", args.rows),
        seed=validate_seed(args.seed),
        limit=limit,
        greedy=not args.no_greedy,
        prompts=args.prompts,
        magpie_chunks=_int_option("--magpie-chunks", args.magpie_chunks) or 0,
    )
    settings.check()
    max_shards = _int_option("--max-shards", args.max_shards)
    if max_shards is not None and (max_shards < 1 or not args.store):
        raise InputError("--max-shards must be at least 1 and goes with --store.")
    loaded = load_model(args.model, args.device, args.dtype, args.precision)
    settings = replace(settings, layers=_layers(args.layers, loaded.num_layers))
    if args.store:
        from lab.training.distill.store import folder_summary, run_store

        made = run_store(loaded, settings, Path(args.store), _progress_bar(), max_shards)
        print(json.dumps({"made": made, **folder_summary(Path(args.store))}, indent=1))
        return 0
    out = Path(args.out or DEFAULT_OUT.format(slug=model_slug(args.model)))
    run_distill(loaded, settings, out, _progress_bar())
    print(f"data in {out}", file=sys.stderr)
    return 0


def register(commands, evaluations, add_model_options) -> None:
    """Add `distill` to the top-level commands."""
    parser = commands.add_parser("distill", help="make self-distillation data for training draft heads (resumable)")
    parser.add_argument("--out", default=None, help="output folder (default data/distill/<model name>)")
    parser.add_argument(
        "--store", default=None, help="keep token ids only, in this tracked folder (e.g. heads/data/<model>/<name>)"
    )
    parser.add_argument("--max-shards", default=None, help="--store: make at most K of the plan's missing shards")
    parser.add_argument(
        "--precision", default="bf16", help="weight format of the linears: bf16, int8, int4, w4a8, auto"
    )
    parser.add_argument("--limit", default=None, help="use only the first K prompts of the 336")
    parser.add_argument("--check-overlap", action="store_true", help="only check the prompts of --store (or --out)")
    parser.add_argument("--prompts", default="handwritten", choices=("handwritten", "magpie"), help="prompt source")
    parser.add_argument("--magpie-chunks", default=None, help="Magpie: chunks of 64 model-written prompts (= shards)")
    parser.add_argument("--layers", default="none", help="extra features: none, eagle3 (2, L/2, L-3) or 2,15,27")
    parser.add_argument("--samples", default="1", help="sampled responses per prompt besides the greedy one")
    parser.add_argument("--no-greedy", action="store_true", help="sampled responses only (a second data set)")
    parser.add_argument("--temperature", default="0.8", help="temperature of the sampled responses")
    parser.add_argument("--top-k", default="32", help="how many next-token probabilities to store per position")
    parser.add_argument("--batch-size", default="8", help="hand-written prompts per batch (and per shard)")
    parser.add_argument("--rows", default="16", help="sequences decoded together (the batch of each forward)")
    add_model_options(parser)
    parser.set_defaults(handler=cmd_distill)
