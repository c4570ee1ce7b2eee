"""`python -m tools.bench --async-rollout [--steps S] [--warmup W] [--async-modes ...]`

The question users ask about a rollout pool of its own (issue 19): on the same 2 ranks, what do
colocate, split (synchronous) and rollout | train at rollout.staleness s = 0, 1, 2 each give? One
real `torchrun -m spmdsplit.train` job per mode, the same workload for all; plus the three-pool
layout (rollout | actor | critic) on 3 ranks, which on a 2-core machine measures contention.

The workload puts generation where it is on GPUs, about half of the work: a random Qwen2 of hidden
64 and 8 layers (~0.33M parameters, tools.models) whose responses never stop early (long_answers),
8 prompts, 192-token responses: decoding 192 tokens one at a time costs about what the five
training passes over the 8 finished rows cost together.

Per mode: step time, generated tokens/s, weight-sync time and each pool's busy share of the step;
then the targets of issue 19 item 6, met or missed. All numbers come from pure functions over the
timeline's events (tests feed them hand-made ones):

  * step time: median over steps > warmup of the wall time between consecutive ends of rank 0's
    step (the end of its last event of step k), over the steps after the warmup and, at
    staleness s, before the last s (which only drain: nothing left to generate). Rank 0 is the actor pool's first rank in every
    layout; with a rollout pool apart, timing_s/step (also reported) starts when rank 0 starts
    waiting for the rows, which is the same period in steady state but not per step.
  * generated tokens/s: response tokens per step (response_length/mean x data.train_batch_size)
    / step time.
  * weight sync: on the actor pool, `sync_weights` (with a rollout pool apart, pushing update k's
    weights; the broadcast blocks until the rollout pool takes them, so it holds a wait); the
    *transfer* is the time both sides are inside sync_weights of the same step at once; on the
    rollout pool, `sync_weights` is taking the weights, the wait included.
  * busy share of a pool: its busiest rank's time inside phases, the waits left out (exchange/*,
    the rollout pool's sync_weights, and of the actor pool's sync_weights all but the transfer),
    over the wall-clock window of the steady steps (rank 0's end of the step before the first to
    its end of the last): per-step ratios would not do, since a rollout pool running ahead works
    for rank 0's step k partly during step k-1 or k+1. busy_s keeps the per-step medians. The rollout pool's gen events carry the batch
    number (k+s during step k) and count in the step that generates them.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

from tools.bench import analysis
from tools.jobs import pools_by_rank, run_job
from tools.models import build_random_qwen2
from tools.report import fmt

MODEL = dict(hidden=64, layers=8, heads=4, kv_heads=4, mlp=128)  # 0.33M parameters
BATCH = 8
WORKLOAD = [f"data.train_batch_size={BATCH}", "data.max_response_length=192", f"actor.ppo_mini_batch_size={BATCH}",
            f"critic.ppo_mini_batch_size={BATCH}", f"actor.ppo_micro_batch_size_per_gpu={BATCH}",
            f"critic.ppo_micro_batch_size_per_gpu={BATCH}", "trainer.num_threads=1", "trainer.seed=1",
            "trainer.device=cpu"]
ROLLOUT_TRAIN = ["placement.mode=custom", "placement.pools={gen: 1, train: 1}",
                 "placement.roles={rollout: gen, actor: train, critic: train}"]
THREE_POOLS = ["placement.mode=custom", "placement.pools={gen: 1, policy: 1, value: 1}",
               "placement.roles={rollout: gen, actor: policy, critic: value}"]
# mode -> (ranks, overrides)
MODES = {
    "colocate": (2, ["placement.mode=colocate", "placement.pools=[]"]),
    "split": (2, ["placement.mode=split", "placement.overlap=true"]),
    "rollout|train s=0": (2, ROLLOUT_TRAIN + ["rollout.staleness=0"]),
    "rollout|train s=1": (2, ROLLOUT_TRAIN + ["rollout.staleness=1"]),
    "rollout|train s=2": (2, ROLLOUT_TRAIN + ["rollout.staleness=2"]),
    "rollout|actor|critic s=1": (3, THREE_POOLS + ["rollout.staleness=1"]),
}
SYNC_MODES = ("colocate", "split")
TARGETS = {"speedup": 1.3, "pipelining": 0.8, "sync_share": 0.10, "busy": 0.8}


# ------------------------------------------------------------------ pure analysis

def step_ends(events: list[dict], rank: int = 0) -> dict[int, float]:
    """step -> seconds at which `rank`'s last event of that step ends."""
    out: dict[int, float] = {}
    for e in events:
        if e["pid"] == rank:
            s = e["args"]["step"]
            out[s] = max(out.get(s, float("-inf")), (e["ts"] + e["dur"]) / 1e6)
    return out


