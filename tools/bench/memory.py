"""`python -m tools.bench.memory [--hidden 768 --layers 12 ...] [--layouts 1+1 2+2 2+2/4] [key=value ...]`

Peak memory per rank, per layout: does a pool's ranks' peak fall as the pool grows, and does it
stay put when a rank's mini-batch is cut into more micro-batches? Builds a random Qwen2 of the
given shape locally (the embedded tokenizer's vocabulary; default: the 76.0M shape of issue 11),
saves it with `save_pretrained` into a temporary folder, and runs a short `placement.mode=split`
job per layout (1+1 on 2 ranks, 2+2 on 4; `2+2/4`: 2+2 with 4 micro-batches per mini-batch on
each rank, `2+2/4-nosync`: the same with `no_sync_accumulation`), one after the other (the
machine's memory is shared). Reads each rank's `peak_memory` counter from the job's timeline
(RSS on CPU, `torch.cuda.max_memory_allocated` on GPU) and prints MB and bytes per parameter of
one model side by side, with an actor rank's peak at the larger layout over the smaller one, and
the issue's targets next to them. Writes `bench_memory.json` / `.md` into `--out`.

RSS counts what the allocator keeps, not only live tensors: glibc raises its mmap threshold
each time a large block is freed, so later large tensors land on the heap and their memory is
never returned, and the peak RSS then says more about malloc than about the code. The jobs run
with `MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0` (freed large blocks go back to the
system) unless `--glibc-default-malloc`; on the 76M model that moves an actor rank's 2+2 peak
from ~2.8 GB to ~1.5 GB.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
import tempfile
import time

from tools.jobs import BenchError, peak_memory, pools_by_rank, run_job
from tools.models import add_shape_flags, build_random_qwen2
from tools.report import fmt, write_report

# Issue 11's workload: 2 steps, 8 prompts, short prompts and responses, mini-batch 8, micro-batch 4.
WORKLOAD = ["data.train_batch_size=8", "data.max_prompt_length=16", "data.max_response_length=16",
            "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
            "actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4",
            "actor.log_prob_micro_batch_size_per_gpu=4", "critic.forward_micro_batch_size_per_gpu=4"]
# Issue 11's targets at the larger layout, in bytes per parameter of one model.
TARGETS = {"actor_bpp": 22.0, "critic_bpp": 16.0, "actor_ratio": 0.75}
# Issue 18's: an actor rank's peak with k micro-batches per mini-batch within this of the same layout's with its own.
MICRO_TARGET_BPP = 1.0
RETURN_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


LAYOUT = re.compile(r"(\d+)\+(\d+)(?:/(\d+))?(-nosync)?")


def parse_layout(layout: str) -> tuple[int, int, int | None, bool]:
    """"a+c[/k][-nosync]" -> (actor ranks, critic ranks, micro-batches per mini-batch per rank or
    None for the workload's own, no_sync_accumulation)."""
    match = LAYOUT.fullmatch(layout)
    if not match:
        raise ValueError(f"layout {layout!r}: expected actor+critic ranks, e.g. 2+2, 2+2/4 or 2+2/4-nosync")
    a, c, k, nosync = match.groups()
    return int(a), int(c), int(k) if k else None, bool(nosync)


def micro_overrides(a: int, c: int, k: int | None, nosync: bool, workload: list[str]) -> list[str]:
    """Each pool's micro-batch cut so that a rank's mini-batch is `k` micro-batches (rollout.n = 1)."""
    if k is None:
        return [f"{role}.no_sync_accumulation=true" for role in ("actor", "critic")] if nosync else []
    opts = dict(o.split("=", 1) for o in workload if "=" in o)
    out = []
    for role, ranks in (("actor", a), ("critic", c)):
        rows = int(opts[f"{role}.ppo_mini_batch_size"]) // ranks
        if rows % k:
            raise ValueError(f"{role}: {rows} rows of a mini-batch per rank do not cut into {k} micro-batches")
        out.append(f"{role}.ppo_micro_batch_size_per_gpu={rows // k}")
        if nosync:
            out.append(f"{role}.no_sync_accumulation=true")
    return out


def layout_overrides(layout: str, workload: list[str] = ()) -> tuple[int, list[str]]:
    """"a+c[/k][-nosync]" -> (world size, overrides): split halves when a == c, else a custom split."""
    a, c, k, nosync = parse_layout(layout)
    extra = micro_overrides(a, c, k, nosync, list(workload))
    if a == c:
        return a + c, ["placement.mode=split", "placement.pools=[]", *extra]
    return a + c, ["placement.mode=custom", "placement.pool_unit=ranks_per_node", f"placement.pools=[{a},{c}]", *extra]


def peaks(trace: dict) -> list[dict]:
    """rank, pool and peak MB (CUDA max allocated where there is one, else RSS), from the last
    `peak_memory` counter of each rank (peaks only grow)."""
    last = {}
    for row in peak_memory(trace, pools_by_rank(trace)):
        last[row["rank"]] = row
    return [{"rank": r["rank"], "pool": r["pool"], "mb": r["cuda_max_allocated_mb"] or r["rss_mb"],
             "kind": "cuda" if r["cuda_max_allocated_mb"] else "rss"} for r in last.values()]


def summarize(layouts: dict[str, list[dict]], params: int) -> dict:
    """Per layout and pool: the largest rank's peak (MB, bytes/param); the actor ratio of the
    last plain layout (a+c) over the first; issue 11's targets checked at the last plain layout;
    per layout with its own micro-batching (a+c/k...), an actor rank's peak minus a+c's."""
    out = {}
    for name, rows in layouts.items():
        out[name] = {pool: max(r["mb"] for r in rows if r["pool"] == pool)
                     for pool in sorted({r["pool"] for r in rows})}
    plain = [name for name in layouts if LAYOUT.fullmatch(name) and parse_layout(name)[2:] == (None, False)]
    first, last = out[plain[0]], out[plain[-1]]
    bpp = {pool: mb * 2**20 / params for pool, mb in last.items()}
    ratio = last.get("actor", 0) / first["actor"] if first.get("actor") else None
    micro = {}
    for name in layouts:
        a, c, _, _ = parse_layout(name)
        base = f"{a}+{c}"
        if name != base and base in out and "actor" in out[name]:
            micro[name] = {"base": base, "actor_bpp": out[name]["actor"] * 2**20 / params,
                           "base_actor_bpp": out[base]["actor"] * 2**20 / params}
            micro[name]["diff_bpp"] = micro[name]["actor_bpp"] - micro[name]["base_actor_bpp"]
    return {"max_mb": out, "ratio_actor": ratio, "targets_at": plain[-1], "micro_batching": micro,
            "targets": {"actor_bpp": bpp.get("actor"), "critic_bpp": bpp.get("critic"), "actor_ratio": ratio}}


def render(report: dict) -> str:
    meta, layouts, summary = report["meta"], report["layouts"], report["summary"]
    params = meta["params"]
    names = list(layouts)
    lines = [f"Peak memory per rank: random Qwen2 {params / 1e6:.1f}M params (hidden {meta['hidden']}, "
             f"{meta['layers']} layers, {meta['heads']}/{meta['kv_heads']} heads, MLP {meta['mlp']}, vocab "
             f"{meta['vocab']}), {meta['steps']} steps on {meta['device']}, torch {meta['torch']}, {meta['date']}, "
             f"malloc env: {' '.join(f'{k}={v}' for k, v in meta.get('malloc_env', {}).items()) or 'glibc default'}",
             f"Workload: `{' '.join(meta['workload'])}`", "",
             "| layout | " + " | ".join(f"rank {i}" for i in range(max(len(v) for v in layouts.values()))) + " |",
             "|---" * (1 + max(len(v) for v in layouts.values())) + "|"]
    for name in names:
        cells = [f"{r['pool']} {r['mb']:.0f} MB = {r['mb'] * 2**20 / params:.1f} B/param" for r in layouts[name]]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    t = summary["targets"]
    at = summary.get("targets_at", names[-1])
    lines += ["", f"At {at}: actor ranks {fmt(t['actor_bpp'], '{:.1f}')} B/param (target <= "
              f"{TARGETS['actor_bpp']:.0f}), critic ranks {fmt(t['critic_bpp'], '{:.1f}')} B/param (target <= "
              f"{TARGETS['critic_bpp']:.0f}); an actor rank's peak {at} / {names[0]} = "
              f"{fmt(t['actor_ratio'], '{:.2f}')} (target <= {TARGETS['actor_ratio']}).",
              *[f"{name}: an actor rank's peak {m['actor_bpp']:.1f} B/param, {m['diff_bpp']:+.1f} B/param from "
                f"{m['base']}'s {m['base_actor_bpp']:.1f} (target within {MICRO_TARGET_BPP:.0f})."
                for name, m in summary.get("micro_batching", {}).items()],
              "Peak = RSS (ru_maxrss) on CPU, which includes the Python interpreter, torch and transformers "
              "(~0.4-0.5 GB per process), or torch.cuda.max_memory_allocated on GPU.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tools.bench.memory", description=__doc__.splitlines()[0])
    add_shape_flags(p)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--layouts", nargs="+", default=["1+1", "2+2", "2+2/4"],
                   help="actor+critic ranks, e.g. 1+1 2+2; /k: k micro-batches per mini-batch on each rank; "
                        "-nosync: with no_sync_accumulation (e.g. 2+2/4-nosync)")
    p.add_argument("--device", default="cpu", help="trainer.device of every job (cpu | cuda)")
    p.add_argument("--glibc-default-malloc", action="store_true",
                   help="leave glibc's malloc as it is (RSS then keeps freed large blocks)")
    p.add_argument("--out", default="outputs/bench_memory")
    p.add_argument("overrides", nargs="*", help="key=value train overrides for every layout")
    args = p.parse_args(argv)

    import torch

    from spmdsplit.embedded import build_tokenizer

    os.makedirs(args.out, exist_ok=True)
    malloc = {} if args.glibc_default_malloc else RETURN_FREED_MEMORY
    os.environ.update(malloc)  # run_job hands the environment to torchrun
    layouts, overrides_by_layout = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as folder:
        # Responses that run to data.max_response_length: a rollout is only as wide as its longest
        # response, and the memory model these peaks are read against sizes for the full width.
        params = build_random_qwen2(folder, args.hidden, args.layers, args.heads, args.kv_heads, args.mlp,
                                    long_answers=True)
        workload = [f"model.path={folder}", f"trainer.total_steps={args.steps}", f"trainer.device={args.device}",
                    *WORKLOAD, *args.overrides]
        for layout in args.layouts:
            nproc, extra = layout_overrides(layout, workload)
            print(f"bench_memory: {layout} on {nproc} ranks", file=sys.stderr, flush=True)
            start = time.time()
            try:
                trace, _ = run_job(nproc, workload + extra, os.path.join(args.out, layout))
            except BenchError as e:
                print(f"bench_memory: error: {e}", file=sys.stderr)
                return 1
            layouts[layout] = peaks(trace)
            overrides_by_layout[layout] = extra
            print(f"bench_memory: {layout} done in {time.time() - start:.0f} s", file=sys.stderr, flush=True)
    meta = {"params": params, "hidden": args.hidden, "layers": args.layers, "heads": args.heads,
            "kv_heads": args.kv_heads, "mlp": args.mlp, "vocab": len(build_tokenizer()), "steps": args.steps,
            "device": args.device, "torch": torch.__version__, "malloc_env": malloc, "workload": workload[1:],
            "layout_overrides": overrides_by_layout,
            "date": datetime.datetime.now().isoformat(timespec="seconds")}
    report = {"schema": "spmdsplit.bench_memory/1", "meta": meta, "layouts": layouts,
              "summary": summarize(layouts, params)}
    write_report(args.out, "bench_memory", report, render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
