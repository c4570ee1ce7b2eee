"""Step time per training engine: FSDP2 and DeepSpeed ZeRO-1/2/3, the same engine on both pools.

    python -m tools.bench.engines [--nproc 2] [--steps 12] [--engines fsdp zero1 zero2 zero3] [key=value ...]

Each engine is a real `torchrun -m spmdsplit.train` job in split placement (default 1+1 on two
ranks, one per core) on the same workload; the numbers come from what the job leaves behind
(TensorBoard step times, the timeline's phases), medians over the steps after `--warmup`.
`start_s` is the job's wall time minus the sum of its step times: process start, model build,
engine set-up (for DeepSpeed: its import, backend and ZeRO set-up) and shutdown (no HF export).
Writes `bench_engines.json` and `bench_engines.md` into `--out` and prints the Markdown.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

from tools.bench.analysis import analyze
from tools.bench.modes import SHORT_WORKLOAD
from tools.jobs import run_job
from tools.report import write_report

ENGINES = {
    "fsdp": [],
    **{f"zero{s}": ["actor.engine=deepspeed", f"actor.zero_stage={s}", "critic.engine=deepspeed",
                    f"critic.zero_stage={s}"] for s in (1, 2, 3)},
}
COLUMNS = [("step", None), ("update_actor", "actor"), ("update_critic", "critic"), ("sync_weights", "actor"),
           ("old_log_prob", "actor"), ("ref", "actor"), ("values", "critic")]


def render(report: dict) -> str:
    meta = report["meta"]
    lines = [f"Engines, {meta['nproc']} ranks split, {meta['steps']} steps, medians after step {meta['warmup']} "
             f"({meta['device']}, torch {meta['torch']}, deepspeed {meta['deepspeed']}, {meta['date']})", "",
             "| engine | " + " | ".join(f"{name} (s)" for name, _ in COLUMNS) + " | start (s) | job wall (s) |",
             "|---" * (len(COLUMNS) + 3) + "|"]
    for engine, row in report["engines"].items():
        cells = []
        for name, pool in COLUMNS:
            value = row["step_time_s"] if pool is None else row["phases"].get(pool, {}).get(name)
            cells.append("n/a" if value is None else f"{value:.3f}")
        lines.append(f"| {engine} | " + " | ".join(cells) + f" | {row['start_s']:.1f} | {row['wall_s']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--engines", nargs="+", choices=list(ENGINES), default=list(ENGINES))
    p.add_argument("--out", default="outputs/bench_engines")
    p.add_argument("overrides", nargs="*", help="key=value train overrides for every engine")
    args = p.parse_args(argv)

    import deepspeed
    import torch

    workload = SHORT_WORKLOAD + [f"trainer.total_steps={args.steps}", "trainer.device=cpu", *args.overrides]
    engines = {}
    for engine in args.engines:
        print(f"bench_engines: {engine}", file=sys.stderr, flush=True)
        start = time.time()
        trace, scalars = run_job(args.nproc, workload + ENGINES[engine], os.path.join(args.out, engine))
        wall = time.time() - start
        row = analyze(trace, scalars, args.warmup)
        row.update(overrides=ENGINES[engine], wall_s=wall,
                   start_s=wall - sum(scalars.get("timing_s/step", {}).values()))
        engines[engine] = row
    meta = {"nproc": args.nproc, "steps": args.steps, "warmup": args.warmup, "device": "cpu",
            "torch": torch.__version__, "deepspeed": deepspeed.__version__, "workload": workload,
            "date": datetime.datetime.now().isoformat(timespec="seconds")}
    report = {"meta": meta, "engines": engines}
    write_report(args.out, "bench_engines", report, render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
