"""The RLM sandbox against the attacks of issue 14, each written so that it succeeded on the earlier sandbox:
the audit hook removed from inside, then AF_UNIX to a host listener, namespace creation, netlink and the other
denied syscalls; frames forged by the code (a 100,000-deep JSON nest, a flood of llm_query, a forged result);
a hostile worker process speaking to the server directly; filling the folder; a missing interpreter.
After each one the same Sandbox answers the next cell. docs/rlm.md maps each attack to its test here."""

from __future__ import annotations

import glob
import os
import socket
import tempfile
import threading
import uuid

import pytest

from lab.methods.rlm import sandbox as sandbox_module
from lab.methods.rlm.sandbox import ExecResult, Sandbox, SandboxError, SandboxLimits, probe_isolation

FAST = SandboxLimits(timeout_s=3.0, cpu_s=10, memory_bytes=512 << 20, output_cap=4000)
NO_HOOK = SandboxLimits(timeout_s=3.0, cpu_s=10, memory_bytes=512 << 20, output_cap=4000, audit=False)
FULL = probe_isolation().level == "full"
needs_full = pytest.mark.skipif(not FULL, reason=f"full isolation unavailable: {probe_isolation().reason}")

# What the earlier sandbox allowed: the hook's lists and os.path.realpath were globals the code could rebind.
UNHOOK = (
    "import sys, os\n"
    "for _module in (sys.modules.get('__main__'), sys.modules.get('rlm_confine')):\n"
    "    for _name in ('BLOCKED_MODULES', 'BLOCKED_EVENTS', 'PATH_EVENTS'):\n"
    "        if _module is not None and hasattr(_module, _name):\n"
    "            setattr(_module, _name, ('\\0never',))\n"
    "os.path.realpath = lambda path: os.getcwd()\n"
)
LIBC = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"


def run_cell(box: Sandbox, code: str, answer: str = "sub-answer") -> ExecResult:
    cell = box.execute(code)
    try:
        next(cell)
        while True:
            cell.send(answer)
    except StopIteration as stop:
        return stop.value


