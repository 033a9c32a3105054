"""Where the wall time of a draft-then-verify round goes, per strategy, without a profiler's overhead.

Runs each strategy at its defaults on the first --limit builtin prompts (embedded model, the CPU defaults unless
--dtype / --precision say otherwise) with plain wall-clock timers around the calls a round makes: the target's
verify forward (`lab.engine.runtime.verify_tree` / `verify`, LM head included), the proposer's `propose` (the
heads and the tree), the acceptance rule, the KV compaction (`commit`), the round's event (`tree_round`); what
is left of a round (emitting tokens and their alternatives, the proposer's `accept`, the loop itself) is "rest".
The prefill is left out of the rounds (ms / token includes it). Greedy's rounds are its decode steps. One warm-up
run per strategy.
Timings are noisy on a shared machine: run it alone.

usage: python scripts/round_time.py [--strategies greedy,speculative,medusa,mtpc,eagle] [--limit 8]
       [--max-new-tokens 128] [--dtype auto] [--precision auto]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lab.speculative.tree as tree_loop_module  # noqa: E402
from lab.app.builtin_prompts import load_prompts  # noqa: E402
from lab.engine import runtime  # noqa: E402
from lab.engine.models import load_model  # noqa: E402
from lab.params import build_params  # noqa: E402
from lab.registry import collect, get_strategy  # noqa: E402
from lab.trace import summarize  # noqa: E402

SPENT: collections.Counter = collections.Counter()  # seconds per timed call
PARTS = ("target forward", "propose", "accept", "commit", "tree_round")


def timed(owner: object, name: str, label: str) -> None:
    """Replace owner.name by a wrapper that adds its wall time to SPENT[label]."""
    original: Callable = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            SPENT[label] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def instrument() -> None:
    timed(runtime, "forward", "target forward")  # verify forwards, greedy's steps and the prefill's forward
    timed(runtime, "prefill", "prefill")  # subtracted: a round's figures leave the prefill out
    for name in ("accept", "commit", "tree_round"):
        timed(tree_loop_module, name, name)
    for module_name in ("eagle", "medusa", "mtpc", "prompt_lookup"):
        module = __import__(f"lab.speculative.proposers.{module_name}", fromlist=["_"])
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == module.__name__ and hasattr(value, "propose"):
                timed(value, "propose", "propose")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategies", default="greedy,speculative,medusa,mtpc,eagle")
    parser.add_argument("--limit", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--precision", default="auto")
    args = parser.parse_args()
    loaded = load_model("smollm2-135m", device="cpu", dtype=args.dtype, precision=args.precision)
    print(f"{loaded.spec}: {loaded.dtype}, {loaded.precision}, {torch.get_num_threads()} threads, "
          f"{args.limit} builtin prompts, {args.max_new_tokens} tokens\n")  # fmt: skip
    prompts = [loaded.encode(p) for p in load_prompts("builtin")[: args.limit]]
    instrument()
    header = "| strategy | ms / token | rounds | tokens / round | ms / round | " + " | ".join(PARTS) + " | rest |"
    lines = [header, "|" + "---|" * (len(PARTS) + 6)]
    for name in args.strategies.split(","):
        strategy = get_strategy(name)
        params = build_params(strategy.Params, {"max_new_tokens": args.max_new_tokens})
        collect(strategy.run(loaded, prompts[0], params, torch.Generator()))  # warm-up
        SPENT.clear()
        wall, tokens, rounds = 0.0, 0, 0
        for ids in prompts:
            start = time.perf_counter()
            stats = summarize(collect(strategy.run(loaded, ids, params, torch.Generator())))
            wall += time.perf_counter() - start
            tokens += stats.new_tokens
            rounds += stats.target_forwards - 1  # the prefill is not a round
        SPENT["target forward"] -= SPENT["prefill"]
        per_round = {part: 1000 * SPENT[part] / max(rounds, 1) for part in PARTS}
        round_ms = 1000 * (wall - SPENT["prefill"]) / max(rounds, 1)
        rest = round_ms - sum(per_round.values())
        cells = " | ".join(f"{per_round[part]:.2f}" for part in PARTS)
        lines.append(f"| {name} | {1000 * wall / max(tokens, 1):.2f} | {rounds} | {tokens / max(rounds, 1):.2f} | "
                     f"{round_ms:.2f} | {cells} | {rest:.2f} |")  # fmt: skip
    print("\n".join(lines))
    print("\nms per round (the prefill left out); rest = the round's wall time no timed call accounts for")


if __name__ == "__main__":
    main()
