"""`python -m tools.bench.reward [--steps S] [--warmup W] [--sleep-s 0.2] [--modes ...] [--out DIR]`

Also `python -m tools.bench --reward [...]`. What a reward that waits costs a step (spmdsplit/rewards/calls.py):
the default job (split 1+1 on 2 ranks, 128 samples a step) scored by a reward that waits SLEEP_S per
sample before giving the built-in score, called in each of the ways a user writes it, each a real
`torchrun -m spmdsplit.train` job:

- `one at a time`: a plain def on one thread (reward.num_workers=1): how every reward ran before;
- `plain def`: the same function with the defaults (threads, reward.num_workers=0: 64 at once);
- `async def`: an `async def` on the scoring rank's event loop (reward.max_concurrency=64);
- `reward server`: reward.remote_url, a server (tools/serve/reward_server.py, its own process) that waits
  as long before each answer.

Per mode: the scoring phase per step (the critic pool's `reward` phase, summed over chunks; median
of the steps after the warmup), the step time, and the target: scoring <= TARGET_S with the
defaults. `code` (with --code) adds the code scorer (rewards/code.py, the sandbox): 128 APPS-shaped
programs of 10 tests each scored in this process, all right, all wrong, half and half: seconds per
batch of 128 on this machine's cores.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import subprocess
import sys
import time

from tools.bench import analysis
from tools.jobs import free_port, run_job
from tools.report import fmt, run_and_write

SLEEP_S, TARGET_S = 0.2, 1.5
FUNCTIONS = '''"""bench_reward's reward functions: each waits {sleep_s} s, then gives the built-in score."""
import asyncio
import time

from spmdsplit.rewards.rule import compute_score


