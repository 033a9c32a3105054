"""The parent side of the RLM sandbox: one isolated worker per run, driven over a pipe it treats as hostile.

Model-written code never runs in the server's process. At the "full" level `Sandbox` starts
`lab/methods/rlm/worker.py` (stdlib only, preceded by `lab/methods/rlm/confine.py`) as
`unshare --net --mount --pid --ipc --fork --kill-child -- sh -c <lab.methods.rlm.root.SETUP_SCRIPT>`: a minimal
root (an empty tmpfs with the library folders, the stdlib, the interpreter, setpriv and /dev/null bound
read-only, a proc and the size-capped noexec tmpfs of the run's folder), `pivot_root` into it, the host's root
detached, then `exec setpriv --reuid=U --regid=U --clear-groups --inh-caps=-all --bounding-set=-all
--no-new-privs PYTHON -I -S -B -c <worker>`, with:
- a fresh unprivileged uid U per sandbox (from a private range, so RLIMIT_NPROC and /proc of one run never
  reach another run); a new network namespace (no interface up: loopback is unreachable); a new pid namespace
  (the worker is its init: when it dies every process of the run dies) with its own /proc (no host PID is
  visible); a new IPC namespace (SysV / POSIX IPC objects die with the worker; seccomp denies the calls too);
  a new mount namespace holding the minimal root (no other host path exists there, not even for stat), whose
  tmpfs at the run's folder (nosuid, nodev, noexec) caps its total size (`folder_bytes`) and file count;
- an empty environment, a new session (the whole process group is SIGKILLed on a timeout, a violation or
  close; the server then reaps every member, `lab.methods.rlm.reap`), PYTHON = `sys.executable` when the
  sandbox uid can run it, else the configured DECODING_LAB_RLM_PYTHON or a system python3 (the worker needs
  only the stdlib);
- inside (see `lab.methods.rlm.worker` / `lab.methods.rlm.confine`): a supervisor holding the channel, Landlock and a
  seccomp filter, and a REPL child without the channel's fds, under rlimits, a nested Landlock domain and an audit hook.
Every frame from the worker is hostile: size-capped (`MAX_FRAME`), read and written with deadlines (select on
non-blocking fds), any exception while parsing (RecursionError included) ends the cell with a clean
"protocol violation" error, every field is checked, cleaned and clamped (`lab.methods.rlm.frames`: ranges to
the context's length), and the worker is killed by process group; the next `execute` starts a fresh one.
`execute(code)` is a generator: it yields `SubQuery` for every `llm_query` (answer with `.send(text)`) and
returns an `ExecResult`.

Levels (`probe_isolation`): "full" needs root, unshare / setpriv / mount / sh, an interpreter the sandbox uid
can run, the four namespaces, proc and tmpfs, Landlock and libseccomp (a trial worker checks them; where the
minimal root cannot be set up, a second trial runs without it and the level's text says "NO minimal root");
otherwise the level is "unisolated": a separate process with rlimits only, which is not a sandbox. Free-form
code mode is refused below "full" (`code_mode_refusal` names what is missing); constrained action mode runs project-made
code only and works at either level. Not covered: cgroups. Memory is bounded by RLIMIT_AS per process, the
tmpfs size and the denial of SysV shared memory and memfds (the two ways to hold memory outside RLIMIT_AS that
the issue-31 red team used); `LEVEL_TEXT` says so to the user.
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path

from lab.methods.rlm import confine, frames, reap, root
from lab.methods.rlm import worker as protocol

PYTHON_ENV = "DECODING_LAB_RLM_PYTHON"
SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")
UID_RANGE = (200_000, 260_000)  # private uids, no passwd entry, never used by a login
MAX_FRAME = 1 << 20  # bytes of one worker -> parent frame
TRUNCATED = protocol.TRUNCATED
LEVEL_TEXT = {
    "full": "sandbox: private uid, network / mount / pid / IPC namespaces, minimal root, private /proc, "
    "size-capped noexec tmpfs, "
    "Landlock, seccomp, rlimits; memory capped per process (RLIMIT_AS), no cgroup",
    "unisolated": "NOT a sandbox: a separate process with resource limits only (action mode runs project code only)",
}
_active_uids: set[int] = set()
_uid_lock = threading.Lock()


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one worker (applied as hard limits inside it)."""

    timeout_s: float = 10.0  # wall clock per REPL cell, not counting time spent serving llm_query
    cpu_s: int = 30  # RLIMIT_CPU per process for the worker's whole life
    memory_bytes: int = 768 << 20  # RLIMIT_AS per process
    open_files: int = 64  # RLIMIT_NOFILE
    file_bytes: int = 8 << 20  # RLIMIT_FSIZE (one file)
    folder_bytes: int = 32 << 20  # the tmpfs size: everything the run writes, together
    folder_files: int = 512  # the tmpfs inode count
    output_cap: int = 16_000  # characters of REPL output kept per cell
    audit: bool = True  # the Python audit hook (tests switch it off to exercise the OS layers alone)


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


