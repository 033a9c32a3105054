"""The RLM sandbox against hostile programs: each ends with a clear error in the cell's transcript, nothing
outside the sandbox changes, and the next cell is served normally. Limits are small to keep this fast."""

from __future__ import annotations

import os
import re
import socket
import threading
import uuid
from pathlib import Path

import pytest

from lab.methods.rlm import sandbox as sandbox_module
from lab.methods.rlm.sandbox import (
    LEVEL_TEXT,
    ExecResult,
    Isolation,
    Sandbox,
    SandboxLimits,
    code_mode_refusal,
    probe_isolation,
)

HOST_SECRET = "host-secret-" + uuid.uuid4().hex  # a host global no sandboxed program may reach
FAST = SandboxLimits(timeout_s=2.0, cpu_s=10, memory_bytes=512 << 20, output_cap=4000)
FULL = probe_isolation().level == "full"
needs_full = pytest.mark.skipif(not FULL, reason=f"full isolation unavailable: {probe_isolation().reason}")


def run_cell(box: Sandbox, code: str, answer: str = "sub-answer") -> ExecResult:
    """Run one cell, answering every llm_query with `answer`."""
    cell = box.execute(code)
    try:
        next(cell)
        while True:
            cell.send(answer)
    except StopIteration as stop:
        return stop.value


def assert_next_cell_works(box: Sandbox) -> None:
    result = run_cell(box, "print(len(context), 6 * 7)")
    assert result.error is None and result.output.strip() == f"{len(box.context)} 42"


