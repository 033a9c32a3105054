"""The sandbox worker: a stdlib-only supervisor that holds the channel to the server and a REPL child that holds
the long context and runs the untrusted code.

`lab.methods.rlm.sandbox` starts this file's source (preceded by `lab.methods.rlm.confine`'s, see `program()`) as the
`-c` program of an isolated Python, already in new network / mount / pid / IPC namespaces (with its own /proc),
in a minimal root (`lab.methods.rlm.root`), under a fresh unprivileged uid, with an empty environment and a
size-capped noexec tmpfs as its folder. Two processes:
1. the supervisor moves the channel off fds 0/1 (fds 0-2 become /dev/null), reads the init frame (context,
   limits), puts Landlock and the seccomp filter on itself (`lab.methods.rlm.confine`; inherited by its child), opens
   three pipes and forks the REPL child;
2. the REPL child closes the channel's fds (it never holds them: it cannot write a frame to the server), puts
   its stdout / stderr on the output pipe, applies the resource limits (RLIMIT_NPROC 0: no process or thread),
   a nested Landlock domain (no signals to the supervisor) and the audit hook, then runs cells as they come.
Per cell the supervisor forwards `exec` {code} to the child and then treats every byte from it as hostile:
frames on the child's pipe are size-capped (`CHILD_FRAME`) and parsed by an incremental reader; every frame
must carry the running cell's number, and the only frames accepted are `llm_query` {prompt, text, ranges}
(relayed to the server, whose `llm_result` {text} goes back to the child with a write deadline) and `done`
{error, final, reads}; the output is what the child wrote to its stdout, read by the supervisor and capped at
`output_cap` characters ("[truncated]"). So a forged `done` (the cell numbers are easy to guess) can at most
end its own cell early, and the frames that follow arrive outside their cell: a violation at the next cell. It
cannot invent output, and nothing the child writes reaches the server unparsed.
Anything else (an unknown op, a malformed or oversized frame, more than `MAX_QUERIES` queries in a cell, a
reply the child does not read, the child's exit) kills the child, sends `result` with the error and
`restart: true`, and ends the worker; the server then kills the whole process group (the pid namespace dies
with it) and starts a fresh worker for the next cell.
Server -> worker frames: `exec`, `llm_result`; worker -> server: `ready` {landlock_abi, seccomp_rules, uid},
`llm_query`, `result` {output, truncated, error, reads, final, restart}. Frames are 4-byte big-endian length +
UTF-8 JSON. The module has no side effects on import, so the parent imports its frame functions from here.
"""

import contextlib
import json
import os
import re
import select
import struct
import sys
import time

HEADER = struct.Struct(">I")
TRUNCATED = "\n[truncated]"
CHILD_FRAME = 1 << 20  # bytes of one REPL child -> supervisor frame
SERVER_FRAME = 1 << 26  # bytes of one server -> worker frame (the init frame carries the context)
MAX_QUERIES = 1000  # llm_query frames in one cell before it is a flood
WRITE_DEADLINE_S = 2.0  # a reply the REPL child does not read within this is a protocol violation


def write_frame(fd, payload, deadline=None):
    """Send one frame: 4-byte big-endian length, then UTF-8 JSON; with `deadline` (time.monotonic()) the fd must
    be non-blocking and a peer that stops reading raises TimeoutError."""
    data = json.dumps(payload, ensure_ascii=False).encode("utf-8", "replace")
    view = memoryview(HEADER.pack(len(data)) + data)
    while view:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [fd], [], left)[1]:
                raise TimeoutError("the peer stopped reading")
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            continue


