"""A failing rank ends the whole job within seconds, on any backend, its error shown.

The rank that raises prints one line saying where (rank, pool, phase, step) and what, then its
traceback, writes a failure notice into the job's store (the c10d store every rank already
shares, under torchrun as under one Slurm task per rank), and leaves with `os._exit(1)`: no
graceful `destroy_process_group`, which on NCCL waits for pending point-to-point work and could
hold the rank forever. Its groups are aborted first (best effort, bounded).

Every rank runs a small watch thread that polls the store for a notice; a rank that sees one
prints whose failure it stops for and leaves the same way, whatever it was waiting on. So a pool
blocked in a receive from the failed rank, or in a collective with it, finds out within a
second or two instead of at a timeout. The failing rank waits (at most 2.5 s) until the others
have shown the notice, because the launcher kills them the moment it exits. Launchers do the same for ranks that die without raising
(a kill, an OOM): torchrun tears the job down, `srun --kill-on-bad-exit=1` too.

A rank that cannot reach the store while the job runs (the store's host, rank 0 or the torchrun
agent, is gone) treats that as a failure too. At the end of a run every rank stops watching
before anyone leaves (a final barrier in the trainer), so a normal exit is never mistaken for one.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback

import torch.distributed as dist

NOTICE = "spmdsplit/failed"
SEEN = "spmdsplit/failure_seen"  # how many other ranks have shown the notice
POLL_S = 1.0

_where: dict = {}  # the innermost phase an exception left: {"phase": ..., "step": ...}
_watch: "FailureWatch | None" = None


def note_phase(name: str, step: int) -> None:
    """Called by the phase timer when an exception leaves a phase; the innermost one wins."""
    if not _where:
        _where.update(phase=name, step=step)


def describe_where(rank: int, role: str) -> str:
    where = f"rank {rank} ({role})"
    if _where:
        where += f", phase {_where['phase']}, step {_where['step']}"
    return where


class FailureWatch:
    def __init__(self, rank: int, role: str):
        self.rank, self.role = rank, role
        self.store = dist.distributed_c10d._get_default_store()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="spmdsplit-failure-watch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(POLL_S):
            try:
                failed = self.store.check([NOTICE])
                notice = self.store.get(NOTICE).decode() if failed else None
            except Exception as e:  # noqa: BLE001 - the store's host is gone: the job is ending
                if self.stopped.is_set():
                    return
                notice = f"the job's store cannot be reached ({type(e).__name__}); its host (rank 0 or the launcher) is gone"
            if notice and not self.stopped.is_set():
                _leave(f"spmdsplit [rank {self.rank}]: stopping: {notice}", code=1, seen=self.store)

    def stop(self) -> None:
        self.stopped.set()


def start_watch(rank: int, role: str) -> None:
    global _watch
    _watch = FailureWatch(rank, role)


def stop_watch() -> None:
    if _watch is not None:
        _watch.stop()


def fail(exc: BaseException, rank: int, role: str) -> None:
    """The error path of a rank after the world formed: report, tell the others, leave now."""
    if _watch is not None:
        _watch.stop()
    where = describe_where(rank, role)
    summary = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
    try:
        store = dist.distributed_c10d._get_default_store()
        # Atomic: the first failure's notice is the one every rank shows.
        notice = store.compare_set(NOTICE, "", f"{where} failed: {summary}").decode()
    except Exception:  # noqa: BLE001 - the store may be gone with its host; the launcher then ends the job
        notice = None
    if notice and not notice.startswith(where + " "):
        # Another rank failed first; this error is most likely the echo of it (a closed connection).
        _leave(f"spmdsplit [rank {rank}]: stopping: {notice} (here: {summary})", code=1, seen=store)
    print(f"spmdsplit [{where}]: error: {summary}", file=sys.stderr, flush=True)
    traceback.print_exception(exc, file=sys.stderr)
    if notice is not None:
        _wait_until_seen(store, dist.get_world_size() - 1, timeout_s=2.5 * POLL_S)
    _leave(None, code=1)


def _wait_until_seen(store, others: int, timeout_s: float) -> None:
    """The launcher kills the other ranks as soon as this one exits (torchrun polls every 0.1 s),
    before their watch (every POLL_S) has shown why they stop; so the failing rank stays a moment,
    bounded, until they have."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if store.add(SEEN, 0) >= others:
                return
        except Exception:  # noqa: BLE001 - the store is gone: nobody is left to wait for
            return
        time.sleep(0.05)


def _leave(message: str | None, code: int, seen=None) -> None:
    if message:
        print(message, file=sys.stderr, flush=True)
    if seen is not None:
        try:
            seen.add(SEEN, 1)
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
    _abort_groups()
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code)


def _abort_groups(timeout_s: float = 5.0) -> None:
    """Aborts the communicators (NCCL's pending work is dropped, not waited for), at most
    `timeout_s`: leaving matters more than leaving tidily."""
    if not dist.is_initialized():
        return
    done = threading.Event()

    def abort():
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
        done.set()

    threading.Thread(target=abort, daemon=True).start()
    done.wait(timeout_s)
    time.sleep(0)  # let the abort thread print nothing half-way
