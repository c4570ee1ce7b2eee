"""The resource limits of the program's process (runner side, standard library only), set by the
process itself before it loads the program, and inherited by whatever it starts."""

from __future__ import annotations

import math
import os
import resource

MB = 1 << 20


def user_tasks(uid: int) -> int:
    """Processes and threads whose real uid is `uid`, machine-wide (what RLIMIT_NPROC counts for a
    uid outside any user namespace of its own)."""
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", "rb") as status:
                fields = dict(line.split(b":", 1) for line in status if b":" in line)
        except OSError:  # gone meanwhile
            continue
        if int(fields[b"Uid"].split()[0]) == uid:
            count += int(fields[b"Threads"])
    return count


def apply(limits: dict, tasks_now: int) -> None:
    """`limits`: the request's {"memory_mb", "max_processes", "max_open_files", "max_output_mb",
    "cpu_s"}; `tasks_now`: what RLIMIT_NPROC already counts for this process's uid (the kernel
    compares that count, threads included, with the limit at each fork or new thread)."""
    cpu = math.ceil(limits["cpu_s"])

    def cap(kind: int, soft: int, hard: int | None = None) -> None:
        hard = soft if hard is None else hard
        ceiling = resource.getrlimit(kind)[1]  # a process may lower its hard limits, never raise them
        if ceiling != resource.RLIM_INFINITY:
            soft, hard = min(soft, ceiling), min(hard, ceiling)
        resource.setrlimit(kind, (soft, hard))

    cap(resource.RLIMIT_AS, limits["memory_mb"] * MB)
    # The hard limit a second later: past the soft one the kernel sends SIGXCPU, which PID 1 of a
    # PID namespace (the program, under namespaces) ignores; past the hard one, SIGKILL.
    cap(resource.RLIMIT_CPU, cpu, cpu + 1)
    cap(resource.RLIMIT_NOFILE, limits["max_open_files"])
    cap(resource.RLIMIT_NPROC, tasks_now + limits["max_processes"])
    # One file's size; Python ignores SIGXFSZ, so a write past it fails with EFBIG.
    cap(resource.RLIMIT_FSIZE, limits["max_output_mb"] * MB)
    cap(resource.RLIMIT_CORE, 0)
