"""Which isolation the job's programs get (reward.sandbox.isolation), found once per process, and
the line the job prints about it at start.

namespaces: each program in new user, PID, mount, network and IPC namespaces
(spmdsplit/sandbox/namespaces.py). It cannot see or signal any process but its own (kill(-1)
reaches only them), its parent included; it has no network; the whole file system is read-only to
it but its folder, a tmpfs of max_output_mb; nothing it starts outlives it (its process is PID 1
of its namespace: when it dies the kernel kills the rest). A root job's programs run as a uid of
their own (a namespace root mapped to an unprivileged outer uid), so RLIMIT_NPROC holds (the
kernel does not apply it to uid 0) and root's files are not theirs; a user job's run as the user.

guard: where unprivileged user namespaces are off (a container's seccomp profile, a sysctl) the
same resource limits, folder and environment, and verl's guard (spmdsplit/sandbox/guard.py),
which a program can undo. What still holds: the limits (CPU, wall time, memory, open files,
output; processes only for a non-root uid), the rank's kill of its process group at the deadline,
and the rank itself (the program's parent is the runner, not the rank). What does not: a program
that sidesteps the guard (`posix.kill`, `posix.fork`, `posix.unlink`) reaches the file system,
network and processes with the job's rights; as root, the machine's. A root job's programs run as
a uid of their own when the interpreter is reachable by one (guard_drops_root), which brings back
RLIMIT_NPROC and keeps root's files and processes safe.
"""

from __future__ import annotations

import subprocess
import tempfile
import threading
from functools import lru_cache

from spmdsplit.sandbox import launch, protocol, reaper
from spmdsplit.sandbox.limits import Limits
from spmdsplit.sandbox.runner import GUARD, NAMESPACES

AUTO = "auto"
LEVELS = (AUTO, NAMESPACES, GUARD)
PROBE_TIMEOUT_S = 30.0


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program): it could not be set up or started."""


@lru_cache(maxsize=1)
def namespaces_work() -> str:
    """"" when a program can be run under namespaces here, else why not: the runner's whole
    namespace set-up done for real, once per process, on an empty program (a root folder that is
    still writable, or Python's folders out of reach, fail it too)."""
    folder = tempfile.mkdtemp(prefix="spmdsplit-sandbox-probe-")
    try:
        limits = Limits()
        try:
            stdout, stderr, returncode = _run_probe(launch.request(NAMESPACES, folder, 0, limits, 5.0, None), folder)
        except (OSError, subprocess.SubprocessError) as e:
            return f"{type(e).__name__}: {e}"
        events = []
        for line in stdout.splitlines():
            try:
                events.append(protocol.decode(line))
            except ValueError:
                return f"unreadable probe report {line[:200]!r}"
        kinds = [event.get("e") for event in events]
        if kinds == [protocol.READY, protocol.DONE]:
            return ""
        why = next((event.get("why") for event in events if event.get("e") == protocol.SETUP_ERROR), None)
        return str(why or f"probe exited {returncode}: {stderr.decode(errors='replace')[-500:]}")
    finally:
        reaper.remove_folder(folder)


def _run_probe(request: bytes, folder: str) -> tuple[bytes, bytes, int]:
    """The runner's report, stderr and exit status. Its stdin stays open until its report ends
    (closing it first would tell the runner that the rank is gone)."""
    runner = subprocess.Popen(launch.command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              cwd=folder, env=launch.environment(folder), start_new_session=True)
    watchdog = threading.Timer(PROBE_TIMEOUT_S, reaper.kill_group, (runner.pid,))
    watchdog.start()
    try:
        runner.stdin.write(request)
        runner.stdin.flush()
        stdout = runner.stdout.read()
        runner.stdin.close()
        stderr = runner.stderr.read()
        return stdout, stderr, runner.wait()
    finally:
        watchdog.cancel()
        if runner.poll() is None:
            reaper.kill_group(runner.pid)
        runner.wait()


def resolve(requested: str) -> tuple[str, str]:
    """(the level programs get, why namespaces are not used or "")."""
    if requested not in LEVELS:
        raise ValueError(f"reward.sandbox.isolation={requested!r}: expected one of {', '.join(LEVELS)}")
    if requested == GUARD:
        return GUARD, "reward.sandbox.isolation=guard"
    why = namespaces_work()
    if not why:
        return NAMESPACES, ""
    if requested == NAMESPACES:
        raise SandboxError(f"reward.sandbox.isolation=namespaces, but namespaces do not work here: {why}")
    return GUARD, why


def describe(level: str, why: str, limits: Limits, workers: int) -> str:
    """The one line the job prints at start about its programs' isolation and limits."""
    first = limits.timeout_s / 2
    terms = (f"{limits.timeout_s:g} s a test ({first:g} s in the first run of all tests), {limits.memory_mb} MB of "
             f"address space, {limits.max_processes} processes, {limits.max_open_files} open files, "
             f"{limits.max_output_mb} MB of output; {workers} at once")
    if level == NAMESPACES:
        who = "a uid of their own" if launch.runs_as_root() else "the job's user"
        return (f"code sandbox: namespaces (user, PID, mount, network, IPC: no network, the file system read-only "
                f"but a {limits.max_output_mb} MB tmpfs folder, as {who}); {terms}")
    if launch.runs_as_root():
        who = "a uid of their own" if launch.guard_drops_root() else "root, with no process limit"
    else:
        who = "the job's user"
    return (f"WARNING: code sandbox: guard only ({why}): resource limits and verl's Python-level guard, which a "
            f"program can undo; no file system, network or process isolation; programs run as {who}; {terms}")
