"""The one place that picks the forward path of a run, fixed for the whole run (docs/architecture.md).

A forward of the lab takes one of three paths (`lab.engine.runtime.model_forward` runs the one chosen here):
- "model": transformers' `model(...)`, for every model;
- "lean": `lab.engine.lean_forward`'s Python loop of a Llama's layers (the same numbers as `model(...)`, less
  per-module overhead);
- "native": the lean forward whose decoder layers run as one C++ call (`lab.engine.native_forward`) for the
  forwards the op takes (one-token steps and row-invariant verify forwards of a batch of one, bf16 / fp16 on a
  CPU); prefill and batched forwards of the run keep the lean Python loop.
Orthogonal to the path, the load-time patches of `lab.engine.invariance` (row-invariant attention and linears)
are on or off for the model (`ForwardPath.row_invariant`: on for CPU models in bf16 / fp16, and in float32 where
MKL's strict mode is on, unless `DECODING_LAB_ROW_INVARIANT=0`); every path computes with them when they are on.

`choose(loaded)` decides from the model (architecture, hooks, training mode), its device and dtype, the switches
(`DECODING_LAB_LEAN_FORWARD=0`, `DECODING_LAB_NATIVE_FORWARD=0`, and `DECODING_LAB_ROW_INVARIANT=0` at load)
and whether the op is built; asking starts the op's background build, so a later run can take it. `pinned` runs
a strategy's event stream with its paths fixed: the first forward of each model in the run decides that model's
path (the runner decides the target's up front and records it in the trace), and a build that finishes during
the run does not switch it. Forwards outside a pinned run (tests calling a strategy directly, training) decide
per forward. `describe` is what `python -m lab doctor` prints.
Not covered: choosing between paths by speed (the paths that apply are each the fastest one known here).
"""

from __future__ import annotations

import contextvars
import os
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from lab.engine import invariance, lean_forward, native_forward
from lab.engine.models import LoadedModel

MODEL, LEAN, NATIVE = "model", "lean", "native"
PATHS = (MODEL, LEAN, NATIVE)


@dataclass(frozen=True)
class ForwardPath:
    """Which path a model's forwards take in a run, and why."""

    name: str  # model | lean | native
    reason: str
    row_invariant: bool = False  # lab.engine.invariance's load-time patches are on

    @property
    def lean(self) -> bool:
        return self.name in (LEAN, NATIVE)

    @property
    def native(self) -> bool:
        return self.name == NATIVE

    def as_dict(self) -> dict:
        return {"name": self.name, "reason": self.reason, "row_invariant": self.row_invariant}


def _off(switch: str) -> bool:
    return os.environ.get(switch, "1") == "0"


def toolchain_present() -> bool:
    """Whether the op's build tools are here (a C++ compiler, as torch's extension builder names it, and ninja):
    where they are, the op should build (and in CI its tests fail rather than skip when it does not)."""
    compiler = os.environ.get("CXX", "c++")
    return shutil.which(compiler) is not None and shutil.which("ninja") is not None


def _not_lean_reason(loaded: LoadedModel) -> str:
    model = loaded.model
    if _off(lean_forward.SWITCH):
        return f"{lean_forward.SWITCH}=0"
    if model.training:
        return "the model is in training mode"
    if not lean_forward.supports(model):
        return "not a plain transformers Llama without hooks (lab.engine.lean_forward.supports)"
    return ""


def _not_native_reason(loaded: LoadedModel, wait: bool) -> str:
    """Why the op does not apply to this model's forwards ("" when it does)."""
    if _off(native_forward.SWITCH):
        return f"{native_forward.SWITCH}=0"
    if loaded.device.type != "cpu":
        return f"the op runs on CPUs only (device {loaded.device.type})"
    if loaded.dtype not in invariance.REDUCED:
        return f"the op runs bf16 / fp16 only ({str(loaded.dtype).removeprefix('torch.')})"
    if not getattr(loaded.model, "_lab_rows_invariant", False):
        return f"row-invariant forwards are off ({invariance.SWITCH}=0 at load)"
    built = native_forward.build() if wait else native_forward.available()  # available() starts the build
    if not built:
        if native_forward.build_state() == "building":
            return "the op is still building in the background (python -m lab.engine.native_forward builds it)"
        return "the op is not built (no C++ compiler or a failed build; see the warning in the log)"
    if native_forward._plan(loaded.model) is None:
        return "the model has modules the op does not run (other linears, activations or norms)"
    return ""


def choose(loaded: LoadedModel, *, wait: bool = False) -> ForwardPath:
    """The path of `loaded`'s forwards, decided now (module docstring); `wait` waits for the op's build."""
    rows = bool(getattr(loaded.model, "_lab_rows_invariant", False))
    why_not = _not_lean_reason(loaded)
    if why_not:
        return ForwardPath(MODEL, why_not, rows)
    why_not = _not_native_reason(loaded, wait)
    if why_not:
        return ForwardPath(LEAN, f"a Llama the lean loop runs; no native layers: {why_not}", rows)
    return ForwardPath(NATIVE, "a Llama in bf16 / fp16 on a CPU with row-invariant forwards and the op built", rows)


@dataclass
class _Run:
    """The paths of one run, one per model, decided at each model's first forward (or up front)."""

    paths: dict[int, ForwardPath] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def path(self, loaded: LoadedModel) -> ForwardPath:
        with self.lock:
            key = id(loaded.model)
            if key not in self.paths:
                self.paths[key] = choose(loaded)
            return self.paths[key]


_RUN: contextvars.ContextVar[_Run | None] = contextvars.ContextVar("lab_forward_run", default=None)


def current(loaded: LoadedModel) -> ForwardPath:
    """The path `loaded`'s next forward takes: the run's, inside `pinned`, else decided for this forward."""
    run = _RUN.get()
    return run.path(loaded) if run is not None else choose(loaded)


def pinned(events: Iterator, fixed: dict[int, ForwardPath] | None = None) -> Iterator:
    """Iterate `events` (a strategy's stream) with every model's path fixed for the run; `fixed` maps
    id(model) to paths decided up front. The run's context is set around each step of the stream (not
    across its yields), so it holds whichever thread pulls the next event and never leaks to the caller;
    threads the run starts inherit it when they copy the context (`contextvars.copy_context`)."""
    run = _Run(dict(fixed or {}))
    try:
        while True:
            token = _RUN.set(run)
            try:
                event = next(events)
            except StopIteration:
                return
            finally:
                _RUN.reset(token)
            yield event
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            token = _RUN.set(run)
            try:
                close()
            finally:
                _RUN.reset(token)
