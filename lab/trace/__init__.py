"""Trace events, the statistics folded from them, and the versioned JSON trace file (docs/architecture.md section 7).

Events are frozen dataclasses of plain Python values (ints, floats, strings, lists of those); each carries the
step index. Strategies emit them, visualizers and stats read them. This package imports neither torch nor
gradio, so visualizers can depend on it alone. It is split by family: `base` (the kind registry, `TokenEmitted`,
`RunFinished`), `logit_level`, `speculative` (chains, trees and the multi-token heads), `system2`, then `stats`
(one fold for every family) and `io` (the file). Importing the package registers every kind.
A trace file is JSON: {"format", "version", "strategy", "model", "prompt", "params", "events": [{"kind", ...}]},
plus the optional "dtype" and "precision" (weight format, `lab.engine.quant`) of the run when they are known, and
"choice": how they were chosen when either was "auto", with the reason (`lab.engine.defaults`), and
"forward_path": the target's forward path for the run (`lab.engine.forward_path`).
Loading checks the size, the nesting depth, the version, every event kind and every field's type, and never
unpickles anything. Detail kinds of later strategies register themselves with `@event_kind`.
"""

from __future__ import annotations

from lab.trace.base import EVENT_KINDS, Event, RunFinished, TokenEmitted, TraceError, event_kind
from lab.trace.io import (
    MAX_DEPTH,
    MAX_EVENTS,
    MAX_TRACE_BYTES,
    TRACE_FORMAT,
    TRACE_VERSION,
    Trace,
    event_from_dict,
    event_to_dict,
    from_json,
    to_json,
)
from lab.trace.logit_level import GuidanceStep, LayerContrast, MirostatStep
from lab.trace.speculative import (
    DraftRound,
    EagleDraft,
    MixtureRound,
    PipelineSpan,
    SpeculationRound,
    TreeRound,
    speculation_stats,
)
from lab.trace.stats import Stats, summarize
from lab.trace.system2 import (
    ReplCall,
    RlmContext,
    RlmResult,
    ThoughtNode,
    ThoughtResult,
    ThoughtStep,
    search_counters,
    verdict_agreement,
)

__all__ = [
    "DraftRound",
    "EVENT_KINDS",
    "EagleDraft",
    "Event",
    "GuidanceStep",
    "LayerContrast",
    "MAX_DEPTH",
    "MAX_EVENTS",
    "MAX_TRACE_BYTES",
    "MirostatStep",
    "MixtureRound",
    "PipelineSpan",
    "ReplCall",
    "RlmContext",
    "RlmResult",
    "RunFinished",
    "SpeculationRound",
    "Stats",
    "TRACE_FORMAT",
    "TRACE_VERSION",
    "ThoughtNode",
    "ThoughtResult",
    "ThoughtStep",
    "TokenEmitted",
    "Trace",
    "TraceError",
    "TreeRound",
    "event_from_dict",
    "event_kind",
    "event_to_dict",
    "from_json",
    "speculation_stats",
    "summarize",
    "to_json",
    "search_counters",
    "verdict_agreement",
]
