"""Times the local code scorer (spmdsplit/rewards/code.py through spmdsplit/sandbox/): batches of
APPS-shaped programs with 10 tests each, all right, all wrong and half of each, scored
concurrently as a rank scores a batch; and one run's phases (the runner's start and isolation
set-up, the program's load, its tests, the end).

    .venv/bin/python -m tools.sandbox_timing --programs 128 --isolation namespaces

A right program costs one run (its tests together); a wrong one 11 (that run, then each of its
first 10 tests alone), so batches of wrong programs take about ten times longer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

from spmdsplit.rewards import code
from spmdsplit.sandbox import Limits, Sandbox, pool

RIGHT = "n = int(input())\nxs = list(map(int, input().split()))\nprint(sum(sorted(xs)[-n:]))"
WRONG = "n = int(input())\nxs = list(map(int, input().split()))\nprint(sum(sorted(xs)[:n]))"


def tests(seed: int) -> str:
    inputs, outputs = [], []
    for t in range(10):
        xs = [(seed * 7919 + t * 104729 + i * 31) % 1000 for i in range(50)]
        n = 1 + (seed + t) % 10
        inputs.append(f"{n}\n{' '.join(map(str, xs))}\n")
        outputs.append(f"{sum(sorted(xs)[-n:])}\n")
    return json.dumps({"inputs": inputs, "outputs": outputs})


async def batch(sandbox: Sandbox, programs: list[str]) -> tuple[float, list[dict]]:
    started = time.monotonic()
    scores = await asyncio.gather(*(code.compute_score(f"```python\n{program}\n```", tests(i), sandbox)
                                    for i, program in enumerate(programs)))
    return time.monotonic() - started, scores


async def phases(sandbox: Sandbox, runs: int) -> dict[str, float]:
    """Median milliseconds of each phase of one run, runs one after another."""
    marks: dict[str, list[float]] = {"start and set-up": [], "load": [], "10 tests": [], "end": []}
    program = {"code": RIGHT, "fn_name": None, "inputs": json.loads(tests(0))["inputs"]}
    follow, ready, take = pool._Report.follow, pool._Report._expect_ready, pool._Report._take
    seen: dict[str, float] = {}

    async def timed_follow(self, *args):
        seen["spawned"] = time.perf_counter()
        result = await follow(self, *args)
        seen["done"] = time.perf_counter()
        return result

    async def timed_ready(self, *args):
        seen["ready"] = time.perf_counter()
        return await ready(self, *args)

    def timed_take(self, line):
        if b'"loaded"' in line:
            seen["loaded"] = time.perf_counter()
        return take(self, line)

    pool._Report.follow, pool._Report._expect_ready, pool._Report._take = timed_follow, timed_ready, timed_take
    try:
        for _ in range(runs):
            seen.clear()
            await sandbox.run(program, 5.0)
            ended = time.perf_counter()
            marks["start and set-up"].append(seen["ready"] - seen["spawned"])
            marks["load"].append(seen["loaded"] - seen["ready"])
            marks["10 tests"].append(seen["done"] - seen["loaded"])
            marks["end"].append(ended - seen["done"])
    finally:
        pool._Report.follow, pool._Report._expect_ready, pool._Report._take = follow, ready, take
    return {name: 1000 * statistics.median(values) for name, values in marks.items()}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs", type=int, default=128)
    parser.add_argument("--isolation", default="auto", choices=("auto", "namespaces", "guard"))
    parser.add_argument("--workers", type=int, default=0, help="programs at once (0: the CPU cores)")
    parser.add_argument("--batches", default="right,wrong,mix")
    args = parser.parse_args()
    sandbox = Sandbox(args.isolation, args.workers, Limits())
    print(sandbox.describe())
    print(f"{len(os.sched_getaffinity(0))} CPU cores; one run, median of 20, ms:",
          {k: round(v, 1) for k, v in (await phases(sandbox, 20)).items()})
    kinds = {"right": [RIGHT] * args.programs, "wrong": [WRONG] * args.programs,
             "mix": [RIGHT if i % 2 else WRONG for i in range(args.programs)]}
    for name in args.batches.split(","):
        seconds, scores = await batch(sandbox, kinds[name])
        runs = sum(1 if s["score"] == 1.0 else 1 + s["tests"] for s in scores)
        print(f"{name:5s}: {args.programs} programs, {runs} runs, {seconds:.1f} s per batch "
              f"({1000 * seconds / runs:.0f} ms a run), mean score {statistics.mean(s['score'] for s in scores):.2f}")


if __name__ == "__main__":
    asyncio.run(main())
