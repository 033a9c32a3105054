"""Run a validated request end to end: load the model, encode the prompt, stream the strategy's events.

The CLI, the app and the benchmark all go through `stream_run`, so they share validation, seeding and the
model cache. The generator frees the strategy's caches when it is closed early (Stop / cancel).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import asdict, replace

import torch

from lab.app.branching import BranchPoint, branch_events
from lab.app.validation import RunRequest, check_prompt_fits
from lab.engine import forward_path
from lab.engine.defaults import NAMES
from lab.engine.forward_path import ForwardPath
from lab.engine.models import MODEL_CACHE, LoadedModel, load_model
from lab.trace import Event, RunFinished, TokenEmitted, Trace, summarize


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """The explicit RNG of a run (docs/architecture.md section 5): every random draw of a strategy uses it."""
    generator = torch.Generator(device="cpu" if device.type == "mps" else device)
    generator.manual_seed(seed)
    return generator


def prepare(request: RunRequest) -> tuple[LoadedModel, list[int]]:
    """Load (or reuse) the model and encode the prompt; raises InputError / ModelLoadError."""
    loaded = load_model(request.model, request.device, request.dtype, request.precision)
    prompt_ids = loaded.encode(request.prompt, chat=request.chat)
    check_prompt_fits(loaded, prompt_ids, request.params.max_new_tokens)
    return loaded, prompt_ids


# The target's forward path of the latest run of each request (by a digest of the request, so no user data is
# kept), for the app, which makes its trace before the model loads and fills it in at the end (`record_choice`).
_RUN_PATHS: OrderedDict[str, ForwardPath] = OrderedDict()
_RUN_PATHS_LOCK = threading.Lock()
MAX_RUN_PATHS = 64


def _request_digest(request: RunRequest) -> str:
    return hashlib.sha256(repr(request).encode("utf-8", "replace")).hexdigest()


def _remember_path(request: RunRequest, path: ForwardPath) -> ForwardPath:
    with _RUN_PATHS_LOCK:
        key = _request_digest(request)
        _RUN_PATHS[key] = path
        _RUN_PATHS.move_to_end(key)
        while len(_RUN_PATHS) > MAX_RUN_PATHS:
            _RUN_PATHS.popitem(last=False)
    return path


def stream_run(
    request: RunRequest, loaded: LoadedModel, prompt_ids: list[int], path: ForwardPath | None = None
) -> Iterator[Event]:
    """The strategy's event stream for this request, seeded from the request, with the forward paths fixed for
    the run (`lab.engine.forward_path.pinned`); `path` is the target's, when decided up front (`new_trace`)."""
    generator = make_generator(request.seed, loaded.device)
    path = path or forward_path.choose(loaded)
    events = request.strategy.run(loaded, prompt_ids, request.params, generator)
    return forward_path.pinned(events, {id(loaded.model): path})


def stream_request(request: RunRequest, point: BranchPoint | None = None) -> Iterator[Event]:
    """Load, encode and stream a request; with a branch point, continue from the parent's prefix and the forced
    token (lab.app.branching) instead of from the prompt."""
    loaded, prompt_ids = prepare(request)
    path = _remember_path(request, forward_path.choose(loaded))
    if point is None:
        yield from stream_run(request, loaded, prompt_ids, path)
        return
    check_prompt_fits(loaded, prompt_ids + list(point.prefix_ids), request.params.max_new_tokens)
    generator = make_generator(request.seed, loaded.device)
    events = branch_events(request.strategy.run, loaded, prompt_ids, request.params, generator, point)
    yield from forward_path.pinned(events, {id(loaded.model): path})


def record_choice(trace: Trace, request: RunRequest) -> None:
    """Fill the trace's dtype, precision, choice (how they were chosen, and why) and forward path once the request's
    model has loaded and run in this process; leaves the trace as it is when it has not (e.g. a ZeroGPU worker)."""
    choice = MODEL_CACHE.known_choice(request.model, request.device, request.dtype, request.precision)
    if choice is not None:
        trace.dtype, trace.precision = NAMES.get(choice.dtype, str(choice.dtype)), choice.precision
        trace.choice = choice.describe()
    with _RUN_PATHS_LOCK:
        path = _RUN_PATHS.get(_request_digest(request))
    if path is not None and trace.forward_path is None:  # the path this request's run was pinned to
        trace.forward_path = path.as_dict()


def new_trace(request: RunRequest, loaded: LoadedModel | None = None, path: ForwardPath | None = None) -> Trace:
    """An empty trace describing the request (with the resolved dtype and precision, how they were chosen, and the
    target's forward path for the run, `path` or decided now, once the model is loaded); events are appended as
    they stream."""
    trace = Trace(request.strategy.name, request.model, request.prompt, asdict(request.params))
    if loaded is not None:
        trace.dtype, trace.precision = str(loaded.dtype).removeprefix("torch."), loaded.precision
        trace.choice = loaded.choice
        trace.forward_path = (path or forward_path.choose(loaded)).as_dict()
    return trace


def path_of(trace: Trace) -> ForwardPath | None:
    """The forward path `new_trace` decided for this run (pass it to `stream_run` so the run takes it)."""
    return ForwardPath(**trace.forward_path) if trace.forward_path else None


def run_to_trace(request: RunRequest) -> Trace:
    """Run a request to the end and return its full trace."""
    loaded, prompt_ids = prepare(request)
    trace = new_trace(request, loaded)
    trace.events.extend(stream_run(request, loaded, prompt_ids, path_of(trace)))
    return trace


STOPPED_BY_USER = "cancelled"  # RunFinished.stop_reason of a run the viewer stopped (lab.trace)


def stopped_trace(trace: Trace) -> Trace:
    """A copy of a run the viewer stopped, closed with a RunFinished(stop_reason="cancelled") so that every view,
    Replay and a download read it as a finished (partial) run. prompt_tokens is 0: the lane does not report the
    prompt's length to the viewer; wall time and target forwards are those of the last event that arrived."""
    if any(isinstance(e, RunFinished) for e in trace.events):
        return trace
    stats = summarize(trace.events)
    tokens = [e for e in trace.events if isinstance(e, TokenEmitted)]
    step = tokens[-1].step + 1 if tokens else 0
    finish = RunFinished(step, STOPPED_BY_USER, stats.wall_s, 0, stats.target_forwards)
    return replace(trace, events=[*trace.events, finish])
