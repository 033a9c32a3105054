"""Comparing runs of the same prompt and seed: a token-level diff of the outputs and side-by-side statistics.

Covered: `token_diff` (difflib's SequenceMatcher over token ids, reported with the token texts as
equal / insert / delete / replace blocks), `first_divergence` (the first output position where two runs differ)
and `compare_rows` (one row per run: tokens, tokens/s, speedup against the greedy run among them, acceptance
rate, mean accepted length tau,
forwards/token, stop reason, and agreement with the first run). Everything is folded from trace events with
`lab.trace.summarize`, so strategies that land later are covered without changes here.
Not covered: semantic similarity of the texts (the diff is exact, token by token).
"""

from __future__ import annotations

from dataclasses import dataclass
from difflib import SequenceMatcher

from lab.app.run_stats import fmt, speed_vs_greedy
from lab.trace import TokenEmitted, Trace, summarize

MAX_COMPARED = 4


@dataclass(frozen=True)
class DiffBlock:
    """One block of a diff: op is equal | insert | delete | replace; texts of the base (a) and other (b) run."""

    op: str
    a_text: str
    b_text: str


def _tokens(trace: Trace) -> list[TokenEmitted]:
    return [e for e in trace.events if isinstance(e, TokenEmitted)]


def token_diff(base: Trace, other: Trace) -> list[DiffBlock]:
    """Blocks turning `base`'s output into `other`'s, compared by token id (autojunk off: outputs are short)."""
    a, b = _tokens(base), _tokens(other)
    matcher = SequenceMatcher(None, [e.token_id for e in a], [e.token_id for e in b], autojunk=False)
    blocks = []
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        blocks.append(DiffBlock(op, "".join(e.text for e in a[i1:i2]), "".join(e.text for e in b[j1:j2])))
    return blocks


def first_divergence(base: Trace, other: Trace) -> int | None:
    """The first output position where the token ids differ (or one run ends); None when they are identical."""
    a, b = base.token_ids, other.token_ids
    for position, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


def agreement(base: Trace, other: Trace) -> float:
    """Share of the longer output's positions where both runs emitted the same token id (1.0 = identical)."""
    a, b = base.token_ids, other.token_ids
    longest = max(len(a), len(b))
    if longest == 0:
        return 1.0
    return round(sum(x == y for x, y in zip(a, b, strict=False)) / longest, 4)


def compare_rows(traces: list[Trace]) -> list[dict]:
    """One row per run, in order; the first run is the reference of `same as first` and `agreement`; the speedup
    is against the greedy run among them ("-" without one), at 2 decimals like acceptance and tau."""
    greedy = next((t for t in traces if t.strategy == "greedy"), None)
    rows = []
    for trace in traces:
        stats = summarize(trace.events)
        divergence = first_divergence(traces[0], trace)
        speed = speed_vs_greedy(trace.events, greedy.events) if greedy is not None else None
        rows.append(
            {
                "strategy": trace.strategy,
                "tokens": stats.new_tokens,
                "tokens/s": fmt(stats.tokens_per_s, 1),
                "speedup vs greedy": None if speed is None else f"{speed.speedup:.2f}x",
                "acceptance": None if stats.acceptance_rate is None else fmt(stats.acceptance_rate),
                "tau": None if stats.mean_accepted_length is None else fmt(stats.mean_accepted_length),
                "forwards/token": fmt(stats.forwards_per_token),
                "stop": stats.stop_reason,
                "agreement with first": agreement(traces[0], trace),
                "first difference at": "-" if divergence is None else divergence,
            }
        )
    return rows


def rows_markdown(rows: list[dict]) -> str:
    """The rows as a markdown table (None shown as '-')."""
    if not rows:
        return ""
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        lines.append("| " + " | ".join("-" if row[k] is None else str(row[k]) for k in keys) + " |")
    return "\n".join(lines)