def read_exact(fd, n):
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("pipe closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(fd, cap):
    """Receive one frame from a trusted peer (blocking), refusing frames over `cap` bytes."""
    (size,) = HEADER.unpack(read_exact(fd, HEADER.size))
    if size > cap:
        raise ValueError(f"frame of {size} bytes exceeds the cap of {cap}")
    return json.loads(read_exact(fd, size).decode("utf-8"))


class FrameReader:
    """Incremental parser of frames from an untrusted peer: `feed(bytes)` returns the complete frames so far.
    Raises ValueError on an oversized, undecodable or non-object frame (RecursionError and friends included)."""

    def __init__(self, cap):
        self.cap, self.buffer = cap, b""

    def feed(self, data):
        self.buffer += data
        frames = []
        while len(self.buffer) >= HEADER.size:
            (size,) = HEADER.unpack(self.buffer[: HEADER.size])
            if size > self.cap:
                raise ValueError(f"a frame of {size} bytes (cap {self.cap})")
            if len(self.buffer) < HEADER.size + size:
                break
            payload, self.buffer = self.buffer[HEADER.size : HEADER.size + size], self.buffer[HEADER.size + size :]
            try:
                frame = json.loads(payload.decode("utf-8"))
            except Exception as error:  # noqa: BLE001 - RecursionError, UnicodeDecodeError, ValueError ...
                raise ValueError(f"a malformed frame ({type(error).__name__})") from None
            if not isinstance(frame, dict):
                raise ValueError("a frame that is not an object")
            frames.append(frame)
        return frames


class CappedText:
    """The first `cap` characters of a byte stream (decoded as UTF-8 with replacement), and whether more came."""

    def __init__(self, cap):
        self.cap, self.data, self.size = cap, bytearray(), 0

    def add(self, chunk):
        if len(self.data) < 4 * self.cap:
            self.data += chunk[: 4 * self.cap - len(self.data)]
        self.size += len(chunk)

    def value(self):
        text = self.data.decode("utf-8", "replace")
        return text[: self.cap], len(text) > self.cap or self.size > len(self.data)


class TrackedContext(str):
    """The context string; slices and whole-string scans are recorded as (start, end) read ranges."""

    reads = []

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, _ = key.indices(len(self))
            TrackedContext.reads.append([start, max(start, stop)])
        elif isinstance(key, int):
            TrackedContext.reads.append([key % max(len(self), 1), key % max(len(self), 1) + 1])
        return str.__getitem__(self, key)

    def _scan(name):
        def method(self, *args, **kwargs):
            TrackedContext.reads.append([0, len(self)])
            return getattr(str, name)(self, *args, **kwargs)

        return method

    find, rfind, index, count, split, splitlines, __iter__, __contains__ = map(
        _scan, ("find", "rfind", "index", "count", "split", "splitlines", "__iter__", "__contains__")
    )


def make_namespace(context, channel):
    """The REPL's globals: `context`, `llm_query`, FINAL / FINAL_VAR and generic helpers (no task knowledge)."""
    state = {"final": None}

    def llm_query(prompt, text=""):
        """Ask the sub-model `prompt` about `text` (a chunk of the context); returns its answer."""
        prompt, text = str(prompt), str(text)
        start = str.find(context, text) if len(text) >= 16 else -1
        ranges = [[start, start + len(text)]] if start >= 0 else []
        return channel({"op": "llm_query", "prompt": prompt, "text": text, "ranges": ranges})

    def peek(start, end):
        return context[max(0, int(start)) : int(end)]

    def grep(pattern, limit=20, width=160):
        """Print and return (start, end, line) of the context's lines that match the regex `pattern`."""
        hits = [(m.start(), m.end(), m.group()) for m in re.finditer(r"[^\n]*(?:" + pattern + r")[^\n]*", context)]
        TrackedContext.reads.append([0, len(context)])
        for start, end, line in hits[:limit]:
            print(f"[{start}:{end}] {line[:width]}")
        if len(hits) > limit:
            print("[more matches not shown]")  # never their number: counting is the caller's job
        return hits

    def chunks(k):
        size = -(-len(context) // max(1, int(k)))
        return [(i, min(len(context), i + size)) for i in range(0, len(context), size)]

    def final(answer):
        state["final"] = str(answer)

    names = dict(context=context, llm_query=llm_query, peek=peek, grep=grep, chunks=chunks, re=re, json=json)
    names.update(FINAL=final, __name__="__repl__", __builtins__=__builtins__)
    names["FINAL_VAR"] = lambda name: final(names[str(name)])
    return names, state


def run_code(code, names, state, stdout):
    """Execute one REPL cell (its prints go to the output pipe); errors become the cell's `error` text."""
    error = None
    sys.stdout = sys.stderr = stdout
    TrackedContext.reads = []
    state["final"] = None
    try:
        exec(compile(code, "<repl>", "exec"), names)
    except MemoryError:
        error = "MemoryError: the cell exceeded the sandbox's memory limit (RLIMIT_AS)"
    except SystemExit as exc:
        error = f"SystemExit({exc.code!r}) is not allowed in the REPL; use FINAL(answer) to finish"
    except BaseException as exc:  # the cell's own failure (incl. KeyboardInterrupt): report it
        error = f"{type(exc).__name__}: {exc}"
    finally:
        sys.stdout = sys.stderr = stdout
        with contextlib.suppress(Exception):  # a broken output stream is the cell's problem, not the protocol's
            stdout.flush()
    return {"op": "done", "error": error, "reads": TrackedContext.reads[:200], "final": state["final"]}


def repl_child(context, limits, cmd_r, up_w, roots):
    """The REPL child's life: confine itself further, then run cells forever (never returns)."""
    import io

    import rlm_confine as confine

    stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), "utf-8", errors="replace", write_through=True)
    confine.set_limits(limits, nproc=0)
    if limits["landlock"]:
        confine.landlock(roots[0], [roots[1]])  # a nested domain: signals to the supervisor are now outside it
    for name in ("ctypes", "_ctypes"):
        sys.modules.pop(name, None)
    if limits["audit"]:
        sys.addaudithook(confine.audit_hook(roots[0], roots[1]))

    current = {"cell": None}

    def channel(message):
        write_frame(up_w, {**message, "cell": current["cell"]})
        return str(read_frame(cmd_r, SERVER_FRAME).get("text", ""))

    names, state = make_namespace(context, channel)
    while True:
        request = read_frame(cmd_r, SERVER_FRAME)
        current["cell"] = request["cell"]
        write_frame(up_w, {**run_code(request["code"], names, state, stdout), "cell": request["cell"]})


