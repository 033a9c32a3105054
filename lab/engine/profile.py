"""Where a strategy's time goes (`python -m lab bench --profile`): a wall-clock profile of real runs.

While a run streams, global `nn.Module` forward hooks time every *outermost* module call (one not made from
inside another module's forward or a section) and file it under a bucket:
- "target forward": the target model's own forward (prefill, decode steps, chain or tree verification); its
  calls are counted with the number of positions each scored, so the profile shows the cost of a wide
  verification forward against a one-token step;
- "target pieces": a submodule of the target called on its own (its embedding or LM head used by a drafter);
- "draft <Class>": any other module (a Medusa / MTPC / EAGLE head, a draft model);
- a section's name ("draft", "accept", "KV compaction"): decode loops mark their phases with `section(name)`;
  a section's whole time goes to its bucket, module calls inside it included (a drafter that uses the
  target's layers or LM head counts as "draft");
- "other": the rest of the run's wall time: sampling, tree bookkeeping outside the sections,
  detokenising and trace events.
The hooks add a little time per module call, and while they are set the target runs through `model(...)` rather
than `lab.engine.lean_forward` (whose per-layer calls hooks would not see), so the profile runs in its own pass after
the timed bench and its wall times are not the bench's tokens/s. On CUDA the profile synchronises after each
outermost call (slower, but GPU time lands in the right bucket). Only the thread that started the timer is
timed (SSD's drafter thread runs beside it, unprofiled).
Not covered: operator-level profiles (use torch.profiler), memory.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from lab.engine.models import LoadedModel

TARGET = "target forward"
TARGET_PIECES = "target pieces"
OUTSIDE = "other"


@dataclass
class ModuleTimes:
    """Seconds and calls per bucket, and the positions each target forward scored."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    target_positions: list[int] = field(default_factory=list)


@dataclass
class _Timer:
    times: ModuleTimes
    thread: int
    sync: torch.device | None
    stack: list[tuple[object, float]] = field(default_factory=list)

    def push(self, key: object) -> None:
        self.stack.append((key, time.perf_counter()))

    def pop(self, key: object, bucket: str) -> None:
        if not self.stack or self.stack[-1][0] is not key:
            return  # a call that started before the timer: skip it
        _, start = self.stack.pop()
        if self.stack:
            return  # not outermost: its time belongs to the enclosing call or section
        if self.sync is not None:
            torch.cuda.synchronize(self.sync)
        self.times.seconds[bucket] += time.perf_counter() - start
        self.times.calls[bucket] += 1


_active: _Timer | None = None


@contextmanager
def section(name: str) -> Iterator[None]:
    """Mark a phase of a decode loop ("draft", "accept", "KV compaction"): while a timer runs (on this thread),
    its time, module calls inside it included, goes to the bucket `name`; otherwise it costs one check."""
    timer = _active
    if timer is None or timer.thread != threading.get_ident():
        yield
        return
    key = object()
    timer.push(key)
    try:
        yield
    finally:
        timer.pop(key, name)


def _bucket(module: nn.Module, target: nn.Module, target_parts: set[int]) -> str:
    if module is target:
        return TARGET
    if id(module) in target_parts:
        return TARGET_PIECES
    return f"draft {type(module).__name__}"


def _positions(args: tuple, kwargs: dict) -> int:
    ids = kwargs.get("input_ids", args[0] if args else None)
    return int(ids.shape[-1]) if isinstance(ids, torch.Tensor) else 0


