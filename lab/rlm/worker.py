"""The sandbox worker: a stdlib-only Python REPL that holds the long context and runs untrusted code.

This file is sent as the `-c` program of `/usr/bin/python3 -I -S` (the system Python: the project venv may be
unreadable to the worker's uid) by `lab.rlm.sandbox`, which has already placed it in a new network namespace,
under a fresh unprivileged uid, in a new session, with an empty environment and a private temp dir as cwd.
Before the first untrusted line the worker, in this order:
1. moves its protocol pipe off fds 0/1 (fds 0-2 become /dev/null) and reads the init frame (context, limits);
2. sets hard = soft resource limits (RLIMIT_CPU, AS, NOFILE, FSIZE, NPROC = 0 more processes, CORE = 0);
3. restricts itself with Landlock (Linux >= 5.13): read-only access to the Python stdlib, read-write to its temp
   dir, nothing else; no execve; no TCP bind/connect; (ABI >= 6) no signals to or abstract sockets of processes
   outside the sandbox;
4. installs a Python audit hook that refuses processes, sockets, ctypes and file access outside the temp dir
   with a clear message (defence in depth: the OS limits above hold even when the hook is bypassed).
The REPL protocol (length-prefixed JSON frames on the pipe): parent -> worker `exec` {code};
worker -> parent `llm_query` {prompt, text, ranges} (answered by `llm_result` {text}) and `result` {output,
truncated, error, reads, final}. Output is capped at `output_cap` characters and marked "[truncated]".
The module has no side effects on import, so the parent imports its frame functions from here.
"""

import json
import os
import re
import struct
import sys

