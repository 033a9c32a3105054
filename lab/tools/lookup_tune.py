"""Prompt lookup's draft length against a machine's verify cost: `python -m lab.tools.lookup_tune`.

Greedy prompt-lookup SD is deterministic, so its rounds can be replayed offline, without timing noise:
1. the lab's greedy output of each prompt is generated once (the text greedy SD reproduces token for token);
2. the target's verify forward of 1 + N tokens is timed at a run's middle context (`eagle_tune.verify_times`: the
   chain's forward as the verifier runs it, and its crop; N = 0 is a decode step, an empty draft's round), each
   the fastest of `--repeats` calls, the lengths interleaved;
3. a drafting rule is replayed over every output: each round it drafts from the text so far (the proposer's own
   code, `lab.speculative.proposers.prompt_lookup`), keeps the draft's common prefix with the greedy continuation
   (exactly what greedy verification keeps, Leviathan et al. 2023, Alg. 1 with one-hot p and q) plus the target's
   own token, and costs t_verify(N) (t_step for an empty draft) plus `overhead` decode steps per drafted round;
4. estimated speedup over greedy = tokens emitted after the first * t_step / the rounds' total cost.
The oracle row drafts exactly the tokens that will be kept (the longest the same lookup match allows): no
rule that drafts from that match can do better under the same cost curve. The alpha rows replay the same rules
under a linear cost curve, 1 + alpha * N decode steps for N drafted tokens, which says how cheap a verify row
must be for a given speedup. The rules: the strategy's default (at most 2n - 1 tokens after an n-gram match),
the same with 1-gram matches ignored, and fixed draft lengths without 1-gram matches.
Not covered: sampling mode (acceptance is random there), a cost that grows with the context within a run, the
Python of a round beyond `--overhead`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

import torch

from lab.app.builtin_prompts import load_prompts
from lab.engine.models import load_model
from lab.engine.sampling import SamplingConfig
from lab.params import build_params
from lab.registry import collect, get_strategy
from lab.speculative.draft import DraftContext
from lab.speculative.params import ChainParams
from lab.speculative.proposers.prompt_lookup import PromptLookupProposer, lookup_match
from lab.tools.eagle_tune import verify_times
from lab.trace import TokenEmitted

Rule = Callable[[list[int], int], list[int]]  # (committed tokens, draft budget) -> drafted tokens
Output = tuple[list[int], list[int]]  # (prompt ids, greedy output ids)


def proposer_rule(max_ngram: int, scaled: bool) -> Rule:
    """The strategy's drafter itself: PromptLookupProposer with these settings."""
    proposer, greedy = PromptLookupProposer(max_ngram, scaled), SamplingConfig(temperature=0.0)

    def draft(tokens: list[int], gamma: int) -> list[int]:
        return proposer.propose(DraftContext(tokens, gamma, greedy, torch.Generator())).tokens

    return draft


def without_unigrams(rule_gamma: int | None, max_ngram: int) -> Rule:
    """Ignore 1-gram matches; otherwise the strategy's rule (None) or the first `rule_gamma` tokens of the match."""
    scaled = proposer_rule(max_ngram, True)

    def draft(tokens: list[int], gamma: int) -> list[int]:
        found, n = lookup_match(tokens, max_ngram, gamma if rule_gamma is None else min(gamma, rule_gamma))
        if n < 2:
            return []
        return scaled(tokens, gamma) if rule_gamma is None else found

    return draft


def kept(draft: Sequence[int], continuation: Sequence[int]) -> int:
    """Drafted tokens greedy verification keeps: the common prefix with the greedy continuation."""
    count = 0
    while count < len(draft) and count < len(continuation) and draft[count] == continuation[count]:
        count += 1
    return count


def replay_cost(
    prompt: list[int], output: list[int], rule: Rule, gamma: int, cost: Callable[[int], float], overhead: float = 0.0
) -> float:
    """Decode steps the replayed rounds of one output cost (module docstring, step 3); `cost(N)`, cost(0) = 1."""
    total, i = 0.0, 1  # the first token comes from the prefill, as in greedy decoding
    while i < len(output):
        draft = rule(prompt + output[:i], min(gamma, len(output) - i - 1))
        total += cost(len(draft)) + (overhead if draft else 0.0)
        i += kept(draft, output[i:]) + 1
    return total


def replay(outputs: list[Output], rule: Rule, gamma: int, cost: Callable[[int], float], overhead: float = 0.0) -> float:
    """Estimated speedup over greedy (module docstring, step 4)."""
    tokens = sum(len(output) - 1 for _, output in outputs)
    total = sum(replay_cost(prompt, output, rule, gamma, cost, overhead) for prompt, output in outputs)
    return tokens / total if total else 1.0