def step_periods(events: list[dict], rank: int = 0) -> dict[int, float]:
    """step k -> wall seconds from the end of step k-1 to the end of step k (on `rank`), k >= 2."""
    ends = step_ends(events, rank)
    return {s: ends[s] - ends[s - 1] for s in sorted(ends) if s - 1 in ends}


def _overlap(a: dict, b: dict) -> float:
    lo, hi = max(a["ts"], b["ts"]), min(a["ts"] + a["dur"], b["ts"] + b["dur"])
    return max(0.0, hi - lo) / 1e6


def is_rollout_pool(pool: str) -> bool:
    return pool == "rollout"


def is_actor_pool(pool: str) -> bool:
    return "actor" in pool.split("+")


def weight_sync(events: list[dict], pools: dict[int, str]) -> dict[str, dict[int, float]]:
    """Per step, on the actor pool's busiest rank: `push` (its sync_weights) and `transfer` (the
    part of it during which a rollout-pool rank is inside its sync_weights of the same step: the
    weights moving; without a rollout pool apart the whole local load); on the rollout pool's
    busiest rank `take` (its sync_weights, waiting included)."""
    syncs = [e for e in events if e["name"] == "sync_weights"]
    receivers = [e for e in syncs if is_rollout_pool(pools.get(e["pid"], "?"))]
    push: dict[tuple[int, int], float] = {}
    transfer: dict[tuple[int, int], float] = {}
    take: dict[tuple[int, int], float] = {}
    for e in syncs:
        key, pool = (e["args"]["step"], e["pid"]), pools.get(e["pid"], "?")
        if is_rollout_pool(pool):
            take[key] = take.get(key, 0.0) + e["dur"] / 1e6
        elif is_actor_pool(pool):
            push[key] = push.get(key, 0.0) + e["dur"] / 1e6
            moved = sum(_overlap(e, r) for r in receivers if r["args"]["step"] == e["args"]["step"]) \
                if receivers else e["dur"] / 1e6
            transfer[key] = transfer.get(key, 0.0) + min(moved, e["dur"] / 1e6)
    return {"push": analysis.busiest_per_step(push), "transfer": analysis.busiest_per_step(transfer),
            "take": analysis.busiest_per_step(take)}


def busy_per_step(events: list[dict], pools: dict[int, str], staleness: int = 0) -> dict[str, dict[int, float]]:
    """pool -> step -> seconds its busiest rank spends inside phases, waits left out: exchange/*,
    the rollout pool's sync_weights (taking the weights), and of the actor pool's sync_weights
    the part when no rollout-pool rank receives (see weight_sync). The rollout pool's gen of batch
    b counts in the step that generates it: max(1, b - staleness)."""
    has_rollout_pool = any(is_rollout_pool(p) for p in pools.values())
    receivers = [e for e in events if e["name"] == "sync_weights" and is_rollout_pool(pools.get(e["pid"], "?"))]
    sums: dict[str, dict[tuple[int, int], float]] = {}
    for e in events:
        pool, name = pools.get(e["pid"], "?"), e["name"]
        if name.startswith("exchange/") or (name == "sync_weights" and is_rollout_pool(pool)):
            continue
        sec = e["dur"] / 1e6
        if name == "sync_weights" and has_rollout_pool:
            sec = min(sec, sum(_overlap(e, r) for r in receivers if r["args"]["step"] == e["args"]["step"]))
        slot = sums.setdefault(pool, {})
        step = max(1, e["args"]["step"] - staleness) if name == "gen" and is_rollout_pool(pool) else e["args"]["step"]
        key = (step, e["pid"])
        slot[key] = slot.get(key, 0.0) + sec
    return {pool: analysis.busiest_per_step(s) for pool, s in sums.items()}


