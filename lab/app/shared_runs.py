"""The classroom server's model lane: one run at a time, a visible waiting line, and identical requests shared.

Covered: `RunHub`, a FIFO of model jobs executed one at a time by a worker thread (model work stays serial, as on
a 2-core server it must), each job keyed by everything that determines its output (model, device, dtype,
strategy, parameters, prompt, chat template, seed and a branch prefix: `request_key`). A request whose key is
running or waiting joins that job (one run, every asker gets all its events from the start); one whose key
finished recently is answered from the recorded events (a bounded LRU of finished runs). `follow` streams a
job's events to one asker and, while it waits, `Waiting` updates with its place in line and an estimated wait
(the expected time of the job running now and of the jobs ahead: max_new_tokens over the tokens/s of recent
runs). A job whose askers all leave (their generator closed, or none of them reading for STALE_S: a cancelled
handler that was not closed) is cancelled, and the generator of a running one is closed so the strategy frees its
caches. `RunHub.model_lock` is held during a run so other model work (Measure) waits.
At most `max_waiting` distinct jobs may wait; beyond that `submit` raises `QueueFull` with the line's length
and expected wait (joining an existing job is always allowed: it costs nothing).
Not covered: persistence across restarts, per-user fairness beyond FIFO, several model lanes (one device).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

from lab.trace import Event, TokenEmitted

CACHE_SIZE = 64
START_TOKENS_PER_S = 20.0  # first estimate of the lane's speed, replaced by measured runs
OVERHEAD_S = 1.0  # per run: encode, prefill, first render
WAIT_POLL_S = 0.5
STALE_S = 5.0  # a job nobody has read from for this long has no asker left (askers read at least every poll)
_ids = itertools.count(1)


class QueueFull(RuntimeError):
    """Too many distinct runs are waiting; the message says how many and for about how long."""


@dataclass(frozen=True)
class Waiting:
    """An asker's place in line (1 = next; 0 = its run is running) and the estimated seconds until it starts."""

    position: int
    waiting: int
    eta_s: float


@dataclass
class Job:
    """One model run shared by every asker of the same key."""

    key: str
    open_events: Callable[[], Iterator[Event]]
    max_new_tokens: int
    id: int = field(default_factory=lambda: next(_ids))
    events: list[Event] = field(default_factory=list)
    askers: int = 0
    started: float | None = None
    done: bool = False
    error: BaseException | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    shared: bool = False  # served to an asker who did not start it (joined or answered from the cache)
    status: str = ""  # why it ended early ("stopped at the ... s limit"), "" otherwise
    last_pull: float = field(default_factory=time.monotonic)  # when an asker last read from it


def request_key(request, prefix: tuple[int, ...] = (), forced: str = "") -> str:
    """Everything that determines a run's events, as one string (equal keys, equal runs)."""
    params = asdict(request.params)
    parts = [request.model, request.device, request.dtype, request.strategy.name, params, request.prompt]
    parts += [request.chat, request.seed, list(prefix), forced]
    return json.dumps(parts, sort_keys=True, default=str)


def key_digest(key: str) -> str:
    """A short, stable name of a request key (the server log names runs by it)."""
    return hashlib.sha1(key.encode("utf-8")).hexdigest()[:12]


