"""The RLM sandbox keeps the host whole (issue 31): each hostile program here succeeded against the sandbox at
main 817fec4 (SysV IPC objects left on the host, forged ranges of 4300 digits, zombies, the host's /proc,
inotify, memfd + execve, the audit hook taken apart through gc). After each one the same Sandbox serves a normal
cell, and the host is as it was: no new IPC objects, no zombie children. docs/rlm.md maps each to its test."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab.methods.rlm import frames, root
from lab.methods.rlm import sandbox as sandbox_module
from lab.methods.rlm.sandbox import ExecResult, Sandbox, SubQuery
from lab.trace import ReplCall, RlmContext, Trace, to_json
from tests.test_sandbox_attacks import (
    FAST,
    FULL,
    HOSTILE_WORKER,
    LIBC,
    NO_HOOK,
    assert_next_cell_works,
    needs_full,
    run_cell,
)
from visualizers.rlm import ISOLATION_TEXT, call_tree_figure, coverage_figure

ROOT = Path(__file__).resolve().parents[1]
IPC_KINDS = ("shm", "msg", "sem")
IPC_CREAT, IPC_RMID, SHM_BYTES = 0o1000, 0, 64 << 20


def ipc_objects() -> dict[str, set[str]]:
    """The host's SysV IPC objects (the id column of /proc/sysvipc/*)."""
    listing = {}
    for kind in IPC_KINDS:
        rows = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]
        listing[kind] = {row.split()[1] for row in rows}
    return listing


def zombie_children() -> list[int]:
    """Children of this process that died and were never reaped."""
    zombies = []
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except (OSError, ValueError):
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if state == "Z" and int(ppid) == os.getpid():
            zombies.append(int(entry))
    return zombies


@pytest.fixture
def host():
    """Snapshot the host's IPC objects; afterwards assert nothing new is left (and remove it if it is)."""
    before = ipc_objects()
    yield before
    after = ipc_objects()
    libc = ctypes.CDLL(None, use_errno=True)
    leaked = {kind: after[kind] - before[kind] for kind in IPC_KINDS}
    for kind, ctl in (("shm", libc.shmctl), ("msg", libc.msgctl), ("sem", libc.semctl)):
        for ident in leaked[kind]:
            ctl(int(ident), IPC_RMID, None) if kind != "sem" else ctl(int(ident), 0, IPC_RMID)
    assert leaked == {kind: set() for kind in IPC_KINDS}, f"IPC objects left on the host: {leaked}"
    assert zombie_children() == []


@pytest.fixture
def host_queue():
    """A root-owned, mode 0666 SysV message queue on the host; yields its key."""
    libc = ctypes.CDLL(None, use_errno=True)
    key = int.from_bytes(os.urandom(3), "big") + 1
    ident = libc.msgget(key, IPC_CREAT | 0o666)
    assert ident >= 0, os.strerror(ctypes.get_errno())
    yield key
    libc.msgctl(ident, IPC_RMID, None)


IPC_CALLS = {  # SysV / POSIX IPC from the REPL -> the call (seccomp: EPERM)
    "shmget 64 MiB": f"libc.shmget(0, {SHM_BYTES}, {IPC_CREAT | 0o666})",
    "shmat": "libc.shmat(0, None, 0)",
    "shmctl": "libc.shmctl(0, 2, ctypes.create_string_buffer(256))",  # IPC_STAT
    "msgget the host's queue": "libc.msgget(KEY, 0)",
    "msgsnd": "libc.msgsnd(0, ctypes.create_string_buffer(16), 8, 0o4000)",
    "msgrcv": "libc.msgrcv(0, ctypes.create_string_buffer(16), 8, 0, 0o4000)",
    "semget": f"libc.semget(0, 1, {IPC_CREAT | 0o666})",
    "semop": "libc.semop(0, ctypes.create_string_buffer(8), 1)",
    "mq_open": "libc.syscall(240, b'/rlm', 0o102, 0o600, None)",  # O_CREAT | O_RDWR
}


