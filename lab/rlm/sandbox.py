"""The parent side of the RLM sandbox: one isolated worker process per run, driven over a pipe.

Model-written code never runs in the server's process. `Sandbox` starts `lab/rlm/worker.py` (stdlib only) as
`unshare --net -- setpriv --reuid=U --regid=U --clear-groups --inh-caps=-all --bounding-set=-all
--no-new-privs /usr/bin/python3 -I -S -B -c <worker>` with:
- a fresh unprivileged uid U per sandbox (from a private range, so RLIMIT_NPROC, signals, ptrace and /proc of
  one run never reach another run) and a new network namespace (no interfaces up: loopback is unreachable);
- an empty environment, a new session (the wall-clock timeout kills the whole process group), and a private
  temp dir (mode 0700, owned by U) as cwd, removed when the sandbox closes;
- resource limits, Landlock and an audit hook set by the worker itself before the first untrusted line
  (see `lab.rlm.worker`); frames from the worker are capped (`MAX_FRAME`), REPL output is capped with
  "[truncated]" inside the worker and again here.
`execute(code)` is a generator: it yields `SubQuery` for every `llm_query` the code makes (the caller answers
with `.send(text)`, which is how sub-model calls reach the parent and nothing else does) and returns an
`ExecResult`. A timeout, a crash, `os._exit` or a protocol violation kills the worker and yields an error
result; the next `execute` starts a fresh worker (the REPL's variables are lost, the context is reloaded).

Isolation levels (`probe_isolation`): "full" needs root (to switch to the private uid), `unshare`, `setpriv`,
a network namespace and Landlock; otherwise "basic" (a plain child process with the same limits and audit
hook: no uid switch, no network namespace, no Landlock). Free-form code mode requires "full" unless the
operator sets DECODING_LAB_RLM_ALLOW_UNISOLATED=1; constrained mode runs project-generated code only and works
at either level. Not covered: seccomp filters, cgroups (memory is bounded by RLIMIT_AS, not a cgroup).
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path

from lab.rlm import worker as protocol

SYSTEM_PYTHON = "/usr/bin/python3"
WORKER_SOURCE = Path(protocol.__file__).read_text(encoding="utf-8")
ALLOW_UNISOLATED_ENV = "DECODING_LAB_RLM_ALLOW_UNISOLATED"
UID_RANGE = (200_000, 260_000)  # private uids, no passwd entry, never used by a login
MAX_FRAME = 1 << 20  # bytes of one worker -> parent frame
TRUNCATED = protocol.TRUNCATED
_active_uids: set[int] = set()
_uid_lock = threading.Lock()


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one worker (applied as hard limits inside it)."""

    timeout_s: float = 10.0  # wall clock per REPL cell, not counting time spent serving llm_query
    cpu_s: int = 30  # RLIMIT_CPU for the worker's whole life
    memory_bytes: int = 768 << 20  # RLIMIT_AS
    open_files: int = 64  # RLIMIT_NOFILE
    file_bytes: int = 8 << 20  # RLIMIT_FSIZE
    output_cap: int = 16_000  # characters of REPL output kept per cell
    audit: bool = True  # the Python audit hook (tests switch it off to exercise the OS layer alone)


@dataclass(frozen=True)
class SubQuery:
    """A llm_query(prompt, text) the running cell made; answer it with the generator's send()."""

    prompt: str
    text: str
    ranges: list[list[int]]


@dataclass
class ExecResult:
    """What one REPL cell produced: captured output (capped), an error text, context ranges read, FINAL()."""

    output: str
    error: str | None = None
    truncated: bool = False
    reads: list[list[int]] = field(default_factory=list)
    final: str | None = None
    seconds: float = 0.0

    @property
    def transcript(self) -> str:
        """Output, truncation marker and error as the root model sees them."""
        text = self.output + (TRUNCATED if self.truncated else "")
        return text + (f"\n[error] {self.error}" if self.error else "")


class SandboxError(RuntimeError):
    """The sandbox could not be started; the message says why."""


@dataclass(frozen=True)
class Isolation:
    level: str  # full | basic
    reason: str  # why not full (empty when full)


