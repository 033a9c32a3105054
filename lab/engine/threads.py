"""Thread policy for model work on a shared CPU (a classroom server, a Space, a laptop running other jobs).

Covered: how many CPUs this process may use (`usable_cpus`: the affinity mask, capped by a cgroup v2 CPU quota),
how many of them other processes keep busy right now (`busy_cpus`: /proc/stat over a short sample, minus this
process's own CPU time), the intra-op thread count for a job (`intra_op_threads`: the free CPUs shared by the
jobs running at once, at least one), and `apply`, which sets `torch.set_num_threads` for the next job.

Why: torch defaults to one intra-op thread per CPU. When another process occupies a core, each parallel region
waits at its barrier for a thread the kernel has descheduled, so a run slows far below its fair share. Running
with only the free CPUs' threads avoids that. The OpenMP wait policy is left as it is: in
`scripts/contention_bench.py` OMP_WAIT_POLICY=PASSIVE (mode "passive") did not raise tokens/s beside CPU-bound
neighbours over the thread count alone and lowered it alone, where every parallel region then pays a wake-up
(docs/benchmarks.md holds the numbers). Not covered: inter-op threads (unused by the decode loops), GPU devices (the
policy only changes CPU threads), NUMA placement.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

BUSY_SAMPLE_S = 0.15
BUSY_MARGIN = 0.5  # a CPU counts as taken once another process uses more than half of it
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


@dataclass(frozen=True)
class ThreadPolicy:
    """What `apply` decided: usable CPUs, CPUs busy with other work, concurrent jobs and the threads set."""

    cpus: int
    busy: float
    jobs: int
    threads: int


def _cgroup_quota() -> float | None:
    """CPUs allowed by a cgroup v2 quota ("max" or absent: no limit)."""
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else max(1.0, int(quota) / int(period))


def usable_cpus() -> int:
    """CPUs this process may run on: the affinity mask, capped by the cgroup quota (at least 1)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    quota = _cgroup_quota()
    return max(1, min(cpus, int(quota)) if quota else cpus)


def _cpu_ticks() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs from the first line of /proc/stat."""
    values = [float(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0.0)  # idle + iowait
    return sum(values) - idle, sum(values)


def busy_cpus(sample_s: float = BUSY_SAMPLE_S) -> float:
    """CPUs kept busy by other processes over a `sample_s` window (0.0 where /proc/stat is unavailable)."""
    try:
        busy0, total0 = _cpu_ticks()
        own0, wall0 = time.process_time(), time.monotonic()
        time.sleep(sample_s)
        busy1, total1 = _cpu_ticks()
        own1, wall1 = time.process_time(), time.monotonic()
    except (OSError, ValueError, IndexError):
        return 0.0
    if total1 <= total0 or wall1 <= wall0:
        return 0.0
    all_cpus = os.cpu_count() or 1
    busy = (busy1 - busy0) / (total1 - total0) * all_cpus  # CPUs busy machine-wide
    own = (own1 - own0) / (wall1 - wall0)
    return max(0.0, busy - own)


def intra_op_threads(jobs: int = 1, cpus: int | None = None, busy: float = 0.0) -> int:
    """Threads per job: the CPUs not taken by other processes, shared by `jobs` concurrent jobs, at least 1."""
    cpus = usable_cpus() if cpus is None else cpus
    taken = int(busy + BUSY_MARGIN)  # round: 0.4 busy CPUs leaves the CPU free, 0.6 takes it
    return max(1, (cpus - taken) // max(1, jobs))


def apply(jobs: int = 1, sample_s: float = BUSY_SAMPLE_S) -> ThreadPolicy:
    """Set torch's intra-op threads for the next job from the CPUs free right now; OMP_NUM_THREADS, when set,
    wins (the user pinned it)."""
    import torch

    cpus = usable_cpus()
    pinned = os.environ.get("OMP_NUM_THREADS", "").strip()
    busy = 0.0 if pinned.isdigit() else busy_cpus(sample_s)
    threads = int(pinned) if pinned.isdigit() and int(pinned) > 0 else intra_op_threads(jobs, cpus, busy)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return ThreadPolicy(cpus, round(busy, 2), jobs, threads)