def _text(frame, key, cap):
    value = frame.get(key)
    return None if value is None else str(value)[:cap]


def serve_cell(code, cell, child, server, cap):
    """Supervisor: run cell number `cell` in the child; returns the `result` frame for the server (restart on a
    violation). Every child frame must carry the running cell's number, so a frame left over from an earlier
    cell (whose code went on after a forged `done`) is a violation, never the next cell's answer."""
    pid, cmd_w, up_r, out_r = child
    output, reader, queries, watched = CappedText(cap), FrameReader(CHILD_FRAME), 0, [up_r, out_r]
    try:
        write_frame(cmd_w, {"op": "exec", "code": code, "cell": cell}, _deadline())
        while True:
            readable = select.select(watched, [], [])[0]
            if out_r in readable:
                chunk = os.read(out_r, 1 << 16)
                if chunk:
                    output.add(chunk)
                else:
                    watched.remove(out_r)  # the code closed its own stdout
            if up_r not in readable:
                continue
            data = os.read(up_r, 1 << 16)
            if not data:
                raise EOFError(_exit_reason(pid))
            for frame in reader.feed(data):
                if frame.get("cell") != cell:
                    raise ValueError(f"the REPL sent a frame outside its cell ({str(frame.get('op'))[:40]!r})")
                if frame.get("op") == "done":
                    _drain(out_r, output)
                    text, truncated = output.value()
                    reads, final = frame.get("reads"), _text(frame, "final", 4000)
                    error = _text(frame, "error", 2000)
                    return {"op": "result", "output": text, "truncated": truncated, "error": error,
                            "reads": reads if isinstance(reads, list) else [], "final": final}  # fmt: skip
                if frame.get("op") != "llm_query":
                    raise ValueError(f"the REPL sent an unexpected frame ({str(frame.get('op'))[:40]!r})")
                queries += 1
                if queries > MAX_QUERIES:
                    raise ValueError(f"the REPL sent more than {MAX_QUERIES} llm_query frames in one cell")
                query = {k: str(frame.get(k, "")) for k in ("prompt", "text")}
                ranges = frame.get("ranges")
                query["ranges"] = ranges[:200] if isinstance(ranges, list) else []
                write_frame(server[1], {"op": "llm_query", **query})
                reply = read_frame(server[0], SERVER_FRAME)
                write_frame(cmd_w, {"op": "llm_result", "text": str(reply.get("text", ""))}, _deadline())
    except EOFError as error:
        reason = str(error)  # the child is reaped already
    except TimeoutError:
        reason, _ = "protocol violation: the REPL did not read its input", _stop(pid)
    except (ValueError, OSError) as error:
        reason, _ = f"protocol violation: {error}", _stop(pid)
    _drain(out_r, output)
    text, truncated = output.value()
    return {"op": "result", "output": text, "truncated": truncated, "error": reason, "restart": True}


