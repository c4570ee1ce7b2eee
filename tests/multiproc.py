"""Runs a function on N real processes joined in a gloo world: the way multi-rank tests run here.

`run_ranks(fn, world_size, *args)` starts one spawned process per rank with RANK/WORLD_SIZE/
MASTER_* set and the default process group initialised, calls `fn(rank, world_size, *args)`,
and returns the list of what each rank returned. A rank that raises fails the test with its
traceback; ranks still alive after `timeout` seconds are killed and the test fails, so a hang
(a collective one side never joins) shows up as a failure, not a stuck suite.
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue, local_world_size):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % local_world_size),
        LOCAL_WORLD_SIZE=str(local_world_size),
    )
    import torch

    torch.set_num_threads(1)
    if os.environ.get("SPMDSPLIT_P2P_CONTRACT") == "1":  # tests/conftest.py: NCCL's rules, not gloo's
        from tests import nccl_p2p

        nccl_p2p.install()
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
        result = fn(rank, world_size, *args)
        # Plain pickle, not torch's shared-memory reduction: the tensors must outlive this process.
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 120, local_world_size: int | None = None):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, local_world_size or world_size))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results, errors = {}, {}
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            rank, status, payload = queue.get(timeout=min(remaining, 1.0))
        except queue_mod.Empty:
            if errors and all(not p.is_alive() or i in errors for i, p in enumerate(procs)):
                break
            continue
        (results if status == "ok" else errors)[rank] = payload
        if errors:
            # One rank failed: give the others a moment to report, then stop waiting for them.
            deadline = min(deadline, time.monotonic() + 10)
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()) if not errors else 2)
    hung = [i for i, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if errors:
        msg = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise AssertionError(f"rank(s) {sorted(errors)} failed:\n{msg}")
    if hung:
        raise AssertionError(f"rank(s) {hung} still running after {timeout}s (hang) and were killed")
    return [pickle.loads(results[r]) for r in range(world_size)]
