"""The kernel calls that put a program in namespaces of its own (runner side, standard library and
ctypes only): unshare, the user ID maps, the mounts, and dropping capabilities.

Called by spmdsplit/sandbox/runner.py in this order, by the runner's outer process (P) unless said:

1. `enter(...)`: P leaves the job's user, mount, network, IPC and PID namespaces for new ones, and
   gets its user IDs mapped (`map_ids`);
2. `private_mounts`, `program_folder`, `expose`, `read_only_everything`: P's mount namespace made
   the program's: a tmpfs on its folder, the directories Python needs made reachable, the rest
   read-only;
3. after P forks the program's process (G, PID 1 of the new PID namespace): G calls
   `fresh_proc` and `drop_capabilities`.

Every failure raises OSError with the call and path in its message; the runner reports it and
the job's start-up probe (spmdsplit/sandbox/isolation.py) turns it into the reason namespaces are
not used.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
NAMESPACES = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWPID

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21

# A mount's options in /proc/self/mountinfo that a remount must repeat: a mount that a user
# namespace's mount namespace copied from a more privileged one has these flags locked, and the
# kernel refuses (EPERM) a remount that would clear one (or change the atime mode).
_KEPT_OPTIONS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
                 "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}

_OCTAL = re.compile(rb"\\([0-7]{3})")

PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_SECUREBITS = 28
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
# noroot, no-setuid-fixup, keep-caps off and no-ambient-raise, each with its lock bit: root in the
# namespace gains no capability by exec or by changing IDs, for good.
_SECUREBITS_LOCKED_DOWN = 0b11101111
_CAPABILITY_VERSION_3 = 0x20080522

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
_libc.prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _bytes(path: str | None) -> bytes | None:
    return None if path is None else os.fsencode(path)


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(_bytes(source), _bytes(target), _bytes(fstype), flags, _bytes(data)),
           f"mount {source or '-'} on {target} ({fstype or 'bind/remount'}, flags {flags:#x})")


def prctl(option: int, arg: int = 0) -> None:
    _check(_libc.prctl(option, arg, 0, 0, 0), f"prctl({option}, {arg})")


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


# -- 1. the namespaces and the ID maps ---------------------------------------------------------

def enter(outer_id: int | None) -> None:
    """P into new user, mount, network, IPC and PID namespaces (the PID one takes P's next child,
    not P), root inside. `outer_id`: the unprivileged outer uid and gid that root inside maps to,
    for a job running as root (written by a helper process, see `map_ids`); None for a job running
    as an ordinary user, whose own uid and gid are mapped (the only map it is allowed to write)."""
    if outer_id is None:
        uid, gid = os.geteuid(), os.getegid()
        _check(_libc.unshare(NAMESPACES), "unshare")
        # An unprivileged process may map only its own IDs, and its gid only once setgroups is
        # denied (else it could drop a group that denies it access).
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"0 {uid} 1")
        _write("/proc/self/gid_map", f"0 {gid} 1")
        return
    helper_read, go = os.pipe()
    helper = os.fork()
    if helper == 0:  # still root in the job's namespaces: allowed to write another process's maps
        os.close(go)
        status = 1
        try:
            os.read(helper_read, 1)
            map_ids(os.getppid(), outer_id)
            status = 0
        finally:
            os._exit(status)
    os.close(helper_read)
    try:
        _check(_libc.unshare(NAMESPACES), "unshare")
        os.write(go, b"1")
    finally:
        os.close(go)
        _, status = os.waitpid(helper, 0)
    if status != 0:
        raise OSError(f"writing the uid/gid maps of the sandbox's user namespace failed (helper status {status})")


def map_ids(pid: int, outer_id: int) -> None:
    """Root inside `pid`'s user namespace is `outer_id` outside, for uid and gid. A map naming
    another user than the writer's own needs CAP_SETUID/CAP_SETGID in the parent namespace: a
    root job's helper has them. Root's supplementary groups are not in the map; the runner drops
    them (setgroups stays allowed when a privileged process wrote the gid map)."""
    _write(f"/proc/{pid}/uid_map", f"0 {outer_id} 1")
    _write(f"/proc/{pid}/gid_map", f"0 {outer_id} 1")


def become_root_inside() -> None:
    """After `enter(outer_id)`: P's IDs become root of the namespace (the mapped outer uid). Its
    real uid until now was the job's root, which the map leaves unmapped: that is the uid the
    kernel counts processes against, so RLIMIT_NPROC would not hold (the kernel exempts uid 0).
    The capabilities in the new namespace are kept: the new uid is the namespace's root."""
    os.setgroups([])
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)


