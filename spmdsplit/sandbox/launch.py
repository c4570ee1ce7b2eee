"""How the rank starts a runner (spmdsplit/sandbox/runner.py): its command line, environment,
user, and request. Shared by the start-up probe (isolation.py) and the pool (pool.py)."""

from __future__ import annotations

import os
import stat
import sys
from functools import lru_cache
from pathlib import Path

from spmdsplit.sandbox import protocol
from spmdsplit.sandbox.limits import Limits
from spmdsplit.sandbox.runner import BOOT, GUARD, NAMESPACES

# Programs run as uids of their own when the job is root: UID_BASE + this process's PID (mod
# 2**20) * SLOTS + a slot, unique among the programs of all ranks of a machine at any one time.
UID_BASE = 1 << 30
SLOTS = 1024

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder holding this spmdsplit


@lru_cache(maxsize=1)
def runner_paths() -> tuple[str, ...]:
    """The runner's sys.path: this spmdsplit first, then the rank's own (so a program imports what
    it would in verl, whose programs run in the trainer's Python: numpy, say)."""
    paths = [_PACKAGE_ROOT]
    for path in sys.path:
        path = os.path.abspath(path or os.curdir)
        if path not in paths and os.path.isdir(path):
            paths.append(path)
    return tuple(paths)


def command() -> list[str]:
    # -I: no environment variables, no user site, not the script's folder on sys.path; -S: no
    # site (runner_paths already holds what site would add).
    return [sys.executable, "-I", "-S", "-c", BOOT, *runner_paths()]


def environment(folder: str) -> dict[str, str]:
    """The program's whole environment: nothing of the job's (tokens, keys, PYTHONPATH...)."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_MAIN_FREE": "1", "GOTOBLAS_MAIN_FREE": "1"}


def program_uid(slot: int) -> int:
    return UID_BASE + (os.getpid() % (1 << 20)) * SLOTS + slot % SLOTS


def _closed_ancestor(path: str) -> str | None:
    """The outermost folder above `path` that others may not search (mode without o+x), if any."""
    parts = Path(path).parts
    for depth in range(1, len(parts)):
        ancestor = str(Path(*parts[:depth]))
        if not os.stat(ancestor).st_mode & stat.S_IXOTH:
            return ancestor
    return None


def _outermost(paths: list[str]) -> list[str]:
    """`paths` less those inside another of them."""
    return [p for p in paths if not any(p != q and p.startswith(q.rstrip(os.sep) + os.sep) for q in paths)]


@lru_cache(maxsize=1)
def hidden_directories() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The runner's sys.path folders that an unprivileged uid cannot reach, grouped by the
    outermost folder on the way that it may not search: ((ancestor, (folder, ...)), ...). Empty
    where Python and its packages lie open (/usr, /opt); ((/root, (...)),) for a Python under a
    0700 home. A root job's programs get them back by bind mounts (namespaces.expose)."""
    groups: dict[str, list[str]] = {}
    for path in runner_paths():
        ancestor = _closed_ancestor(path)
        if ancestor is not None:
            groups.setdefault(ancestor, []).append(path)
    return tuple((ancestor, tuple(_outermost(paths))) for ancestor, paths in groups.items())


def runs_as_root() -> bool:
    return os.geteuid() == 0


def guard_drops_root() -> bool:
    """Under guard, a root job's programs run as a uid of their own (RLIMIT_NPROC holds, and what
    only root may touch is safe) where that uid can still run Python: nothing on its path hidden."""
    interpreter = os.path.dirname(os.path.realpath(sys.executable))
    return runs_as_root() and not hidden_directories() and _closed_ancestor(interpreter + os.sep + "x") is None


def spawn_options(isolation: str, slot: int) -> dict:
    """Popen options for the runner's user: under guard a root job's own uid where allowed (set by
    the child before exec, no preexec_fn); under namespaces the runner starts as the job and maps
    itself."""
    if isolation == GUARD and guard_drops_root():
        uid = program_uid(slot)
        return {"user": uid, "group": uid, "extra_groups": []}
    return {}


def request(isolation: str, folder: str, slot: int, limits: Limits, cpu_s: float, program: dict | None) -> bytes:
    root = runs_as_root()
    return protocol.encode({
        "isolation": isolation,
        "folder": folder,
        "outer_id": program_uid(slot) if isolation == NAMESPACES and root else None,
        "hidden": [[ancestor, list(paths)] for ancestor, paths in hidden_directories()] if root else [],
        "limits": limits.for_runner(cpu_s),
        "program": program,
    })


def prepare_folder(folder: str, isolation: str, slot: int) -> None:
    """The program's folder belongs to its uid when it runs as one (guard, root job)."""
    options = spawn_options(isolation, slot)
    if options:
        os.chown(folder, options["user"], options["group"])
