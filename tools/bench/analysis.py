"""What every bench reads from its jobs: medians over the steps after the warm-up, per-pool phase
times, update spans and the cross-pool exchange from a job's Chrome-trace timeline and
TensorBoard scalars, and the timeline plot. Pure (trace events and scalars in, numbers out), so
that tests can feed them hand-made events; the benches of this package build on them, none on
another bench's command.
"""

from __future__ import annotations

import statistics

from tools.jobs import peak_memory, pools_by_rank

PHASES = ("sync_weights", "gen", "old_log_prob", "ref", "values", "reward", "adv", "update_actor",
          "update_critic", "exchange/rollout", "exchange/log_probs", "exchange/advantages", "exchange/generated")
UPDATES = ("update_actor", "update_critic")


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