# -- 2. P's mounts --------------------------------------------------------------------------------

def private_mounts() -> None:
    """Nothing mounted from here on propagates back to the job's mount namespace."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)


def program_folder(folder: str, size_mb: int) -> None:
    """A tmpfs of `size_mb` on the program's folder: what it writes fills that and then gets
    ENOSPC, never the disk; it is gone with the mount namespace."""
    mount("tmpfs", folder, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size_mb}m,nr_inodes=4096,mode=0700")


def open_hidden(directories: list[str]) -> list[int]:
    """O_PATH descriptors of `directories`, opened while P may still reach them (before it becomes
    the unprivileged root of its namespace) and after it entered its own mount namespace (a bind
    mount's source must be a mount of the caller's namespace)."""
    return [os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) for path in directories]


def expose(hidden: list[tuple[str, list[str]]], handles: list[int]) -> None:
    """Make directories that the namespace's unprivileged root could not reach reachable again:
    each `(ancestor, [directory, ...])` is an ancestor it may not search (a 0700 home holding
    the interpreter, say), covered by an empty tmpfs, with each directory bind-mounted back at its
    own path inside it (from `handles`, `open_hidden`'s descriptors in the same order). The rest of
    the ancestor's content is hidden from the program."""
    handles = iter(handles)
    for ancestor, directories in hidden:
        mount("tmpfs", ancestor, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
        for directory in directories:
            os.makedirs(directory, mode=0o755, exist_ok=True)
            mount(f"/proc/self/fd/{next(handles)}", directory, None, MS_BIND | MS_REC)


def _mount_points() -> list[tuple[str, int]]:
    """(mount point, the flags a remount must repeat) of every mount in this mount namespace, in
    /proc/self/mountinfo's order (a mount before those mounted on it)."""
    points = []
    with open("/proc/self/mountinfo", "rb") as info:
        for line in info:
            fields = line.split()
            # Spaces, tabs, newlines and backslashes in a path are written as octal escapes.
            point = os.fsdecode(_OCTAL.sub(lambda m: bytes([int(m.group(1), 8)]), fields[4]))
            flags = 0
            for option in fields[5].decode().split(","):
                flags |= _KEPT_OPTIONS.get(option, 0)
            points.append((point, flags))
    return points


def read_only_everything(writable: str) -> None:
    """Remount every mount read-only but the one on `writable` (the program's folder). A mount
    under a directory that root of the namespace may not search (EACCES) cannot be reached by the
    program either and is left; one already gone (ENOENT) too; any other refusal is an error."""
    done = set()
    for point, flags in _mount_points():
        if point == writable or point in done:
            continue
        done.add(point)
        try:
            mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.ENOENT):
                raise


# -- 3. G's set-up --------------------------------------------------------------------------------

def fresh_proc() -> None:
    """A /proc of G's own PID namespace over the job's: the program sees only its own processes.
    Mounted by G, PID 1 there (a proc mount shows the mounter's PID namespace)."""
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)


class _CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class _CapData(ctypes.Structure):
    _fields_ = (("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32))


def drop_capabilities() -> None:
    """G keeps none of root's capabilities in its user namespace, and can never get one back (not
    by exec either): else the program could remount the file system read-write, or mount over it."""
    prctl(PR_SET_SECUREBITS, _SECUREBITS_LOCKED_DOWN)
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for capability in range(last + 1):
        prctl(PR_CAPBSET_DROP, capability)
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    empty = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(_CapHeader(_CAPABILITY_VERSION_3, 0)), empty), "capset")
    prctl(PR_SET_NO_NEW_PRIVS, 1)


def die_with_parent(signal: int) -> None:
    """The kernel sends `signal` to this process when its parent (P) dies."""
    prctl(PR_SET_PDEATHSIG, signal)
