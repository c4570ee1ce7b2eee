"""The default bench (`python -m tools.bench`, tools/bench/__main__.py): the same workload on
the same ranks as `colocate`, `split` with `placement.overlap=false` (`split-blocking`) and
`split` with overlap (plus `split-stream` with `--stream-chunks N > 1`), each a real
`torchrun -m spmdsplit.train` job, read back by tools/bench/analysis.py: TensorBoard scalars
(step times, per-phase timings) and the Chrome-trace timeline (per-rank phase spans, exchange
bytes and transfer times, peak memory). Writes `bench.json`, `bench.md` and one
`timeline_<mode>.png` per mode into `--out`, and prints the Markdown.

The first `--warmup` steps are left out of every median.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

from tools.bench.analysis import (
    PHASES,
    analyze,
    ideal_speedup,
    median,
    plot_timeline,
    ratio,
)
from tools.jobs import free_port, pick_device, run_job
from tools.models import build_random_qwen2
from tools.report import fmt

MODE_OVERRIDES = {
    "colocate": ["placement.mode=colocate", "placement.pools=[]"],
    "split-blocking": ["placement.overlap=false"],
    "split": ["placement.overlap=true"],
    "split-stream": ["placement.overlap=true"],  # + rollout.stream_chunks=N
    # Who generates, and with which engine (a generation-heavy workload shows it: --gen-heavy).
    "split-all": ["placement.overlap=true", "rollout.ranks=all"],
    "split-vllm": ["placement.overlap=true", "rollout.name=vllm"],
    "split-vllm-all": ["placement.overlap=true", "rollout.name=vllm", "rollout.ranks=all"],
}
ROLLOUT_MODES = ("split", "split-all", "split-vllm", "split-vllm-all")
# --gen-heavy: long responses from a random Qwen2 of ~3.6M parameters (heads of 32 for vLLM-CPU)
# that all but never samples its EOS (build_random_qwen2's long_answers), so every response runs
# to max_response_length and generation is most of the step, as it is for real LLMs.
GEN_HEAVY_MODEL = dict(hidden=256, layers=4, heads=8, kv_heads=2, mlp=768)
GEN_HEAVY_WORKLOAD = ["data.train_batch_size=32", "data.max_response_length=96", "actor.ppo_mini_batch_size=32",
                      "critic.ppo_mini_batch_size=32", "actor.ppo_micro_batch_size_per_gpu=8",
                      "critic.ppo_micro_batch_size_per_gpu=8", "rollout.kv_cache_memory_gb=0.25"]
SHORT_WORKLOAD = ["data.train_batch_size=16", "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
                  "actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4"]


def overlap_summary(modes: dict[str, dict]) -> dict:
    """Measured update-phase speedup of overlap over no-overlap next to the ideal, both from
    the no-overlap run's update times."""
    blocking, split = modes.get("split-blocking"), modes.get("split")
    if not blocking or not split:
        return {}
    t_a, t_c = blocking["update"]["T_actor_s"], blocking["update"]["T_critic_s"]
    return {"T_actor_s": t_a, "T_critic_s": t_c, "ideal": ideal_speedup(t_a, t_c),
            "span_blocking_s": blocking["update"]["span_s"], "span_overlap_s": split["update"]["span_s"],
            "measured": ratio(blocking["update"]["span_s"], split["update"]["span_s"])}