@contextmanager
def module_timer(loaded: LoadedModel) -> Iterator[ModuleTimes]:
    """Time outermost module calls and sections into buckets while the block runs, on the calling thread
    (global hooks, removed on exit; SSD's drafter thread is not timed)."""
    global _active
    if _active is not None:
        raise RuntimeError("a module timer is already running")
    target = loaded.model
    target_parts = {id(m) for m in target.modules()}
    timer = _Timer(ModuleTimes(), threading.get_ident(), loaded.device if loaded.device.type == "cuda" else None)

    def before(module: nn.Module, args: tuple) -> None:
        if threading.get_ident() == timer.thread:
            timer.push(module)

    def target_positions(module: nn.Module, args: tuple, kwargs: dict) -> None:
        # global pre-hooks run first, so an outermost target call is alone on the stack here
        if threading.get_ident() == timer.thread and len(timer.stack) == 1:
            timer.times.target_positions.append(_positions(args, kwargs))

    def after(module: nn.Module, args: tuple, output: object) -> None:
        if threading.get_ident() == timer.thread:
            timer.pop(module, _bucket(module, target, target_parts))

    handles = [
        nn.modules.module.register_module_forward_pre_hook(before),
        target.register_forward_pre_hook(target_positions, with_kwargs=True),
        nn.modules.module.register_module_forward_hook(after, always_call=True),
    ]
    _active = timer
    try:
        yield timer.times
    finally:
        _active = None
        for handle in handles:
            handle.remove()


@dataclass(frozen=True)
class ProfileRow:
    """One strategy's profile over its runs: share of wall time per bucket and the target-forward costs."""

    name: str
    wall_s: float
    new_tokens: int
    shares: dict[str, float]  # bucket -> fraction of wall time (OUTSIDE included); sums to 1
    ms_per_target_forward: float
    positions_per_target_forward: float  # mean positions scored per target forward (prefill excluded)
    target_forwards_per_token: float

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "wall_s": round(self.wall_s, 3),
            "new_tokens": self.new_tokens,
            "shares": {k: round(v, 4) for k, v in self.shares.items()},
            "ms_per_target_forward": round(self.ms_per_target_forward, 2),
            "positions_per_target_forward": round(self.positions_per_target_forward, 2),
            "target_forwards_per_token": round(self.target_forwards_per_token, 3),
        }


def profile_row(name: str, wall_s: float, new_tokens: int, runs: list[ModuleTimes]) -> ProfileRow:
    """Fold the timers of one strategy's runs (each run's first target forward is its prefill, left out of the
    positions mean but kept in the time: it is part of the run)."""
    seconds: dict[str, float] = defaultdict(float)
    for times in runs:
        for bucket, value in times.seconds.items():
            seconds[bucket] += value
    inside = sum(seconds.values())
    shares = {bucket: value / wall_s for bucket, value in sorted(seconds.items())} if wall_s > 0 else {}
    shares[OUTSIDE] = max(0.0, 1.0 - inside / wall_s) if wall_s > 0 else 0.0
    forwards = sum(times.calls.get(TARGET, 0) for times in runs)
    decode_positions = [p for times in runs for p in times.target_positions[1:]]
    return ProfileRow(
        name=name,
        wall_s=wall_s,
        new_tokens=new_tokens,
        shares=shares,
        ms_per_target_forward=1000 * seconds.get(TARGET, 0.0) / forwards if forwards else 0.0,
        positions_per_target_forward=sum(decode_positions) / len(decode_positions) if decode_positions else 0.0,
        target_forwards_per_token=forwards / new_tokens if new_tokens else 0.0,
    )


def format_profile(rows: list[ProfileRow]) -> str:
    """A markdown table: per strategy, the share of wall time per bucket and the target-forward costs."""
    buckets = sorted({b for row in rows for b in row.shares if b != OUTSIDE}, key=lambda b: (b != TARGET, b))
    buckets.append(OUTSIDE)
    columns = ["strategy", "ms / token", *buckets, "ms / target forward", "positions / forward", "forwards / token"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        per_token = 1000 * row.wall_s / row.new_tokens if row.new_tokens else 0.0
        cells = [row.name, f"{per_token:.1f}", *(f"{100 * row.shares.get(b, 0.0):.0f}%" for b in buckets)]
        cells += [
            f"{row.ms_per_target_forward:.1f}",
            f"{row.positions_per_target_forward:.1f}",
            f"{row.target_forwards_per_token:.3f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
