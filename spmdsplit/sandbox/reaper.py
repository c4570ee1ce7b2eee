"""The end of a program's run, on the rank's side: its processes killed, its folder removed."""

from __future__ import annotations

import os
import shutil
import signal
import stat


def kill_group(pgid: int) -> None:
    """SIGKILL to a runner that did not end when told, and its group (it leads one: started in a
    session of its own; the program has a group of its own). The program's process then gets its
    parent-death signal, and under namespaces the kernel kills the rest of its PID namespace."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_uid(uid: int, rounds: int = 50) -> int:
    """SIGKILL to every process whose real uid is `uid` (a uid of one program's alone: guard, root
    job), until none is left or `rounds` passes; the processes left. Reaches what left the process
    group (a setsid, a double fork), which the group kill misses."""
    for _ in range(rounds):
        found = processes_of(uid)
        if not found:
            return 0
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return len(processes_of(uid))


def processes_of(uid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status", "rb") as status:
                    for line in status:
                        if line.startswith(b"Uid:"):
                            if int(line.split()[1]) == uid:
                                found.append(int(entry))
                            break
            except (OSError, ValueError):
                continue
    return found


def remove_folder(folder: str) -> None:
    """The program's folder and anything in it, whatever modes the program left on it."""
    def unlock_and_retry(function, path, _error):
        try:
            os.chmod(os.path.dirname(path), stat.S_IRWXU)
            os.chmod(path, stat.S_IRWXU)
            function(path)
        except OSError:
            pass

    shutil.rmtree(folder, onerror=unlock_and_retry)
