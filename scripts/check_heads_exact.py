"""Every lossless method in greedy mode against plain greedy, token for token, on the builtin prompts (embedded model).

Usage: .venv/bin/python scripts/check_heads_exact.py [--dtype float32|bfloat16] [--max-new-tokens 128]
    [--start 0] [--limit 24] [--methods sd-lookup,sd-self,sd-model,ssd,medusa,mtpc,eagle,eagle1]
    [--variant LABEL=METHOD:key=value[,key=value]] ... [--compare A,B] ... [--json FILE]
Methods: sd-lookup / sd-self / sd-model (vanilla SD with prompt lookup, the first 8 layers, the target as its own
drafter), ssd (self-draft, gamma 3), and medusa, mtpc, eagle (EAGLE-3), eagle1 with the shipped heads; `--variant`
adds a method with other parameters (e.g. `mtpc-r4=mtpc:heads_path=data/heads/mtpc-r4`), checked the same way. Prints
one line per prompt (tokens, tau of each method) and a summary; `--compare A,B` adds the paired mean difference of tau
(B - A) over the prompts with its bootstrap 95% interval (`lab.tools.bench_stats.mean_difference_interval`); `--json`
writes the per-prompt taus. Exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lab.app.builtin_prompts import BUILTIN_PROMPTS  # noqa: E402
from lab.engine.models import load_model  # noqa: E402
from lab.engine.quant import PRECISIONS  # noqa: E402
from lab.params import build_params  # noqa: E402
from lab.registry import collect, get_strategy  # noqa: E402
from lab.tools.bench_stats import mean_difference_interval  # noqa: E402
from lab.trace import TokenEmitted, summarize  # noqa: E402

METHODS = {
    "sd-lookup": ("speculative", {"drafter": "prompt-lookup"}),
    "sd-self": ("speculative", {"drafter": "self-draft", "draft_layers": 8, "gamma": 3}),
    "sd-model": ("speculative", {"drafter": "model", "gamma": 4}),
    "ssd": ("ssd", {"drafter": "self-draft", "draft_layers": 8, "gamma": 3}),
    "medusa": ("medusa", {}),
    "mtpc": ("mtpc", {}),
    "eagle": ("eagle", {}),
    "eagle1": ("eagle", {"head": "eagle1"}),
}


def tokens_of(events: list) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEmitted)]


def run(loaded, name: str, ids: list[int], values: dict) -> list:
    strategy = get_strategy(name)
    return collect(strategy.run(loaded, ids, build_params(strategy.Params, values), torch.Generator()))


def parse_variant(spec: str) -> tuple[str, tuple[str, dict]]:
    """`LABEL=METHOD:key=value[,key=value]` -> (LABEL, (strategy, params)) on top of METHOD's settings."""
    label, _, rest = spec.partition("=")
    method, _, settings = rest.partition(":")
    if not label or method not in METHODS:
        raise SystemExit(f"--variant expects LABEL=METHOD:key=value with METHOD in {', '.join(METHODS)}, got {spec!r}")
    name, values = METHODS[method]
    extra = dict(item.split("=", 1) for item in settings.split(",") if "=" in item)
    return label, (name, {**values, **extra})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument(
        "--precision", default="bf16", choices=[p for p in PRECISIONS if p != "auto"], help="weight format"
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=len(BUILTIN_PROMPTS))
    parser.add_argument("--start", type=int, default=0, help="skip the first N prompts")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated, from: " + ", ".join(METHODS))
    parser.add_argument("--variant", action="append", default=[], help="LABEL=METHOD:key=value[,key=value]")
    parser.add_argument("--compare", action="append", default=[], help="A,B: paired mean difference of tau, B - A")
    parser.add_argument("--json", type=Path, help="write the per-prompt taus and matches here")
    args = parser.parse_args()
    loaded = load_model("smollm2-135m", device="cpu", dtype=args.dtype, precision=args.precision)
    methods = {name: METHODS[name] for name in args.methods.split(",") if name}
    methods |= dict(parse_variant(spec) for spec in args.variant)
    pairs = [tuple(pair.split(",")) for pair in args.compare]
    if any(len(pair) != 2 or not set(pair) <= set(methods) for pair in pairs):
        raise SystemExit(f"--compare expects A,B among {', '.join(methods)}, got {args.compare}")
    equal, taus = dict.fromkeys(methods, 0), {name: [] for name in methods}
    prompts = BUILTIN_PROMPTS[args.start : args.limit]
    for prompt in prompts:
        ids = loaded.encode(prompt.text)
        reference = tokens_of(run(loaded, "greedy", ids, {"max_new_tokens": args.max_new_tokens}))
        line = [f"{prompt.category:10s} {len(reference):4d} tokens"]
        for label, (name, values) in methods.items():
            events = run(loaded, name, ids, {"max_new_tokens": args.max_new_tokens, **values})
            same = tokens_of(events) == reference
            equal[label] += same
            taus[label].append(summarize(events).mean_accepted_length or 0.0)
            line.append(f"{label} tau {taus[label][-1]:.2f}{'' if same else ' MISMATCH'}")
        print("  ".join(line), flush=True)
    print(
        f"dtype {args.dtype}, {args.precision} weights, {len(prompts)} prompts, {args.max_new_tokens} tokens, "
        f"{torch.get_num_threads()} threads"
    )
    for label in methods:
        mean = sum(taus[label]) / len(taus[label])
        print(f"{label}: equal to greedy on {equal[label]}/{len(prompts)} prompts; mean tau {mean:.3f}")
    for first, other in pairs:
        mean, interval = mean_difference_interval(taus[first], taus[other])
        print(f"tau {other} - {first}: mean {mean:+.3f} over {len(prompts)} prompts, bootstrap 95% interval {interval}")
    if args.json:
        settings = {"dtype": args.dtype, "precision": args.precision, "max_new_tokens": args.max_new_tokens}
        methods_json = {label: {"strategy": name, "params": values} for label, (name, values) in methods.items()}
        record = {**settings, "prompts": len(prompts), "methods": methods_json, "tau": taus, "equal": equal}
        args.json.write_text(json.dumps(record, indent=1), encoding="utf-8")
    return 0 if all(n == len(prompts) for n in equal.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
