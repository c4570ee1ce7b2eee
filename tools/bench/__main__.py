"""`python -m tools.bench [--nproc N] [--steps S] [--modes ...] [key=value ...]`

Runs the same workload on the same ranks as `colocate`, `split` with `placement.overlap=false`
(`split-blocking`) and `split` with overlap (plus `split-stream` with `--stream-chunks N > 1`),
each a real `torchrun -m spmdsplit.train` job, and reads back what the jobs left: TensorBoard
scalars (step times, per-phase timings) and the Chrome-trace timeline (per-rank phase spans,
exchange bytes and transfer times, peak memory). Writes `bench.json`, `bench.md` and one
`timeline_<mode>.png` per mode into `--out`, and prints the Markdown.

`--long-tail` compares fixed micro-batches with token budgets instead (tools/bench/tokens.py).
`--async-rollout` compares colocate, split and a rollout pool of its own at staleness 0, 1, 2 on
the same 2 ranks, on a generation-heavy workload (tools/bench/async_rollout.py).

`--agent`, `--continuous`, `--reward` and `--judge` hand over to tools/bench/agent.py,
tools/bench/continuous.py, tools/bench/reward.py and tools/bench/judge.py, with flags of their own.

This module is the command only: the default bench's jobs and report are tools/bench/modes.py,
the analysis every bench reads its jobs with tools/bench/analysis.py.
"""

from __future__ import annotations

import argparse
import sys

from tools.bench import agent, async_rollout, continuous, judge, modes, reward, tokens
from tools.bench.modes import MODE_OVERRIDES, ROLLOUT_MODES
from tools.report import run_and_write


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
                   help="fixed micro-batches vs token budgets (tools/bench/tokens.py): a long-tail workload and "
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
                        "three pools on 3 (tools/bench/async_rollout.py); writes bench_async.json/.md")
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
        args.async_modes = args.async_modes or list(async_rollout.MODES)
        for m in set(args.async_modes) - set(async_rollout.MODES):
            p.error(f"--async-modes {m!r}: expected one of {', '.join(map(repr, async_rollout.MODES))}")
    for o in args.overrides:
        if o.startswith(("trainer.log_dir=", "trainer.timeline=")):
            p.error(f"{o}: the bench sets trainer.log_dir and trainer.timeline itself (see --out)")
    return args


def main(argv=None) -> int:
    if "--agent" in (sys.argv[1:] if argv is None else argv):  # tools/bench/agent.py, with flags of its own
        return agent.main(argv)
    if "--continuous" in (sys.argv[1:] if argv is None else argv):  # tools/bench/continuous.py, likewise
        return continuous.main(argv)
    if "--reward" in (sys.argv[1:] if argv is None else argv):  # tools/bench/reward.py, likewise
        return reward.main(argv)
    if "--judge" in (sys.argv[1:] if argv is None else argv):  # tools/bench/judge.py, likewise
        return judge.main(argv)
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.long_tail:
        run, render, name = tokens.run, tokens.render_markdown, "bench_tokens"
    elif args.async_rollout:
        run, render, name = async_rollout.run, async_rollout.render_markdown, "bench_async"
    else:
        run, render, name = modes.run_bench, modes.render_markdown, "bench"
    return run_and_write(args.out, name, run, render, args)


if __name__ == "__main__":
    sys.exit(main())
