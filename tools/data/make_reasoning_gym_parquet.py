"""Writes reasoning-gym's tasks as a verl parquet file (nothing is downloaded; the `reasoning-gym` extra).

    python -m tools.data.make_reasoning_gym_parquet OUT.parquet --tasks leg_counting,basic_arithmetic \
        [--size 1000 --seed 1 --split train --system-prompt default --plain]

The rows are exactly those `data.train_files=reasoning_gym:<tasks>` builds in a job
(spmdsplit/data/reasoning_gym.py): data_source `reasoning_gym/<task>`, extra_info {task, config,
index, split}, from which the built-in scorer rebuilds each entry. `--split val` offsets the seed
as a job's validation split does, so `--seed S` gives the same train and val rows as
data.reasoning_gym.seed=S.
"""

from __future__ import annotations

import argparse
import sys

from spmdsplit.data import reasoning_gym
from spmdsplit.data.parquet import DataError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the parquet file to write")
    parser.add_argument("--tasks", required=True, help="comma-separated reasoning-gym task names")
    parser.add_argument("--size", type=int, default=1000, help="entries per task")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--split", choices=("train", "val"), default="train")
    parser.add_argument("--system-prompt", default="default", help="a name in reasoning_gym.utils.SYSTEM_PROMPTS, or ''")
    parser.add_argument("--plain", action="store_true", help="plain-text prompts instead of chat messages")
    args = parser.parse_args(argv)
    if args.size <= 0:
        parser.error("--size: expected a positive number")
    try:
        tasks = reasoning_gym.parse_tasks(reasoning_gym.PREFIX + args.tasks, "--tasks")
        rows = reasoning_gym.make_rows(tasks, args.size, reasoning_gym.split_seed(args.seed, args.split), args.split, args.system_prompt, not args.plain, "--tasks")
    except DataError as e:
        print(f"make_reasoning_gym_parquet: error: {e}", file=sys.stderr)
        return 2
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = ("prompt", "data_source", "ability", "reward_model", "extra_info")
    pq.write_table(pa.Table.from_pylist([{c: r[c] for c in columns} for r in rows]), args.out)
    print(f"wrote {len(rows)} row(s) of {', '.join(tasks)} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
