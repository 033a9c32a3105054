"""The OS layers the RLM sandbox worker puts on itself (stdlib + ctypes only: this source runs inside the worker).

`lab.methods.rlm.worker` calls these in its own process before it starts the REPL child, and the REPL child again on
itself (a nested Landlock domain, so it cannot signal the supervisor):
- `set_limits`: hard = soft resource limits (RLIMIT_CPU, AS, NOFILE, FSIZE, CORE, and NPROC when asked);
- `landlock`: Landlock (Linux >= 5.13): read-only access to the Python stdlib, read-write to the run's folder,
  no execve, no TCP bind/connect (ABI >= 4), no signals or abstract unix sockets outside the domain (ABI >= 6);
- `seccomp`: a libseccomp filter (the Debian package libseccomp2, loaded with ctypes) that returns EPERM for
  namespace creation (unshare, setns, clone with any CLONE_NEW* flag; clone3 gets ENOSYS because its flags sit
  behind a pointer the filter cannot read, so libc falls back to clone), every socket family but AF_INET /
  AF_INET6 (so no AF_UNIX, AF_NETLINK, AF_PACKET, AF_ALG, AF_VSOCK ...), raw and packet sockets, socketpair,
  ptrace and the cross-process memory and fd calls (process_vm_*, pidfd_getfd, kcmp), mount and the new mount
  API, bpf, keyctl / add_key / request_key, perf_event_open, userfaultfd, io_uring (its operations bypass
  seccomp), module and kexec loading, SysV and POSIX IPC (shm*, msg*, sem*, mq_*), memfd_create /
  memfd_secret, execve / execveat (neither process execs after the filter is loaded), inotify / fanotify, and a
  few other privileged calls; syscalls of another ABI (i386, x32) kill the process (libseccomp's bad-arch
  action). Everything else is allowed: the filter is a deny list (an allow list would have to follow the
  syscalls of whichever interpreter and libc run the worker; docs/rlm.md says why).
- `audit_hook`: a Python audit hook that refuses processes, sockets, ctypes, gc walks and paths outside the
  folder with readable messages. It keeps its own copies of what it checks and refuses the gc calls that
  reach its closure, but it lives in the same process as the untrusted code (a frame from a traceback still
  shows its locals; os.path.realpath's Python code reads module globals): a convenience for clear errors,
  never a boundary.
Not covered: cgroups (memory is bounded by RLIMIT_AS), filters on the arguments of ioctl / prctl.
"""

import ctypes
import os
import struct

BLOCKED_MODULES = ("ctypes", "_ctypes", "subprocess", "_posixsubprocess", "socket", "_socket", "multiprocessing")
BLOCKED_MODULES += ("pty", "mmap", "_multiprocessing", "signal", "_signal", "resource", "fcntl", "asyncio", "ssl")
BLOCKED_EVENTS = ("os.system", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.kill")
BLOCKED_EVENTS += ("os.killpg", "subprocess.", "ctypes.", "socket.", "sys.addaudithook", "os.setuid", "pty.")
BLOCKED_EVENTS += ("os.chmod", "os.chown", "os.link", "os.symlink", "shutil.", "sys.remote_exec", "os.truncate")
GC_EVENTS = ("gc.get_objects", "gc.get_referrers", "gc.get_referents")  # the walks that find the hook's closure
PATH_EVENTS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.listdir", "os.scandir", "os.utime", "glob.")

SECCOMP_DENY = (
    "unshare", "setns", "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp", "socketpair",
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsmount", "fsconfig",
    "fspick", "mount_setattr", "bpf", "keyctl", "add_key", "request_key", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "kexec_load", "kexec_file_load", "init_module",
    "finit_module", "delete_module", "open_by_handle_at", "name_to_handle_at", "quotactl", "swapon", "swapoff",
    "reboot", "acct", "syslog", "iopl", "ioperm", "personality", "uselib", "lookup_dcookie", "vhangup",
    # SysV and POSIX IPC: objects outside RLIMIT_AS (the IPC namespace also drops them with the worker)
    "shmget", "shmat", "shmdt", "shmctl", "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop", "semtimedop",
    "semctl", "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify", "mq_getsetattr",
    # memory outside RLIMIT_AS, running a binary (from a memfd: Landlock only sees paths), watching host folders
    "memfd_create", "memfd_secret", "execve", "execveat", "inotify_init", "inotify_init1", "inotify_add_watch",
    "fanotify_init", "fanotify_mark",
)  # fmt: skip
CLONE_NEW = (0x00000080, 0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)
AF_INET, AF_INET6, SOCK_TYPE_MASK, SOCK_RAW, SOCK_PACKET = 2, 10, 0xF, 3, 10
ACT_ALLOW = 0x7FFF0000
CMP_LT, CMP_EQ, CMP_GT, CMP_MASKED_EQ = 2, 4, 6, 7


def set_limits(limits, nproc=None):
    """Hard = soft resource limits; `nproc` (0 = no new process or thread on this uid) when given."""
    import resource

    pairs = {
        resource.RLIMIT_CPU: limits["cpu_s"],
        resource.RLIMIT_AS: limits["memory_bytes"],
        resource.RLIMIT_NOFILE: limits["open_files"],
        resource.RLIMIT_FSIZE: limits["file_bytes"],
        resource.RLIMIT_CORE: 0,
    }
    if nproc is not None:
        pairs[resource.RLIMIT_NPROC] = nproc
    for which, value in pairs.items():
        resource.setrlimit(which, (value, value))


def landlock(read_dirs, write_dirs):
    """Restrict this process with Landlock; returns the ABI version used, or 0 when the kernel lacks it."""
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


class _Cmp(ctypes.Structure):
    """libseccomp's struct scmp_arg_cmp."""

    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]


