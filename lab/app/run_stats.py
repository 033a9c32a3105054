"""The numbers a run's stats say out loud, folded from its events (gradio-free; the Run and Compare tabs show them).

Covered: `speed_vs_greedy` (an acceleration method's tokens/s over a greedy run's on the same prompt and model,
and when it is below 1x the one-line reason: what a round cost in greedy decode steps, verify and drafting apart,
against the tokens a round emitted), `key_quantities` (each method's own number: Mirostat's observed surprise
against its target tau, CFG's gamma, DoLa's chosen premature layer), `system2_quantities` (what a Tree of Thoughts
or RLM run is about, in place of tokens/s and forwards/token, which mean nothing for a search or a REPL loop),
`progress_line` (what such a run has done before its answer's tokens exist) and `fmt` (sensible precision: rates and
ratios to 2 decimals, tokens/s to 1). Not covered: timing greedy on demand (the caller supplies a greedy run it
has, e.g. a recent one from the shared lane's cache).
"""

from __future__ import annotations

import html
from collections import Counter
from dataclasses import dataclass

from lab.trace import (
    DraftRound,
    Event,
    GuidanceStep,
    LayerContrast,
    MirostatStep,
    ReplCall,
    RlmContext,
    RlmResult,
    RunFinished,
    ThoughtNode,
    ThoughtResult,
    ThoughtStep,
    TreeRound,
    search_counters,
    summarize,
)

CELL_CHARS = 60  # an answer longer than this is cut in the stats table (the token view holds all of it)


@dataclass(frozen=True)
class Speed:
    """speedup = tokens/s of the method / tokens/s of greedy; reason: why it is below 1x ("" otherwise)."""

    speedup: float
    greedy_tokens_per_s: float
    reason: str = ""


def fmt(value: object, digits: int = 2) -> str:
    """A stat for display: floats to `digits` decimals, None as "-", everything else as is."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def is_acceleration(events: list[Event]) -> bool:
    """Whether the run drafted and verified (speculative, SSD, Medusa, EAGLE, MTPC): its speed is its point."""
    return any(isinstance(e, DraftRound | TreeRound) for e in events)


def _greedy_step_s(greedy: list[Event]) -> float | None:
    """Seconds per greedy decode step (one target forward per token)."""
    finished = next((e for e in reversed(greedy) if isinstance(e, RunFinished)), None)
    if finished is None or finished.target_forwards <= 0 or finished.wall_s <= 0:
        return None
    return finished.wall_s / finished.target_forwards


def slow_reason(events: list[Event], greedy: list[Event]) -> str:
    """One line: the mean round's cost in greedy decode steps (verify of n rows, drafting) against its tokens."""
    step_s = _greedy_step_s(greedy)
    rounds = [e for e in events if isinstance(e, DraftRound | TreeRound)]
    if step_s is None or not rounds:
        return ""
    rows = sum(len(r.draft_tokens) + 1 if isinstance(r, DraftRound) else len(r.tokens) + 1 for r in rounds)
    verify = sum(r.verify_s for r in rounds) / len(rounds) / step_s
    draft = sum(r.draft_s for r in rounds) / len(rounds) / step_s
    tau = summarize(events).mean_accepted_length or 0.0
    return (
        f"a round cost {verify + draft:.1f} greedy decode steps (verify of {rows / len(rounds):.0f} rows "
        f"{verify:.1f}, drafting {draft:.1f}) and emitted τ = {tau:.2f} tokens"
    )


def speed_vs_greedy(events: list[Event], greedy: list[Event]) -> Speed | None:
    """The method's speed over greedy's on the same prompt; None when either has no measured speed."""
    mine, base = summarize(events).tokens_per_s, summarize(greedy).tokens_per_s
    if mine <= 0 or base <= 0:
        return None
    ratio = mine / base
    return Speed(round(ratio, 2), base, slow_reason(events, greedy) if ratio < 1.0 else "")


def key_quantities(events: list[Event]) -> list[tuple[str, str]]:
    """(label, value) of the method's own quantity, read from its detail events ([] for methods without one)."""
    miro = [e for e in events if isinstance(e, MirostatStep) and e.series == "mirostat"]
    if miro:
        observed = sum(e.surprise for e in miro) / len(miro)
        return [("observed surprise vs target τ", f"{observed:.2f} vs {miro[0].tau:.2f} bits")]
    guidance = [e for e in events if isinstance(e, GuidanceStep)]
    if guidance:
        return [("guidance γ", fmt(float(guidance[0].gamma)))]
    layers = [e.chosen_layer for e in events if isinstance(e, LayerContrast)]
    if layers:
        layer, count = Counter(layers).most_common(1)[0]
        return [("chosen layer", f"{layer} ({count} of {len(layers)} steps)")]
    return []


def _cell(text: str) -> str:
    """Model text as one markdown table cell: one line, cut to CELL_CHARS, pipes and markup escaped."""
    line = " ".join(text.split())
    line = line if len(line) <= CELL_CHARS else line[: CELL_CHARS - 1] + "…"
    return html.escape(line, quote=False).replace("|", "\\|") or "(empty)"


def _latest(events: list[Event], kind: type):
    return next((e for e in reversed(events) if isinstance(e, kind)), None)


def system2_quantities(events: list[Event]) -> list[tuple[str, str]] | None:
    """The numbers a system-2 run is about (None for other runs). Tree of Thoughts: model calls and tokens run (the
    counters its figures show, `lab.trace.search_counters`), forwards, and whether the answer solves the task.
    RLM: root turns and sub-calls (counted from the call tree as it streams), tokens over all calls, and the answer
    beside the expected one with the verdict (the expected answer is known when the question asked is the task's
    own)."""
    context = _latest(events, RlmContext)
    if context is not None:
        calls = [e for e in events if isinstance(e, ReplCall)]
        result = _latest(events, RlmResult)
        rows = [
            ("root turns", str(sum(c.role == "root" for c in calls))),
            ("sub-calls", str(sum(c.role == "sub" for c in calls))),
            ("tokens, all calls", f"{sum(c.prompt_tokens + c.output_tokens for c in calls):,}"),
            ("answer", _cell(result.answer) if result else "…"),
            ("expected", _cell(context.expected) if context.expected else "unknown (not the task's own question)"),
        ]
        if result is not None and result.correct is not None:
            rows.append(("verdict", "correct" if result.correct else "wrong"))
        return rows
    if not any(isinstance(e, ThoughtNode | ThoughtStep | ThoughtResult) for e in events):
        return None
    calls, tokens = search_counters(events)
    result = _latest(events, ThoughtResult)
    finished = _latest(events, RunFinished)
    forwards = finished.target_forwards if finished else result.forwards if result else None
    rows = [("model calls", str(calls)), ("tokens run", f"{tokens:,}"), ("forwards", fmt(forwards))]
    if result is not None and result.solved is not None:
        rows.append(("solved", "yes" if result.solved else "no"))
    return rows


def progress_line(events: list[Event]) -> str:
    """What a system-2 run has done so far, for the token view before the answer's tokens exist ("" otherwise)."""
    quantities = system2_quantities(events)
    if not quantities:
        return ""
    counts = [f"{value} {label}" for label, value in quantities[:3] if label != "forwards"]
    return f"Working: {', '.join(counts)} so far. The answer's tokens appear here when the run answers."
