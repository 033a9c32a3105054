"""Run a validated request end to end: load the model, encode the prompt, stream the strategy's events.

The CLI, the app and the benchmark all go through `stream_run`, so they share validation, seeding and the
model cache. The generator frees the strategy's caches when it is closed early (Stop / cancel).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict

import torch

from lab.app.branching import BranchPoint, branch_events
from lab.app.validation import RunRequest, check_prompt_fits
from lab.engine import forward_path
from lab.engine.forward_path import ForwardPath
from lab.engine.models import LoadedModel, load_model
from lab.trace import Event, Trace


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """The explicit RNG of a run (DESIGN.md 5): every random draw of a strategy uses it."""
    generator = torch.Generator(device="cpu" if device.type == "mps" else device)
    generator.manual_seed(seed)
    return generator


def prepare(request: RunRequest) -> tuple[LoadedModel, list[int]]:
    """Load (or reuse) the model and encode the prompt; raises InputError / ModelLoadError."""
    loaded = load_model(request.model, request.device, request.dtype, request.precision)
    prompt_ids = loaded.encode(request.prompt, chat=request.chat)
    check_prompt_fits(loaded, prompt_ids, request.params.max_new_tokens)
    return loaded, prompt_ids


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
    if point is None:
        yield from stream_run(request, loaded, prompt_ids)
        return
    check_prompt_fits(loaded, prompt_ids + list(point.prefix_ids), request.params.max_new_tokens)
    generator = make_generator(request.seed, loaded.device)
    events = branch_events(request.strategy.run, loaded, prompt_ids, request.params, generator, point)
    yield from forward_path.pinned(events, {id(loaded.model): forward_path.choose(loaded)})


def new_trace(request: RunRequest, loaded: LoadedModel | None = None, path: ForwardPath | None = None) -> Trace:
    """An empty trace describing the request (with the resolved dtype and precision and the target's forward path
    for the run, `path` or decided now, once the model is loaded); events are appended as they stream."""
    trace = Trace(request.strategy.name, request.model, request.prompt, asdict(request.params))
    if loaded is not None:
        trace.dtype, trace.precision = str(loaded.dtype).removeprefix("torch."), loaded.precision
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