def waits(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep({sleep_s})
    return compute_score(data_source, solution_str, ground_truth, extra_info)


async def waits_async(data_source, solution_str, ground_truth, extra_info=None):
    await asyncio.sleep({sleep_s})
    return compute_score(data_source, solution_str, ground_truth, extra_info)
'''
WORKLOAD = ["placement.mode=split", "trainer.num_threads=1", "trainer.seed=1", "trainer.device=cpu",
            "trainer.val_freq=-1", "trainer.save_freq=-1"]
MODES = {  # mode -> overrides (FUNCTIONS and URL filled in)
    "one at a time": ["reward.custom_fn.path=FUNCTIONS", "reward.custom_fn.name=waits", "reward.num_workers=1"],
    "plain def": ["reward.custom_fn.path=FUNCTIONS", "reward.custom_fn.name=waits"],
    "async def": ["reward.custom_fn.path=FUNCTIONS", "reward.custom_fn.name=waits_async"],
    "reward server": ["reward.remote_url=URL"],
}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="tools.bench.reward", description=__doc__.splitlines()[0])
    p.add_argument("--reward", action="store_true", help=argparse.SUPPRESS)  # from python -m tools.bench --reward
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    p.add_argument("--sleep-s", type=float, default=SLEEP_S, help="what each sample's reward waits")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--code", action="store_true", help="also time the code scorer on 128 APPS-shaped programs")
    p.add_argument("--out", default="outputs/bench_reward")
    p.add_argument("overrides", nargs="*", help="key=value train overrides for every mode")
    return p.parse_args(argv)


def start_server(sleep_s: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "tools.serve.reward_server", "--port", str(port),
                               "--sleep", str(sleep_s)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, f"http://127.0.0.1:{port}/"
        except OSError:
            time.sleep(0.2)
    server.kill()
    raise RuntimeError("the reward server did not start within 30 s")


def scoring_per_step(trace: dict, warmup: int) -> float | None:
    """The critic pool's `reward` phase per step (its chunks summed, the slowest rank's), median
    over the steps after the warmup."""
    events, pools = analysis.complete_events(trace), analysis.pools_by_rank(trace)
    return analysis.pool_phase_medians(events, pools, warmup).get("critic", {}).get("reward")


def run(args) -> dict:
    os.makedirs(args.out, exist_ok=True)
    functions = os.path.join(args.out, "reward_functions.py")
    with open(functions, "w") as f:
        f.write(FUNCTIONS.format(sleep_s=args.sleep_s))
    server, url = start_server(args.sleep_s) if "reward server" in args.modes else (None, "")
    rows = {}
    try:
        for mode in args.modes:
            overrides = [o.replace("FUNCTIONS", functions).replace("URL", url) for o in MODES[mode]]
            trace, scalars = run_job(2, [*WORKLOAD, f"trainer.total_steps={args.steps}", *overrides, *args.overrides],
                                     os.path.join(args.out, mode.replace(" ", "_")))
            rows[mode] = {"scoring_s": scoring_per_step(trace, args.warmup),
                          "step_s": analysis.median_after_warmup(scalars.get("timing_s/step", {}), args.warmup)}
            print(f"bench_reward: {mode}: scoring {fmt(rows[mode]['scoring_s'])} s, step {fmt(rows[mode]['step_s'])} s",
                  file=sys.stderr, flush=True)
    finally:
        if server is not None:
            server.kill()
    report = {"date": datetime.date.today().isoformat(), "sleep_s": args.sleep_s, "steps": args.steps,
              "warmup": args.warmup, "target_s": TARGET_S, "modes": rows}
    if args.code:
        report["code"] = code_scoring()
    return report


def code_scoring() -> dict:
    """The code scorer on 128 APPS-shaped programs of 10 tests each (tools/data/make_code_parquet.py's
    problems), in this process: seconds per batch, all right, all wrong, half and half."""
    from tools.data.make_code_parquet import bench_samples

    from spmdsplit.config import load_config
    from spmdsplit.rewards.calls import RewardCalls, waiting_scorers

    cfg = load_config(None, [])
    calls = RewardCalls(cfg.reward, waiting=waiting_scorers(cfg.reward))
    out = {"cores": len(os.sched_getaffinity(0))}
    for name in ("right", "wrong", "half"):
        samples = bench_samples(128, name)
        calls.score(samples[:2])  # the sandbox's probe and first start, out of the timing
        start = time.monotonic()
        scored = calls.score(samples)
        out[name] = {"seconds": time.monotonic() - start,
                     "mean_score": sum(s.score or 0.0 for s in scored) / len(scored),
                     "errors": sum(s.error is not None for s in scored)}
    calls.close()
    return out


def render_markdown(report: dict) -> str:
    lines = [f"# Rewards that wait ({report['date']})", "",
             f"Split 1+1 on 2 ranks, 128 samples a step, each sample's reward waiting {report['sleep_s']} s; "
             f"{report['steps']} steps, medians after {report['warmup']}.", "",
             "| mode | scoring per step (s) | step (s) |", "|---|---|---|"]
    for mode, row in report["modes"].items():
        lines.append(f"| {mode} | {fmt(row['scoring_s'])} | {fmt(row['step_s'])} |")
    target = report["target_s"]
    defaults = [m for m in ("plain def", "async def", "reward server") if m in report["modes"]]
    met = [m for m in defaults if (report["modes"][m]["scoring_s"] or 1e9) <= target]
    lines += ["", f"Target: scoring <= {target} s per step with the defaults: "
              + ("met" if len(met) == len(defaults) else f"missed ({', '.join(sorted(set(defaults) - set(met)))})") + "."]
    if "code" in report:
        code = report["code"]
        lines += ["", f"Code scoring, 128 APPS-shaped programs of 10 tests each, in one process on {code['cores']} cores:",
                  "", "| programs | seconds per batch | mean score | errors |", "|---|---|---|---|"]
        for name in ("right", "wrong", "half"):
            c = code[name]
            lines.append(f"| all {name} | {c['seconds']:.2f} | {c['mean_score']:.3f} | {c['errors']} |"
                         if name != "half" else f"| half right | {c['seconds']:.2f} | {c['mean_score']:.3f} | {c['errors']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return run_and_write(args.out, "bench_reward", run, render_markdown, args)


if __name__ == "__main__":
    sys.exit(main())