def busy_share_in_window(events: list[dict], pools: dict[int, str], start: float, end: float) -> dict[str, float]:
    """pool -> share of the wall-clock window [start, end] (seconds) its busiest rank spends inside
    phases, the waits left out as in busy_per_step. A window, not per-step ratios: a rollout pool
    running ahead works for rank 0's step k partly inside step k-1 or k+1 (its batches are posted
    at its own step's start), so one step's busy time can exceed that step's wall time."""
    has_rollout_pool = any(is_rollout_pool(p) for p in pools.values())
    receivers = [e for e in events if e["name"] == "sync_weights" and is_rollout_pool(pools.get(e["pid"], "?"))]
    per_rank: dict[int, float] = {}
    for e in events:
        pool, name = pools.get(e["pid"], "?"), e["name"]
        if name.startswith("exchange/") or (name == "sync_weights" and is_rollout_pool(pool)):
            continue
        window = {"ts": start * 1e6, "dur": (end - start) * 1e6}
        sec = _overlap(e, window)
        if name == "sync_weights" and has_rollout_pool:  # only while a receiver takes them
            both = [(max(e["ts"], r["ts"]), min(e["ts"] + e["dur"], r["ts"] + r["dur"]))
                    for r in receivers if r["args"]["step"] == e["args"]["step"]]
            sec = sum(_overlap(window, {"ts": lo, "dur": hi - lo}) for lo, hi in both if hi > lo)
        per_rank[e["pid"]] = per_rank.get(e["pid"], 0.0) + sec
    out: dict[str, float] = {}
    for rank, sec in per_rank.items():
        pool = pools.get(rank, "?")
        out[pool] = max(out.get(pool, 0.0), sec / (end - start))
    return out


def steady_steps(total_steps: int, warmup: int, staleness: int) -> range:
    """The steps the medians use: after the warmup, and before the last `staleness` steps, in
    which a rollout pool running ahead has nothing left to generate (the run drains)."""
    return range(warmup + 1, total_steps - staleness + 1)


def analyze(trace: dict, scalars: dict[str, dict[int, float]], warmup: int, batch: int, staleness: int = 0) -> dict:
    """One mode's numbers from its timeline and TensorBoard scalars, medians over steady_steps."""
    events, pools = analysis.complete_events(trace), pools_by_rank(trace)
    periods = step_periods(events)
    steady = set(steady_steps(max(periods, default=0), warmup, staleness))

    def after(by_step):
        return analysis.median(v for k, v in by_step.items() if k in steady)

    step = after(periods)
    length = after(scalars.get("response_length/mean", {}))
    sync = {k: after(v) for k, v in weight_sync(events, pools).items()}
    busy = {pool: after(v) for pool, v in busy_per_step(events, pools, staleness).items()}
    ends = step_ends(events)
    first, last = min(steady, default=0) - 1, max(steady, default=0)
    busy_share = busy_share_in_window(events, pools, ends[first], ends[last]) if first in ends and last in ends else {}
    return {
        "step_time_s": step, "timing_s_step": after(scalars.get("timing_s/step", {})),
        "steps_used": sum(1 for k in periods if k in steady), "staleness": staleness,
        "pools": {str(r): p for r, p in sorted(pools.items())},
        "response_tokens_per_step": length * batch if length is not None else None,
        "tokens_per_s": analysis.ratio(length * batch, step) if length is not None else None,
        "sync": {"push_s": sync["push"], "transfer_s": sync["transfer"], "take_s": sync["take"],
                 "push_share": analysis.ratio(sync["push"], step), "transfer_share": analysis.ratio(sync["transfer"], step)},
        "busy_s": busy, "busy_share": busy_share,
        "phases": analysis.pool_phase_medians(events, pools, warmup),
    }


