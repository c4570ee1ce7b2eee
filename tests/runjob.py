"""Runs `torchrun -m spmdsplit.train` as a user would, and reads what it leaves behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from tests.multiproc import free_port


def torchrun(nproc: int, *overrides: str, timeout: float = 600, cwd=None) -> subprocess.CompletedProcess:
    if not any(o.startswith("trainer.default_local_dir=") for o in overrides):
        # Never resume from (or write to) checkpoints another run left in the working folder.
        overrides = (f"trainer.default_local_dir={tempfile.mkdtemp(prefix='spmdsplit-ckpt-')}", *overrides)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}", "-m", "spmdsplit.train", "trainer.progress_bar=false", *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def timeline_events(path: str) -> list[dict]:
    with open(path) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def overlapping_steps(events: list[dict], a_name: str, a_ranks, b_name: str, b_ranks) -> list[int]:
    """Steps in which phase `a_name` on some rank of `a_ranks` and `b_name` on some rank of
    `b_ranks` ran at the same time (their [ts, ts+dur) intervals intersect)."""
    def spans(name, ranks):
        out = {}
        for e in events:
            if e["name"] == name and e["pid"] in ranks:
                out.setdefault(e["args"]["step"], []).append((e["ts"], e["ts"] + e["dur"]))
        return out

    a, b = spans(a_name, set(a_ranks)), spans(b_name, set(b_ranks))
    return sorted(
        s for s in a.keys() & b.keys()
        if any(x0 < y1 and y0 < x1 for x0, x1 in a[s] for y0, y1 in b[s])
    )