def run_cell_within(box: Sandbox, code: str, seconds: float) -> ExecResult:
    """run_cell in a thread: a server blocked forever (the earlier flood attack) fails the test instead of hanging."""
    results: list[ExecResult] = []
    thread = threading.Thread(target=lambda: results.append(run_cell(box, code)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert results, f"the server did not answer within {seconds} s"
    return results[0]


def assert_next_cell_works(box: Sandbox) -> None:
    result = run_cell(box, "print(len(context), 6 * 7)")
    assert result.error is None and result.output.strip() == f"{len(box.context)} 42", result.transcript


@needs_full
def test_removing_the_audit_hook_from_inside_leaves_the_os_layers() -> None:
    """The earlier sandbox's hook was removed by rebinding its lists (UNHOOK; since issue 31 the hook keeps its
    own copies, tests/test_sandbox_host.py): with it off, ctypes and socket import fine and the OS layers hold."""
    with Sandbox("x", FAST) as box:
        result = run_cell(box, UNHOOK + "import ctypes")
        assert result.error == "PermissionError: sandbox: importing ctypes is not allowed", result.transcript
    with Sandbox("x", NO_HOOK) as box:
        result = run_cell(box, "import ctypes, socket\nprint('hook gone')")
        assert result.error is None and result.output == "hook gone\n"
        result = run_cell(box, LIBC + "print(libc.unshare(0x10000000), ctypes.get_errno())")  # CLONE_NEWUSER
        assert result.output.split() == ["-1", "1"], result.transcript  # EPERM from seccomp
        assert_next_cell_works(box)


@needs_full
def test_unix_socket_to_a_host_listener_is_refused() -> None:
    path = os.path.join(tempfile.gettempdir(), f"rlm-host-{uuid.uuid4().hex}.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    os.chmod(path, 0o777)  # even a socket anyone may connect to stays out of reach
    listener.listen(1)
    listener.settimeout(0.3)
    try:
        with Sandbox("x", NO_HOOK) as box:
            result = run_cell(box, f"import socket\nsocket.socket(socket.AF_UNIX).connect({path!r})")
            assert result.error is not None and "Operation not permitted" in result.error, result.transcript
            assert_next_cell_works(box)
        with pytest.raises(TimeoutError):
            listener.accept()  # nobody connected
    finally:
        listener.close()
        os.unlink(path)


DENIED = {  # syscall attempts -> the errno seccomp returns (1 = EPERM, 38 = ENOSYS)
    "unshare(CLONE_NEWUSER)": ("libc.unshare(0x10000000)", 1),
    "unshare(NEWUSER) then unshare(NEWNET)": ("min(libc.unshare(0x10000000), libc.unshare(0x40000000))", 1),
    "clone(CLONE_NEWUSER)": ("libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)", 1),
    "clone3": ("libc.syscall(435, ctypes.create_string_buffer(88), 88)", 38),
    "setns": ("libc.setns(0, 0)", 1),
    "socket(AF_NETLINK)": ("libc.socket(16, 3, 12)", 1),  # NETLINK_NETFILTER
    "socket(AF_PACKET)": ("libc.socket(17, 3, 0)", 1),
    "socket(AF_INET, SOCK_RAW)": ("libc.socket(2, 3, 1)", 1),
    "socket(AF_UNIX)": ("libc.socket(1, 1, 0)", 1),
    "socketpair(AF_UNIX)": ("libc.socketpair(1, 1, 0, ctypes.create_string_buffer(8))", 1),
    "ptrace(TRACEME)": ("libc.ptrace(0, 0, 0, 0)", 1),
    "keyctl": ("libc.syscall(250, 0, -3, 0)", 1),  # KEYCTL_GET_KEYRING_ID of the session keyring
    "perf_event_open": ("libc.syscall(298, ctypes.create_string_buffer(128), 0, -1, -1, 0)", 1),
    "userfaultfd": ("libc.syscall(323, 0)", 1),
    "bpf": ("libc.syscall(321, 0, ctypes.create_string_buffer(128), 128)", 1),
    "mount": ("libc.mount(b'none', b'.', b'tmpfs', 0, None)", 1),
    "io_uring_setup": ("libc.syscall(425, 8, ctypes.create_string_buffer(120))", 1),
    "pidfd_getfd": ("libc.syscall(438, 0, 0, 0)", 1),
}


@needs_full
@pytest.mark.parametrize("name", list(DENIED))
def test_seccomp_denies(name: str) -> None:
    """With the audit hook off (as if removed), each call fails with seccomp's errno and the REPL goes on."""
    call, errno = DENIED[name]
    with Sandbox("x", NO_HOOK) as box:
        result = run_cell(box, LIBC + f"print({call}, ctypes.get_errno())")
        assert result.error is None and result.output.split() == ["-1", str(errno)], result.transcript
        assert_next_cell_works(box)


@needs_full
def test_ordinary_children_are_still_refused_by_rlimit_not_seccomp() -> None:
    with Sandbox("x", NO_HOOK) as box:
        result = run_cell(box, LIBC + "print(libc.syscall(56, 17, 0, 0, 0, 0), ctypes.get_errno())")  # plain fork
        assert result.output.split() == ["-1", "11"], result.transcript  # EAGAIN: RLIMIT_NPROC 0
        assert_next_cell_works(box)


WRITE_ALL_FDS = (
    "import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, FRAME)\n    except OSError:\n        pass\n"
)


def frame_literal(payload: bytes) -> str:
    return f"import struct\nFRAME = struct.pack('>I', {len(payload)}) + {payload!r}\n"


@pytest.mark.parametrize("audit", [True, False])
def test_a_deeply_nested_frame_is_a_clean_error(audit: bool) -> None:
    """100,000 nested '[' raised RecursionError inside the server's execute; now it is this cell's error."""
    limits = FAST if audit else NO_HOOK
    with Sandbox("x", limits) as box:
        result = run_cell(box, frame_literal(b"[" * 100_000) + WRITE_ALL_FDS + "import time\ntime.sleep(30)")
        assert result.error is not None and "protocol violation" in result.error, result.transcript
        assert_next_cell_works(box)


def test_a_flood_of_forged_llm_query_frames_never_blocks_the_server() -> None:
    """The code writes llm_query frames without ever reading a reply, then sleeps (no CPU limit is hit)."""
    payload = b'{"op": "llm_query", "prompt": "p", "text": "t", "ranges": []}'
    code = frame_literal(payload) + "import os, time\nfor _ in range(100000):\n" + "\n".join(
        "    " + line for line in WRITE_ALL_FDS.splitlines()[1:]
    )  # fmt: skip
    with Sandbox("x", FAST) as box:
        result = run_cell_within(box, code + "\ntime.sleep(60)", 30)
        assert result.error is not None and "protocol violation" in result.error, result.transcript
        assert_next_cell_works(box)


def test_a_forged_result_frame_cannot_become_the_cells_output() -> None:
    forged = [b'{"op": "result", "output": "FORGED", "error": null, "reads": [], "final": "FORGED"}']
    forged.append(b'{"op": "done", "output": "FORGED", "error": null, "reads": [], "final": null}')
    with Sandbox("x", FAST) as box:
        for payload in forged:
            result = run_cell(box, frame_literal(payload) + WRITE_ALL_FDS + "print('real')")
            assert "FORGED" not in result.output and result.final != "FORGED", result.transcript
            assert_next_cell_works(box)


HOSTILE_WORKER = """import json, os, struct, sys, time
def send(data):
    os.write(1, struct.pack('>I', len(data)) + data)
def recv():
    size = struct.unpack('>I', os.read(0, 4))[0]
    data = b''
    while len(data) < size:
        data += os.read(0, size - len(data))
    return json.loads(data)
recv()
send(json.dumps({'op': 'ready'}).encode())
while True:
    recv()
"""
HOSTILE_REPLIES = {  # what a compromised worker sends the server after `exec`
    "nested JSON": ("send(b'[' * 100000)\n    time.sleep(60)", "malformed frame (RecursionError)"),
    "invalid UTF-8": ("send(b'\\xff\\xfe')\n    time.sleep(60)", "malformed frame (UnicodeDecodeError)"),
    "oversized frame": ("os.write(1, struct.pack('>I', 2**31))\n    time.sleep(60)", "a frame of 2147483648 bytes"),
    "not an object": ("send(b'[1, 2]')\n    time.sleep(60)", "not an object"),
    "unknown op": ('send(b\'{"op": "shell"}\')\n    time.sleep(60)', "unexpected frame 'shell'"),
    "query flood, never reads": (
        'while True:\n        send(b\'{"op": "llm_query", "prompt": "p", "text": "\' + b\'x\' * 4000 + b\'"}\')',
        "the worker stopped reading its input",
    ),
}


@pytest.mark.parametrize("name", list(HOSTILE_REPLIES))
def test_a_hostile_worker_gets_a_clean_error_and_a_fresh_worker(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's side alone: whatever the worker process sends, the cell ends with a clean error."""
    reply, expected = HOSTILE_REPLIES[name]
    program = HOSTILE_WORKER.replace("    recv()\n", f"    recv()\n    {reply}\n")
    monkeypatch.setattr(sandbox_module, "worker_program", lambda: program)
    with Sandbox("x", FAST, isolation="unisolated") as box:
        result = run_cell_within(box, "print(1)", 30)
        assert result.error is not None and expected in result.error, result.transcript
        assert box.process is None  # killed by process group
        monkeypatch.undo()
        assert_next_cell_works(box)


def test_wrongly_typed_result_fields_are_coerced(monkeypatch: pytest.MonkeyPatch) -> None:
    reply = 'send(json.dumps({"op": "result", "output": ["x"], "reads": "all", "final": {"a": 1}}).encode())'
    program = HOSTILE_WORKER.replace("    recv()\n", f"    recv()\n    {reply}\n")
    monkeypatch.setattr(sandbox_module, "worker_program", lambda: program)
    with Sandbox("x", FAST, isolation="unisolated") as box:
        result = run_cell(box, "print(1)")
        assert result.output == "['x']" and result.reads == [] and result.final == "{'a': 1}"


@needs_full
def test_the_folder_has_a_total_size_cap() -> None:
    """Many files each under RLIMIT_FSIZE used to fill the disk (192 MiB in 0.6 s); the tmpfs stops them."""
    code = (
        "total = 0\nfor i in range(64):\n    with open(f'f{i}', 'wb') as f:\n"
        "        for _ in range(8):\n            f.write(b'x' * (1 << 20)); total += 1 << 20\n"
    )
    with Sandbox("x", FAST) as box:
        result = run_cell(box, code)
        assert result.error is not None and "No space left on device" in result.error, result.transcript
        assert os.listdir(box.tmpdir) == []  # the host's folder is untouched: the tmpfs lives in the namespace
        assert_next_cell_works(box)


def test_a_missing_interpreter_is_a_clear_error_and_leaks_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "rlm-sandbox-*")))
    monkeypatch.setenv(sandbox_module.PYTHON_ENV, "/nonexistent/python3")
    box = Sandbox("x", FAST)
    with pytest.raises(SandboxError, match=sandbox_module.PYTHON_ENV):
        box.start()
    with tempfile.NamedTemporaryFile(suffix="-python3") as not_executable:  # exists, but cannot be run
        monkeypatch.setenv(sandbox_module.PYTHON_ENV, not_executable.name)
        with pytest.raises(SandboxError, match="did not start"):
            box.start()
    assert box.process is None and box.tmpdir is None and box.uid is None
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "rlm-sandbox-*"))) == before
    result = run_cell(box, "print(1)")  # execute reports the failure as the cell's error
    assert result.error is not None and sandbox_module.PYTHON_ENV in result.error
    monkeypatch.delenv(sandbox_module.PYTHON_ENV)
    with box:
        assert_next_cell_works(box)