def ideal_pipelining(mode: dict) -> dict:
    """From an on-policy (s = 0) run with a rollout pool apart: gen = the rollout pool's gen, train =
    the train pools' busiest busy time; pipelining can gain at best (gen + train) / max(gen, train)."""
    gen = mode["phases"].get("rollout", {}).get("gen")
    train = max((v for p, v in mode["busy_s"].items() if not is_rollout_pool(p) and v is not None), default=None)
    return {"gen_s": gen, "train_s": train, "ideal": analysis.ideal_speedup(gen, train)}


def targets(modes: dict[str, dict]) -> list[dict]:
    """Issue 19 item 6's targets, each with its value, bound and met (None where a mode is missing)."""
    s0, s1 = modes.get("rollout|train s=0"), modes.get("rollout|train s=1")
    sync_steps = [modes[m]["step_time_s"] for m in SYNC_MODES if m in modes and modes[m]["step_time_s"]]
    best_sync = min(sync_steps, default=None)
    rows = []

    def row(name, value, bound, at_least, how, unit="share"):
        met = None if value is None else (value >= bound if at_least else value <= bound)
        rows.append({"target": name, "value": value, "bound": bound, "at_least": at_least, "met": met, "how": how,
                     "unit": unit})

    s1_step = s1["step_time_s"] if s1 else None
    row("rollout|train s=1 step rate vs best synchronous", analysis.ratio(best_sync, s1_step), TARGETS["speedup"], True,
        "min(step colocate, step split) / step s=1", unit="ratio")
    ideal = ideal_pipelining(s0) if s0 else {}
    measured = analysis.ratio(s0["step_time_s"], s1_step) if s0 else None
    share = (measured - 1) / (ideal["ideal"] - 1) if measured is not None and ideal.get("ideal") and ideal["ideal"] > 1 \
        else None
    row("s=1 vs s=0: share of the ideal pipelining gain", share, TARGETS["pipelining"], True,
        f"(step s=0 / step s=1 - 1) / (ideal - 1); measured {fmt(measured, '{:.2f}x')}, ideal "
        f"{fmt(ideal.get('ideal'), '{:.2f}x')} = (gen {fmt(ideal.get('gen_s'))} + train {fmt(ideal.get('train_s'))}) "
        "/ max, both from s=0")
    row("weight sync on the actor pool / step at s=1 (push, waiting included)", s1["sync"]["push_share"] if s1 else None,
        TARGETS["sync_share"], False, "median sync_weights of the actor pool / step")
    row("weight sync on the actor pool / step at s=1 (transfer only)", s1["sync"]["transfer_share"] if s1 else None,
        TARGETS["sync_share"], False, "both sides inside sync_weights / step")
    for pool, value in sorted((s1 or {}).get("busy_share", {}).items()):
        row(f"s=1: {pool} pool busy", value, TARGETS["busy"], True,
            "busiest rank's phases, waits left out / wall time of the steady steps")
    return rows


