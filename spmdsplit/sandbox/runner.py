"""The trusted process a program runs in (standard library only; started by
spmdsplit/sandbox/pool.py as `python -I -S -c BOOT <sys.path...>`, its environment already
scrubbed and its working folder a fresh one).

It reads one request line on stdin (spmdsplit/sandbox/protocol.py): the isolation level, the
folder, the limits, and the program with its tests' *inputs* (never the expected outputs). Then:

- P, this process: under `namespaces`, enters new user, mount, network, IPC and PID namespaces
  and makes its mount namespace the program's (spmdsplit/sandbox/namespaces.py); then forks G
  and waits for it, or for the end of its stdin (the rank gone or done: it kills G);
- G, the program's process (under namespaces: PID 1 of the new PID namespace, in a session of its
  own, killed by the kernel when P dies, with a /proc of its own and no capabilities): moves its
  report channel off fd 1, points fds 0-2 at /dev/null, sets its resource limits
  (spmdsplit/sandbox/rlimits.py), says "ready", applies verl's guard
  (spmdsplit/sandbox/guard.py), and runs the program (spmdsplit/sandbox/harness.py).

P never runs program code, and under namespaces the program cannot name it: not by PID (P is
outside its PID namespace), not by process group (G has a session of its own).
"""

from __future__ import annotations

import os
import select
import signal
import sys

from spmdsplit.sandbox import protocol, rlimits

BOOT = "import sys; sys.path[:0] = sys.argv[1:]; from spmdsplit.sandbox.runner import main; main()"
NAMESPACES = "namespaces"
GUARD = "guard"


def _fail(fd: int, why: str) -> None:
    try:
        protocol.write_all(fd, protocol.encode({"e": protocol.SETUP_ERROR, "why": why}))
    finally:
        os._exit(1)


def outer_setup(request: dict) -> None:
    """P's part of the namespace set-up (see spmdsplit/sandbox/namespaces.py)."""
    from spmdsplit.sandbox import namespaces

    outer_id = request["outer_id"]
    folder = request["folder"]
    namespaces.enter(outer_id)
    hidden = request["hidden"] if outer_id is not None else []
    handles = namespaces.open_hidden([directory for _, directories in hidden for directory in directories])
    if outer_id is not None:
        namespaces.become_root_inside()
    namespaces.private_mounts()
    namespaces.program_folder(folder, request["limits"]["max_output_mb"])
    namespaces.expose(hidden, handles)
    namespaces.read_only_everything(folder)
    for handle in handles:
        os.close(handle)


def _parent_alive(alive: int) -> bool:
    """P holds the write end of `alive` until it dies: no data and no end of file means alive."""
    os.set_blocking(alive, False)
    try:
        return os.read(alive, 1) != b""
    except BlockingIOError:
        return True


def _probe_checks(folder: str) -> None:
    """What the start-up probe checks in the program's place: Python's own folders can be listed
    (imports that come later will work), the folder is writable and the root is read-only."""
    for path in sys.path:
        if os.path.isdir(path):
            os.listdir(path)
    with open(os.path.join(folder, "probe"), "w") as f:
        f.write("written")
    if not os.statvfs("/").f_flag & os.ST_RDONLY:
        raise OSError("the root file system is still writable")


