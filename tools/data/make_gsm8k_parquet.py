#!/usr/bin/env python
"""Writes GSM8K-style parquet files in verl's schema from local data (nothing is downloaded).

    python tools/data/make_gsm8k_parquet.py --out data/gsm8k [--train-rows 256 --test-rows 64 --seed 0]

writes DIR/train.parquet and DIR/test.parquet with the columns verl's GSM8K preprocessing writes:

    data_source   "openai/gsm8k"
    prompt        [{"role": "user", "content": <question> + the step-by-step instruction}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": <the number after "####", without commas>}
    extra_info    {"split", "index", "answer" (the worked solution), "question"}

The problems come from a JSON-lines file of {"question", "answer"} objects whose answers end in
`#### <number>` (`--source`; by default the hand-written sample shipped in
spmdsplit/data/gsm8k_sample.jsonl, every fourth of which goes to the test split), topped up to
the requested row counts with templated word problems generated from `--seed`. `--source` also
takes the real GSM8K jsonl files when you have them locally (e.g. `--source train.jsonl
--test-source test.jsonl`, `--train-rows 0` for all of them).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
ANSWER_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
DEFAULT_SOURCE = os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "spmdsplit", "data",
                 "gsm8k_sample.jsonl")
)
TEST_EVERY = 4  # without --test-source, every 4th source problem goes to the test split


def ground_truth(answer: str) -> str:
    """The final answer after `####`, commas removed (as verl's preprocessing extracts it)."""
    match = ANSWER_RE.search(answer)
    if match is None:
        raise ValueError(f"no '#### <number>' in the answer: {answer[-80:]!r}")
    return match.group(1).replace(",", "")


def load_problems(path: str) -> list[dict]:
    problems = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                question, answer = item["question"], item["answer"]
                if not (isinstance(question, str) and question.strip() and isinstance(answer, str)):
                    raise ValueError("question and answer must be non-empty strings")
                ground_truth(answer)
            except (ValueError, KeyError, TypeError) as e:
                raise SystemExit(f"{path}:{line_no}: not a GSM8K problem ({e})") from e
            problems.append({"question": question, "answer": answer})
    return problems


def _fmt(n: int) -> str:
    return f"{n:,}"


# Templated word problems: each takes a random generator and returns (question, worked answer).
NAMES = ["Ava", "Omar", "Priya", "Lucas", "Chen", "Sofia", "Mateo", "Amara", "Jonas", "Keiko", "Ravi", "Elena"]
ITEMS = ["apples", "marbles", "stickers", "pencils", "cards", "shells", "stamps", "beads"]


def _boxes(rng):
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    boxes, per, given = rng.randint(2, 9), rng.randint(6, 48), rng.randint(1, 30)
    total = boxes * per
    given = min(given, total - 1)
    left = total - given
    q = (
        f"{name} has {boxes} boxes with {per} {item} in each box. {name} gives away {given} {item}. "
        f"How many {item} are left?"
    )
    a = (
        f"{name} starts with {boxes} * {per} = {_fmt(total)} {item}.\n"
        f"After giving some away, {_fmt(total)} - {given} = {_fmt(left)} {item} are left.\n"
        f"#### {_fmt(left)}"
    )
    return q, a


def _sales(rng):
    item = rng.choice(["lamps", "backpacks", "bicycles", "chairs", "jackets"])
    price, sold, days = rng.randint(12, 95), rng.randint(8, 40), rng.randint(3, 7)
    per_day, total = price * sold, price * sold * days
    q = (
        f"A shop sells {item} for ${price} each. It sells {sold} {item} every day. "
        f"How many dollars does it take in over {days} days?"
    )
    a = (
        f"Each day it takes in {sold} * {price} = ${_fmt(per_day)}.\n"
        f"Over {days} days it takes in {_fmt(per_day)} * {days} = ${_fmt(total)}.\n"
        f"#### {_fmt(total)}"
    )
    return q, a


def _temperature(rng):
    place = rng.choice(["a desert town", "a mountain pass", "a harbor", "a ski resort", "a farm"])
    start, drop, rise = rng.randint(-10, 15), rng.randint(5, 25), rng.randint(2, 9)
    after_drop = start - drop
    end = after_drop + rise
    q = (
        f"In {place} the temperature was {start} degrees in the evening. It fell {drop} degrees overnight "
        f"and rose {rise} degrees by morning. What was the temperature in the morning?"
    )
    a = (
        f"After falling it was {start} - {drop} = {after_drop} degrees.\n"
        f"After rising it was {after_drop} + {rise} = {end} degrees.\n"
        f"#### {end}"
    )
    return q, a


def _travel(rng):
    name = rng.choice(NAMES)
    v1, t1, v2, t2 = rng.randint(30, 90), rng.randint(2, 5), rng.randint(20, 70), rng.randint(2, 4)
    d1, d2 = v1 * t1, v2 * t2
    q = (
        f"{name} drives at {v1} miles per hour for {t1} hours and then at {v2} miles per hour for {t2} hours. "
        f"How many miles does {name} drive?"
    )
    a = (
        f"The first part is {v1} * {t1} = {d1} miles.\n"
        f"The second part is {v2} * {t2} = {d2} miles.\n"
        f"In total {name} drives {d1} + {d2} = {_fmt(d1 + d2)} miles.\n"
        f"#### {_fmt(d1 + d2)}"
    )
    return q, a


def _balance(rng):
    name = rng.choice(NAMES)
    balance, bill1, bill2 = rng.randint(50, 900), rng.randint(20, 600), rng.randint(20, 600)
    deposit = rng.randint(10, 300)
    bills = bill1 + bill2
    after = balance - bills
    end = after + deposit
    q = (
        f"{name}'s bank account holds ${balance}. {name} pays bills of ${bill1} and ${bill2} "
        f"and then deposits ${deposit}. What is the balance now, in dollars?"
    )
    a = (
        f"The bills come to {bill1} + {bill2} = ${bills}.\n"
        f"After paying them the balance is {balance} - {bills} = {after} dollars.\n"
        f"After the deposit it is {after} + {deposit} = {end} dollars.\n"
        f"#### {end}"
    )
    return q, a


TEMPLATES = [_boxes, _sales, _temperature, _travel, _balance]


def templated_problems(n: int, rng: random.Random, avoid: set[str]) -> list[dict]:
    out = []
    for _ in range(100 * n + 100):
        if len(out) == n:
            break
        q, a = rng.choice(TEMPLATES)(rng)
        if q not in avoid:
            avoid.add(q)
            out.append({"question": q, "answer": a})
    if len(out) < n:
        raise SystemExit(f"could only generate {len(out)} distinct templated problems, {n} asked")
    return out


def make_row(problem: dict, split: str, index: int) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": problem["question"] + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth(problem["answer"])},
        "extra_info": {"split": split, "index": index, "answer": problem["answer"], "question": problem["question"]},
    }