def render_markdown(report: dict) -> str:
    meta, modes = report["meta"], report["modes"]
    best = min((modes[m]["step_time_s"] for m in SYNC_MODES if m in modes and modes[m]["step_time_s"]), default=None)
    lines = [f"# spmdsplit bench --async-rollout: {meta['device']}, torch {meta['torch']}, {meta['date']}", "",
             f"Model: random Qwen2 {meta['model']} ({meta['params'] / 1e6:.2f}M parameters, responses never stop "
             f"early). Workload (every mode): `{' '.join(meta['workload'])}`; {meta['steps']} steps, medians over "
             f"steps > {meta['warmup']} and, at staleness s, <= {meta['steps']} - s (the last s steps generate "
             "nothing: the run drains).", "",
             "| mode | ranks | step (s) | timing_s/step (s) | vs best sync | gen tokens/s | weight sync: push on actor "
             "pool (s) | transfer (s) | take on rollout pool (s) | busy share per pool |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in modes.items():
        busy = ", ".join(f"{p} {fmt(v, '{:.0%}')}" for p, v in sorted(m["busy_share"].items()))
        s = m["sync"]
        lines.append(f"| {name} | {m['ranks']} | {fmt(m['step_time_s'])} | {fmt(m['timing_s_step'])} | "
                     f"{fmt(analysis.ratio(best, m['step_time_s']), '{:.2f}x')} | {fmt(m['tokens_per_s'], '{:.0f}')} | "
                     f"{fmt(s['push_s'])} | {fmt(s['transfer_s'])} | {fmt(s['take_s'])} | {busy} |")
    lines += ["", "| target | value | bound | met? | how |", "|---|---|---|---|---|"]
    for t in report["targets"]:
        spec = "{:.2f}x" if t["unit"] == "ratio" else "{:.0%}"
        met = "n/a" if t["met"] is None else "met" if t["met"] else "**missed**"
        lines.append(f"| {t['target']} | {fmt(t['value'], spec)} | {'>=' if t['at_least'] else '<='} "
                     f"{spec.format(t['bound'])} | {met} | {t['how']} |")
    columns = [(n, p) for n, m in modes.items() for p in m["phases"]]
    names = [p for p in analysis.PHASES + ("balance",) if any(p in modes[n]["phases"][q] for n, q in columns)]
    lines += ["", "Median seconds per step of each phase, per pool (a pool's time is its slowest rank's; the rollout "
              "pool's gen by batch number):", "",
              "| phase | " + " | ".join(f"{n} {p}" for n, p in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for phase in names:
        lines.append(f"| {phase} | " + " | ".join(fmt(modes[n]["phases"][p].get(phase)) for n, p in columns) + " |")
    lines += ["", "Definitions: *step* = median wall time between consecutive ends of rank 0's step; *timing_s/step* "
              "= rank 0's own step timer; *gen tokens/s* = response_length/mean x data.train_batch_size / step; "
              "*push* = the actor pool's sync_weights (with a rollout pool apart it blocks until the rollout pool "
              "takes the weights), *transfer* = the part of it when the rollout pool is inside sync_weights of the "
              "same step too, *take* = the rollout pool's sync_weights, waiting included; *busy* = the busiest "
              "rank's time inside phases (exchange/*, take and push-minus-transfer left out) / the wall time of "
              "the steady steps (see tools/bench/async_rollout.py's docstring).", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------ running the jobs

def staleness_of(overrides: list[str]) -> int:
    return int(next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("rollout.staleness=")), 0))


def run(args) -> dict:
    import torch

    os.makedirs(args.out, exist_ok=True)
    model = os.path.join(args.out, "async_model")
    params = build_random_qwen2(model, **MODEL, long_answers=True)
    workload = WORKLOAD + [f"model.path={os.path.abspath(model)}", f"trainer.total_steps={args.steps}"] + \
        list(args.overrides)
    window = (min(args.warmup + 1, args.steps), min(args.warmup + 3, args.steps))
    modes = {}
    for i, name in enumerate(args.async_modes, 1):
        nproc, extra = MODES[name]
        print(f"tools.bench: [{i}/{len(args.async_modes)}] {name} on {nproc} ranks: {' '.join(extra)}",
              file=sys.stderr, flush=True)
        start = time.time()
        slug = name.replace("|", "_").replace(" ", "_").replace("=", "")
        trace, scalars = run_job(nproc, workload + extra, os.path.join(args.out, slug))
        modes[name] = {"ranks": nproc, "overrides": extra, "wall_s": time.time() - start,
                       **analyze(trace, scalars, args.warmup, BATCH, staleness_of(extra)),
                       "timeline_png": f"timeline_{slug}.png"}
        analysis.plot_timeline(trace, f"{name}: steps {window[0]}-{window[1]} (cpu, {nproc} ranks)",
                            os.path.join(args.out, modes[name]["timeline_png"]), window)
    meta = {"device": "cpu", "torch": torch.__version__, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "model": MODEL, "params": params, "workload": workload, "steps": args.steps, "warmup": args.warmup}
    return {"schema": "spmdsplit.bench_async/1", "meta": meta, "modes": modes, "targets": targets(modes),
            "pipelining": ideal_pipelining(modes["rollout|train s=0"]) if "rollout|train s=0" in modes else {}}
