"""`Stats` and `summarize`: the run statistics folded from a list of events (the same for every family)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lab.trace.base import Event, RunFinished, TokenEmitted
from lab.trace.speculative import DraftRound, _tree_stats


@dataclass(frozen=True)
class Stats:
    """Aggregates of a run, folded from its events in one place (`summarize`)."""

    new_tokens: int
    wall_s: float
    tokens_per_s: float
    target_forwards: int
    forwards_per_token: float
    stop_reason: str
    # speculative runs only (None without DraftRound events): alpha = accepted / examined draft tokens
    # (Leviathan et al. 2023's acceptance rate; tokens after a rejection are never examined) and the mean
    # number of tokens a round emits (accepted + the recovered or bonus token)
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _draft_stats(events: list[Event]) -> tuple[float | None, float | None]:
    """(acceptance rate, mean accepted length) folded from DraftRound events; None where undefined."""
    rounds = [e for e in events if isinstance(e, DraftRound)]
    if not rounds:
        return None, None
    accepted = sum(r.accepted for r in rounds)
    examined = accepted + sum(r.recovered is not None for r in rounds)
    emitted = accepted + sum(r.recovered is not None or r.bonus is not None for r in rounds)
    return (round(accepted / examined, 4) if examined else None), round(emitted / len(rounds), 4)


def summarize(events: list[Event]) -> Stats:
    """Fold events into run statistics; works mid-run too (time and forwards from the latest events)."""
    tokens = [e for e in events if isinstance(e, TokenEmitted)]
    finished = next((e for e in reversed(events) if isinstance(e, RunFinished)), None)
    wall = finished.wall_s if finished else (tokens[-1].t if tokens else 0.0)
    forwards = finished.target_forwards if finished else len({e.step for e in tokens})
    n = len(tokens)
    acceptance_rate, mean_accepted_length = _draft_stats(events)
    if mean_accepted_length is None:  # tree rounds (Medusa, MTPC, EAGLE)
        acceptance_rate, mean_accepted_length = _tree_stats(events)
    return Stats(
        new_tokens=n,
        wall_s=round(wall, 4),
        tokens_per_s=round(n / wall, 2) if wall > 0 else 0.0,
        target_forwards=forwards,
        forwards_per_token=round(forwards / n, 3) if n else 0.0,
        stop_reason=finished.stop_reason if finished else "running",
        acceptance_rate=acceptance_rate,
        mean_accepted_length=mean_accepted_length,
    )
