"""Reaping every process of a sandbox worker's process group, wherever it was reparented.

The server kills a worker with SIGKILL to its process group and waits for the launcher it started. The other
members die with it but may outlive their parent for an instant; an orphan is then reparented to the nearest
subreaper or to PID 1. Where the server is one of those (a container whose PID 1 is the server, a supervisor
that set PR_SET_CHILD_SUBREAPER), the orphans come back to it, and nothing else would ever wait for them: a
zombie per worker start. `reap_group` waits until no process of the group is left, reaping those that are the
server's own children. It only ever waits for pids whose process group is the worker's, so it never takes the
exit status of another subprocess of the server.
"""

from __future__ import annotations

import contextlib
import os
import time

POLL_S = 0.005


def group_members(pgid: int) -> list[tuple[int, int, str]]:
    """(pid, parent pid, state) of every process whose process group is `pgid` (read from /proc)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if len(fields) > 3 and int(fields[2]) == pgid:
            members.append((int(entry), int(fields[1]), fields[0].decode()))
    return members


def reap_group(pgid: int, timeout_s: float = 2.0) -> int:
    """Wait (at most `timeout_s`) until process group `pgid` is empty, reaping the members that are this
    process's children; returns how many it reaped. Call it after SIGKILL to the group."""
    me, reaped, deadline = os.getpid(), 0, time.monotonic() + timeout_s
    while True:
        members = group_members(pgid)
        for pid, parent, _ in members:
            if parent == me:
                with contextlib.suppress(ChildProcessError):
                    reaped += os.waitpid(pid, os.WNOHANG)[0] == pid
        if not members or time.monotonic() > deadline:
            return reaped
        time.sleep(POLL_S)
