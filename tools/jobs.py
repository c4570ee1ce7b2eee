"""Running one `torchrun -m spmdsplit.train` job for a tool, and reading back what it left: the
Chrome-trace timeline (which rank sits in which pool, each rank's peak memory) and the
TensorBoard scalars, and the device the jobs run on. Shared by the benches (tools/bench/), the
device checks (tools/device/) and tools.plan, so that none of them has to import another for it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys


class BenchError(RuntimeError):
    """A job that failed or left nothing to read; the message carries its stderr tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_device(overrides: list[str], nproc: int) -> str:
    """The device every job runs on: trainer.device if set, else cuda when there is a GPU per
    rank (torchrun puts rank r on cuda:r), else cpu. Passed to every job, so the label is true."""
    for o in reversed(overrides):
        if o.startswith("trainer.device=") and o.split("=", 1)[1] != "auto":
            return o.split("=", 1)[1]
    import torch

    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= nproc else "cpu"


def read_scalars(log_dir: str) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def torchrun_job(nproc: int, args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """`torchrun -m spmdsplit.train *args`: the job as a user starts it, what a benchmark measures."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), "-m", "spmdsplit.train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


# How the tools start a job: real torchrun. The test suite swaps in its warm launcher
# (tests/support/launch.py), which runs the same entry point in forked ranks, to check the tools'
# harness without paying every job's start-up; what the tools measure stays torchrun's.
LAUNCH = torchrun_job


def run_job(nproc: int, overrides: list[str], job_dir: str, timeout: float = 3600) -> tuple[dict, dict]:
    """One `torchrun -m spmdsplit.train` job; returns (timeline trace, TensorBoard scalars)."""
    tb, timeline = os.path.join(job_dir, "tb"), os.path.join(job_dir, "timeline.json")
    args = ["trainer.progress_bar=false", f"trainer.log_dir={tb}", f"trainer.timeline={timeline}", "trainer.output_dir=",
            # every mode starts from step 1, whatever checkpoints lie in the working folder
            "trainer.resume=disable", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    os.makedirs(job_dir, exist_ok=True)
    result = LAUNCH(nproc, args, env, timeout)
    command = " ".join(map(str, result.args))
    with open(os.path.join(job_dir, "log.txt"), "w") as f:
        f.write(command + "\n\n" + result.stdout + "\n" + result.stderr)
    if result.returncode != 0 or not os.path.isfile(timeline):
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-40:])
        raise BenchError(f"job failed (exit {result.returncode}): {command}\n--- output tail ---\n{tail}")
    with open(timeline) as f:
        return json.load(f), read_scalars(tb)


# ------------------------------------------------------------------ reading a job's timeline

def pools_by_rank(trace: dict) -> dict[int, str]:
    """rank -> "actor" | "critic" | "actor+critic", from the "rank r (pool)" process names."""
    pools = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "M" and e.get("name") == "process_name":
            name = e["args"]["name"]
            pools[e["pid"]] = name[name.find("(") + 1: name.rfind(")")] if "(" in name else "?"
    return pools


def peak_memory(trace: dict, pools: dict[int, str], counter: str = "peak_memory") -> list[dict]:
    """Every `peak_memory` counter of the timeline (or another of the timer's memory counters:
    `memory_before_models`), by rank: RSS and CUDA max allocated (MB)."""
    rows = [{"rank": e["pid"], "pool": pools.get(e["pid"], "?"), "rss_mb": e["args"].get("rss_mb"),
             "cuda_max_allocated_mb": e["args"].get("cuda_max_allocated_mb")}
            for e in trace.get("traceEvents", []) if e.get("ph") == "C" and e.get("name") == counter]
    return sorted(rows, key=lambda r: r["rank"])