@functools.cache
def probe_isolation() -> Isolation:
    """Which isolation this machine supports; checked once per process by starting a trial worker."""
    missing = [tool for tool in ("unshare", "setpriv") if shutil.which(tool) is None]
    if missing or not os.path.exists(SYSTEM_PYTHON):
        return Isolation("basic", f"missing {', '.join(missing) or SYSTEM_PYTHON}")
    if os.geteuid() != 0:
        return Isolation("basic", "the server does not run as root, so it cannot switch the worker to a private uid")
    try:
        with Sandbox("", SandboxLimits(timeout_s=10), isolation="full") as trial:
            if trial.landlock_abi <= 0:
                return Isolation("basic", "the kernel has no Landlock, so file reads could not be confined")
    except SandboxError as error:
        return Isolation("basic", str(error))
    return Isolation("full", "")


def code_mode_refusal() -> str | None:
    """Why free-form code mode is refused here, or None when it may run."""
    isolation = probe_isolation()
    if isolation.level == "full" or os.environ.get(ALLOW_UNISOLATED_ENV) == "1":
        return None
    return (
        f"Code mode is disabled: the sandbox cannot be fully isolated here ({isolation.reason}). "
        f"Use the constrained action mode, or set {ALLOW_UNISOLATED_ENV}=1 to run model-written code with the "
        "basic sandbox only (rlimits + audit hook, no uid/network/filesystem isolation) at your own risk."
    )


def _claim_uid() -> int:
    with _uid_lock:
        for _ in range(1000):
            uid = int.from_bytes(os.urandom(4), "big") % (UID_RANGE[1] - UID_RANGE[0]) + UID_RANGE[0]
            if uid not in _active_uids:
                _active_uids.add(uid)
                return uid
    raise SandboxError("no free sandbox uid")


