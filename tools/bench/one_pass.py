"""The old log-probs from the update's own forward against a separate old_log_prob pass, side by side.

    python -m tools.bench.one_pass [--steps 6] [--warmup 2] [key=value ...]

The GRPO preset (configs/grpo_rollout_actor.yaml: rollout | actor 1+1 on two ranks, one step
off-policy, token importance weights) on a random Qwen2 that answers at length (every response
runs to data.max_response_length=64: 32 prompts x 4 = 128 responses of 64 tokens), with one
mini-batch (actor.ppo_mini_batch_size=32), so the update is one pass (roles/actor.py
update_is_one_pass). Two real `torchrun` jobs, `actor.old_log_prob_from_update` true and false;
printed: the phases' medians per pool after `--warmup` steps, the step time, and how far apart the
two jobs' metrics are. Writes `bench_one_pass.json` and `.md` into `--out`.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

from tools.bench.analysis import analyze
from tools.bench.modes import GEN_HEAVY_MODEL
from tools.jobs import run_job
from tools.models import build_random_qwen2
from tools.report import write_report

WORKLOAD = ["--config", "configs/grpo_rollout_actor.yaml", "data.max_response_length=64",
            "actor.ppo_mini_batch_size=32", "actor.ppo_micro_batch_size_per_gpu=16",
            "actor.log_prob_micro_batch_size_per_gpu=16", "rollout.kv_cache_memory_gb=0.25", "trainer.device=cpu"]
VARIANTS = {"separate pass": ["actor.old_log_prob_from_update=false"], "from the update": []}
TRAIN_PHASES = ("old_log_prob", "ref", "update_actor", "exchange/generated", "sync_weights")
GEN_PHASES = ("gen", "sync_weights")


def metric_gaps(a: dict[str, dict[int, float]], b: dict[str, dict[int, float]]) -> dict[str, float]:
    """The largest |a - b| over the steps, per metric the two share (timings left out)."""
    gaps = {}
    for name in sorted(set(a) & set(b)):
        if not name.startswith(("timing", "perf")):
            gaps[name] = max((abs(a[name][s] - b[name][s]) for s in a[name] if s in b[name]), default=0.0)
    return gaps


def render(report: dict) -> str:
    variants, meta = report["variants"], report["meta"]
    lines = [f"GRPO rollout | actor 1+1, 128 responses x 64 tokens, one mini-batch; medians of steps "
             f"{meta['warmup'] + 1}-{meta['steps']} (s), {meta['date']}", "",
             "| pool | phase | " + " | ".join(variants) + " |", "|---|---|" + "---|" * len(variants)]
    for pool, phases in (("train", TRAIN_PHASES), ("gen", GEN_PHASES)):
        for phase in phases:
            cells = [row["phases"].get(row["pool_names"][pool], {}).get(phase) for row in variants.values()]
            lines.append(f"| {pool} | {phase} | " + " | ".join("-" if c is None else f"{c:.3f}" for c in cells) + " |")
    lines.append("| | **step** | " + " | ".join(f"**{row['step_time_s']:.3f}**" for row in variants.values()) + " |")
    lines += ["", "Largest gap between the two jobs' metrics over the steps (ratio-based ones are 0 vs float noise):", ""]
    lines += [f"- {name}: {gap:.2e}" for name, gap in report["metric_gaps"].items() if gap > 0]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="outputs/bench_one_pass")
    p.add_argument("overrides", nargs="*", help="key=value train overrides for both jobs")
    args = p.parse_args(argv)

    model = os.path.join(args.out, "long_answers_model")
    if not os.path.isfile(os.path.join(model, "config.json")):
        build_random_qwen2(model, **GEN_HEAVY_MODEL, long_answers=True)
    workload = WORKLOAD + [f"model.path={os.path.abspath(model)}", f"trainer.total_steps={args.steps}", *args.overrides]
    variants, scalars = {}, {}
    for name, extra in VARIANTS.items():
        print(f"bench_one_pass: {name}", file=sys.stderr, flush=True)
        trace, scalars[name] = run_job(2, workload + extra, os.path.join(args.out, name.replace(" ", "_")))
        row = analyze(trace, scalars[name], args.warmup)
        row["pool_names"] = {("gen" if "rollout" in pool else "train"): pool for pool in row["pools"].values()}
        variants[name] = row
    meta = {"steps": args.steps, "warmup": args.warmup, "workload": workload,
            "date": datetime.datetime.now().isoformat(timespec="seconds")}
    report = {"meta": meta, "variants": variants, "metric_gaps": metric_gaps(*scalars.values())}
    write_report(args.out, "bench_one_pass", report, render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