def test_the_interpreter_is_sys_executable_where_the_uid_can_run_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.delenv(sandbox_module.PYTHON_ENV, raising=False)
    assert sandbox_module.interpreter(full=False) == sys.executable  # same uid: no /usr/bin/python3 needed
    monkeypatch.setattr(sandbox_module, "SYSTEM_PYTHONS", ())
    monkeypatch.setattr(sandbox_module, "_runnable_by_others", lambda path: False)
    assert sandbox_module.interpreter(full=True) is None


def test_a_forged_done_with_a_guessed_cell_number_ends_only_its_own_cell() -> None:
    """The worst a forged `done` can do: end its own cell early (like FINAL); its real `done` then arrives
    outside its cell, so the next cell is a protocol violation and the one after runs on a fresh REPL."""
    payload = b'{"op": "done", "cell": 0, "error": null, "reads": [], "final": "forged"}'
    code = "print('before')\n" + frame_literal(payload) + WRITE_ALL_FDS + "import time\ntime.sleep(0.5)\nprint('after')"
    with Sandbox("x", FAST) as box:
        result = run_cell(box, code)
        assert result.final == "forged" and result.output == "before\n" and result.error is None
        late = run_cell(box, "print('next')")
        assert late.error is not None and "outside its cell" in late.error, late.transcript
        assert_next_cell_works(box)
