"""The minimal root of the RLM sandbox worker (issue 31: no host path by name, not even to stat / access / readlink).

`lab.methods.rlm.sandbox` runs `SETUP_SCRIPT` with sh as root inside the worker's new mount and pid namespaces:
an empty tmpfs over the run's folder (on the host that folder stays empty), into which `root_entries` are bound
read-only and nosuid (the library folders, the interpreter's stdlib, the interpreter, setpriv, /dev/null, the
loader's cache; the links among them kept as links), the new pid namespace's proc at /proc, the size-capped
noexec working tmpfs at the folder's own path; then `pivot_root` into it, the root made read-only, the host's
root detached (`umount -l`), and `exec setpriv ... python` from inside. An empty, read-only /.old stays (the
pivot's mount point). Without umount / pivot_root / the stdlib's path the sandbox falls back to
`PLAIN_SETUP_SCRIPT` (the host's tree, Landlock-confined) and its level says so.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess

SETUP_SCRIPT = (  # sh -c: the minimal root (a tmpfs over the run's folder on the host side, then -L link / -B
    # folder / -F file entries bound read-only into it), the new pid namespace's proc, the capped working tmpfs at
    # the folder's own path inside it, pivot_root into it, detach the host's root, exec setpriv ... python
    "set -e; m=$1 um=$2 pr=$3 size=$4 nodes=$5 uid=$6 dir=$7; shift 7; r=$dir"
    ' && "$m" -t tmpfs -o size=1m,nr_inodes=4096,mode=0755,nosuid,nodev rlm-root "$r"'
    ' && while [ "$1" != -- ]; do case $1 in'
    ' -L) mkdir -p "$r${2%/*}"; ln -s "$3" "$r$2"; shift 3;;'
    ' -B) mkdir -p "$r$2"; "$m" --bind "$2" "$r$2"; "$m" -o remount,bind,ro,nosuid "$r$2"; shift 2;;'
    ' -F) mkdir -p "$r${2%/*}"; : > "$r$2"; "$m" --bind "$2" "$r$2"; "$m" -o remount,bind,ro,nosuid "$r$2"; shift 2;;'
    " *) exit 64;; esac; done; shift"
    ' && mkdir -p "$r/proc" "$r$dir" "$r/.old" && "$m" -t proc -o nosuid,nodev,noexec proc "$r/proc"'
    ' && "$m" -t tmpfs -o "size=$size,nr_inodes=$nodes,mode=0700,uid=$uid,gid=$uid,nosuid,nodev,noexec" rlm "$r$dir"'
    ' && cd "$r" && "$pr" . .old && "/.old$m" -o remount,bind,ro / && "/.old$um" -l /.old'
    ' && cd "$dir" && unset PWD OLDPWD && exec "$@"'
)
PLAIN_SETUP_SCRIPT = (  # the fallback without a minimal root: proc over /proc, the capped tmpfs over the folder
    'm=$1; shift 3; "$m" -t proc -o nosuid,nodev,noexec proc /proc'
    ' && "$m" -t tmpfs -o "size=$1,nr_inodes=$2,mode=0700,uid=$3,gid=$3,nosuid,nodev,noexec" rlm "$4"'
    ' && cd "$4" && unset PWD OLDPWD && shift 4 && while [ "$1" != -- ]; do shift; done && shift && exec "$@"'
)
LIBRARY_DIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib")
ROOT_FILES = ("/dev/null", "/etc/ld.so.cache")


def root_tools() -> list[str] | None:
    """umount and pivot_root for the minimal root, or None when either is missing."""
    paths = [shutil.which(name) for name in ("umount", "pivot_root")]
    return None if None in paths else [os.path.realpath(path) for path in paths]


@functools.cache
def _stdlib_dir(python: str) -> str | None:
    """The real folder of `python`'s stdlib (where its os module lives), or None when it cannot be asked."""
    ask = "import os; print(os.path.realpath(os.path.dirname(os.__file__)))"
    try:
        done = subprocess.run([python, "-I", "-S", "-c", ask], capture_output=True, text=True, timeout=20, env={})
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def root_entries(python: str, setpriv: str | None) -> list[str] | None:
    """What the minimal root holds, as SETUP_SCRIPT's entries: the library folders (links kept as links), the
    interpreter's stdlib, the interpreter and setpriv (files), /dev/null and the loader's cache; bound read-only.
    None when a piece is missing (the worker then runs without a minimal root)."""
    stdlib = _stdlib_dir(python)
    if stdlib is None or setpriv is None:
        return None
    entries: list[str] = []
    folders = []
    for folder in LIBRARY_DIRS:
        if os.path.islink(folder):
            entries += ["-L", folder, os.readlink(folder)]
        elif os.path.isdir(folder):
            folders.append(folder)
    if not any(stdlib == f or stdlib.startswith(f + os.sep) for f in folders):
        folders.append(stdlib)
    for folder in folders:
        entries += ["-B", folder]
    for file in (python, os.path.realpath(setpriv), *ROOT_FILES):
        if os.path.exists(file):
            entries += ["-F", file]
    return entries
