"""`python -m tools.bench [--nproc N] [--steps S] [--modes ...] [key=value ...]`

Runs the same workload on the same ranks as `colocate`, `split` with `placement.overlap=false`
(`split-blocking`) and `split` with overlap (plus `split-stream` with `--stream-chunks N > 1`),
each a real `torchrun -m spmdsplit.train` job, and reads back what the jobs left: TensorBoard
scalars (step times, per-phase timings) and the Chrome-trace timeline (per-rank phase spans,
exchange bytes and transfer times, peak memory). Writes `bench.json`, `bench.md` and one
`timeline_<mode>.png` per mode into `--out`, and prints the Markdown.

`--long-tail` compares fixed micro-batches with token budgets instead (tools/bench_tokens.py).
`--async-rollout` compares colocate, split and a rollout pool of its own at staleness 0, 1, 2 on
the same 2 ranks, on a generation-heavy workload (tools/bench_async.py).

The first `--warmup` steps are left out of every median. The analysis functions are pure (trace
events and scalars in, numbers out) so that tests can feed them hand-made events.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

from tools.jobs import free_port, peak_memory, pools_by_rank, run_job
from tools.models import build_random_qwen2
from tools.report import fmt, run_and_write

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
PHASES = ("sync_weights", "gen", "old_log_prob", "ref", "values", "reward", "adv", "update_actor",
          "update_critic", "exchange/rollout", "exchange/log_probs", "exchange/advantages", "exchange/generated")
UPDATES = ("update_actor", "update_critic")


# ------------------------------------------------------------------ pure analysis

def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def median_after_warmup(by_step: dict[int, float], warmup: int) -> float | None:
    """Median over steps > warmup (steps count from 1): compilation, allocator growth and the
    first weight sync make the first steps unrepresentative."""
    return median(v for s, v in by_step.items() if s > warmup)


def ideal_speedup(t_actor: float | None, t_critic: float | None) -> float | None:
    """What overlapping two phases can gain at best: both in sequence vs the longer one alone."""
    if not t_actor or not t_critic:
        return None
    return (t_actor + t_critic) / max(t_actor, t_critic)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def complete_events(trace: dict) -> list[dict]:
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]


def phase_seconds(events: list[dict]) -> dict[tuple[int, int, str], float]:
    """(rank, step, phase) -> seconds, summed (streaming gives one `gen` event per chunk)."""
    out: dict[tuple[int, int, str], float] = {}
    for e in events:
        key = (e["pid"], e["args"]["step"], e["name"])
        out[key] = out.get(key, 0.0) + e["dur"] / 1e6
    return out


def pool_phase_medians(events: list[dict], pools: dict[int, str], warmup: int) -> dict[str, dict[str, float]]:
    """pool -> phase -> median seconds per step, where a pool's time in a step is its slowest
    rank's (the pool moves on at the pace of its last rank)."""
    per_step: dict[tuple[str, str], dict[int, float]] = {}
    for (rank, step, name), sec in phase_seconds(events).items():
        slot = per_step.setdefault((pools.get(rank, "?"), name), {})
        slot[step] = max(slot.get(step, 0.0), sec)
    out: dict[str, dict[str, float]] = {}
    for (pool, name), by_step in sorted(per_step.items()):
        value = median_after_warmup(by_step, warmup)
        if value is not None:
            out.setdefault(pool, {})[name] = value
    return out


def update_spans(events: list[dict]) -> dict[int, float]:
    """step -> seconds from the earliest start of update_actor/update_critic on any rank to the
    latest end: the wall time a step's updates occupy, overlapped or not."""
    bounds: dict[int, list[float]] = {}
    for e in events:
        if e["name"] in UPDATES:
            b = bounds.setdefault(e["args"]["step"], [float("inf"), float("-inf")])
            b[0], b[1] = min(b[0], e["ts"]), max(b[1], e["ts"] + e["dur"])
    return {s: (hi - lo) / 1e6 for s, (lo, hi) in bounds.items()}


