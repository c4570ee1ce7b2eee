"""reasoning-gym's own scorers, for the rows of spmdsplit/data/reasoning_gym.py (data_source
`reasoning_gym/<task>`): the entry is rebuilt from the row's extra_info (task, config, index; each
dataset built once per process), the answer is read as reasoning-gym reads it
(`reasoning_gym.utils.extract_answer`: the last `<answer>...</answer>`, stripped; None without one),
and the task's `score_answer(answer, entry)` gives the score, partial credit included. The ground
truth is not read: several tasks accept many answers.

Bounded like math-verify (usercode.call_within): a few tasks check answers with sympy, and a call
that runs past TIMEOUT_S scores 0.0.
"""

from __future__ import annotations

from spmdsplit.data import reasoning_gym as rows
from spmdsplit.usercode import Overrun, call_within

DATA_SOURCE_PREFIX = rows.DATA_SOURCE_PREFIX
TIMEOUT_S = 10.0


def _score(solution_str: str, extra_info: dict) -> float:
    try:
        from reasoning_gym.utils import extract_answer
    except ImportError:
        raise ImportError(rows.INSTALL) from None
    task, config, index = extra_info["task"], extra_info["config"], int(extra_info["index"])
    entry = rows.entry(task, config, index)
    return rows.dataset(task, config).score_answer(extract_answer(solution_str), entry)


def compute_score(solution_str: str, ground_truth=None, extra_info: dict | None = None) -> float:
    if not isinstance(extra_info, dict) or not {"task", "config", "index"} <= extra_info.keys():
        raise ValueError(f"a reasoning_gym/ row needs extra_info with task, config and index (got {extra_info!r}); "
                         "build the rows with reasoning_gym:<task> in data.train_files or tools/data/make_reasoning_gym_parquet.py")
    try:
        return call_within(TIMEOUT_S, _score, solution_str, extra_info)
    except Overrun:
        return 0.0
