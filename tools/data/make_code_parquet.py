#!/usr/bin/env python
"""Writes a small code task as parquet files in verl's schema for its code data sources (nothing is
downloaded): problems in APPS's row shape, scored by running the response's program against the
row's tests (spmdsplit/rewards/code.py).

    python -m tools.data.make_code_parquet --out data/code [--train-rows 256 --test-rows 32 --tests 10 --seed 0] \
        [--digit-prompts]

writes DIR/train.parquet and DIR/test.parquet with the columns verl's APPS / TACO preprocessing writes:

    data_source   "apps"
    prompt        [{"role": "user", "content": <the statement> + the instruction to answer in ```python```}]
                  (--digit-prompts: the problem's number in digits, plain text: all the embedded model,
                  whose vocabulary is digits and a few signs, can read; it cannot write Python either)
    ability       "code"
    reward_model  {"style": "rule", "ground_truth": <JSON: {"inputs": [...], "outputs": [...]}, and
                   "fn_name" for a problem whose tests call a function>}
    extra_info    {"split", "index", "problem"}

Problems are drawn from a few templates (stdin programs: sums, maxima, reversals, counts; call-based
functions: arithmetic on arguments), each instance with its own `--tests` random test cases.
`bench_samples(n, kind)` gives tools/bench/reward.py rows with right or wrong programs as responses.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from dataclasses import dataclass
from typing import Callable

DATA_SOURCE = "apps"
INSTRUCTION = "Write a Python program that solves it. Put the program in a ```python``` block."


@dataclass(frozen=True)
class Template:
    """A problem: its statement, how to make one test's (input, output) from a generator, a right
    program and a wrong one; `fn_name` for call-based tests (inputs: JSON lines of arguments)."""
    name: str
    statement: str
    test: Callable[[random.Random], tuple[str, str]]
    right: str
    wrong: str
    fn_name: str | None = None


def _numbers(rng: random.Random, n: int, lo: int = -50, hi: int = 50) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(n)]


def _sum_test(rng):
    xs = _numbers(rng, rng.randint(1, 8))
    return f"{len(xs)}\n{' '.join(map(str, xs))}\n", f"{sum(xs)}\n"


def _max_test(rng):
    xs = _numbers(rng, rng.randint(1, 8))
    return f"{len(xs)}\n{' '.join(map(str, xs))}\n", f"{max(xs)}\n"


def _reverse_test(rng):
    word = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(1, 10)))
    return f"{word}\n", f"{word[::-1]}\n"


def _vowels_test(rng):
    word = "".join(rng.choice("abcdeiou") for _ in range(rng.randint(1, 12)))
    return f"{word}\n", f"{sum(c in 'aeiou' for c in word)}\n"


def _add_test(rng):
    a, b = rng.randint(-100, 100), rng.randint(-100, 100)
    return f"{a}\n{b}", json.dumps(a + b)


def _scale_test(rng):
    xs, k = _numbers(rng, rng.randint(1, 6)), rng.randint(-3, 3)
    return f"{json.dumps(xs)}\n{k}", json.dumps([x * k for x in xs])


TEMPLATES = [
    Template("sum", "Read n, then n integers on one line. Print their sum.", _sum_test,
             "n = int(input())\nprint(sum(map(int, input().split())))\n",
             "n = int(input())\nprint(sum(map(int, input().split())) + 1)\n"),
    Template("max", "Read n, then n integers on one line. Print the largest.", _max_test,
             "input()\nprint(max(map(int, input().split())))\n",
             "input()\nprint(min(map(int, input().split())))\n"),
    Template("reverse", "Read a word. Print it reversed.", _reverse_test,
             "import sys\nprint(sys.stdin.readline().strip()[::-1])\n",
             "import sys\nprint(sys.stdin.readline().strip())\n"),
    Template("vowels", "Read a word. Print how many of its letters are vowels (a, e, i, o, u).", _vowels_test,
             "w = input()\nprint(sum(c in 'aeiou' for c in w))\n",
             "w = input()\nprint(len(w))\n"),
    Template("add", "Write add(a, b) returning the sum of two integers.", _add_test,
             "def add(a, b):\n    return a + b\n", "def add(a, b):\n    return a - b\n", fn_name="add"),
    Template("scale", "Write scale(xs, k) returning the list xs with every element multiplied by k.", _scale_test,
             "class Solution:\n    def scale(self, xs, k):\n        return [x * k for x in xs]\n",
             "class Solution:\n    def scale(self, xs, k):\n        return xs\n", fn_name="scale"),
]


def problem(index: int, tests: int, seed: int) -> tuple[Template, dict]:
    """The index-th problem: its template and its ground truth (tests of its own)."""
    rng = random.Random(seed * 1_000_003 + index)
    template = TEMPLATES[index % len(TEMPLATES)]
    cases = [template.test(rng) for _ in range(tests)]
    truth = {"inputs": [i for i, _ in cases], "outputs": [o for _, o in cases]}
    if template.fn_name:
        truth["fn_name"] = template.fn_name
    return template, truth


def row(index: int, split: str, tests: int, seed: int, digits: bool = False) -> dict:
    template, truth = problem(index, tests, seed)
    text = f"{template.statement}\n{INSTRUCTION}"
    return {"data_source": DATA_SOURCE,
            "prompt": f"{index:04d}" if digits else [{"role": "user", "content": text}],
            "ability": "code",
            "reward_model": {"style": "rule", "ground_truth": json.dumps(truth)},
            "extra_info": {"split": split, "index": index, "problem": template.name}}


def as_response(program: str) -> str:
    return f"Here is my solution.\n```python\n{program}```\n"


def bench_samples(n: int, kind: str, tests: int = 10, seed: int = 0) -> list:
    """`n` scoring samples (spmdsplit/rewards/calls.py Sample) of the task, answered by right
    programs (`right`), wrong ones (`wrong`), or right for even rows (`half`)."""
    from spmdsplit.rewards.calls import Sample

    out = []
    for i in range(n):
        template, truth = problem(i, tests, seed)
        right = kind == "right" or (kind == "half" and i % 2 == 0)
        out.append(Sample(DATA_SOURCE, as_response(template.right if right else template.wrong), json.dumps(truth),
                          {"index": i}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--train-rows", type=int, default=256)
    parser.add_argument("--test-rows", type=int, default=32)
    parser.add_argument("--tests", type=int, default=10, help="test cases per problem")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--digit-prompts", action="store_true",
                        help="each prompt the problem's number in digits, plain text (the embedded model)")
    args = parser.parse_args()
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(args.out, exist_ok=True)
    splits = {"train": range(args.train_rows), "test": range(args.train_rows, args.train_rows + args.test_rows)}
    for split, indices in splits.items():
        rows = [row(i, split, args.tests, args.seed, args.digit_prompts) for i in indices]
        pq.write_table(pa.Table.from_pylist(rows), os.path.join(args.out, f"{split}.parquet"))
        print(f"{os.path.join(args.out, split + '.parquet')}: {len(rows)} rows")


if __name__ == "__main__":
    main()