HEADER = struct.Struct(">I")
TRUNCATED = "\n[truncated]"
BLOCKED_MODULES = ("ctypes", "_ctypes", "subprocess", "_posixsubprocess", "socket", "_socket", "multiprocessing")
BLOCKED_MODULES += ("pty", "mmap", "_multiprocessing", "signal", "_signal", "resource", "fcntl", "asyncio", "ssl")
BLOCKED_EVENTS = ("os.system", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.kill")
BLOCKED_EVENTS += ("os.killpg", "subprocess.", "ctypes.", "socket.", "sys.addaudithook", "os.setuid", "pty.")
BLOCKED_EVENTS += ("os.chmod", "os.chown", "os.link", "os.symlink", "shutil.", "sys.remote_exec", "os.truncate")
PATH_EVENTS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.listdir", "os.scandir", "os.utime", "glob.")


def write_frame(fd, payload):
    """Send one frame: 4-byte big-endian length, then UTF-8 JSON."""
    data = json.dumps(payload, ensure_ascii=False).encode("utf-8", "replace")
    view = memoryview(HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


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
    """Receive one frame, refusing frames over `cap` bytes."""
    (size,) = HEADER.unpack(read_exact(fd, HEADER.size))
    if size > cap:
        raise ValueError(f"frame of {size} bytes exceeds the cap of {cap}")
    return json.loads(read_exact(fd, size).decode("utf-8"))


class CappedOutput:
    """A text stream that keeps the first `cap` characters written to it and counts the rest."""

    def __init__(self, cap):
        self.cap, self.parts, self.size = cap, [], 0

    def write(self, text):
        text = str(text)
        if self.size < self.cap:
            self.parts.append(text[: self.cap - self.size])
        self.size += len(text)
        return len(text)

    def flush(self):
        pass

    def value(self):
        return "".join(self.parts), self.size > self.cap


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


def set_limits(limits):
    import resource

    pairs = {
        resource.RLIMIT_CPU: limits["cpu_s"],
        resource.RLIMIT_AS: limits["memory_bytes"],
        resource.RLIMIT_NOFILE: limits["open_files"],
        resource.RLIMIT_FSIZE: limits["file_bytes"],
        resource.RLIMIT_NPROC: 0,  # counted per uid, and the uid is this run's alone: no new process or thread
        resource.RLIMIT_CORE: 0,
    }
    for which, value in pairs.items():
        resource.setrlimit(which, (value, value))


def landlock(read_dirs, write_dirs):
    """Restrict this process with Landlock; returns the ABI version used, or 0 when the kernel lacks it."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    abi = libc.syscall(444, None, 0, 1)  # landlock_create_ruleset(NULL, 0, VERSION)
    if abi <= 0:
        return 0
    fs_all = (1 << 13) - 1 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0) | (1 << 15 if abi >= 5 else 0)
    net_all = 3 if abi >= 4 else 0
    scoped = 3 if abi >= 6 else 0
    attr = struct.pack("<QQQ", fs_all, net_all, scoped)
    size = 24 if abi >= 6 else (16 if abi >= 4 else 8)
    ruleset = libc.syscall(444, ctypes.c_char_p(attr[:size]), size, 0)
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    read = (1 << 2) | (1 << 3)  # READ_FILE | READ_DIR
    rw = fs_all & ~1  # everything but EXECUTE
    for path, access in [(d, read) for d in read_dirs] + [(d, rw) for d in write_dirs]:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        rule = struct.pack("<Qi", access, fd)
        if libc.syscall(445, ruleset, 1, ctypes.c_char_p(rule), 0) != 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule failed for {path}")
        os.close(fd)
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.syscall(446, ruleset, 0) != 0:  # NO_NEW_PRIVS; restrict_self
        raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    os.close(ruleset)
    return abi


def audit_hook(read_roots, write_root):
    """A sys.addaudithook hook: refuse processes, sockets, ctypes and paths outside the sandbox's roots."""

    def inside(path, roots):
        if isinstance(path, int):
            return True  # an already open descriptor
        real = os.path.realpath(os.fsdecode(path))
        return any(real == root or real.startswith(root + os.sep) for root in roots)

    def hook(event, args):
        if event == "import" and args[0].split(".")[0] in BLOCKED_MODULES:
            raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
        if event.startswith(BLOCKED_EVENTS):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open" and args[0] is not None:
            writing = isinstance(args[1], str) and any(c in args[1] for c in "wax+")
            writing = writing or (isinstance(args[2], int) and args[2] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
            if not inside(args[0], [write_root] if writing else read_roots + [write_root]):
                raise PermissionError(f"sandbox: {'writing' if writing else 'reading'} {args[0]!r} is not allowed")
        if event.startswith(PATH_EVENTS) and args and not inside(args[0] if args[0] is not None else ".", [write_root]):
            raise PermissionError(f"sandbox: {event} on {args[0]!r} is not allowed")

    return hook


def make_namespace(context, channel):
    """The REPL's globals: `context`, `llm_query`, FINAL / FINAL_VAR and the action helpers."""
    state = {"final": None}

    def llm_query(prompt, text=""):
        """Ask the sub-model `prompt` about `text` (a chunk of the context); returns its answer."""
        prompt, text = str(prompt), str(text)
        start = str.find(context, text) if len(text) >= 16 else -1
        ranges = [[start, start + len(text)]] if start >= 0 else []
        return channel({"op": "llm_query", "prompt": prompt, "text": text, "ranges": ranges})

    def peek(start, end):
        return context[max(0, int(start)) : int(end)]

    def grep(pattern, limit=3, width=160):
        """Lines of the context that contain `pattern` (a regex): the first hits, their count, the sum of their last
        numbers; returns the match objects."""
        hits = [m for m in re.finditer(r"[^\n]*(?:" + pattern + r")[^\n]*", context)]
        TrackedContext.reads.append([0, len(context)])
        numbers = [re.findall(r"\d+", m.group()) for m in hits]
        for m in hits[:limit]:
            print(f"[{m.start()}:{m.end()}] {m.group()[:width]}")
        print(f"count of matching lines: {len(hits)}")
        print(f"total of their last numbers: {sum(int(n[-1]) for n in numbers if n)}")
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


def run_code(code, names, state, cap):
    """Execute one REPL cell with stdout/stderr captured; errors become the cell's `error` text."""
    out, error = CappedOutput(cap), None
    saved = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = out
    TrackedContext.reads = []
    state["final"] = None
    try:
        exec(compile(code, "<repl>", "exec"), names)
    except MemoryError:
        error = "MemoryError: the cell exceeded the sandbox's memory limit (RLIMIT_AS)"
    except SystemExit as exc:
        error = f"SystemExit({exc.code!r}) is not allowed in the REPL; use FINAL(answer) to finish"
    except BaseException as exc:  # the cell's own failure (incl. MemoryError, KeyboardInterrupt): report it
        error = f"{type(exc).__name__}: {exc}"
    finally:
        sys.stdout, sys.stderr = saved
    text, truncated = out.value()
    reads = TrackedContext.reads[:200]
    return {"op": "result", "output": text, "truncated": truncated, "error": error, "reads": reads, **state}


def main():
    rfd, wfd = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    init = read_frame(rfd, 1 << 26)
    limits, tmp = init["limits"], os.getcwd()
    context = TrackedContext(init["context"])
    del init
    stdlib = os.path.dirname(os.__file__)
    abi = landlock([stdlib], [tmp]) if limits["landlock"] else 0
    for name in ("ctypes", "_ctypes"):
        sys.modules.pop(name, None)
    set_limits(limits)
    if limits["audit"]:
        sys.addaudithook(audit_hook([stdlib], tmp))
    write_frame(wfd, {"op": "ready", "landlock_abi": abi, "uid": os.getuid(), "pid": os.getpid()})

    def channel(message):
        write_frame(wfd, message)
        reply = read_frame(rfd, 1 << 22)
        return str(reply.get("text", ""))

    names, state = make_namespace(context, channel)
    while True:
        request = read_frame(rfd, 1 << 22)
        write_frame(wfd, run_code(request["code"], names, state, limits["output_cap"]))


if __name__ == "__main__":
    main()