def exchange_stats(events: list[dict], step_times: dict[int, float], warmup: int) -> dict:
    """Cross-pool exchange per step, on the receiving ranks. transfer = first header to last
    payload (`args.transfer_us`), wait = the whole exchange phase (mostly waiting for the other
    pool). Per step the busiest receiving rank counts; shares are over that step's step time.
    Bandwidth = all bytes / all transfer time (after warmup). None where the timeline lacks the fields."""
    sums: dict[str, dict[tuple[int, int], float]] = {"wait": {}, "transfer": {}, "bytes": {}}
    for e in events:
        if not e["name"].startswith("exchange/") or e["args"]["step"] <= warmup:
            continue
        key, args = (e["args"]["step"], e["pid"]), e["args"]
        values = {"wait": e["dur"] / 1e6, "bytes": args.get("bytes"),
                  "transfer": args["transfer_us"] / 1e6 if "transfer_us" in args else None}
        for name, v in values.items():
            if v is not None:
                sums[name][key] = sums[name].get(key, 0.0) + v
    wait, transfer, nbytes = (busiest_per_step(sums[k]) for k in ("wait", "transfer", "bytes"))
    total_bytes, total_s = sum(sums["bytes"].values()), sum(sums["transfer"].values())

    def share(per_step):
        return median(v / step_times[s] for s, v in per_step.items() if step_times.get(s))

    return {"transfer_s": median(transfer.values()), "share": share(transfer),
            "wait_s": median(wait.values()), "wait_share": share(wait),
            "bytes_per_step": median(nbytes.values()),
            "bandwidth_MBps": total_bytes / total_s / 1e6 if total_bytes and total_s else None}


def busiest_per_step(sums: dict[tuple[int, int], float]) -> dict[int, float]:
    """(step, rank) -> value  to  step -> the largest value of any rank."""
    out: dict[int, float] = {}
    for (step, _), v in sums.items():
        out[step] = max(out.get(step, 0.0), v)
    return out


def analyze(trace: dict, scalars: dict[str, dict[int, float]], warmup: int) -> dict:
    """One mode's numbers from its timeline and TensorBoard scalars."""
    events, pools = complete_events(trace), pools_by_rank(trace)
    step_times = scalars.get("timing_s/step", {})
    return {
        "step_time_s": median_after_warmup(step_times, warmup),
        "steps_used": sum(1 for s in step_times if s > warmup),
        "pools": {str(r): p for r, p in sorted(pools.items())},
        "phases": pool_phase_medians(events, pools, warmup),
        "update": {"T_actor_s": median_after_warmup(scalars.get("timing_s/update_actor", {}), warmup),
                   "T_critic_s": median_after_warmup(scalars.get("timing_s/update_critic", {}), warmup),
                   "span_s": median_after_warmup(update_spans(events), warmup)},
        "exchange": exchange_stats(events, step_times, warmup),
        "peak_memory": peak_memory(trace, pools),
    }


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


# ------------------------------------------------------------------ running jobs

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


# ------------------------------------------------------------------ reports

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