class ProtocolViolation(Exception):
    """The worker sent something the protocol does not allow (or stopped reading)."""


@dataclass(frozen=True)
class Isolation:
    level: str  # full | unisolated
    missing: tuple[str, ...] = ()  # what the full level lacks here (empty when full)
    minimal_root: bool = True  # the worker sees only its pivot_root'ed minimal root (else the host's tree by name)

    @property
    def reason(self) -> str:
        return "; ".join(self.missing)

    @property
    def trace_level(self) -> str:
        """What a trace records (`RlmContext.isolation`): full | full-no-root | unisolated."""
        return "full-no-root" if self.level == "full" and not self.minimal_root else self.level

    @property
    def description(self) -> str:
        text = LEVEL_TEXT[self.level]
        if self.level == "full" and not self.minimal_root:
            text = text.replace("minimal root", "NO minimal root (host paths visible by name)")
        return text + (f" (missing: {self.reason})" if self.missing else "")


def _runnable_by_others(path: str) -> bool:
    """Whether a uid that is neither owner nor group can execute `path` (o+x on the file and every directory)."""
    real = Path(os.path.realpath(path))
    try:
        if not real.is_file() or not real.stat().st_mode & stat.S_IXOTH or not real.stat().st_mode & stat.S_IROTH:
            return False
        return all(parent.stat().st_mode & stat.S_IXOTH for parent in real.parents)
    except OSError:
        return False


def interpreter(full: bool) -> str | None:
    """The Python the worker runs: DECODING_LAB_RLM_PYTHON, else sys.executable when the sandbox uid can run it
    (always at the unisolated level: same uid), else a system python3; None when there is none."""
    configured = os.environ.get(PYTHON_ENV)
    if configured:
        return configured if os.path.isfile(configured) else None
    candidates = [sys.executable, getattr(sys, "_base_executable", ""), *SYSTEM_PYTHONS]
    for path in filter(None, candidates):
        if os.path.isfile(path) and (not full or _runnable_by_others(path)):
            return os.path.realpath(path) if full else path
    return None


def _tools() -> dict[str, str | None]:
    return {name: shutil.which(name) for name in ("unshare", "setpriv", "mount", "sh")}


def _static_missing() -> list[str]:
    missing = [f"the {name} command" for name, path in _tools().items() if path is None]
    if os.geteuid() != 0:
        missing.append("root (to switch the worker to a private uid and create its namespaces)")
    if interpreter(full=True) is None:
        missing.append(f"a Python the sandbox uid can run (set {PYTHON_ENV})")
    if confine.load_libseccomp() is None:
        missing.append("libseccomp (the Debian package libseccomp2)")
    return missing


def _trial(minimal_root: bool) -> tuple[list[str], bool]:
    """Start a trial worker: (what the full level lacks, whether the minimal root was in place)."""
    try:
        with Sandbox("", SandboxLimits(timeout_s=10), isolation="full", minimal_root=minimal_root) as trial:
            missing = [] if trial.landlock_abi > 0 else ["Landlock in the kernel (file access could not be confined)"]
            return missing + ([] if trial.seccomp_rules > 0 else ["a loaded seccomp filter"]), trial.rooted
    except SandboxError as error:
        return [f"a working isolated worker ({error})"], False


@functools.cache
def probe_isolation() -> Isolation:
    """Which isolation this machine supports; checked once per process by starting a trial worker (with the
    minimal root, and without it when that one fails: the level then says the host's paths are visible)."""
    missing = _static_missing()
    if missing:
        return Isolation("unisolated", tuple(missing))
    missing, rooted = _trial(minimal_root=True)
    if not missing and rooted:
        return Isolation("full")
    why = "; ".join(missing) or "umount, pivot_root, the interpreter's stdlib or setpriv"
    missing, _ = _trial(minimal_root=False)
    return Isolation("unisolated" if missing else "full", (*missing, f"a minimal root ({why})"), minimal_root=False)


def code_mode_refusal() -> str | None:
    """Why free-form code mode is refused here, or None when it may run (only at the full level)."""
    isolation = probe_isolation()
    if isolation.level == "full":
        return None
    return (
        f"Code mode is refused: model-written code runs only in the full sandbox, and here it is missing "
        f"{isolation.reason}. Use the constrained action mode (it runs project-generated code only)."
    )


