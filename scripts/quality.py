"""Quality cost of each weight precision (issue 17): what int8 / int4 weights change in greedy decoding.

For every precision (bf16 = float weights, int8, int4; activations in --dtype) and every builtin prompt (chat
template on), greedy decoding of --tokens tokens, scored against the fp32 model with float weights (the
reference): the mean log-probability per generated token under the reference (nats; one teacher-forced forward,
`lab.tools.measure.output_log_likelihood`), the share of positions whose token equals the reference's greedy token
(position by position: after a first difference the texts drift apart, so this also counts the drift), the mean
length of the common prefix, and the teacher-forced top-1 agreement (on the reference's own greedy text, the
share of positions where the precision's argmax equals the reference's argmax: a per-token measure without
drift). The reference row (fp32, float weights) is measured the same way.

usage: python scripts/quality.py [--tokens 128] [--limit N] [--dtype bfloat16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from lab.app.builtin_prompts import load_prompts
from lab.engine.models import LoadedModel, load_model
from lab.params import build_params
from lab.tools.measure import output_log_likelihood
from lab.trace import TokenEmitted
from strategies import collect, get_strategy

GREEDY = get_strategy("greedy")


def greedy(loaded: LoadedModel, prompt_ids: list[int], tokens: int) -> list[int]:
    params = build_params(GREEDY.Params, {"max_new_tokens": tokens})
    events = collect(GREEDY.run(loaded, prompt_ids, params, torch.Generator().manual_seed(0)))
    return [e.token_id for e in events if isinstance(e, TokenEmitted)]


@torch.inference_mode()
def argmax_along(loaded: LoadedModel, prompt_ids: list[int], output_ids: list[int]) -> list[int]:
    """Teacher-forced argmax at every generated position of prompt + output."""
    ids = torch.tensor([prompt_ids + output_ids], dtype=torch.long, device=loaded.device)  # [1, T]
    logits = loaded.model(ids).logits[0, len(prompt_ids) - 1 : -1]  # [n, V]
    return logits.argmax(-1).tolist()


def prefix_length(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def evaluate(
    loaded: LoadedModel, reference: LoadedModel, prompts: list[list[int]], outputs: list[list[int]], tokens: int
) -> dict:
    """The four measures of one model against the reference's greedy outputs `outputs`."""
    logp, same, prefix, top1 = [], [], [], []
    for ids, ref_out in zip(prompts, outputs, strict=True):
        out = ref_out if loaded is reference else greedy(loaded, ids, tokens)
        logp.append(output_log_likelihood(reference, ids, out))
        same.append(sum(x == y for x, y in zip(out, ref_out, strict=False)) / max(len(ref_out), 1))
        prefix.append(prefix_length(out, ref_out))
        ref_argmax = ref_out  # the reference's argmax on its own greedy text is its greedy text
        mine = ref_argmax if loaded is reference else argmax_along(loaded, ids, ref_out)
        top1.append(sum(x == y for x, y in zip(mine, ref_argmax, strict=True)) / max(len(ref_out), 1))
    return {
        "mean log p_fp32 per token": statistics.fmean(logp),
        "greedy tokens equal to fp32 greedy": statistics.fmean(same),
        "mean common prefix (tokens)": statistics.fmean(prefix),
        "teacher-forced top-1 agreement": statistics.fmean(top1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16", help="activation dtype of the quantized rows")
    parser.add_argument("--precisions", default="bf16,int8,int4")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    reference = load_model("smollm2-135m", device="cpu", dtype="float32", precision="bf16")
    prompts = [reference.encode(text) for text in load_prompts("builtin")[: args.limit]]
    outputs = [greedy(reference, ids, args.tokens) for ids in prompts]
    rows = {"fp32 (reference)": evaluate(reference, reference, prompts, outputs, args.tokens)}
    for precision in args.precisions.split(","):
        loaded = load_model("smollm2-135m", device="cpu", dtype=args.dtype, precision=precision)
        rows[f"{precision} weights, {args.dtype}"] = evaluate(loaded, reference, prompts, outputs, args.tokens)
        del loaded
    columns = list(next(iter(rows.values())))
    print(f"{len(prompts)} builtin prompts, {args.tokens} greedy tokens each; reference: fp32, float weights\n")
    print("| precision | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for name, row in rows.items():
        cells = [f"{row[c]:.1f}" if "prefix" in c else f"{row[c]:.3f}" for c in columns]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens": args.tokens, "prompts": len(prompts), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