def _deadline():
    return time.monotonic() + WRITE_DEADLINE_S


def _drain(fd, output):
    """Read what is left in a non-blocking pipe."""
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if not chunk:
            return
        output.add(chunk)


def _stop(pid):
    import signal

    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)


def _exit_reason(pid):
    """Why the child closed its pipe: its exit status (it is killed if it closed the pipe but lives on)."""
    import signal

    for _ in range(50):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.02)
    else:
        _stop(pid)
        _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        names = {signal.SIGXCPU: "CPU time limit exceeded", signal.SIGKILL: "killed", signal.SIGXFSZ: "file too big"}
        signum = os.WTERMSIG(status)
        return f"the REPL process was killed by signal {signum} ({names.get(signum, 'a crash')})"
    return f"the REPL process exited with status {os.WEXITSTATUS(status)} (os._exit or a crash)"


def start_child(context, limits, roots, server):
    """Fork the REPL child with its three pipes; returns (pid, cmd_w, up_r, out_r) for the supervisor."""
    cmd_r, cmd_w = os.pipe()
    up_r, up_w = os.pipe()
    out_r, out_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            for fd in (*server, cmd_w, up_r, out_r):
                os.close(fd)
            os.dup2(out_w, 1)
            os.dup2(out_w, 2)
            os.close(out_w)
            repl_child(context, limits, cmd_r, up_w, roots)
        finally:
            os._exit(70)
    for fd in (cmd_r, up_w, out_w):
        os.close(fd)
    for fd in (cmd_w, up_r, out_r):
        os.set_blocking(fd, False)
    return pid, cmd_w, up_r, out_r


def main():
    import rlm_confine as confine

    server = (os.dup(0), os.dup(1))
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    init = read_frame(server[0], SERVER_FRAME)
    limits, folder = init["limits"], os.getcwd()
    context = TrackedContext(init["context"])
    del init
    roots = ([os.path.dirname(os.__file__)], folder)
    lib = confine.load_libseccomp() if limits["seccomp"] else None
    if limits["seccomp"] and lib is None:
        write_frame(server[1], {"op": "error", "error": "libseccomp.so.2 is not installed"})
        return
    abi = confine.landlock([roots[0][0]], [folder]) if limits["landlock"] else 0
    rules = confine.seccomp(lib) if lib is not None else 0
    child = start_child(context, limits, roots, server)
    confine.set_limits(limits, nproc=0)
    write_frame(server[1], {"op": "ready", "landlock_abi": abi, "seccomp_rules": rules, "uid": os.getuid()})
    for cell in range(1 << 62):
        request = read_frame(server[0], SERVER_FRAME)
        result = serve_cell(str(request.get("code", "")), cell, child, server, limits["output_cap"])
        write_frame(server[1], result)
        if result.get("restart"):
            return


if __name__ == "__main__":
    main()