def load_libseccomp():
    """The libseccomp shared library, or None when it is not installed."""
    try:
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    except OSError:
        return None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
    lib.seccomp_rule_add_array.argtypes += [ctypes.POINTER(_Cmp)]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_load.argtypes = lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


def _seccomp_rules():
    """(syscall, errno, comparisons) of the deny list; comparisons = [(arg, op, a, b)], all must hold."""
    eperm, enosys = 1, 38
    rules = [(name, eperm, []) for name in SECCOMP_DENY] + [("clone3", enosys, [])]
    rules += [("clone", eperm, [(0, CMP_MASKED_EQ, flag, flag)]) for flag in CLONE_NEW]
    rules += [("socket", eperm, [(0, CMP_LT, AF_INET, 0)]), ("socket", eperm, [(0, CMP_GT, AF_INET6, 0)])]
    rules += [("socket", eperm, [(0, CMP_EQ, family, 0)]) for family in range(AF_INET + 1, AF_INET6)]
    rules += [("socket", eperm, [(1, CMP_MASKED_EQ, SOCK_TYPE_MASK, kind)]) for kind in (SOCK_RAW, SOCK_PACKET)]
    return rules


def seccomp(lib):
    """Load the deny-list filter into this process (and its future children); returns the rule count."""
    ctx = lib.seccomp_init(ACT_ALLOW)
    if not ctx:
        raise OSError("seccomp_init failed")
    try:
        added = 0
        for name, errno, comparisons in _seccomp_rules():
            number = lib.seccomp_syscall_resolve_name(name.encode())
            if number < 0:
                continue  # not a syscall of this architecture
            args = (_Cmp * max(1, len(comparisons)))(*[_Cmp(*c) for c in comparisons])
            if lib.seccomp_rule_add_array(ctx, 0x00050000 | errno, number, len(comparisons), args) != 0:
                raise OSError(f"seccomp_rule_add failed for {name}")
            added += 1
        if lib.seccomp_load(ctx) != 0:
            raise OSError("seccomp_load failed")
        return added
    finally:
        lib.seccomp_release(ctx)


def audit_hook(read_roots, write_root):
    """A sys.addaudithook hook: refuse processes, sockets, ctypes, gc walks and paths outside the sandbox's roots.
    The names it uses are bound here, as locals of this call, so rebinding this module's lists, `os.path.realpath`
    or a builtin does not change them, and the gc walks that reach its closure are refused; still no boundary
    (realpath's own Python code reads module globals; see the module docstring)."""
    realpath, fspath, sep, is_int, is_str, any_of = os.path.realpath, os.fspath, os.sep, int, str, any
    kind_of, refuse, writing_modes = isinstance, PermissionError, os.O_WRONLY | os.O_RDWR | os.O_CREAT
    modules, events, path_events = tuple(BLOCKED_MODULES), tuple(BLOCKED_EVENTS + GC_EVENTS), tuple(PATH_EVENTS)
    read_roots, write_roots = tuple(read_roots) + (write_root,), (write_root,)

    def inside(path, roots):
        if kind_of(path, is_int):
            return True  # an already open descriptor
        path = fspath(path)
        real = realpath(path if kind_of(path, is_str) else path.decode("utf-8", "surrogateescape"))
        return any_of(real == root or real.startswith(root + sep) for root in roots)

    def hook(event, args):
        if event == "import" and args[0].split(".")[0] in modules:
            raise refuse(f"sandbox: importing {args[0]} is not allowed")
        if event.startswith(events) or (event == "object.__setattr__" and args[1] == "__code__"):
            raise refuse(f"sandbox: {event} is not allowed")
        if event == "open" and args[0] is not None:
            writing = kind_of(args[1], is_str) and any_of(c in args[1] for c in "wax+")
            writing = writing or (kind_of(args[2], is_int) and args[2] & writing_modes)
            if not inside(args[0], write_roots if writing else read_roots):
                raise refuse(f"sandbox: {'writing' if writing else 'reading'} {args[0]!r} is not allowed")
        if event.startswith(path_events) and args and not inside(args[0] if args[0] is not None else ".", write_roots):
            raise refuse(f"sandbox: {event} on {args[0]!r} is not allowed")

    return hook
