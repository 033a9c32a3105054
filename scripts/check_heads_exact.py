"""Greedy Medusa and MTPC against plain greedy, token for token, on the builtin prompts (embedded model, fp32).

Usage: .venv/bin/python scripts/check_heads_exact.py [--max-new-tokens 128] [--start 0] [--limit 24]
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
from strategies import medusa, mtpc  # noqa: E402
from strategies.base import collect  # noqa: E402
from strategies.greedy import GreedyParams  # noqa: E402
from strategies.greedy import run as greedy_run  # noqa: E402
from strategies.medusa import TreeParams  # noqa: E402


def tokens_of(events: list) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEmitted)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=len(BUILTIN_PROMPTS))
    parser.add_argument("--start", type=int, default=0, help="skip the first N prompts")
    args = parser.parse_args()
    loaded = load_model("smollm2-135m", device="cpu", dtype="float32")
    strategies = {"medusa": medusa, "mtpc": mtpc}
    equal, taus = dict.fromkeys(strategies, 0), {name: [] for name in strategies}
    prompts = BUILTIN_PROMPTS[args.start : args.limit]
    for prompt in prompts:
        ids = loaded.encode(prompt.text)
        reference = tokens_of(collect(greedy_run(loaded, ids, GreedyParams(args.max_new_tokens), torch.Generator())))
        line = [f"{prompt.category:10s} {len(reference):4d} tokens"]
        for name, module in strategies.items():
            events = collect(module.run(loaded, ids, TreeParams(args.max_new_tokens), torch.Generator()))
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