def build_splits(
    source: str, test_source: str | None, train_rows: int, test_rows: int, seed: int
) -> dict[str, list[dict]]:
    problems = load_problems(source)
    if test_source:
        pools = {"train": problems, "test": load_problems(test_source)}
    else:
        pools = {
            "train": [p for i, p in enumerate(problems) if i % TEST_EVERY != TEST_EVERY - 1],
            "test": [p for i, p in enumerate(problems) if i % TEST_EVERY == TEST_EVERY - 1],
        }
    seen = {p["question"] for pool in pools.values() for p in pool}
    splits = {}
    for split, want, offset in (("train", train_rows, 0), ("test", test_rows, 1)):
        pool = pools[split]
        if want <= 0:  # 0: every source problem of the split, nothing generated
            chosen = pool
        elif want <= len(pool):
            chosen = pool[:want]
        else:
            chosen = pool + templated_problems(want - len(pool), random.Random(seed * 2 + offset), seen)
        splits[split] = [make_row(p, split, i) for i, p in enumerate(chosen)]
    return splits


def write_parquet(rows: list[dict], path: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = path + ".tmp"
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> dict[str, str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for train.parquet and test.parquet")
    parser.add_argument("--train-rows", type=int, default=256, help="rows of train.parquet (0: the source's only)")
    parser.add_argument("--test-rows", type=int, default=64, help="rows of test.parquet (0: the source's only)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the templated problems")
    parser.add_argument("--source", default=DEFAULT_SOURCE, help="JSON lines of {question, answer}; default: the sample")
    parser.add_argument("--test-source", default=None, help="JSON lines for the test split; default: every 4th --source line")
    args = parser.parse_args(argv)

    splits = build_splits(args.source, args.test_source, args.train_rows, args.test_rows, args.seed)
    os.makedirs(args.out, exist_ok=True)
    written = {}
    for split, rows in splits.items():
        path = os.path.join(args.out, f"{split}.parquet")
        write_parquet(rows, path)
        written[split] = path
        print(f"{path}: {len(rows)} rows")
    return written


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