@needs_full
@pytest.mark.parametrize("name", list(IPC_CALLS))
def test_sysv_and_posix_ipc_is_denied(name: str, host, host_queue) -> None:
    """At 817fec4 one cell kept 4 x 256 MiB of SysV shared memory on the host after close and read a host queue."""
    with Sandbox("x", NO_HOOK) as box:
        result = run_cell(box, LIBC + f"KEY = {host_queue}\nprint({IPC_CALLS[name]}, ctypes.get_errno())")
        assert result.error is None and result.output.split() == ["-1", "1"], result.transcript
        assert_next_cell_works(box)


@needs_full
def test_the_worker_has_its_own_ipc_namespace(host) -> None:
    """The second layer: were a SysV call allowed, its objects would live and die in the worker's namespace."""
    with Sandbox("x", NO_HOOK) as box:
        result = run_cell(box, "import os\nprint(os.readlink('/proc/self/ns/ipc'))")
        assert result.error is None and result.output.startswith("ipc:["), result.transcript
        assert result.output.strip() != os.readlink("/proc/self/ns/ipc")
        assert_next_cell_works(box)


FORGE = (  # the cell forges an llm_query through its own channel and writes its own read ranges
    "BIG = 10 ** 4300 - 1\n"
    "channel = [c.cell_contents for c in llm_query.__closure__ if getattr(c.cell_contents, '__name__', '') "
    "== 'channel'][0]\n"
    "channel({'op': 'llm_query', 'prompt': 'p', 'text': 't' * 40, "
    "'ranges': [[BIG, BIG], [-BIG, 5], [7, 3], [1, 2, 3], 'x', [True, 2]] * 60})\n"
    "type(context).reads.extend([[BIG, -BIG], [5, 2 ** 70], [-3, 4]] * 300)\n"
    "print('forged')\n"
)


def in_context(ranges: list[list[int]], length: int) -> bool:
    return len(ranges) <= 200 and all(type(a) is int and type(b) is int and 0 <= a <= b <= length for a, b in ranges)


def test_forged_ranges_and_reads_are_clamped_to_the_context(host) -> None:
    """At 817fec4 a 4300-digit range became 4301-digit integers in RlmRun's sub-call split, and to_json(trace),
    the event serializer and call_tree_figure raised ValueError. Now every integer is clamped to the context."""
    context = "abcdefghij" * 10
    with Sandbox(context, FAST) as box:
        cell = box.execute(FORGE)
        query = next(cell)
        assert isinstance(query, SubQuery) and in_context(query.ranges, len(context)), query.ranges[:3]
        assert query.ranges[:3] == [[100, 100], [0, 5], [3, 7]]  # reversed pairs are ordered; junk is dropped
        try:
            cell.send("answer")
        except StopIteration as stop:
            result: ExecResult = stop.value
        assert result.output == "forged\n" and in_context(result.reads, len(context)), result.reads[:3]
        assert_next_cell_works(box)
    split = query.ranges[0][0] + 3 * 10_000  # what RlmRun._sub_call adds to the first offset
    calls = [ReplCall(1, 1, 0, 1, "sub", "p", "", query.ranges + [[split, split + 1]], "a", "", 1, 1, 0.1)]
    calls.append(ReplCall(0, 0, -1, 0, "root", "code", "", result.reads, "forged", "", 1, 1, 0.1))
    events = [RlmContext(0, "q", "pasted", "", len(context), 30, context[:20], "code", "full"), *calls]
    trace = Trace(strategy="rlm", model="m", prompt="q", params={}, events=events)
    assert json.loads(to_json(trace))["events"][1]["ranges"][0] == [100, 100]
    assert call_tree_figure(events).data and coverage_figure(events).data


ZOMBIES = """
import ctypes, os, sys
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come here, as to a container's PID 1
from lab.methods.rlm.sandbox import Sandbox, SandboxLimits
limits = SandboxLimits(timeout_s=0.5, cpu_s=10, memory_bytes=512 << 20, output_cap=4000)
starts = 0
for _ in range(4):
    with Sandbox("x", limits, isolation=sys.argv[1]) as box:
        for code in ("import os\\nos._exit(3)", "while True:\\n    pass", "print(1)"):
            cell = box.execute(code)
            try:
                next(cell)
            except StopIteration:
                pass
        starts += 1 + box.restarts
zombies, alive = [], []
for entry in filter(str.isdigit, os.listdir("/proc")):
    try:
        state, ppid = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[:2]
    except OSError:
        continue
    if int(ppid) == os.getpid():
        (zombies if state == "Z" else alive).append(entry)
print(starts, len(zombies), len(alive))
"""