ESCAPE = f"/tmp/rlm-escape-{uuid.uuid4().hex}"
HOSTILE = {
    "os.system": (f"import os\nos.system('touch {ESCAPE}')", "os.system is not allowed"),
    "subprocess": (f"import subprocess\nsubprocess.run(['touch', '{ESCAPE}'])", "importing subprocess"),
    "ctypes": (f"import ctypes\nctypes.CDLL(None).system(b'touch {ESCAPE}')", "importing ctypes"),
    "subclasses walk to Popen": (
        "seen, todo = set(), [object]\n"
        "while todo:\n"
        "    cls = todo.pop()\n"
        "    for sub in type.__subclasses__(cls):\n"
        "        if sub not in seen:\n"
        "            seen.add(sub); todo.append(sub)\n"
        "popen = [c for c in seen if c.__name__ == 'Popen']\n"
        f"popen[0](['touch', '{ESCAPE}'])",
        "IndexError",
    ),
    "traceback frame walk": (
        "try:\n    1 / 0\nexcept ZeroDivisionError as exc:\n    frame = exc.__traceback__.tb_frame\n"
        "scopes = []\nwhile frame is not None:\n    scopes.append(frame.f_globals); frame = frame.f_back\n"
        "print(len(scopes), 'frames')\n"
        "[g for g in scopes if 'HOST_SECRET' in g][0]['HOST_SECRET']",
        "IndexError",
    ),
    "read /etc/passwd": ("print(open('/etc/passwd').read())", "not allowed"),
    "read the app's files": (f"print(open({str(Path(__file__).resolve())!r}).read())", "not allowed"),
    "write outside the temp dir": (f"open({ESCAPE!r}, 'w').write('pwned')", "not allowed"),
    "while True": ("while True:\n    pass", "timed out after 2 s"),
    "2 GiB allocation": ("block = bytearray(2 * 1024**3)", "MemoryError"),
    "fork bomb": ("import os\nwhile True:\n    os.fork()", "os.fork is not allowed"),
    "SystemExit": ("raise SystemExit(3)", "SystemExit(3) is not allowed"),
    "os._exit": ("import os\nos._exit(3)", "exited with status 3"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_program_is_contained(name: str) -> None:
    code, expected = HOSTILE[name]
    with Sandbox("the context " * 100, FAST) as box:
        result = run_cell(box, code)
        assert result.error is not None and expected in result.error, result.transcript
        assert "[error]" in result.transcript
        assert HOST_SECRET not in result.transcript and "root:x:0:0" not in result.transcript
        assert_next_cell_works(box)
    assert not os.path.exists(ESCAPE)


def test_printing_100_mb_is_truncated() -> None:
    with Sandbox("x", FAST) as box:
        result = run_cell(box, "print('y' * 100_000_000)")
        assert result.truncated and result.transcript.endswith("[truncated]")
        assert len(result.output) <= FAST.output_cap
        assert_next_cell_works(box)


def test_socket_to_the_host_is_refused() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    try:
        with Sandbox("x", FAST) as box:
            result = run_cell(box, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)")
            assert result.error is not None and "socket" in result.error
            assert_next_cell_works(box)
        with pytest.raises(TimeoutError):
            listener.accept()  # nobody connected
    finally:
        listener.close()


def test_environment_is_empty_and_temp_dir_private_and_removed() -> None:
    with Sandbox("x", FAST) as box:
        tmpdir = box.tmpdir
        result = run_cell(
            box, "import os\nprint(dict(os.environ))\nopen('f.txt', 'w').write('mine')\nprint(os.getcwd())"
        )
        assert result.error is None
        environ, cwd = result.output.splitlines()
        assert environ in ("{}", "{'LC_CTYPE': 'C.UTF-8'}")  # empty; Python's locale coercion (PEP 538) may add one
        assert cwd == tmpdir
        assert (os.stat(tmpdir).st_mode & 0o777) == 0o700
    assert not os.path.exists(tmpdir)


@needs_full
@pytest.mark.parametrize(
    "code, expected",
    [
        ("import os\nos.fork()", "Resource temporarily unavailable"),  # RLIMIT_NPROC on the private uid
        ("import os\nos.execv('/bin/sh', ['sh'])", "Operation not permitted"),  # seccomp (and Landlock: no execute)
        ("open('/etc/ld.so.cache').read()", "Permission denied"),  # Landlock: in the minimal root, not readable
        (f"open({ESCAPE!r}, 'w')", "Permission denied|Read-only file system"),  # Landlock; the read-only root
        ("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)", "rror"),  # netns + Landlock
        ("import os\nos.kill(1, 9)", "Operation not permitted"),
        ("import os\nprint(os.listdir('/proc'))", "Permission denied"),
    ],
)
def test_os_layer_holds_without_the_audit_hook(code: str, expected: str) -> None:
    """The audit hook is only the first fence: with it off, the uid, rlimits, Landlock, seccomp and netns hold."""
    with Sandbox("x", SandboxLimits(timeout_s=2.0, audit=False)) as box:
        result = run_cell(box, code)
        assert result.error is not None and re.search(expected, result.error), result.transcript
        assert_next_cell_works(box)
    assert not os.path.exists(ESCAPE)


@needs_full
def test_worker_runs_unprivileged_with_landlock() -> None:
    with Sandbox("x", FAST) as box:
        assert box.uid is not None and box.uid >= sandbox_module.UID_RANGE[0]
        assert box.landlock_abi >= 1
        assert run_cell(box, "import os\nprint(os.getuid(), os.getgid())").output.split() == [str(box.uid)] * 2


def test_concurrent_runs_never_see_each_other() -> None:
    results: dict[str, ExecResult] = {}
    boxes = {name: Sandbox(f"context of {name}", FAST) for name in ("a", "b")}
    code = (
        "import os\nopen('shared.txt', 'w').write(context)\n"
        "print(open('shared.txt').read())\nprint(sorted(os.listdir('.')))\n"
        "try:\n    print(os.listdir(OTHER))\nexcept Exception as exc:\n    print('other:', type(exc).__name__)"
    )

    def work(name: str, other: str) -> None:
        run_cell(boxes[name], f"OTHER = {boxes[other].tmpdir!r}")
        results[name] = run_cell(boxes[name], code)

    try:
        for box in boxes.values():
            box.start()
        threads = [threading.Thread(target=work, args=pair) for pair in (("a", "b"), ("b", "a"))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for box in boxes.values():
            box.close()
    for name in ("a", "b"):
        lines = results[name].output.splitlines()
        assert lines[0] == f"context of {name}" and lines[1] == "['shared.txt']"
        assert lines[2] in ("other: PermissionError", "other: FileNotFoundError")


def test_llm_query_goes_through_the_parent_with_ranges() -> None:
    with Sandbox("alpha beta gamma delta epsilon zeta", FAST) as box:
        cell = box.execute("answer = llm_query('which letter?', context[6:22])\nprint(answer.upper())")
        query = next(cell)
        assert query.prompt == "which letter?" and query.text == "beta gamma delta" and query.ranges == [[6, 22]]
        with pytest.raises(StopIteration) as stop:
            cell.send("b")
        assert stop.value.value.output == "B\n" and [6, 22] in stop.value.value.reads


def test_garbage_frames_are_a_protocol_violation() -> None:
    with Sandbox("x", FAST) as box:
        result = run_cell(box, "import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'\\xff' * 8)\n"
                          "    except OSError:\n        pass\nwhile True:\n    pass")  # fmt: skip
        assert result.error is not None and "protocol violation" in result.error
        assert_next_cell_works(box)


def test_final_and_final_var() -> None:
    with Sandbox("x", FAST) as box:
        assert run_cell(box, "FINAL(41 + 1)").final == "42"
        assert run_cell(box, "answer = 'seven'\nFINAL_VAR('answer')").final == "seven"


def test_code_mode_is_refused_without_full_isolation_and_names_what_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    missing = ("the unshare command", "libseccomp (the Debian package libseccomp2)")
    monkeypatch.setattr(sandbox_module, "probe_isolation", lambda: Isolation("unisolated", missing))
    monkeypatch.setenv("DECODING_LAB_RLM_ALLOW_UNISOLATED", "1")  # the old opt-out no longer exists
    refusal = code_mode_refusal()
    assert refusal is not None and all(m in refusal for m in missing)
    assert "NOT a sandbox" in Isolation("unisolated", missing).description
    assert LEVEL_TEXT["full"].startswith("sandbox:") and LEVEL_TEXT["unisolated"].startswith("NOT a sandbox")


def test_unisolated_level_still_runs_the_audit_layer() -> None:
    with Sandbox("x", FAST, isolation="unisolated") as box:
        assert (
            run_cell(box, "import os\nos.system('true')").error == "PermissionError: sandbox: os.system is not allowed"
        )
        assert_next_cell_works(box)