def oracle(outputs: list[Output], max_ngram: int, gamma: int, cost: Callable[[int], float]) -> float:
    """The same replay drafting only the tokens that will be kept from the lookup's match (module docstring)."""

    def knowing(prompt: list[int], output: list[int]) -> Rule:
        def draft(tokens: list[int], budget: int) -> list[int]:
            found, _ = lookup_match(tokens, max_ngram, budget)
            return found[: kept(found, output[len(tokens) - len(prompt) :])]

        return draft

    tokens = sum(len(output) - 1 for _, output in outputs)
    total = sum(replay_cost(prompt, output, knowing(prompt, output), gamma, cost) for prompt, output in outputs)
    return tokens / total if total else 1.0


def linear(alpha: float) -> Callable[[int], float]:
    return lambda n: 1.0 + alpha * n


def measured(step_s: float, verify_s: dict[int, float]) -> Callable[[int], float]:
    """Cost in decode steps from timings; beyond the largest timed N it grows by the last timed slope."""
    largest = max(verify_s)
    slope = (verify_s[largest] - verify_s[largest - 1]) / step_s if largest - 1 in verify_s else 0.0

    def cost(n: int) -> float:
        if n == 0:
            return 1.0
        if n in verify_s:
            return verify_s[n] / step_s
        return verify_s[largest] / step_s + (n - largest) * slope

    return cost


def greedy_outputs(loaded, prompts: list[list[int]], max_new_tokens: int) -> list[Output]:
    greedy = get_strategy("greedy")
    params = build_params(greedy.Params, {"max_new_tokens": max_new_tokens})
    out = []
    for ids in prompts:
        events = collect(greedy.run(loaded, ids, params, torch.Generator()))
        out.append((ids, [e.token_id for e in events if isinstance(e, TokenEmitted)]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--precision", default="auto", help="weight format, as `run` (default: the lab's choice)")
    parser.add_argument("--limit", type=int, default=24, help="builtin prompts replayed")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--sizes", default="1,2,3,4,5,6,7,8", help="draft lengths N whose verify is timed")
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per length (interleaved; the fastest)")
    parser.add_argument("--overhead", type=float, default=0.0, help="decode steps of Python per drafted round")
    parser.add_argument("--alphas", default="0.02,0.05,0.08,0.1,0.12,0.15,0.2")
    args = parser.parse_args()
    defaults = ChainParams()
    gamma, max_ngram = defaults.gamma, defaults.max_ngram
    loaded = load_model(args.model, dtype=args.dtype, precision=args.precision)
    print(f"{loaded.spec}: {loaded.choice or f'{loaded.dtype}, {loaded.precision} weights'}")
    with torch.inference_mode():
        prompts = [loaded.encode(p) for p in load_prompts("builtin")[: args.limit]]
        outputs = greedy_outputs(loaded, prompts, args.max_new_tokens)
        context = round(sum(len(ids) for ids in prompts) / len(prompts) + args.max_new_tokens / 2)  # a run's middle
        sizes = [int(x) for x in args.sizes.split(",")]
        verify_s = verify_times(loaded, [0, *sizes], context, args.repeats, chain=True)  # N = 0: a decode step
    step_s = verify_s.pop(0)
    curve = measured(step_s, verify_s)
    print(f"decode step {1000 * step_s:.2f} ms after {context} positions; verify of 1 + N tokens in decode steps:")
    print("  " + ", ".join(f"N={n}: {curve(n):.3f}" for n in sizes))
    rules = {
        f"default: at most 2n - 1 after an n-gram (n <= {max_ngram}, gamma {gamma})": proposer_rule(max_ngram, True),
        "the same, 1-gram matches ignored": without_unigrams(None, max_ngram),
        **{f"{g} tokens, 1-gram matches ignored": without_unigrams(g, max_ngram) for g in (2, 3, 4, 6)},
    }
    alphas = [float(a) for a in args.alphas.split(",")]
    print(f"\n| rule | measured curve | {' | '.join(f'alpha {a}' for a in alphas)} |")
    print(f"|---|---|{'---|' * len(alphas)}")
    for name, rule in rules.items():
        row = [replay(outputs, rule, gamma, curve, args.overhead)]
        row += [replay(outputs, rule, gamma, linear(a), args.overhead) for a in alphas]
        print(f"| {name} | {' | '.join(f'{x:.3f}' for x in row)} |")
    row = [oracle(outputs, max_ngram, gamma, curve)] + [oracle(outputs, max_ngram, gamma, linear(a)) for a in alphas]
    print(f"| oracle: only the tokens that will be kept | {' | '.join(f'{x:.3f}' for x in row)} |")


if __name__ == "__main__":
    main()
