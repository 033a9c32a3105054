"""Prompt-lookup drafting (Saxena 2023, "Prompt Lookup Decoding"; HF `PromptLookupCandidateGenerator`).

Deterministic, model-free: take the last n tokens of the sequence (n = max_ngram down to 1), find the most
recent earlier occurrence of that n-gram in the prompt + generated text, and propose the up to gamma tokens
that followed it. No match: an empty draft (the round is a plain target step). q = None (one-hot at the drafted
token), so acceptance is exact: a token is kept iff the target would have produced it (greedy) or with
probability p(x) (sampling), and the output stays distributed as the target's (Leviathan et al. 2023, Alg. 1).
Differences from HF: HF takes the first (leftmost) match of the longest n-gram and stops the candidates at
EOS; we take the most recent (rightmost) match, which follows the text being generated more closely, and the
strategy cuts every draft after EOS. HF also drops candidates its logits processors forbid (p = -inf); we let
verification reject them (p(x) = 0 is never accepted), which is the same result one forward later.
Match-scaled length (`scaled`, the strategies' default `lookup_scaling`): after a match of n tokens draft at most
2n - 1 (a 1-gram match drafts 1 token, a 4-gram match 7). A lookup's acceptance grows with the matched length,
and on CPUs where a verify forward costs markedly more per extra token, long drafts from weak 1-gram matches lose
more than they win. The rule was chosen by replaying the lab's greedy outputs of 12 builtin prompts (128 tokens)
under three measured cost curves, where it beat fixed gamma under the steep ones and tied under the flat one
(docs/speculative.md, "Where the time goes").
For SSD (`context.fanout` > 0) each drafted position also reports its candidates (`continuations`): the distinct
tokens that followed earlier matches of the longest matching suffix n-gram there, most frequent first, with
their relative frequencies as probabilities (a ranking heuristic, not a model distribution).
Not covered: suffix trees / multi-candidate lookup (a tree of matches).
"""

from __future__ import annotations

from lab.speculative.draft import Draft, DraftContext, Verified


def lookup_match(tokens: list[int], max_ngram: int, gamma: int) -> tuple[list[int], int]:
    """(up to `gamma` tokens following the most recent earlier match of the longest suffix n-gram, n); n = 0 and
    no tokens when nothing matches."""
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), 0, -1):
        suffix = tokens[length - n :]
        first = suffix[0]
        for start in range(length - n - 1, -1, -1):  # most recent match first; the suffix itself excluded
            if tokens[start] == first and tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + gamma], n
    return [], 0


def lookup(tokens: list[int], max_ngram: int, gamma: int) -> list[int]:
    """Up to `gamma` tokens following the most recent earlier match of the longest suffix n-gram (n <= max_ngram)."""
    return lookup_match(tokens, max_ngram, gamma)[0]


def continuations(tokens: list[int], max_ngram: int, limit: int) -> tuple[list[int], list[float]]:
    """The distinct tokens that followed earlier matches of the longest matching suffix n-gram (n <= max_ngram),
    most frequent first (ties: most recent first), with their relative frequencies; at most `limit`."""
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), 0, -1):
        suffix = tokens[length - n :]
        counts: dict[int, int] = {}
        for start in range(length - n - 1, -1, -1):
            if tokens[start] == suffix[0] and tokens[start : start + n] == suffix:
                follower = tokens[start + n]
                counts[follower] = counts.get(follower, 0) + 1
        if counts:
            ranked = sorted(counts.items(), key=lambda item: -item[1])[:limit]  # stable: recency among ties
            total = sum(counts.values())
            return [t for t, _ in ranked], [round(c / total, 6) for _, c in ranked]
    return [], []


class PromptLookupProposer:
    """Deterministic n-gram drafter over the prompt and the generated text; costs no forward pass."""

    name = "prompt-lookup"
    feature_layers = ()

    def __init__(self, max_ngram: int = 3, scaled: bool = False) -> None:
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.scaled = scaled  # draft at most 2n - 1 tokens after a match of n tokens

    @property
    def forwards(self) -> int:
        return 0

    def propose(self, context: DraftContext) -> Draft:
        if context.gamma <= 0:
            return Draft([])
        tokens, n = lookup_match(context.tokens, self.max_ngram, context.gamma)
        if self.scaled:
            tokens = tokens[: 2 * n - 1]
        if not context.fanout or not tokens:
            return Draft(tokens)
        rows = [
            continuations(context.tokens + tokens[:i], self.max_ngram, context.fanout + 1) for i in range(len(tokens))
        ]
        return Draft(tokens, top_ids=[ids for ids, _ in rows], top_probs=[probs for _, probs in rows])

    def accept(self, verified: Verified) -> None:
        """Stateless: nothing to roll back."""

    def close(self) -> None:
        """Stateless: nothing to free."""
