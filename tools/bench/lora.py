"""`python -m tools.bench.lora [--rank 8] [--hidden 768 --layers 12 ...] [key=value ...]`

LoRA beside full fine-tuning, in one run (docs/lora.md): the same job twice on a random Qwen2 of the
given shape (default: the 76.0M shape of tools.bench.memory), GRPO with generation on a pool of its
own (configs/grpo_rollout_actor.yaml: rank 0 the actor and its reference, rank 1 the rollout
engine), once fully fine-tuned and once with `model.lora_rank`. Side by side, with LoRA / full:

- the actor rank's peak memory (the timeline's `peak_memory`: RSS on CPU, CUDA max allocated on
  GPU) and the same less the rank's memory before any model was built (`memory_before_models`:
  the interpreter, torch and transformers, ~0.4-0.5 GB of RSS per CPU process that no model
  choice changes), for issue 39's target of <= 35 % for actor + reference;
- the bytes the rollout engine takes per sync (the timeline's sync_weights `bytes`), target <= 3 %;
- the actor's part of a checkpoint on disk, and the median step time.

Writes bench_lora.json / .md into --out.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile

from tools.jobs import BenchError, peak_memory, pools_by_rank, run_job
from tools.models import add_shape_flags, build_random_qwen2
from tools.report import fmt, write_report

# The GRPO layout, short rows (tools.bench.memory's workload, with rollout.n >= 2 for GRPO's groups).
WORKLOAD = ["--config", "configs/grpo_rollout_actor.yaml", "data.train_batch_size=8", "rollout.n=2",
            "data.max_prompt_length=16", "data.max_response_length=16", "actor.ppo_mini_batch_size=8",
            "actor.ppo_micro_batch_size_per_gpu=4", "actor.log_prob_micro_batch_size_per_gpu=4",
            "ref.log_prob_micro_batch_size_per_gpu=4"]
TARGETS = {"memory": 0.35, "sync_bytes": 0.03}
RETURN_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}  # as tools.bench.memory


def folder_mb(path: str) -> float:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files) / 2**20


def measure(trace: dict, scalars: dict, ckpt: str, steps: int) -> dict:
    pools = pools_by_rank(trace)
    actor = next(r for r, pool in pools.items() if "actor" in pool)

    def mb(counter: str) -> float:
        row = [r for r in peak_memory(trace, pools, counter) if r["rank"] == actor][-1]
        return row["cuda_max_allocated_mb"] or row["rss_mb"]

    syncs = [e["args"]["bytes"] for e in trace.get("traceEvents", [])
             if e.get("name") == "sync_weights" and "bytes" in e.get("args", {})]
    step_times = [t for step, t in sorted(scalars.get("timing_s/step", {}).items()) if step > 1]
    peak, before = mb("peak_memory"), mb("memory_before_models")
    return {"actor_peak_mb": peak, "actor_before_models_mb": before, "actor_models_mb": peak - before,
            "sync_bytes": max(syncs) if syncs else None, "syncs": len(syncs),
            "actor_checkpoint_mb": folder_mb(os.path.join(ckpt, f"global_step_{steps}", "actor")),
            "step_s": statistics.median(step_times) if step_times else None}


ROWS = [("actor rank peak (MB)", "actor_peak_mb", "{:.0f}"),
        ("  less the rank before any model (MB)", "actor_models_mb", "{:.0f}"),
        ("bytes per sync to the engine", "sync_bytes", "{:,.0f}"),
        ("actor's checkpoint (MB)", "actor_checkpoint_mb", "{:.2f}"),
        ("median step (s)", "step_s", "{:.2f}")]


def render(report: dict) -> str:
    meta, full, adapter = report["meta"], report["full"], report["lora"]
    lines = [f"LoRA (rank {meta['rank']}, alpha {meta['alpha']}) beside full fine-tuning: random Qwen2 "
             f"{meta['params'] / 1e6:.1f}M params (hidden {meta['hidden']}, {meta['layers']} layers), {meta['steps']} "
             f"steps of GRPO on rollout | actor, {meta['device']}, torch {meta['torch']}, {meta['date']}",
             f"Workload: `{' '.join(meta['workload'])}`", "",
             "| | full | LoRA | LoRA / full |", "|---|---|---|---|"]
    for label, key, spec in ROWS:
        ratio = adapter[key] / full[key] if full.get(key) and adapter.get(key) is not None else None
        lines.append(f"| {label} | {fmt(full.get(key), spec)} | {fmt(adapter.get(key), spec)} | {fmt(ratio, '{:.3f}')} |")
    r = report["ratios"]
    lines += ["", f"Actor + reference memory, LoRA / full: {fmt(r['memory_models'], '{:.2f}')} of what the models take "
              f"(peak less the rank before them), {fmt(r['memory_peak'], '{:.2f}')} of the whole peak "
              f"(target <= {TARGETS['memory']}). Bytes per sync: {fmt(r['sync_bytes'], '{:.4f}')} of a full sync "
              f"(target <= {TARGETS['sync_bytes']}).",
              "Peak = RSS (ru_maxrss) on CPU, torch.cuda.max_memory_allocated on GPU. Full fine-tuning holds the "
              "policy's fp32 masters, gradients and AdamW moments and a reference copy; LoRA the frozen base "
              "(the reference is the base with the adapter off) and the adapter's.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tools.bench.lora", description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    add_shape_flags(p)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cpu", help="trainer.device of both jobs (cpu | cuda)")
    p.add_argument("--out", default="outputs/bench_lora")
    p.add_argument("overrides", nargs="*", help="key=value train overrides for both jobs")
    args = p.parse_args(argv)

    import torch

    os.makedirs(args.out, exist_ok=True)
    os.environ.update(RETURN_FREED_MEMORY)  # run_job hands the environment to torchrun
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as folder:
        model = os.path.join(folder, "model")
        params = build_random_qwen2(model, args.hidden, args.layers, args.heads, args.kv_heads, args.mlp,
                                    long_answers=True)
        workload = [*WORKLOAD, f"model.path={model}", f"trainer.total_steps={args.steps}",
                    f"trainer.device={args.device}", f"trainer.save_freq={args.steps}", *args.overrides]
        for name, extra in (("full", []), ("lora", [f"model.lora_rank={args.rank}", f"model.lora_alpha={args.alpha}"])):
            ckpt = os.path.join(folder, f"ckpt-{name}")
            print(f"bench_lora: {name}", file=sys.stderr, flush=True)
            try:
                trace, scalars = run_job(2, workload + extra + [f"trainer.default_local_dir={ckpt}"],
                                         os.path.join(args.out, name))
            except BenchError as e:
                print(f"bench_lora: error: {e}", file=sys.stderr)
                return 1
            results[name] = measure(trace, scalars, ckpt, args.steps)
    full, adapter = results["full"], results["lora"]
    ratios = {"memory_peak": adapter["actor_peak_mb"] / full["actor_peak_mb"],
              "memory_models": adapter["actor_models_mb"] / full["actor_models_mb"],
              "sync_bytes": adapter["sync_bytes"] / full["sync_bytes"] if full["sync_bytes"] else None}
    meta = {"params": params, "rank": args.rank, "alpha": args.alpha, "hidden": args.hidden, "layers": args.layers,
            "steps": args.steps, "device": args.device, "torch": torch.__version__,
            "workload": [w for w in workload if not w.startswith("model.path=")],
            "date": datetime.datetime.now().isoformat(timespec="seconds")}
    report = {"schema": "spmdsplit.bench_lora/1", "meta": meta, "full": full, "lora": adapter, "ratios": ratios,
              "targets": TARGETS}
    write_report(args.out, "bench_lora", report, render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
