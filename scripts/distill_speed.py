"""Distillation speed: response tokens/s of `lab distill`'s batched decoding, the left-padded batch against the
unpadded batched decode steps of the native op, in one process on the same prompts.

usage: PYTHONPATH=. .venv/bin/python scripts/distill_speed.py [--prompts 48] [--width 16] [--repeat 3]
    [--max-new-tokens 128] [--precision int4] [--dtype bfloat16] [--temperature 0]

The prompts are the first `--prompts` hand-written distillation prompts (`lab.training.distill.prompts`), each path
decoding all of them `--width` sequences at a time: "padded" is the left-padded batch (`lab distill` before the
batched steps: consecutive batches of `--width` prompts, each until its longest row ends), "steps" the unpadded
batched decode steps of the C++ op with continuous batching (a prompt starts when a sequence ends). Each repeat runs
both paths, alternating which goes first (so a drift of the machine's speed is shared). Printed: one JSON line per
run, then the median response tokens/s of each path and the median of the per-repeat ratios with their range.
Run it alone: other jobs on the two cores change both figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from lab.engine import forward_path
from lab.engine.models import load_model
from lab.training.distill.batched import decode_batch
from lab.training.distill.prompts import distill_prompts

PATHS = {"padded": "padded", "steps": "auto"}  # name -> decode_batch's path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--precision", default="int4")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    loaded = load_model("smollm2-135m", device="cpu", dtype=args.dtype, precision=args.precision)
    path = forward_path.choose(loaded, wait=True)
    print(json.dumps({"forward_path": path.as_dict(), "threads": torch.get_num_threads()}))
    if not path.native:
        print("the native op does not run here: both paths would be the padded batch")
        return 1
    prompts = [loaded.encode(text, chat=True) for _, text in distill_prompts()[: args.prompts]]
    rates: dict[str, list[float]] = {name: [] for name in PATHS}
    ratios = []
    for repeat in range(args.repeat):
        run: dict[str, float] = {}
        for name in list(PATHS) if repeat % 2 == 0 else list(reversed(PATHS)):
            generator = torch.Generator().manual_seed(repeat)
            start = time.perf_counter()
            decoded = decode_batch(
                loaded, prompts, args.max_new_tokens, args.temperature, generator, path=PATHS[name], width=args.width
            )
            seconds = time.perf_counter() - start
            tokens = sum(len(d.response) for d in decoded)
            run[name] = tokens / seconds
            line = {"repeat": repeat, "path": name, "response_tokens": tokens, "seconds": round(seconds, 2)}
            print(json.dumps(line | {"tokens_per_s": round(run[name], 1)}))
        for name in PATHS:
            rates[name].append(run[name])
        ratios.append(run["steps"] / run["padded"])
    print(
        f"\n{args.prompts} prompts, width {args.width}, {args.max_new_tokens} tokens, {args.precision} / {args.dtype}, "
        f"T = {args.temperature}, {args.repeat} repeats"
    )
    print("| path | median response tok/s |\n|---|---|")
    for name in PATHS:
        print(f"| {name} | {statistics.median(rates[name]):.1f} |")
    low, high = min(ratios), max(ratios)
    print(f"\nsteps / padded: median {statistics.median(ratios):.2f}x, per-repeat {low:.2f}x to {high:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
