"""Where one sandbox run's time goes (spmdsplit/sandbox/): the runner's start and isolation set-up,
the program's load (verl's prelude imports), its 10 tests, the end; the median of 20 runs one
after another. What batches of programs cost a rank is the reward bench's
(`python -m tools.bench --reward --code`, docs/rewards.md).

    .venv/bin/python -m tools.timing.sandbox_timing --isolation namespaces
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from spmdsplit.sandbox import Limits, Sandbox, pool

RIGHT = "n = int(input())\nxs = list(map(int, input().split()))\nprint(sum(sorted(xs)[-n:]))"


def tests(seed: int) -> str:
    inputs, outputs = [], []
    for t in range(10):
        xs = [(seed * 7919 + t * 104729 + i * 31) % 1000 for i in range(50)]
        n = 1 + (seed + t) % 10
        inputs.append(f"{n}\n{' '.join(map(str, xs))}\n")
        outputs.append(f"{sum(sorted(xs)[-n:])}\n")
    return json.dumps({"inputs": inputs, "outputs": outputs})


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
    parser.add_argument("--isolation", default="auto", choices=("auto", "namespaces", "guard"))
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    sandbox = Sandbox(args.isolation, 1, Limits())
    print(sandbox.describe())
    print(f"one run, median of {args.runs}, ms:", {k: round(v, 1) for k, v in (await phases(sandbox, args.runs)).items()})


if __name__ == "__main__":
    asyncio.run(main())
