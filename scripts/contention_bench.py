"""Contention bench: greedy tokens/s alone and beside CPU-bound neighbours, before and after the thread policy.

usage: .venv/bin/python scripts/contention_bench.py [--tokens 64] [--repeat 3] [--neighbours 2]
    [--modes before,after,passive,short-spin]

For each mode a fresh worker process loads the embedded model (so the OpenMP settings are read at torch's import):
- before: torch's defaults (one intra-op thread per CPU, OpenMP's default wait policy);
- after: `lab.engine.threads.apply` before each run, as the app does (intra-op threads from the CPUs that are free right
  now; OpenMP's default wait policy);
- passive: the same, with OMP_WAIT_POLICY=PASSIVE set before torch is imported (waiting threads sleep at once);
- short-spin: the same, waiting threads spin SHORT_SPIN iterations (GOMP_SPINCOUNT), then sleep.
The worker runs greedy `repeat` times alone, then again while `neighbours` processes run `while True: pass`.
Printed: one JSON line per mode and a Markdown table (median tokens/s, beside / alone). Other jobs on the machine
change the numbers: run it alone and say what else was running. List a mode twice (for example
before,after,before,after) to see how much the machine's speed drifts between workers.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Explain in a few sentences why the sky is blue."
NEIGHBOUR = "while True: pass"
MODES = ("before", "after", "passive", "short-spin")
SHORT_SPIN = "10000"  # libgomp's busy-wait iterations before a waiting thread sleeps (its default: 300000)


def worker(tokens: int, mode: str) -> None:
    """Load once, then per line on stdin run greedy and print {"tokens_per_s", "threads"} as JSON."""
    sys.path.insert(0, str(ROOT))
    from lab.engine import threads

    policy = mode != "before"
    if mode == "passive":
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # before torch is imported: libgomp reads it once
    elif mode == "short-spin":
        os.environ["GOMP_SPINCOUNT"] = SHORT_SPIN
    import torch

    from lab.app.runner import run_to_trace
    from lab.app.validation import validate_request
    from lab.trace import summarize

    request = validate_request("greedy", PROMPT, {"max_new_tokens": tokens})
    run_to_trace(request)  # load + warm-up
    print(json.dumps({"ready": True}), flush=True)
    for _line in sys.stdin:
        chosen = threads.apply() if policy else None
        stats = summarize(run_to_trace(request).events)
        busy = chosen.busy if chosen else None
        result = {"tokens_per_s": stats.tokens_per_s, "threads": torch.get_num_threads(), "busy": busy}
        print(json.dumps(result), flush=True)


def measure(mode: str, args: argparse.Namespace) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT")}
    command = [sys.executable, __file__, "--worker", mode, "--tokens", str(args.tokens)]
    proc = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def runs(n: int) -> list[dict]:
        out = []
        for _ in range(n):
            proc.stdin.write("run\n")
            proc.stdin.flush()
            ready, _, _ = select.select([proc.stdout], [], [], args.timeout)
            if not ready:  # slower than `timeout`: record it as at most tokens / timeout
                out.append({"tokens_per_s": 0.0, "threads": None, "busy": None, "timed_out": True})
                break
            out.append(json.loads(proc.stdout.readline()))
        return out

    ready, _, _ = select.select([proc.stdout], [], [], args.timeout * 4)
    assert ready and json.loads(proc.stdout.readline()).get("ready"), "worker failed to start"
    alone = runs(args.repeat)
    neighbours = [subprocess.Popen([sys.executable, "-c", NEIGHBOUR]) for _ in range(args.neighbours)]
    try:
        time.sleep(1.0)
        beside = runs(args.repeat)
    finally:
        for n in neighbours:
            n.kill()
            n.wait()
        proc.kill()
        proc.wait(timeout=60)
    a = statistics.median(r["tokens_per_s"] for r in alone)
    b = statistics.median(r["tokens_per_s"] for r in beside)
    return {
        "mode": mode,
        "alone": alone,
        "beside": beside,
        "alone_tps": a,
        "beside_tps": b,
        "ratio": b / a if a else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--neighbours", type=int, default=2)
    parser.add_argument("--modes", default="before,after")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one run may take")
    parser.add_argument("--worker", choices=MODES)
    args = parser.parse_args()
    if args.worker:
        worker(args.tokens, args.worker)
        return
    rows = []
    for mode in args.modes.split(","):
        row = measure(mode, args)
        print(json.dumps(row), flush=True)
        rows.append(row)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\ngreedy, {args.tokens} tokens, median of {args.repeat}, {args.neighbours} neighbours `{NEIGHBOUR}`")
    print(f"load average at the end (1, 5, 15 min): {load}")
    print("| mode | threads alone / beside | alone tok/s | beside tok/s | beside / alone |\n|---|---|---|---|---|")
    for r in rows:
        t = f"{r['alone'][0].get('threads')} / {r['beside'][0].get('threads')}"
        print(f"| {r['mode']} | {t} | {r['alone_tps']:.1f} | {r['beside_tps']:.1f} | {r['ratio']:.0%} |")


if __name__ == "__main__":
    main()