def program_process(request: dict, alive: int, tasks_now: int) -> None:
    """G: set up (see the module's docstring), then run the program. Never returns."""
    in_namespaces = request["isolation"] == NAMESPACES
    report = 1
    try:
        from spmdsplit.sandbox import namespaces

        # A process group of G's own, which P kills whole when G ends (before reaping G, so that
        # nothing is orphaned); under namespaces a session of its own too, so that kill(0) and
        # killpg(0) reach nothing but the program.
        if in_namespaces:
            os.setsid()
        else:
            os.setpgid(0, 0)
        namespaces.die_with_parent(signal.SIGKILL)
        if not _parent_alive(alive):  # P died before the line above took effect
            os._exit(1)
        if in_namespaces:
            namespaces.fresh_proc()
            namespaces.drop_capabilities()
        os.chdir(request["folder"])
        report = os.dup(1)  # not inherited by what the program may exec
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.closerange(3, report)
        os.closerange(report + 1, 65536)
        # verl's program process: stdin is /dev/null opened by multiprocessing, stdout and stderr a
        # /dev/null file of its own.
        sys.stdin = open(0, encoding="utf-8", closefd=False)
        sys.stdout = sys.stderr = open(os.devnull, "w")
        rlimits.apply(request["limits"], tasks_now)
        if request["program"] is None:
            _probe_checks(request["folder"])
    except Exception as e:  # noqa: BLE001 - reported: the sandbox itself failed
        _fail(report, f"{type(e).__name__}: {e}")

    def write(data: bytes) -> None:
        try:
            protocol.write_all(report, data)
        except OSError:  # the rank stopped reading, or the program closed the channel
            os._exit(1)

    write(protocol.encode({"e": protocol.READY}))
    if request["program"] is not None:
        from spmdsplit.sandbox import guard, harness

        limit = request["limits"]["max_output_mb"] << 20
        guard.apply()
        harness.run(request["program"], write, sys.stdin, limit)
    else:
        write(protocol.encode({"e": protocol.DONE}))
    os._exit(0)


def tasks_counted(request: dict) -> int:
    """What RLIMIT_NPROC counts for G's uid once G exists (the kernel refuses a fork or a new
    thread when that count has reached the limit), counted by P before it forks G."""
    if request["isolation"] == NAMESPACES:
        if request["outer_id"] is not None or _nproc_per_namespace():
            # P and G. A root job's namespace root is a uid of this program's alone; and since
            # Linux 5.14 the count is kept per user namespace and uid (ucounts), so a user job's
            # namespace held P alone until now.
            return 2
        # Before 5.14 it is the uid's count machine-wide (threads included): P, still seeing the
        # job's /proc, counts the job user's tasks (its uid reads as 0 through P's map).
        return rlimits.user_tasks(os.getuid()) + 1
    if os.getuid() == 0:
        return 1  # the kernel does not enforce RLIMIT_NPROC for root outside a user namespace
    return rlimits.user_tasks(os.getuid()) + 1  # outside a namespace: machine-wide, as above


def _nproc_per_namespace() -> bool:
    release = os.uname().release.split("-")[0].split(".")
    try:
        return (int(release[0]), int(release[1])) >= (5, 14)
    except (IndexError, ValueError):
        return False


def wait_for(child: int) -> int:
    """G's exit status, as a shell shows it, once G and its process group are gone. Kills them
    when stdin ends first (the rank is done with the program, or gone)."""
    try:
        handle = os.pidfd_open(child)
    except OSError:
        handle = None  # a kernel before 5.3: no lifeline, the rank's kill is the only end
    while handle is not None:
        readable, _, _ = select.select([0, handle], [], [])
        if handle in readable:
            break
        if not os.read(0, 4096):
            break
    try:
        os.killpg(child, signal.SIGKILL)  # G's group outlives G until G is reaped: reaches what G left
    except OSError:
        pass
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def main() -> None:
    try:
        request = protocol.decode(protocol.read_line(0))
        if request["isolation"] == NAMESPACES:
            outer_setup(request)
        tasks_now = tasks_counted(request)
        alive, alive_keep = os.pipe()
        child = os.fork()
    except Exception as e:  # noqa: BLE001 - reported: the sandbox itself failed
        _fail(1, f"{type(e).__name__}: {e}")
    if child == 0:
        os.close(alive_keep)
        program_process(request, alive, tasks_now)
    os.close(alive)
    os.close(1)  # the report channel is G's alone: its end of file is G's (and its children's) end
    os._exit(wait_for(child))


if __name__ == "__main__":
    main()
