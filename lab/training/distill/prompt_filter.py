"""Filtering and de-duplicating machine-written prompts (Magpie, Xu et al. 2024, Sec. 2.2 "filtering"), and the
check that keeps them disjoint from the benchmark prompts (`lab.app.builtin_prompts.BUILTIN_PROMPTS`).

A candidate is kept when it (1) is 3..80 words and 12..600 characters, (2) reads as English (at least 90% of
its letters are ASCII letters and it holds at least one common English function word), (3) is not degenerate
(no chat-template markers, at least half of its words distinct, no word 3-gram repeated three times), (4) is
not a duplicate: its normalised text (lower case, letters and digits only, single spaces) is new, and its word
3-gram Jaccard similarity to every kept prompt is at most `NEAR`, (5) is not near any benchmark prompt: shares
no more than `BENCH_NEAR` of that prompt's 3-grams (containment, so a bench prompt inside a longer candidate
counts) and is not equal to it after normalisation. Not covered: model-based quality or safety scoring.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable

NEAR = 0.5  # max word 3-gram Jaccard similarity to an already kept prompt
BENCH_NEAR = 0.3  # max fraction of a benchmark prompt's 3-grams found in a candidate
_FUNCTION_WORDS = frozenset(
    ("the", "a", "an", "of", "to", "in", "is", "are", "and", "or", "for", "what", "how", "why", "can", "you")
    + ("i", "my", "me", "your", "with", "on", "be", "do", "does", "it", "this", "that")
)
_MARKERS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "assistant\n", "user\n")


def normalise(text: str) -> str:
    """Lower case, letters and digits only, single spaces."""
    return " ".join(re.sub(r"[^a-z0-9]+", " ", text.lower()).split())


def ngrams(text: str, n: int = 3) -> frozenset[tuple[str, ...]]:
    """Word n-grams of the normalised text (the whole text as one gram when shorter than n)."""
    words = normalise(text).split()
    if len(words) < n:
        return frozenset([tuple(words)]) if words else frozenset()
    return frozenset(tuple(words[i : i + n]) for i in range(len(words) - n + 1))


def reject_reason(text: str) -> str | None:
    """Why a candidate fails the length / language / degeneracy filters, or None when it passes."""
    words = text.split()
    if not 3 <= len(words) <= 80 or not 12 <= len(text) <= 600:
        return "length"
    if any(marker in text for marker in _MARKERS):
        return "degenerate"
    letters = [c for c in text if c.isalpha()]
    ascii_letters = sum(c.isascii() for c in letters)
    lowered = set(normalise(text).split())
    if not letters or ascii_letters < 0.9 * len(letters) or not lowered & _FUNCTION_WORDS:
        return "language"
    plain = normalise(text).split()
    if len(set(plain)) < 0.5 * len(plain):
        return "degenerate"
    counts: dict[tuple[str, ...], int] = defaultdict(int)
    for i in range(len(plain) - 2):
        counts[tuple(plain[i : i + 3])] += 1
    if counts and max(counts.values()) >= 3:
        return "degenerate"
    return None


class NearDuplicateIndex:
    """Kept prompts with an inverted index on word 3-grams, for exact and near-duplicate look-ups."""

    def __init__(self) -> None:
        self.grams: list[frozenset] = []
        self.normalised: set[str] = set()
        self.index: dict[tuple[str, ...], list[int]] = defaultdict(list)

    def near(self, text: str, threshold: float = NEAR) -> bool:
        """True when `text` equals a kept prompt after normalisation or its 3-gram Jaccard exceeds `threshold`."""
        if normalise(text) in self.normalised:
            return True
        grams = ngrams(text)
        shared: dict[int, int] = defaultdict(int)
        for gram in grams:
            for other in self.index.get(gram, ()):
                shared[other] += 1
        return any(n / (len(grams) + len(self.grams[o]) - n) > threshold for o, n in shared.items())

    def add(self, text: str) -> None:
        grams = ngrams(text)
        for gram in grams:
            self.index[gram].append(len(self.grams))
        self.grams.append(grams)
        self.normalised.add(normalise(text))


def near_benchmark(text: str, bench: Iterable[str], threshold: float = BENCH_NEAR) -> bool:
    """True when `text` equals a benchmark prompt after normalisation or holds more than `threshold` of the
    3-grams of one (containment: a benchmark prompt quoted inside a longer candidate counts)."""
    text_grams, plain = ngrams(text), normalise(text)
    for prompt in bench:
        grams = ngrams(prompt)
        if plain == normalise(prompt) or (grams and len(grams & text_grams) / len(grams) > threshold):
            return True
    return False


class PromptPool:
    """The running selection: each new candidate is filtered against the benchmark prompts and every prompt kept so
    far (`seed_prompts`, e.g. the hand-written set, count as kept); `reasons` counts why candidates were dropped."""

    def __init__(self, bench: list[str], seed_prompts: Iterable[str] = ()) -> None:
        self.bench, self.index, self.reasons = list(bench), NearDuplicateIndex(), defaultdict(int)
        for text in seed_prompts:
            self.index.add(text)

    def select(self, candidates: Iterable[str]) -> list[str]:
        """The candidates that pass every filter (module docstring), in order; they join the pool."""
        kept = []
        for raw in candidates:
            text = raw.strip()
            reason = reject_reason(text)
            if reason is None and near_benchmark(text, self.bench):
                reason = "near benchmark"
            if reason is None and self.index.near(text):
                reason = "duplicate"
            if reason:
                self.reasons[reason] += 1
                continue
            self.index.add(text)
            kept.append(text)
        return kept


def overlap_report(prompts: list[str], bench: list[str]) -> dict:
    """The data's prompt counts and every prompt near a benchmark prompt (`near_benchmark`), for the overlap check."""
    near = [text for text in prompts if near_benchmark(text, bench)]
    return {"prompts": len(prompts), "distinct": len({normalise(t) for t in prompts}), "near_benchmark": near}