def plot_timeline(trace: dict, title: str, path: str, steps: tuple[int, int]) -> None:
    """One bar row per rank, bars colored by phase, for steps [first, last]: enough to see
    whether the pools' phases sit over each other, few enough to read."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = [e for e in complete_events(trace) if steps[0] <= e["args"]["step"] <= steps[1]]
    pools = pools_by_rank(trace)
    ranks = sorted(pools or {e["pid"] for e in events})
    colors = {p: plt.get_cmap("tab10")(i) for p, i in zip(PHASES[:9], (0, 1, 2, 3, 4, 5, 6, 8, 9))}  # 7 is grey
    colors.update({"exchange/rollout": "0.8", "exchange/log_probs": "0.65", "exchange/advantages": "0.5"})  # waits: grey
    t0 = min((e["ts"] for e in events), default=0)
    fig, ax = plt.subplots(figsize=(12, max(2.8, 1.2 + 0.5 * len(ranks))))
    names = [p for p in PHASES if any(e["name"] == p for e in events)] + sorted({e["name"] for e in events} - set(PHASES))
    for name in names:
        labeled = False
        for i, rank in enumerate(ranks):
            bars = [((e["ts"] - t0) / 1e6, e["dur"] / 1e6) for e in events if e["pid"] == rank and e["name"] == name]
            if bars:
                ax.broken_barh(bars, (i - 0.4, 0.8), facecolors=colors.get(name, "black"), label=None if labeled else name)
                labeled = True
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_yticks(range(len(ranks)), [f"rank {r} ({pools.get(r, '?')})" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title)
    fig.savefig(path, dpi=100, bbox_inches="tight")  # "tight": the legend below the axes stays in
    plt.close(fig)


# ------------------------------------------------------------------ the command

def pick_device(overrides: list[str], nproc: int) -> str:
    """The device every job runs on: trainer.device if set, else cuda when there is a GPU per
    rank (torchrun puts rank r on cuda:r), else cpu. Passed to every job, so the label is true."""
    for o in reversed(overrides):
        if o.startswith("trainer.device=") and o.split("=", 1)[1] != "auto":
            return o.split("=", 1)[1]
    import torch

    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= nproc else "cpu"


def mode_overrides(mode: str, workload: list[str], stream_chunks: int) -> list[str]:
    if mode == "colocate":
        return list(MODE_OVERRIDES[mode])
    # A custom layout the user chose (e.g. placement.pools=[3,1]) stays; otherwise split halves.
    user_mode = [o.split("=", 1)[1] for o in workload if o.startswith("placement.mode=")]
    layout = [] if user_mode[-1:] == ["custom"] else ["placement.mode=split"]
    stream = [f"rollout.stream_chunks={stream_chunks}"] if mode == "split-stream" else []
    return layout + MODE_OVERRIDES[mode] + stream


def parse_args(argv):
    p = argparse.ArgumentParser(prog="tools.bench", description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks per job (default 2: 1+1, one per core)")
    p.add_argument("--steps", type=int, help="training steps per job (default 20; 4 with --short)")
    p.add_argument("--warmup", type=int, help="first steps left out of the medians (default 2; 1 with --short)")
    p.add_argument("--modes", nargs="+", choices=list(MODE_OVERRIDES), help="a subset of the modes")
    p.add_argument("--stream-chunks", type=int, default=1, help="N > 1 adds split-stream (rollout.stream_chunks=N)")
    p.add_argument("--critic-weight", type=int, help="sets critic.ppo_epochs: the critic pool's update work")
    p.add_argument("--short", action="store_true", help="a tiny workload, for tests")
    p.add_argument("--gen-heavy", action="store_true",
                   help="long responses from a random ~3.6M-parameter Qwen2; default modes: " + " ".join(ROLLOUT_MODES))
    p.add_argument("--long-tail", action="store_true",
                   help="fixed micro-batches vs token budgets (tools/bench_tokens.py): a long-tail workload and "
                        "the default, at each --layouts; writes bench_tokens.json/.md")
    p.add_argument("--layouts", nargs="+", choices=("1+1", "2+2"), default=["1+1", "2+2"], help="--long-tail: split layouts")
    p.add_argument("--workloads", nargs="+", choices=("long-tail", "default"), default=["long-tail", "default"],
                   help="--long-tail: which workloads")
    p.add_argument("--token-modes", nargs="+", choices=("fixed", "budgets", "tokens"), default=["fixed", "tokens"],
                   help="--long-tail: which modes (budgets: token budgets and balancing without packing)")
    p.add_argument("--default-steps", type=int, default=20, help="--long-tail: steps of each default-workload job")
    p.add_argument("--max-token-len", type=int,
                   help="--long-tail: the long tail's token budget for every pass (default: each workload's "
                        "budgets are its fixed micro-batches' tokens)")
    p.add_argument("--async-rollout", action="store_true",
                   help="colocate, split and rollout | train at rollout.staleness 0, 1, 2 on the same 2 ranks, plus "
                        "three pools on 3 (tools/bench_async.py); writes bench_async.json/.md")
    p.add_argument("--async-modes", nargs="+", help="--async-rollout: a subset of its modes (names as in its table)")
    p.add_argument("--out", default="outputs/bench", help="where bench.json, bench.md and the PNGs go")
    p.add_argument("overrides", nargs="*", help="key=value train overrides for every mode")
    args = p.parse_args(argv)
    few = args.short or args.long_tail  # --long-tail: 8-12 jobs on 2 cores, each step seconds long
    args.steps = args.steps or (4 if args.short else 6 if args.long_tail else 12 if args.async_rollout else 20)
    args.warmup = (1 if few else 2) if args.warmup is None else args.warmup
    if args.modes is None and args.gen_heavy:
        args.modes = list(ROLLOUT_MODES)
    if args.modes is None:
        args.modes = ["colocate", "split-blocking", "split"] + (["split-stream"] if args.stream_chunks > 1 else [])
    if args.async_rollout:
        from tools import bench_async

        args.async_modes = args.async_modes or list(bench_async.MODES)
        for m in set(args.async_modes) - set(bench_async.MODES):
            p.error(f"--async-modes {m!r}: expected one of {', '.join(map(repr, bench_async.MODES))}")
    for o in args.overrides:
        if o.startswith(("trainer.log_dir=", "trainer.timeline=")):
            p.error(f"{o}: the bench sets trainer.log_dir and trainer.timeline itself (see --out)")
    return args


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


def main(argv=None) -> int:
    if "--agent" in (sys.argv[1:] if argv is None else argv):  # tools/bench_agent.py, with flags of its own
        return __import__("tools.bench_agent").bench_agent.main(argv)
    if "--continuous" in (sys.argv[1:] if argv is None else argv):  # tools/bench_continuous.py, likewise
        return __import__("tools.bench_continuous").bench_continuous.main(argv)
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.long_tail:
        from tools import bench_tokens  # it builds on this module's analysis: imported only here

        run, render, name = bench_tokens.run, bench_tokens.render_markdown, "bench_tokens"
    elif args.async_rollout:
        from tools import bench_async  # likewise

        run, render, name = bench_async.run, bench_async.render_markdown, "bench_async"
    else:
        run, render, name = run_bench, render_markdown, "bench"
    return run_and_write(args.out, name, run, render, args)


if __name__ == "__main__":
    sys.exit(main())