def _claim_uid() -> int:
    with _uid_lock:
        for _ in range(1000):
            uid = int.from_bytes(os.urandom(4), "big") % (UID_RANGE[1] - UID_RANGE[0]) + UID_RANGE[0]
            if uid not in _active_uids:
                _active_uids.add(uid)
                return uid
    raise SandboxError("no free sandbox uid")


def worker_program() -> str:
    """The -c program: `lab.methods.rlm.confine` registered as the module rlm_confine, then `lab.methods.rlm.worker`."""
    confine_source = Path(confine.__file__).read_text(encoding="utf-8")
    return (
        "import sys, types\nrlm_confine = types.ModuleType('rlm_confine')\n"
        f"exec(compile({confine_source!r}, 'rlm_confine.py', 'exec'), rlm_confine.__dict__)\n"
        "sys.modules['rlm_confine'] = rlm_confine\n" + Path(protocol.__file__).read_text(encoding="utf-8")
    )


class Sandbox:
    """One worker holding `context`; see the module docstring. Use as a context manager."""

    def __init__(
        self, context: str, limits: SandboxLimits = SandboxLimits(), isolation: str | None = None,
        minimal_root: bool | None = None,
    ) -> None:  # fmt: skip
        self.context, self.limits = context, limits
        self.isolation = isolation or probe_isolation().level
        self.minimal_root = probe_isolation().minimal_root if minimal_root is None else minimal_root
        self.rooted = False  # whether the last worker started in the minimal root
        self.process: subprocess.Popen | None = None
        self.tmpdir: str | None = None
        self.uid: int | None = None
        self.landlock_abi = self.seccomp_rules = 0
        self.restarts = 0

    def __enter__(self) -> Sandbox:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _command(self, python: str) -> list[str]:
        worker = [python, "-I", "-S", "-B", "-c", worker_program()]
        if self.isolation != "full":
            return worker
        tools = _tools()
        namespaces = [tools["unshare"], "--net", "--mount", "--pid", "--ipc", "--fork", "--kill-child"]
        namespaces += ["--propagation", "private", "--"]
        folder = [str(self.limits.folder_bytes), str(self.limits.folder_files), str(self.uid), self.tmpdir]
        root_tools = root.root_tools()
        entries = root.root_entries(python, tools["setpriv"]) if self.minimal_root else None
        self.rooted = bool(root_tools and entries)
        script = root.SETUP_SCRIPT if self.rooted else root.PLAIN_SETUP_SCRIPT
        mount = [os.path.realpath(tools["mount"]), *(root_tools or ["-", "-"])]
        setup = [tools["sh"], "-c", script, "sh", *mount, *folder, *(entries or []), "--"]
        ids = [f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups"]
        caps = ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
        return namespaces + setup + [os.path.realpath(tools["setpriv"]), *ids, *caps] + worker

    def start(self) -> None:
        """Start a fresh worker (own uid, folder, namespaces), send it the context, wait for `ready`."""
        self.close()
        try:
            self._spawn()
        except (OSError, EOFError, ValueError, TimeoutError, ProtocolViolation) as error:
            self.close()
            raise SandboxError(f"the sandbox worker did not start ({type(error).__name__}: {error})") from None
        except BaseException:
            self.close()
            raise

    def _spawn(self) -> None:
        full = self.isolation == "full"
        python = interpreter(full)
        if python is None:
            raise SandboxError(f"no Python interpreter the sandbox can run; set {PYTHON_ENV}")
        self.tmpdir = tempfile.mkdtemp(prefix="rlm-sandbox-")
        os.chmod(self.tmpdir, 0o700)
        if full:
            self.uid = _claim_uid()
        self.process = subprocess.Popen(
            self._command(python), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env={}, cwd=self.tmpdir, start_new_session=True, close_fds=True,
        )  # fmt: skip
        os.set_blocking(self.process.stdin.fileno(), False)
        keys = ("cpu_s", "memory_bytes", "open_files", "file_bytes", "output_cap", "audit")
        limits = {key: getattr(self.limits, key) for key in keys} | {"landlock": full, "seccomp": full}
        deadline = time.monotonic() + 15
        self._write({"context": self.context, "limits": limits}, deadline)
        ready = self._read(deadline)
        if ready.get("op") != "ready":
            raise ProtocolViolation(frames.clean_text(ready.get("error", "no ready frame"))[:200])
        self.landlock_abi = frames.count(ready.get("landlock_abi"), 1 << 16)
        self.seccomp_rules = frames.count(ready.get("seccomp_rules"), 1 << 16)

    def _write(self, payload: dict, deadline: float) -> None:
        """One frame to the worker before `deadline` (non-blocking fd): a worker that stops reading is a
        protocol violation, never a server blocked in write()."""
        try:
            protocol.write_frame(self.process.stdin.fileno(), payload, deadline)
        except TimeoutError:
            raise ProtocolViolation("the worker stopped reading its input") from None

    def _read(self, deadline: float) -> dict:
        """One frame from the worker before `deadline`, size-capped; anything malformed is a ProtocolViolation."""
        fd = self.process.stdout.fileno()
        (size,) = protocol.HEADER.unpack(self._read_exact(fd, protocol.HEADER.size, deadline))
        if size > MAX_FRAME:
            raise ProtocolViolation(f"the worker sent a frame of {size} bytes (cap {MAX_FRAME})")
        payload = self._read_exact(fd, size, deadline)
        try:
            message = protocol.json.loads(payload.decode("utf-8"))
        except Exception as error:  # noqa: BLE001 - RecursionError, UnicodeDecodeError, ValueError, MemoryError ...
            raise ProtocolViolation(f"the worker sent a malformed frame ({type(error).__name__})") from None
        if not isinstance(message, dict):
            raise ProtocolViolation("the worker sent a frame that is not an object")
        return message

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
        started = time.monotonic()
        if self.process is None or self.process.poll() is not None:
            try:
                self.start()
            except SandboxError as error:
                return ExecResult("", str(error), False, [], None, 0.0)
            self.restarts += 1
        deadline = started + self.limits.timeout_s
        try:
            self._write({"op": "exec", "code": code}, time.monotonic() + 5)
            while True:
                message = self._read(deadline)
                if message.get("op") == "result":
                    return self._result(message, time.monotonic() - started)
                if message.get("op") != "llm_query":
                    raise ProtocolViolation(f"unexpected frame {str(message.get('op'))[:40]!r}")
                paused = time.monotonic()
                answer = yield self._query(message)
                deadline += time.monotonic() - paused  # serving the sub-call does not count against the cell
                self._write({"op": "llm_result", "text": str(answer)}, time.monotonic() + 5)
        except TimeoutError:
            return self._failure(f"timed out after {self.limits.timeout_s:g} s of wall-clock time", started)
        except (EOFError, BrokenPipeError):
            return self._failure(self._exit_reason(), started)
        except (ProtocolViolation, OSError) as error:
            return self._failure(f"protocol violation: {error}", started)

    def _query(self, message: dict) -> SubQuery:
        """An `llm_query` frame as a SubQuery: text fields cleaned, ranges clamped to the context."""
        prompt, text = frames.clean_text(message.get("prompt")), frames.clean_text(message.get("text"))
        return SubQuery(prompt, text, frames.ranges(message.get("ranges"), len(self.context)))

    def _result(self, message: dict, seconds: float) -> ExecResult:
        """A `result` frame as an ExecResult: every field type-checked, cleaned, capped or clamped."""
        output = message.get("output")
        output = output if isinstance(output, str) else frames.clean_text(output)
        truncated = message.get("truncated") is True or len(output) > self.limits.output_cap
        error, final = message.get("error"), message.get("final")
        result = ExecResult(
            frames.clean_text(output[: self.limits.output_cap]),
            frames.clean_text(error)[:2000] if error is not None else None, truncated,
            frames.ranges(message.get("reads"), len(self.context)),
            frames.clean_text(final)[: frames.FINAL_CAP] if final is not None else None, round(seconds, 4),
        )  # fmt: skip
        if message.get("restart") is True:  # the worker ended the REPL (its child exited or misbehaved)
            self._kill()
            result.error = f"{result.error}; the REPL was restarted and its variables are lost"
        return result

    def _exit_reason(self) -> str:
        try:
            code = self.process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            return "the worker stopped answering"
        return f"the worker exited with status {code}"

    def _failure(self, reason: str, started: float) -> ExecResult:
        """Kill the worker (its whole process group) and report why; the next cell gets a fresh worker."""
        self._kill()
        message = f"{reason}; the REPL was restarted and its variables are lost"
        return ExecResult("", message, False, [], None, round(time.monotonic() - started, 4))

    def _kill(self) -> None:
        """SIGKILL the worker's process group, wait for the launcher and reap the members that were reparented
        to this process (`lab.methods.rlm.reap`): no zombie is left even where the server is PID 1."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)
        reap.reap_group(self.process.pid)
        for stream in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError):
                stream.close()
        self.process = None

    def close(self) -> None:
        """Kill the worker and remove its folder; the uid goes back to the pool. Safe to call at any point."""
        self._kill()
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None
        if self.uid is not None:
            with _uid_lock:
                _active_uids.discard(self.uid)
            self.uid = None
