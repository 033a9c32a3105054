"""Tuning EAGLE-2's tree size for a model on a machine: `python -m lab.tools.eagle_tune`.

EAGLE-2 picks total_tokens automatically by timing the target's verify forward at a few tree sizes. Here the
same idea is made exact for greedy decoding:
1. verify cost: the target's tree-verify forward (with KV compaction) is timed for 1 + N tokens, N in `sizes`, at
   a run's middle context (the prompts' mean length plus half of max_new_tokens), and one head step for `branch`
   frontier nodes is timed (min over repeats, interleaved);
2. acceptance: EAGLE runs greedily on the prompts once per `branch` with a large tree (total_tokens =
   max(sizes), depth = max(depths)). For a smaller setting (N, D), the kept tree is the first N candidates of
   depth < D in the rerank order, and the greedy walk follows the same target argmaxes, so its accepted length
   is the number of leading nodes of the big tree's accepted path that survive the cut. This is exact round by
   round; over a run the round boundaries of a smaller tree shift, so tau(N, D) is a close estimate;
3. estimated tokens/s(N, D) = tau(N, D) / (t_extend + (D - 1) t_step + t_verify(N) + t_other), ranked, where
   t_other is the rest of a round (drafting bookkeeping, reranking, acceptance, Python): the acceptance runs' wall
   time per round (less a prefill of each prompt, timed again) less the modelled parts of their big tree, taken as
   the same for every tree size.
`--precision` tunes for a weight precision (the costs and the head's serving form follow it; "auto" is what the
lab's defaults choose on this machine). The printed table and the best setting are what the eagle strategy's
defaults come from (docs/benchmarks.md has the current run). Not covered: sampling mode (acceptance is random there),
per-prompt adaptation of the tree size, a t_other that grows with the tree.
"""

from __future__ import annotations

import argparse
import time

import torch

from lab.app.builtin_prompts import load_prompts
from lab.engine import runtime
from lab.engine.invariance import rows_invariant
from lab.engine.models import load_model
from lab.engine.sampling import SamplingConfig
from lab.engine.tree_attention import build_tree_attention
from lab.heads.common import load_heads
from lab.heads.eagle import KIND, build_head, serving_head
from lab.registry import collect
from lab.speculative.proposers.eagle import EagleProposer, TreeShape
from lab.speculative.tree import TreeSettings, tree_loop
from lab.trace import EagleDraft, TreeRound