class RunHub:
    """A one-at-a-time model lane with a waiting line, shared identical runs and a cache of finished ones."""

    def __init__(
        self,
        max_waiting: int,
        max_run_s: float = 300.0,
        cache_size: int = CACHE_SIZE,
        before_run: Callable[[], object] | None = None,
    ) -> None:
        self.max_waiting = max_waiting
        self.before_run = before_run  # e.g. lab.engine.threads.apply: pick the threads for this run
        self.max_run_s = max_run_s
        self.cache_size = cache_size
        self.model_lock = threading.Lock()
        self._cond = threading.Condition()
        self._pending: list[Job] = []
        self._running: Job | None = None
        self._active: dict[str, Job] = {}
        self._finished: OrderedDict[str, Job] = OrderedDict()
        self._tokens_per_s = START_TOKENS_PER_S
        self._worker: threading.Thread | None = None
        self.runs_started = 0
        self.shared_answers = 0

    # --- askers -----------------------------------------------------------------------------------------------

    def submit(self, key: str, open_events: Callable[[], Iterator[Event]], max_new_tokens: int) -> Job:
        """The job for `key`: a finished one from the cache, a running or waiting one to join, or a new one."""
        with self._cond:
            job = self._finished.get(key) or self._active.get(key)
            if job is not None and not job.cancelled.is_set():
                if job.done:
                    self._finished.move_to_end(key)
                job.askers += 1
                job.last_pull = time.monotonic()
                job.shared = True
                self.shared_answers += 1
                return job
            if len(self._pending) >= self.max_waiting:
                eta = self._eta(len(self._pending))
                raise QueueFull(
                    f"Queue is full: {len(self._pending)} runs are waiting for the model (you would be "
                    f"#{len(self._pending) + 1}, about {eta:.0f} s). Try again in a minute, or open an example "
                    "in the Replay tab."
                )
            job = Job(key, open_events, max_new_tokens, askers=1)
            self._active[key] = job
            self._pending.append(job)
            self._ensure_worker()
            self._cond.notify_all()
            return job

    def follow(self, job: Job, poll_s: float = WAIT_POLL_S) -> Iterator[Waiting | list[Event]]:
        """A Waiting update per poll while the job is in line, then its events in batches (all of them, from the
        first; an empty batch when nothing arrived within `poll_s`) until it ends; re-raises the run's error.
        Leaving early (close) releases this asker."""
        cursor = 0
        try:
            while True:
                job.last_pull = time.monotonic()
                with self._cond:
                    if cursor == len(job.events) and not job.done:
                        self._cond.wait(poll_s)
                    batch, done, error = job.events[cursor:], job.done, job.error
                    place = self._place(job) if job.started is None and not done else None
                cursor += len(batch)
                if place is not None:
                    yield place
                else:
                    yield batch
                if done:
                    if error is not None:
                        raise error
                    return
        finally:
            self.release(job)

    def release(self, job: Job) -> None:
        """One asker left; a job nobody waits for any more is cancelled (removed from the line, or stopped)."""
        with self._cond:
            job.askers -= 1
            if job.askers > 0 or job.done:
                return
            job.cancelled.set()
            if job in self._pending:
                self._pending.remove(job)
                self._active.pop(job.key, None)
            self._cond.notify_all()

    def recent(self, wanted: Callable[[str], bool]) -> list[Event] | None:
        """The events of the most recently finished run whose key satisfies `wanted` (None when there is none)."""
        with self._cond:
            for key in reversed(self._finished):
                if wanted(key):
                    return list(self._finished[key].events)
        return None

    def status(self) -> dict:
        with self._cond:
            return {
                "waiting": len(self._pending),
                "running": self._running.id if self._running else None,
                "runs_started": self.runs_started,
                "shared_answers": self.shared_answers,
                "tokens_per_s": round(self._tokens_per_s, 2),
            }

    # --- estimates (under the lock) -----------------------------------------------------------------------------

    def _expected_s(self, job: Job) -> float:
        return OVERHEAD_S + job.max_new_tokens / max(self._tokens_per_s, 0.1)

    def _remaining_s(self) -> float:
        job = self._running
        if job is None:
            return 0.0
        emitted = sum(isinstance(e, TokenEmitted) for e in job.events)
        left = max(0, job.max_new_tokens - emitted) / max(self._tokens_per_s, 0.1)
        return max(left, self._expected_s(job) - (time.monotonic() - (job.started or time.monotonic())))

    def _eta(self, ahead: int) -> float:
        return self._remaining_s() + sum(self._expected_s(j) for j in self._pending[:ahead])

    def _place(self, job: Job) -> Waiting:
        index = self._pending.index(job) if job in self._pending else 0
        return Waiting(index + 1, len(self._pending), round(self._eta(index), 1))

    # --- the worker ---------------------------------------------------------------------------------------------

    @staticmethod
    def _abandoned(job: Job) -> bool:
        """No asker has read from the job for STALE_S: their handlers were cancelled (a client's cancel, Stop)
        without closing their generators, so nobody is left to show it to."""
        return time.monotonic() - job.last_pull > STALE_S

    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._work, daemon=True, name="model-lane")
            self._worker.start()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._pending:
                    self._cond.wait()
                job = self._pending.pop(0)
                if self._abandoned(job):  # every asker went away without a word (a killed client)
                    job.cancelled.set()
                    self._active.pop(job.key, None)
                    job.done = True
                    self._cond.notify_all()
                    continue
                job.started = time.monotonic()
                self._running = job
                self.runs_started += 1
                self._cond.notify_all()
            print(f"[decoding-lab] run {job.id} started ({job.askers} asking) key={key_digest(job.key)}", flush=True)
            with self.model_lock:
                self._run(job)

    def _run(self, job: Job) -> None:
        events = None
        try:
            if self.before_run is not None:
                self.before_run()
            events = job.open_events()
            for event in events:
                with self._cond:
                    job.events.append(event)
                    self._cond.notify_all()
                if job.cancelled.is_set() or self._abandoned(job):
                    job.cancelled.set()
                    break
                if time.monotonic() - (job.started or 0.0) > self.max_run_s:
                    job.status = f"stopped at the {self.max_run_s:.0f} s limit"
                    break
        except BaseException as error:  # handed to every asker by `follow`
            job.error = error
        finally:
            if events is not None and hasattr(events, "close"):
                events.close()  # frees the strategy's caches
            self._finish(job)

    def _finish(self, job: Job) -> None:
        with self._cond:
            job.done = True
            self._running = None
            if self._active.get(job.key) is job:
                del self._active[job.key]
            elapsed = time.monotonic() - (job.started or time.monotonic())
            tokens = sum(isinstance(e, TokenEmitted) for e in job.events)
            if tokens and elapsed > 0:
                self._tokens_per_s = 0.5 * self._tokens_per_s + 0.5 * tokens / elapsed
            if job.error is None and not job.cancelled.is_set():
                self._finished[job.key] = job
                while len(self._finished) > self.cache_size:
                    self._finished.popitem(last=False)
            self._cond.notify_all()