class Sandbox:
    """One worker process holding `context`; see the module docstring. Use as a context manager."""

    def __init__(self, context: str, limits: SandboxLimits = SandboxLimits(), isolation: str | None = None):
        self.context, self.limits = context, limits
        self.isolation = isolation or probe_isolation().level
        self.process: subprocess.Popen | None = None
        self.tmpdir: str | None = None
        self.uid: int | None = None
        self.landlock_abi = 0
        self.restarts = 0

    def __enter__(self) -> Sandbox:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _command(self) -> list[str]:
        python = [SYSTEM_PYTHON, "-I", "-S", "-B", "-c", WORKER_SOURCE]
        if self.isolation != "full":
            return python
        ids = [f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups"]
        caps = ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
        tools = [shutil.which("unshare") or "unshare", "--net", "--", shutil.which("setpriv") or "setpriv"]
        return tools + ids + caps + python

    def start(self) -> None:
        """Start a fresh worker with its own uid and temp dir, send it the context, wait for `ready`."""
        self.close()
        self.tmpdir = tempfile.mkdtemp(prefix="rlm-sandbox-")
        if self.isolation == "full":
            self.uid = _claim_uid()
            os.chown(self.tmpdir, self.uid, self.uid)
        os.chmod(self.tmpdir, 0o700)
        self.process = subprocess.Popen(
            self._command(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={},
            cwd=self.tmpdir,
            start_new_session=True,
            close_fds=True,
        )
        init = {
            "context": self.context,
            "limits": {
                "cpu_s": self.limits.cpu_s,
                "memory_bytes": self.limits.memory_bytes,
                "open_files": self.limits.open_files,
                "file_bytes": self.limits.file_bytes,
                "output_cap": self.limits.output_cap,
                "audit": self.limits.audit,
                "landlock": self.isolation == "full",
            },
        }
        try:
            protocol.write_frame(self.process.stdin.fileno(), init)
            ready = self._read(time.monotonic() + 15)
        except (OSError, EOFError, ValueError, TimeoutError) as error:
            self.close()
            raise SandboxError(f"the sandbox worker did not start ({error})") from None
        self.landlock_abi = int(ready.get("landlock_abi", 0))

    def _read(self, deadline: float) -> dict:
        """One frame from the worker before `deadline`, with the size cap; raises on timeout / EOF / junk."""
        fd = self.process.stdout.fileno()
        header = self._read_exact(fd, protocol.HEADER.size, deadline)
        (size,) = protocol.HEADER.unpack(header)
        if size > MAX_FRAME:
            raise ValueError(f"the worker sent a frame of {size} bytes (cap {MAX_FRAME})")
        payload = protocol.json.loads(self._read_exact(fd, size, deadline).decode("utf-8"))
        if not isinstance(payload, dict):
            raise ValueError("the worker sent a malformed frame")
        return payload

    @staticmethod
    def _read_exact(fd: int, n: int, deadline: float) -> bytes:
        chunks, left = [], n
        while left:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise TimeoutError("timed out")
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                raise EOFError("the worker exited")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def execute(self, code: str) -> Generator[SubQuery, str, ExecResult]:
        """Run one REPL cell; yields SubQuery for each llm_query (send the answer back); returns the result."""
        if self.process is None or self.process.poll() is not None:
            self.start()
            self.restarts += 1
        started = time.monotonic()
        deadline = started + self.limits.timeout_s
        try:
            protocol.write_frame(self.process.stdin.fileno(), {"op": "exec", "code": code})
            while True:
                message = self._read(deadline)
                if message.get("op") == "result":
                    return self._result(message, time.monotonic() - started)
                if message.get("op") != "llm_query":
                    raise ValueError(f"unexpected frame {str(message.get('op'))[:40]!r}")
                paused = time.monotonic()
                answer = yield SubQuery(str(message.get("prompt", "")), str(message.get("text", "")), _ranges(message))
                deadline += time.monotonic() - paused  # serving the sub-call does not count against the cell
                protocol.write_frame(self.process.stdin.fileno(), {"op": "llm_result", "text": str(answer)})
        except TimeoutError:
            return self._failure(f"timed out after {self.limits.timeout_s:g} s of wall-clock time", started)
        except (EOFError, BrokenPipeError):
            return self._failure(self._exit_reason(), started)
        except (ValueError, UnicodeDecodeError, OSError) as error:
            return self._failure(f"protocol violation: {error}", started)

    def _result(self, message: dict, seconds: float) -> ExecResult:
        output = str(message.get("output", ""))
        truncated = bool(message.get("truncated")) or len(output) > self.limits.output_cap
        error = message.get("error")
        final = message.get("final")
        return ExecResult(
            output[: self.limits.output_cap],
            str(error)[:2000] if error is not None else None,
            truncated,
            _ranges(message, "reads"),
            str(final) if final is not None else None,
            round(seconds, 4),
        )

    def _exit_reason(self) -> str:
        try:
            code = self.process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            return "the worker stopped answering"
        reasons = {
            -signal.SIGXCPU: "CPU time limit exceeded",
            -signal.SIGKILL: "killed",
            -signal.SIGXFSZ: "file too big",
        }
        return f"the REPL process exited with status {code} ({reasons.get(code, 'os._exit or a crash')})"

    def _failure(self, reason: str, started: float) -> ExecResult:
        """Kill the worker (its whole process group) and report why; the next cell gets a fresh worker."""
        self._kill()
        message = f"{reason}; the REPL was restarted and its variables are lost"
        return ExecResult("", message, False, [], None, round(time.monotonic() - started, 4))

    def _kill(self) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            stream.close()
        self.process = None

    def close(self) -> None:
        """Kill the worker and remove its temp dir; the uid goes back to the pool."""
        self._kill()
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None
        if self.uid is not None:
            with _uid_lock:
                _active_uids.discard(self.uid)
            self.uid = None


def _ranges(message: dict, key: str = "ranges") -> list[list[int]]:
    """Validated [start, end] integer pairs from an untrusted frame (at most 200)."""
    items = message.get(key)
    if not isinstance(items, list):
        return []
    pairs = [p for p in items[:200] if isinstance(p, list) and len(p) == 2 and all(type(v) is int for v in p)]
    return [[int(a), int(b)] for a, b in pairs]