def verify_times(
    loaded, sizes: list[int], context: int = 200, repeats: int = 5, *, chain: bool = False
) -> dict[int, float]:
    """Seconds of one verify forward over 1 + N tokens after `context` cached positions plus its commit, min over
    repeats, as `lab.speculative.verify` runs them (row-invariant: without `rows_invariant` a multi-token forward
    takes the prefill path instead): a tree with the hidden states EAGLE's head reads and the KV compaction, or
    (`chain`) a causal chain without features, cropped (speculative decoding's verify)."""
    ids = loaded.encode("Explain how a bicycle works, step by step.") + [100] * context
    state, _ = runtime.prefill(loaded, ids[: max(context, 1)])
    n0, best = state.length, {n: float("inf") for n in sizes}
    for _ in range(repeats):
        for n in sizes:
            tokens = [100 + i for i in range(n + 1)]
            start = time.perf_counter()
            with rows_invariant(loaded):
                if chain:
                    runtime.verify(state, tokens)
                else:
                    parents = [-1] + [(i - 1) // 4 for i in range(1, n + 1)]
                    runtime.verify_tree(state, build_tree_attention(parents), tokens, hidden_states=True)
            if chain:
                runtime.crop(state, min(n0 + 2, state.length))  # the root and one kept token
            else:
                runtime.select(state, list(range(n0)) + [n0, n0 + 1])
            best[n] = min(best[n], time.perf_counter() - start)
            runtime.crop(state, n0)
    return best


def head_times(loaded, head, branch: int, repeats: int = 5) -> tuple[float, float]:
    """(extend of 3 real pairs, one tree step of `branch` nodes incl. logits and top-k), seconds, min over repeats."""
    drafter = EagleProposer(head, TreeShape(branch=branch, depth=2))
    hidden = int(loaded.config.hidden_size)
    drafter.cache.extend(torch.randn(200, hidden, dtype=loaded.dtype), list(range(200)), 0)
    extend, step = float("inf"), float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        f_hat = drafter.cache.extend(torch.randn(3, hidden, dtype=loaded.dtype), [1, 2, 3], 200)
        middle = time.perf_counter()
        drafter.grow(f_hat, 202, 2, ())
        end = time.perf_counter()
        extend, step = min(extend, middle - start), min(step, end - middle)
        drafter.cache.rollback()
        drafter.cache.cache.crop(-3)
        drafter.cache.committed -= 3
    return extend, step


def rounds_of(events: list) -> list[tuple[list[int], list[int], int]]:
    """Per round: (rerank position of every candidate, depth of every candidate, the accepted candidates)."""
    trees = {e.step: e for e in events if isinstance(e, TreeRound)}
    out = []
    for d in (e for e in events if isinstance(e, EagleDraft)):
        order = sorted(range(len(d.tokens)), key=lambda i: (-d.scores[i], d.depths[i], i))
        position = [0] * len(order)
        for rank, i in enumerate(order):
            position[i] = rank
        candidate_of = {node: i for i, node in enumerate(d.kept) if node >= 0}
        path = [candidate_of[node] for node in trees[d.step].accepted]
        out.append((position, d.depths, path))
    return out


def tau_for(rounds: list, total_tokens: int, depth: int) -> float:
    """Mean tokens per round had the tree been cut to (total_tokens, depth) (module docstring, step 2)."""
    emitted = 0
    for position, depths, path in rounds:
        allowed = sorted((p for p, d in zip(position, depths, strict=True) if d < depth))[:total_tokens]
        cut = allowed[-1] if allowed else -1
        kept = 0
        for node in path:
            if depths[node] >= depth or position[node] > cut:
                break
            kept += 1
        emitted += kept + 1
    return emitted / max(len(rounds), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--precision", default="auto", help="weight format, as `run` (default: the lab's choice)")
    parser.add_argument("--heads-path", default="", help="EAGLE head file or stem (default: the shipped one)")
    parser.add_argument("--limit", type=int, default=8, help="builtin prompts used for the acceptance runs")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--sizes", default="4,8,12,16,20,24,32,40,48,64")
    parser.add_argument("--depths", default="3,4,5,6,7,8")
    parser.add_argument("--branches", default="4,6,8,10")
    args = parser.parse_args()
    sizes, depths = [int(x) for x in args.sizes.split(",")], [int(x) for x in args.depths.split(",")]
    loaded = load_model(args.model, dtype=args.dtype, precision=args.precision)
    print(f"{loaded.spec}: {loaded.choice or f'{loaded.dtype}, {loaded.precision} weights'}")
    tensors, _ = load_heads(KIND, loaded, args.heads_path or None)
    head = serving_head(build_head(loaded, tensors["vocab"], tensors), loaded)
    prompts = [loaded.encode(p) for p in load_prompts("builtin")[: args.limit]]
    context = round(sum(len(ids) for ids in prompts) / len(prompts) + args.max_new_tokens / 2)  # a run's middle
    verify = verify_times(loaded, sizes, context)
    print(f"verify ms (1 + N tokens after {context}):", {n: round(1000 * t, 2) for n, t in verify.items()})
    results = []
    for branch in (int(x) for x in args.branches.split(",")):
        extend, step = head_times(loaded, head, branch)
        print(f"branch {branch}: head extend {1000 * extend:.2f} ms, head step {1000 * step:.2f} ms")
        shape = TreeShape(max(sizes), max(depths), branch)
        settings = TreeSettings(args.max_new_tokens, SamplingConfig(temperature=0.0), method="eagle")
        runs, wall = [], 0.0
        for ids in prompts:
            start = time.perf_counter()
            runs.append(collect(tree_loop(loaded, ids, EagleProposer(head, shape), torch.Generator(), settings)))
            middle = time.perf_counter()
            runtime.prefill(loaded, ids)  # the run's prefill again, to leave it out of the rounds' time
            wall += (middle - start) - (time.perf_counter() - middle)
        rounds = [r for events in runs for r in rounds_of(events)]
        modelled = extend + (max(depths) - 1) * step + verify[max(sizes)]
        other = max(wall / max(len(rounds), 1) - modelled, 0.0)
        print(
            f"branch {branch}: {1000 * wall / max(len(rounds), 1):.2f} ms a round of the big tree, "
            f"{1000 * modelled:.2f} modelled: t_other {1000 * other:.2f} ms"
        )
        print(f"branch {branch}: tau by total_tokens (rows) x depth {depths} (columns), {len(rounds)} rounds")
        for n in sizes:
            print(f"  {n:4d}: " + " ".join(f"{tau_for(rounds, n, depth):5.2f}" for depth in depths))
            for depth in depths:
                tau = tau_for(rounds, n, depth)
                seconds = extend + (depth - 1) * step + verify[n] + other
                results.append((tau / seconds, tau, branch, n, depth, 1000 * seconds))
    print("est. tok/s   tau  branch  total_tokens  depth  ms/round")
    for row in sorted(results, reverse=True)[:25]:
        print(f"{row[0]:10.1f} {row[1]:5.2f} {row[2]:7d} {row[3]:13d} {row[4]:6d} {row[5]:9.1f}")


if __name__ == "__main__":
    main()