@pytest.mark.parametrize("level", ["full", "unisolated"])
def test_workers_started_and_killed_leave_no_zombies(level: str, host) -> None:
    """At 817fec4 killing the worker's process group left the reparented supervisor unreaped where the server is
    a subreaper or a container's PID 1: one zombie per worker start. Twelve starts here (exit, timeout, close)."""
    if level == "full" and not FULL:
        pytest.skip("full isolation unavailable")
    done = subprocess.run(
        [sys.executable, "-c", ZOMBIES, level], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    starts, zombies, alive = map(int, done.stdout.split())
    assert starts == 12 and zombies == 0 and alive == 0, done.stdout


@needs_full
def test_the_hosts_proc_is_not_visible(host) -> None:
    """At 817fec4 the worker saw the host's /proc: every host PID (110 of them) and other runs' uids."""
    code = "import os\nprint(os.path.exists('/proc/%d'), sum(os.path.exists(f'/proc/{p}') for p in range(1, 32768)))"
    code %= os.getpid()
    with Sandbox("x", NO_HOOK) as box:
        result = run_cell(box, code)
        assert result.error is None, result.transcript
        visible_self, visible = result.output.split()
        assert visible_self == "False" and int(visible) <= 2, result.output  # the supervisor and the REPL child
        assert_next_cell_works(box)


OS_CALLS = {  # -> the call and the errno expected now (1 = EPERM from seccomp)
    "inotify_init1": ("libc.inotify_init1(0)", 1),
    "inotify_init": ("libc.syscall(253)", 1),
    "fanotify_init": ("libc.syscall(300, 0, 0)", 1),
    "memfd_create": ("libc.memfd_create(b'x', 0)", 1),
    "execve": ("libc.execve(b'/bin/sh', (ctypes.c_char_p * 2)(b'sh', None), (ctypes.c_char_p * 1)(None))", 1),
    "execveat": ("libc.syscall(322, -100, b'/bin/sh', (ctypes.c_char_p * 2)(b'sh', None), None, 0)", 1),
}


@needs_full
@pytest.mark.parametrize("name", list(OS_CALLS))
def test_inotify_memfd_and_execve_are_denied(name: str, host) -> None:
    """At 817fec4 inotify watched host folders, and memfd_create + execve ran a native binary (Landlock gave
    EACCES for files on disk, not for a memfd)."""
    call, errno = OS_CALLS[name]
    with Sandbox("x", NO_HOOK) as box:
        result = run_cell(box, LIBC + f"print({call}, ctypes.get_errno())")
        assert result.error is None and result.output.split() == ["-1", str(errno)], result.transcript
        assert_next_cell_works(box)


@needs_full
def test_the_working_folder_is_noexec_nosuid_nodev(host) -> None:
    with Sandbox("x", NO_HOOK) as box:
        result = run_cell(box, "import os\nprint(os.statvfs('.').f_flag & (os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC))")
        assert result.error is None and int(result.output) == os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC
        assert_next_cell_works(box)


GC_UNHOOK = (  # take the hook apart through gc: its globals and its closure, wherever they are bound
    "import gc\n"
    "for f in [o for o in gc.get_objects() if type(o).__name__ == 'function' and o.__name__ == 'hook']:\n"
    "    for name in ('BLOCKED_MODULES', 'BLOCKED_EVENTS', 'PATH_EVENTS'):\n"
    "        f.__globals__[name] = ('\\0never',)\n"
    "    for cell in f.__closure__ or ():\n"
    "        if isinstance(cell.cell_contents, tuple):\n"
    "            cell.cell_contents = ('\\0never',)\n"
    "        elif callable(cell.cell_contents):\n"
    "            cell.cell_contents = lambda *args: True\n"
)
UNHOOK_GLOBALS = (
    "import sys, os\n"
    "for _module in (sys.modules.get('__main__'), sys.modules.get('rlm_confine')):\n"
    "    for _name in ('BLOCKED_MODULES', 'BLOCKED_EVENTS', 'PATH_EVENTS'):\n"
    "        if _module is not None and hasattr(_module, _name):\n"
    "            setattr(_module, _name, ('\\0never',))\n"
    "os.path.realpath = lambda path: os.getcwd()\n"
    "print(open('/etc/hostname').read())\n"
)


@pytest.mark.parametrize("route", ["gc", "globals"])
def test_the_audit_hook_is_not_taken_apart_by_the_known_routes(route: str, host) -> None:
    """At 817fec4 both routes removed the hook wholly (ctypes then imported). The hook is still no boundary
    (docs/rlm.md says why); these routes now end in its own clear error."""
    code = GC_UNHOOK if route == "gc" else UNHOOK_GLOBALS
    with Sandbox("x", FAST) as box:
        result = run_cell(box, code + "import ctypes\nprint('hook gone')")
        assert result.error is not None and result.error.startswith("PermissionError: sandbox:"), result.transcript
        assert "hook gone" not in result.output
        assert run_cell(box, "import ctypes").error == "PermissionError: sandbox: importing ctypes is not allowed"
        assert_next_cell_works(box)


def test_a_forged_sub_call_range_leaves_the_trace_exportable(tiny, monkeypatch: pytest.MonkeyPatch, host) -> None:
    """The issue's run end to end: a code-mode cell forges an llm_query whose text is long enough to be split
    (RlmRun._sub_call adds offsets to its first range) with a 4300-digit range. At 817fec4 to_json(trace) and
    call_tree_figure raised ValueError (4301-digit integers); now the trace exports and the figures draw."""
    from lab.app.runner import make_generator
    from lab.methods.rlm import lm, loop
    from lab.params import build_params
    from strategies import get_strategy

    forge = FORGE.replace("'t' * 40", "'word ' * 3000")  # about 3000 tokens: split into parts of 128
    script = iter([f"```repl\n{forge}```", "FINAL(1)"])

    def scripted(loaded, ids, max_new_tokens, stop=None):
        if "REPL environment" in loaded.decode(ids):  # a root turn
            return lm.Generation(next(script), len(ids), 10, 1)
        return lm.Generation("sub", len(ids), 1, 1)

    monkeypatch.setattr(loop.lm, "generate", scripted)
    monkeypatch.setattr(loop.lm, "window", lambda loaded: 8192)
    monkeypatch.setattr("strategies.rlm.code_mode_refusal", lambda: None)
    rlm = get_strategy("rlm")
    context = "abc " * 500
    params = build_params(rlm.Params, {"mode": "code", "task": "pasted", "context_text": context, "sub_window": 128})
    events = list(rlm.run(tiny, tiny.encode("What is it?", chat=False), params, make_generator(0, tiny.device)))
    subs = [e for e in events if isinstance(e, ReplCall) and e.role == "sub"]
    assert len(subs) > 1 and any(e.action.startswith("combined") for e in subs)  # the split ran
    trace = Trace(strategy="rlm", model="tiny", prompt="What is it?", params={}, events=events)
    assert json.loads(to_json(trace))["events"] and call_tree_figure(events).data and coverage_figure(events).data
    assert all(in_context(e.ranges, len(context)) for e in events if isinstance(e, ReplCall))


def test_frame_fields_are_cleaned_and_clamped() -> None:
    big = 10**4300 - 1
    assert frames.ranges([[5, 2], [True, 1], [-big, big], "x", [1.0, 2], [3, 4, 5], [big, 7]], 10) == [
        [2, 5],
        [0, 10],
        [7, 10],
    ]
    assert frames.ranges([[0, 1]] * 500, 10) == [[0, 1]] * frames.MAX_RANGES and frames.ranges({"a": 1}, 10) == []
    assert frames.clean_text("a\ud800b") == "a?b" and frames.clean_text(None) == "" and frames.clean_text(7) == "7"
    assert frames.count(True, 5) == 0 and frames.count(big, 7) == 7 and frames.count(-1, 7) == 0


def test_a_lone_surrogate_from_a_hostile_worker_cannot_break_the_trace(monkeypatch: pytest.MonkeyPatch, host) -> None:
    """JSON's \\ud800 escape decodes to a lone surrogate, which UTF-8 cannot encode: at 817fec4 it reached the
    ExecResult as is, and writing a trace that held it raised UnicodeEncodeError."""
    frame = r'{"op": "result", "output": "o\ud800", "error": "e\udfff", "final": "\ud800"}'
    reply = f"send({frame.encode()!r})"
    program = HOSTILE_WORKER.replace("    recv()\n", f"    recv()\n    {reply}\n")
    monkeypatch.setattr(sandbox_module, "worker_program", lambda: program)
    with Sandbox("x", FAST, isolation="unisolated") as box:
        result = run_cell(box, "print(1)")
        monkeypatch.undo()
        box.close()  # the hostile worker never ends; the next cell starts the real one
        assert_next_cell_works(box)
    assert (result.output, result.error, result.final) == ("o?", "e?", "?")
    call = ReplCall(0, 0, -1, 0, "root", "code", "", result.reads, result.output, result.error, 1, 1, 0.1, result.final)
    to_json(Trace(strategy="rlm", model="m", prompt="q", params={}, events=[call])).encode("utf-8")


HOST_PATHS = ("/etc/shadow", "/etc/passwd", "/root", "/work", str(ROOT), "/home", "/var")
BY_NAME = (  # stat / access / readlink / exists on host paths: Landlock does not check them, the minimal root does
    "import os\nfound = []\n"
    "for path in PATHS:\n"
    "    for name, call in (('stat', os.stat), ('lstat', os.lstat), ('readlink', os.readlink)):\n"
    "        try:\n            call(path)\n            found.append((path, name))\n"
    "        except FileNotFoundError:\n            pass\n"
    "        except OSError as exc:\n            found.append((path, name, exc.errno))\n"
    "    if os.access(path, os.F_OK) or os.path.exists(path) or os.path.lexists(path):\n"
    "        found.append((path, 'access'))\n"
    "print(found)"
)


@needs_full
def test_host_paths_do_not_exist_for_the_repl(host) -> None:
    """At 817fec4 (and until the minimal root) a cell learnt /etc/shadow's size and date with os.stat, and that
    /root, /work and the repository exist; now the REPL's root holds only the interpreter, its libraries and its
    folder. The host's files are untouched and a normal cell still works."""

    def files() -> dict[str, tuple[int, int, int]]:
        return {
            path: (s.st_ino, s.st_size, s.st_mtime_ns)
            for path in ("/etc/shadow", "/etc/passwd")
            for s in [os.stat(path)]
        }

    before = files()
    assert all(os.path.lexists(path) for path in HOST_PATHS if path not in ("/home", "/var"))  # they exist on the host
    with Sandbox("the context 12345", NO_HOOK) as box:
        result = run_cell(box, f"PATHS = {list(HOST_PATHS)!r}\n" + BY_NAME)
        assert result.error is None and result.output.strip() == "[]", result.transcript
        normal = "import json\nprint(json.dumps({'n': len(context), 'x': sum(range(10))}), context[-5:])"
        result = run_cell(box, normal)
        assert result.error is None and result.output.strip() == '{"n": 17, "x": 45} 12345', result.transcript
        assert_next_cell_works(box)
    assert files() == before and all(map(os.path.lexists, ("/root", "/work", str(ROOT))))


@needs_full
def test_without_the_minimal_root_the_level_says_so(monkeypatch: pytest.MonkeyPatch, host) -> None:
    """Where umount / pivot_root are missing the worker falls back to the host's tree (Landlock-confined), and the
    level shown to the user says the minimal root is missing."""
    monkeypatch.setattr(root, "root_tools", lambda: None)
    with Sandbox("x", NO_HOOK, isolation="full", minimal_root=True) as box:
        assert not box.rooted
        result = run_cell(box, "import os\nprint(os.path.exists('/etc/shadow'))")
        assert result.error is None and result.output.strip() == "True", result.transcript
        assert_next_cell_works(box)
    isolation = sandbox_module.probe_isolation.__wrapped__()
    assert isolation.level == "full" and not isolation.minimal_root, isolation
    assert "NO minimal root" in isolation.description and "a minimal root" in isolation.reason
    assert isolation.trace_level == "full-no-root" and "WITHOUT a minimal root" in ISOLATION_TEXT["full-no-root"]
