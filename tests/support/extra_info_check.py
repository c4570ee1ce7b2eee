"""A check, for the real jobs of test_e2e.py and test_rollout_ranks.py, that every reward
function call gets its own row's `extra_info`, in training and in validation, whatever the
placement.

`write_job_files` writes verl parquet files whose rows say who they are twice: the ground truth
of row i of a split is i in three digits then the split's digit ("0070" is train row 7), and
`extra_info` is `{"index": i, "split": ...}`. The custom reward function it writes asserts that
the two agree, so a missing extra_info (None, {}) and one from another row (a routing slip) both
stop the job with a RewardError showing the sample; it logs each call (rank, split, index) and
scores like the embedded copy task. `overrides` gives the job's config keys for these files.
"""

from __future__ import annotations

import math
import textwrap

SPLIT_DIGITS = {"train": "0", "test": "1"}
TRAIN_ROWS, VAL_ROWS = 64, 8  # 8: every placement the tests run has a validation unit dividing it

REWARD_FN = """
    import os

    from spmdsplit.rewards.rule import positional_match_score

    SPLIT_DIGITS = {split_digits!r}
    LOG = {log!r}


    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        assert isinstance(extra_info, dict), f"extra_info is {{extra_info!r}}, not the row's dict"
        index, split = extra_info.get("index"), extra_info.get("split")
        assert (index, SPLIT_DIGITS.get(split)) == (int(ground_truth[:3]), ground_truth[3]), (
            f"extra_info {{extra_info!r}} is not the row of ground truth {{ground_truth!r}}")
        with open(LOG, "a") as f:  # one short line per call: appends from several ranks stay whole
            f.write(f"{{os.environ['RANK']}} {{split}} {{index}}\\n")
        return positional_match_score(solution_str, ground_truth)
"""


def _rows(split: str, count: int) -> list[dict]:
    rows = []
    for i in range(count):
        answer = f"{i:03d}{SPLIT_DIGITS[split]}"
        rows.append({
            "prompt": answer + "=",  # the embedded copy task: the prompt's digits are the answer
            "data_source": "synthetic/copy",
            "reward_model": {"ground_truth": answer, "style": "rule"},
            "extra_info": {"index": i, "split": split},
        })
    return rows


def write_job_files(folder) -> tuple[list[str], str]:
    """Writes train.parquet, test.parquet and reward.py into `folder`; returns (the config
    overrides that use them, the path of the calls' log)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", TRAIN_ROWS), ("test", VAL_ROWS)):
        pq.write_table(pa.Table.from_pylist(_rows(split, count)), folder / f"{split}.parquet")
    log = folder / "calls.log"
    reward = folder / "reward.py"
    reward.write_text(textwrap.dedent(REWARD_FN.format(split_digits=SPLIT_DIGITS, log=str(log))))
    overrides = [f"data.train_files={folder}/train.parquet", f"data.val_files={folder}/test.parquet",
                 f"reward.custom_fn.path={reward}", "trainer.val_freq=2"]
    return overrides, str(log)


def calls(log: str) -> list[tuple[int, str, int]]:
    """(rank, split, index) of every reward function call the job made."""
    with open(log) as f:
        return [(int(r), s, int(i)) for r, s, i in (line.split() for line in f)]


def assert_every_split_scored(log: str, actor_ranks, critic_ranks) -> None:
    """Training and validation rows were all scored through the check, on the critic pool's ranks
    (validation uses as many rows as divide evenly over both pools: generation.validation_set)."""
    unit = math.lcm(len(actor_ranks), len(critic_ranks))
    seen = calls(log)
    assert {rank for rank, _, _ in seen} == set(critic_ranks)
    assert {split for _, split, _ in seen} == {"train", "test"}
    assert {i for _, split, i in seen if split == "test"} == set(range(VAL_ROWS // unit * unit))
