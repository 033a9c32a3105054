"""Shared pieces of the app's tabs: model work (ZeroGPU-aware), throttled streaming, the views of one run, the
step inspector and its token-click wiring. Gradio UI code only; the logic lives in gradio-free `lab` modules.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import gradio as gr

from lab.app.branching import BranchError, BranchPoint, branch_record
from lab.app.pacing import REALTIME, STEP, PaceControl, Pacer, PaceRegistry
from lab.app.presets import MODELS
from lab.app.run_stats import fmt, is_acceleration, key_quantities, progress_line, speed_vs_greedy, system2_quantities
from lab.app.runner import new_trace, record_choice, stopped_trace, stream_request
from lab.app.shared_runs import Job, QueueFull, RunHub, Waiting, request_key
from lab.app.validation import RunRequest, validate_request
from lab.app.zerogpu import gpu_function, zero_gpu_enabled
from lab.engine import threads
from lab.engine.models import ModelLoadError
from lab.params import DecodeParams, InputError
from lab.trace import TokenEmitted, Trace, summarize, to_json
from strategies import REGISTRY, by_family
from ui.layout import MAX_FIGURES
from visualizers import strategy_figures, strategy_token_view

RENDER_INTERVAL_S = 0.2
# Deployment knobs (environment): the hard limit of one run, the waiting events the queue accepts.
MAX_RUN_SECONDS = int(os.environ.get("DECODING_LAB_MAX_RUN_S", "300"))
# DECODING_LAB_QUEUE_SIZE: distinct runs that may wait for the model (identical requests share one run and do not
# count); the default fits a class of 30 students plus the teacher with room to spare.
QUEUE_MAX_SIZE = int(os.environ.get("DECODING_LAB_QUEUE_SIZE", "32"))
MEASURE_TIME_LIMIT = 1200
STATE_TTL_S = 3600
MAX_PARAMS_JSON_CHARS = 10_000
MAX_UPLOAD = "10mb"
REPLAY_TICK_S = 0.4
MODEL_CHOICES = MODELS  # lab.app.presets: the embedded model and the known draft / target pairs
TRACE_DIR = Path(tempfile.gettempdir()) / "decoding-lab-traces"
MAX_TRACE_FILES = 200
_TRACE_FILES_LOCK = threading.Lock()
COMMON_DEFAULTS = DecodeParams()
VIEW_COUNT = 3 + MAX_FIGURES  # token view, figures, stats, text (`view_updates`)
MODEL_QUEUE = {"concurrency_id": "model", "concurrency_limit": 1, "time_limit": MAX_RUN_SECONDS + 120}
# Run requests wait inside their handler, in the shared model lane (`lab.app.shared_runs`), where they see their place
# in line; Gradio admits this many at once (more wait in Gradio's own queue, which shows its position too).
RUN_QUEUE = {"concurrency_id": "classroom", "concurrency_limit": QUEUE_MAX_SIZE + 8, "time_limit": 3 * MAX_RUN_SECONDS}
POLL_S = 0.05
WAITING_RENDER_S = 1.0
HUB = RunHub(QUEUE_MAX_SIZE, MAX_RUN_SECONDS, before_run=threads.apply)
PACE = PaceRegistry()
# Light work (replay, inspect, learn, history) runs queued in its own unlimited group, so it never waits for the
# model and its errors (gr.Error) still reach the browser as messages (with queue=False gradio 6.31 answers 500
# and shows no text). It is refused with the queue-full message only when max_size events are already waiting.
LIGHT = {"concurrency_id": "light", "concurrency_limit": None, "api_visibility": "private"}
LATEX = [{"left": "$$", "right": "$$", "display": True}, {"left": "$", "right": "$", "display": False}]


# --- model work (inside spaces.GPU on ZeroGPU: plain events out, no figures) ---------------------------------


def model_events(request: RunRequest, point: BranchPoint | None = None) -> Iterator:
    """Load the model, encode the prompt (and a branch's prefix) and stream the strategy's events; errors surface
    while iterating."""
    events = stream_request(request, point)
    try:
        yield from events
    finally:
        events.close()  # frees the strategy's caches, also when the client cancels


gpu_events = gpu_function(model_events, duration=MAX_RUN_SECONDS)


def open_job(request: RunRequest, point: BranchPoint | None = None) -> Job:
    """Join the shared model lane: the run of an identical request (running, waiting or recently finished) or a new
    one; a full line becomes a clear gr.Error."""
    forced = repr((point.forced_id, point.forced_text)) if point else ""
    key = request_key(request, point.prefix_ids if point else (), forced)
    try:
        return HUB.submit(key, lambda: gpu_events(request, point), request.params.max_new_tokens)
    except QueueFull as error:
        raise gr.Error(str(error), title="Queue full") from None


def direct_batches(request: RunRequest, point: BranchPoint | None) -> Iterator[list]:
    """The events of one run in the request's own thread, without the shared lane: on ZeroGPU, where the
    spaces.GPU function must run in the handler that asked for the GPU (Gradio's queue then serialises runs)."""
    events = gpu_events(request, point)
    try:
        for event in events:
            yield [event]
    finally:
        events.close()


def waiting_text(place: Waiting) -> str:
    if place.position <= 0:
        return "starting…"
    return (
        f"⏳ waiting: you are #{place.position} in line ({place.waiting} waiting), "
        f"about {5 * math.ceil(place.eta_s / 5):.0f} s until your run starts"
    )


def pace_text(pacer: Pacer | None, shown: list, arrived: list, done: bool) -> str:
    if pacer is None or pacer.caught_up(arrived):
        return ""
    pace, _ = pacer.control.snapshot()
    total = sum(isinstance(e, TokenEmitted) for e in arrived)
    head = "step mode: press ▶ (or the → key) for the next token" if pace == STEP else f"paced at {pace}"
    return f"{head} · {pacer.shown} of {total}{'' if done else '+'} tokens shown"


STOPPED_STATUS = "stopped by you"
STOP_WORDS = {"cancelled": STOPPED_STATUS}


def stop_pressed(control: PaceControl | None) -> bool:
    return control is not None and control.stop_requested


def stream_trace(
    request: RunRequest, deadline: float, point: BranchPoint | None = None, control: PaceControl | None = None
) -> Iterator[tuple[Trace, bool, str, Trace]]:
    """(shown trace, final, status, full trace) about every RENDER_INTERVAL_S while the run streams (and while it
    waits in line: the status says where), then once final. With a PaceControl the events are buffered and the shown
    trace is released at its pace (the run itself is not slowed); step mode ends when the run has ended, showing the
    tokens released so far. Stop (the control's stop_requested) ends the run as a result: the final update holds the
    tokens shown so far, closed as a cancelled run. Bad input or a model that cannot load becomes a gr.Error (the
    server keeps serving)."""
    trace = new_trace(request)
    trace.precision = request.precision  # as requested: the model loads inside the GPU function (ZeroGPU)
    trace.branch = branch_record(point) if point else None
    job = open_job(request, point) if not zero_gpu_enabled() else None
    pacer = Pacer(control) if control else None
    follow = HUB.follow(job, POLL_S) if job else direct_batches(request, point)
    last_render, shown_len, status, done, waiting = 0.0, -1, "", False, ""
    try:
        while not stop_pressed(control):
            item = next(follow, None)
            done = item is None
            if isinstance(item, Waiting):  # a new message when the place changes, else once a second
                text = waiting_text(item)
                if text != waiting or time.monotonic() - last_render >= WAITING_RENDER_S:
                    last_render, waiting = time.monotonic(), text
                    yield trace, False, text, trace
                continue
            trace.events.extend(item or [])
            now = time.monotonic()
            visible = pacer.visible(trace.events, now, done) if pacer else len(trace.events)
            if now > deadline:
                status = f"stopped at the {MAX_RUN_SECONDS} s limit"
                break
            caught_up = pacer is None or pacer.caught_up(trace.events)
            if done and (caught_up or (pacer and pacer.control.snapshot()[0] == STEP)):
                break
            if done:
                time.sleep(POLL_S)
            paced = pacer is not None and pacer.control.snapshot()[0] != REALTIME  # render every release
            if visible != shown_len and (paced or now - last_render >= RENDER_INTERVAL_S):
                last_render, shown_len = now, visible
                shown = trace_prefix(trace, visible)
                yield shown, False, pace_text(pacer, shown.events, trace.events, done), trace
    except (InputError, ModelLoadError, BranchError) as error:
        raise gr.Error(str(error)) from None
    finally:
        follow.close()
    record_choice(trace, request)  # the resolved dtype and precision, and why (the model has loaded by now)
    yield final_update(trace, pacer, status or (job.status if job else ""), stopped=stop_pressed(control))


def final_update(trace: Trace, pacer: Pacer | None, status: str, stopped: bool) -> tuple[Trace, bool, str, Trace]:
    """The last (shown, True, status, full) of a run: everything shown once the run ended; what was on screen when
    Stop was pressed, closed as a cancelled run (the full trace then is that same partial run)."""
    if stopped:
        shown = pacer.visible(trace.events, time.monotonic()) if pacer else len(trace.events)
        partial = stopped_trace(trace_prefix(trace, shown))
        return partial, True, STOPPED_STATUS, partial
    visible = pacer.visible(trace.events, time.monotonic(), True) if pacer else len(trace.events)
    return trace_prefix(trace, visible), True, status or pace_text(pacer, [], trace.events, True), trace


def trace_prefix(trace: Trace, n: int) -> Trace:
    """The trace with its first n events (the same object when n covers all of them)."""
    if n >= len(trace.events):
        return trace
    return dataclasses.replace(trace, events=trace.events[:n])


def session_pace(request: gr.Request | None, registry: PaceRegistry = PACE) -> PaceControl:
    """The PaceControl of the browser session making `request` (in `registry`: the Run tab's by default)."""
    return registry.get(getattr(request, "session_hash", None) or "anonymous")


def start_pacing(request: gr.Request | None, pace: str, registry: PaceRegistry = PACE) -> PaceControl:
    """The session's PaceControl (in `registry`: the Run tab's by default), reset for a new live run at `pace`."""
    control = session_pace(request, registry)
    control.set_pace(pace)
    control.step(-control.snapshot()[1])
    control.stop_requested = False
    control.live = True
    return control


def checked_request(strategy: str, prompt: str, params: dict, **options) -> RunRequest:
    try:
        return validate_request(strategy, prompt, params, **options)
    except InputError as error:
        raise gr.Error(str(error)) from None


# --- rendering (figures are built here, outside the model work) ------------------------------------------------


def strategy_choices() -> list[tuple[str, str]]:
    """Dropdown entries grouped by family: ("family › name", name)."""
    return [(f"{family} › {s.name}", s.name) for family, items in by_family().items() for s in items]


def strategy_info(name: str) -> str:
    strategy = REGISTRY.get(name)
    if strategy is None:
        return ""
    return f"**{strategy.name}** ({strategy.family}): {strategy.summary}  \n*Paper:* {strategy.paper}"


def stats_markdown(trace: Trace, status: str = "", extra: list[tuple[str, str]] | None = None, note: str = "") -> str:
    """The run's stats as one table row: counts, speed, acceptance α / τ (2 decimals), the method's own quantity
    (lab.app.run_stats.key_quantities), `extra` columns (the Run tab's speedup) and why it stopped; `note`: a line
    under the table."""
    stats = summarize(trace.events)
    system2 = system2_quantities(trace.events)
    if system2 is not None:  # a search or a REPL loop: its calls and answer, not a decoding speed
        rows = [*system2, ("answer tokens", stats.new_tokens)]
        rows += [("time", f"{stats.wall_s:.1f} s")] if stats.wall_s > 0 else []
    else:
        rows = [
            ("tokens", stats.new_tokens),
            ("tokens/s", fmt(stats.tokens_per_s, 1)),
            ("target forwards", stats.target_forwards),
            ("forwards/token", fmt(stats.forwards_per_token)),
        ]
    if stats.acceptance_rate is not None:
        rows += [("acceptance α", fmt(stats.acceptance_rate)), ("τ (tokens/round)", fmt(stats.mean_accepted_length))]
    rows += key_quantities(trace.events) + list(extra or [])
    rows.append(("stop", status or STOP_WORDS.get(stats.stop_reason, stats.stop_reason)))
    header = "| " + " | ".join(k for k, _ in rows) + " |\n|" + "---|" * len(rows)
    table = header + "\n| " + " | ".join(str(v) for _, v in rows) + " |"
    note = "\n\n".join(part for part in (note, f"*Model: {trace.choice}*" if trace.choice else "") if part)
    return f"{table}\n\n{note}" if note else table


def greedy_baseline(request: RunRequest) -> list | None:
    """The events of a recent greedy run (shared lane's cache) of the same prompt, model, device, dtype, chat
    template and seed, any budget; None when there is none."""
    wanted = [request.model, request.device, request.dtype, "greedy"]

    def matches(key: str) -> bool:
        parts = json.loads(key)
        same = parts[:4] == wanted and parts[5:7] == [request.prompt, request.chat]
        return same and parts[4].get("repetition_penalty", 1.0) == 1.0 and parts[8] == []

    return HUB.recent(matches)


def speed_stats(trace: Trace, request: RunRequest) -> tuple[list[tuple[str, str]], str]:
    """The Run tab's speedup column for an acceleration method and a line under the stats: the speed against a
    recent greedy run of the same prompt and why it is below 1x, or how to get one."""
    if not is_acceleration(trace.events):
        return [], ""
    greedy = greedy_baseline(request)
    speed = speed_vs_greedy(trace.events, greedy) if greedy else None
    if speed is None:
        return [("speedup vs greedy", "-")], "Speed: run greedy on this prompt (same model) to see the speedup."
    line = f"Speed: {speed.speedup:.2f}x greedy ({speed.greedy_tokens_per_s:.1f} tok/s on this prompt)"
    return [("speedup vs greedy", f"{speed.speedup:.2f}x")], f"{line}; {speed.reason}." if speed.reason else line


def stats_line(trace: Trace, status: str = "") -> str:
    """The run's numbers on one line (narrow columns)."""
    stats = summarize(trace.events)
    system2 = system2_quantities(trace.events)
    if system2 is not None:
        return " · ".join([f"{label} {value}" for label, value in system2] + [status or stats.stop_reason])
    parts = [f"{stats.new_tokens} tokens", f"{fmt(stats.tokens_per_s, 1)} tok/s"]
    parts.append(f"{fmt(stats.forwards_per_token)} fwd/token")
    if stats.acceptance_rate is not None:
        parts += [f"α {fmt(stats.acceptance_rate)}", f"τ {fmt(stats.mean_accepted_length)}"]
    return " · ".join(parts + [status or stats.stop_reason])


def _modified(path: Path) -> float | None:
    """A file's modification time, or None when another handler (or process) removed it meanwhile."""
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return None


def write_trace_file(trace_json: str, prefix: str = "trace") -> str:
    """Save a trace (or other JSON) for download; the folder keeps at most MAX_TRACE_FILES files (oldest removed).
    Many handlers finish at once when a shared run ends, so pruning is serialised and tolerates files that vanish."""
    with _TRACE_FILES_LOCK:
        TRACE_DIR.mkdir(parents=True, exist_ok=True)
        dated = [(t, p) for p in TRACE_DIR.glob("*.json") if (t := _modified(p)) is not None]
        old = [p for _, p in sorted(dated)]
        for path in old[: max(0, len(old) - MAX_TRACE_FILES + 1)]:
            path.unlink(missing_ok=True)
        path = TRACE_DIR / f"{prefix}-{uuid.uuid4().hex[:12]}.json"
        path.write_text(trace_json, encoding="utf-8")
    return str(path)


def view_updates(trace: Trace, status: str = "", selected: int | None = None, width_px: float | None = None) -> list:
    """[token view, main figure, stats, text, detail figures...]: every view of a (partial) trace; `width_px`: the
    plot width of a narrow column (text in figures is fitted to it)."""
    figures = strategy_figures(trace.strategy, trace.events, width_px)[:MAX_FIGURES]
    details = [gr.Plot(value=f, visible=True) for f in figures[1:]]
    details += [gr.Plot(visible=False)] * (MAX_FIGURES - len(figures))
    tokens = strategy_token_view(trace.strategy, trace.events, selected, progress_line(trace.events))
    return [tokens, figures[0], stats_markdown(trace, status), trace.text, *details]


def render(trace: Trace, final: bool, status: str = "", full: Trace | None = None) -> list:
    """One update of the Run tab's outputs (the `/run` API order): token view, main figure, stats, text, trace
    JSON, trace file, detail figures, then the session's run state. JSON, file and state only at the end, for the
    `full` trace (default: the one shown); the state's position is the number of tokens shown (keyboard stepping)."""
    tokens, main, stats, text, *details = view_updates(trace, status)
    if not final:
        return [tokens, main, stats, text, gr.skip(), gr.skip(), *details, gr.skip()]
    full = full or trace
    trace_json = to_json(full)
    path = write_trace_file(trace_json)
    position = sum(isinstance(e, TokenEmitted) for e in trace.events)
    state = {"id": uuid.uuid4().hex, "trace": full, "path": path, "status": status, "position": position}
    return [tokens, main, stats, text, trace_json, path, *details, state]