def _p2p_worker(rank: int, port: int, nbytes: int, repeats: int, backend: str, queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=2)
    samples = []
    for i in range(repeats + 1):  # the first round warms up the connection
        # Fresh buffers every round, as the exchange allocates its own.
        buf = torch.full((nbytes // 4,), float(i), device=device) if rank == 0 else \
            torch.empty(nbytes // 4, device=device)
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
        else:
            dist.recv(buf, 0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i and rank == 1:
            samples.append(nbytes / (time.perf_counter() - start) / 1e6)
    if rank == 1:
        queue.put(samples)
    dist.barrier()
    dist.destroy_process_group()


def measure_p2p(device: str, nbytes: int = 64 << 20, repeats: int = 5) -> dict:
    """Raw point-to-point bandwidth between two fresh processes (receiver's clock), the ceiling
    the exchange's bandwidth can be read against. NCCL on 2+ GPUs, else gloo on CPU tensors."""
    import torch
    import torch.multiprocessing as mp

    backend = "nccl" if device == "cuda" and torch.cuda.device_count() >= 2 else "gloo"
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_p2p_worker, args=(free_port(), nbytes, repeats, backend, queue), nprocs=2)
    samples = queue.get()
    return {"backend": backend, "bytes": nbytes, "repeats": repeats,
            "bandwidth_MBps": median(samples), "samples_MBps": samples}


def rollout_summary(modes: dict) -> list[dict]:
    """Per rollout mode: gen seconds per pool, step seconds, and the two ratios the rollout work
    is judged by: vLLM's gen against HF's on the actor pool, and ranks=all's step against
    actor-only generation with the same engine."""
    rows = []
    for name in ROLLOUT_MODES:
        if name not in modes:
            continue
        m = modes[name]
        engine_base = "split-vllm" if "vllm" in name else "split"
        hf = modes.get("split", {}).get("phases", {}).get("actor", {}).get("gen")
        rows.append({
            "mode": name, "gen_actor_s": m["phases"].get("actor", {}).get("gen"),
            "gen_critic_s": m["phases"].get("critic", {}).get("gen"), "step_s": m["step_time_s"],
            "gen_vs_hf": ratio(m["phases"].get("actor", {}).get("gen"), hf) if name.startswith("split-vllm") else None,
            "step_vs_actor_only": ratio(m["step_time_s"], modes.get(engine_base, {}).get("step_time_s"))
            if name.endswith("-all") else None,
        })
    return rows


def render_markdown(report: dict) -> str:
    meta, modes, ov, p2p = report["meta"], report["modes"], report["overlap"], report["p2p"]
    lines = [
        f"# spmdsplit bench: {meta['device']}, {meta['nproc']} ranks, torch {meta['torch']}, {meta['date']}", "",
        f"Workload: `{' '.join(meta['workload']) or '(defaults)'}`; {meta['steps']} steps, medians over steps "
        f"> {meta['warmup']}. Critic weight: {meta['critic_weight'] or 'not set'} (`--critic-weight K` sets "
        "critic.ppo_epochs=K; actor.ppo_epochs / critic.ppo_epochs scale each pool's update work, so the ideal "
        "update speedup goes from ~2 at 1:1 to ~1.25 at 1:4).", "",
        "| mode | median step (s) | vs colocate | update span (s) | exchange transfer share | "
        "exchange wait share | exchange bandwidth (MB/s) | raw p2p (MB/s) | peak memory per rank (MB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = modes.get("colocate", {}).get("step_time_s")
    for name, m in modes.items():
        mem = ", ".join(f"r{r['rank']} {r['pool']} {fmt(r['cuda_max_allocated_mb'] or r['rss_mb'], '{:.0f}')}"
                        for r in m["peak_memory"]) or "n/a"
        ex = m["exchange"]
        lines.append(
            f"| {name} | {fmt(m['step_time_s'])} | {fmt(ratio(base, m['step_time_s']), '{:.2f}x')} | "
            f"{fmt(m['update']['span_s'])} | {fmt(ex['share'], '{:.1%}')} | {fmt(ex['wait_share'], '{:.1%}')} | "
            f"{fmt(ex['bandwidth_MBps'], '{:.1f}')} | {fmt(p2p['bandwidth_MBps'], '{:.0f}')} | {mem} |")
    lines += ["", "| update-phase speedup of overlap over no overlap | measured | ideal | T_actor (s) | T_critic (s) |",
              "|---|---|---|---|---|",
              f"| split vs split-blocking | {fmt(ov.get('measured'), '{:.2f}x')} | {fmt(ov.get('ideal'), '{:.2f}x')} | "
              f"{fmt(ov.get('T_actor_s'))} | {fmt(ov.get('T_critic_s'))} |", ""]
    columns = [(name, pool) for name, m in modes.items() for pool in m["phases"]]
    lines += ["Median seconds per step of each phase, per pool (a pool's time is its slowest rank's):", "",
              "| phase | " + " | ".join(f"{n} {p}" for n, p in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for phase in PHASES:
        cells = [modes[n]["phases"][p].get(phase) for n, p in columns]
        if any(c is not None for c in cells):
            lines.append(f"| {phase} | " + " | ".join(fmt(c) for c in cells) + " |")
    if report.get("rollout"):
        lines += ["Rollout engines and who generates (targets on 1+1 CPU ranks: vLLM gen <= 0.6x HF's; "
                  "rollout.ranks=all step <= 0.8x actor-only):", "",
                  "| mode | gen, actor pool (s) | gen, critic pool (s) | step (s) | gen vs HF | step vs actor-only |",
                  "|---|---|---|---|---|---|"]
        for r in report["rollout"]:
            lines.append(f"| {r['mode']} | {fmt(r['gen_actor_s'])} | {fmt(r['gen_critic_s'])} | {fmt(r['step_s'])} | "
                         f"{fmt(r['gen_vs_hf'], '{:.2f}x')} | {fmt(r['step_vs_actor_only'], '{:.2f}x')} |")
        lines.append("")
    lines += ["", "Definitions: *update span* = per step, from the earliest start of update_actor/update_critic "
              "on any rank to the latest end, median over steps; measured speedup = span(split-blocking) / "
              "span(split); ideal = (T_actor + T_critic) / max(T_actor, T_critic), with T = median "
              "timing_s/update_* of split-blocking. *Exchange transfer* = first header to last payload on the "
              "receiving rank (args.transfer_us), *wait* = the whole exchange phase; per step the busiest receiver, "
              "over the step time. Exchange bandwidth = bytes / transfer time over all exchanges; raw p2p = one "
              f"{p2p['bytes'] >> 20} MB tensor, {p2p['backend']} send/recv, median of {p2p['repeats']}. Peak memory: "
              "CUDA max allocated on GPU, else RSS.", ""]
    return "\n".join(lines)


def mode_overrides(mode: str, workload: list[str], stream_chunks: int) -> list[str]:
    if mode == "colocate":
        return list(MODE_OVERRIDES[mode])
    # A custom layout the user chose (e.g. placement.pools=[3,1]) stays; otherwise split halves.
    user_mode = [o.split("=", 1)[1] for o in workload if o.startswith("placement.mode=")]
    layout = [] if user_mode[-1:] == ["custom"] else ["placement.mode=split"]
    stream = [f"rollout.stream_chunks={stream_chunks}"] if mode == "split-stream" else []
    return layout + MODE_OVERRIDES[mode] + stream



def run_bench(args) -> dict:
    import torch

    device = pick_device(args.overrides, args.nproc)
    workload = (SHORT_WORKLOAD if args.short else []) + list(args.overrides)
    if args.gen_heavy:
        model = os.path.join(args.out, "gen_heavy_model")
        if not os.path.isfile(os.path.join(model, "config.json")):
            build_random_qwen2(model, **GEN_HEAVY_MODEL, long_answers=True)
        workload = GEN_HEAVY_WORKLOAD + [f"model.path={os.path.abspath(model)}"] + workload
    workload += [f"critic.ppo_epochs={args.critic_weight}"] if args.critic_weight else []
    workload += [f"trainer.total_steps={args.steps}", f"trainer.device={device}"]
    window = (min(args.warmup + 1, args.steps), min(args.warmup + 3, args.steps))
    os.makedirs(args.out, exist_ok=True)
    modes = {}
    for i, mode in enumerate(args.modes, 1):
        extra = mode_overrides(mode, workload, args.stream_chunks)
        print(f"tools.bench: [{i}/{len(args.modes)}] {mode}: {' '.join(extra)}", file=sys.stderr, flush=True)
        start = time.time()
        trace, scalars = run_job(args.nproc, workload + extra, os.path.join(args.out, mode))
        modes[mode] = {"overrides": extra, "wall_s": time.time() - start, **analyze(trace, scalars, args.warmup),
                       "timeline_png": f"timeline_{mode}.png"}
        title = f"{mode}: steps {window[0]}-{window[1]} ({device}, {args.nproc} ranks)"
        plot_timeline(trace, title, os.path.join(args.out, modes[mode]["timeline_png"]), window)
    print("tools.bench: raw point-to-point bandwidth", file=sys.stderr, flush=True)
    meta = {"device": device, "nproc": args.nproc, "torch": torch.__version__,
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "workload": workload,
            "steps": args.steps, "warmup": args.warmup, "critic_weight": args.critic_weight,
            "stream_chunks": args.stream_chunks, "short": args.short}
    return {"schema": "spmdsplit.bench/1", "meta": meta, "p2p": measure_p2p(device), "modes": modes,
            "overlap": overlap_summary(modes), "rollout": rollout_summary(modes)}
