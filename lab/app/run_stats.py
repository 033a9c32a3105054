"""The numbers a run's stats say out loud, folded from its events (gradio-free; the Run and Compare tabs show them).

Covered: `speed_vs_greedy` (an acceleration method's tokens/s over a greedy run's on the same prompt and model,
and when it is below 1x the one-line reason: what a round cost in greedy decode steps, verify and drafting apart,
against the tokens a round emitted), `key_quantities` (each method's own number: Mirostat's observed surprise
against its target tau, CFG's gamma, DoLa's chosen premature layer) and `fmt` (sensible precision: rates and
ratios to 2 decimals, tokens/s to 1). Not covered: timing greedy on demand (the caller supplies a greedy run it
has, e.g. a recent one from the shared lane's cache).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from lab.trace import DraftRound, Event, GuidanceStep, LayerContrast, MirostatStep, RunFinished, TreeRound, summarize


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
