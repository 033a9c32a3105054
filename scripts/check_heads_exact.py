"""Greedy Medusa, MTPC and EAGLE against plain greedy, token for token, on the builtin prompts (embedded model, fp32).

Usage: .venv/bin/python scripts/check_heads_exact.py [--max-new-tokens 128] [--start 0] [--limit 24]
    [--strategies medusa,mtpc,eagle]
Prints one line per prompt (tokens, tau of each strategy) and a summary; exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lab.models import load_model  # noqa: E402
from lab.prompts import BUILTIN_PROMPTS  # noqa: E402
from lab.trace import TokenEmitted, summarize  # noqa: E402
from strategies import get_strategy  # noqa: E402
from strategies.base import collect  # noqa: E402
from strategies.greedy import GreedyParams  # noqa: E402
from strategies.greedy import run as greedy_run  # noqa: E402


def tokens_of(events: list) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEmitted)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=len(BUILTIN_PROMPTS))
    parser.add_argument("--start", type=int, default=0, help="skip the first N prompts")
    parser.add_argument("--strategies", default="medusa,mtpc,eagle", help="comma-separated, shipped heads")
    args = parser.parse_args()
    loaded = load_model("smollm2-135m", device="cpu", dtype="float32")
    strategies = {name: get_strategy(name) for name in args.strategies.split(",")}
    equal, taus = dict.fromkeys(strategies, 0), {name: [] for name in strategies}
    prompts = BUILTIN_PROMPTS[args.start : args.limit]
    for prompt in prompts:
        ids = loaded.encode(prompt.text)
        reference = tokens_of(collect(greedy_run(loaded, ids, GreedyParams(args.max_new_tokens), torch.Generator())))
        line = [f"{prompt.category:10s} {len(reference):4d} tokens"]
        for name, strategy in strategies.items():
            params = strategy.Params(max_new_tokens=args.max_new_tokens)
            events = collect(strategy.run(loaded, ids, params, torch.Generator()))
            same = tokens_of(events) == reference
            equal[name] += same
            taus[name].append(summarize(events).mean_accepted_length)
            line.append(f"{name} tau {taus[name][-1]:.3f}{'' if same else ' MISMATCH'}")
        print("  ".join(line), flush=True)
    for name in strategies:
        mean = sum(taus[name]) / len(taus[name])
        print(f"{name}: equal to greedy on {equal[name]}/{len(prompts)} prompts; mean tau {mean:.3f}")
    return 0 if all(n == len(prompts) for n in equal.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
