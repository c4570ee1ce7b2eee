"""Rule scorers, chosen by each sample's `data_source` as verl does (`compute_score`)."""

from __future__ import annotations

import math
from typing import Callable

from spmdsplit.data.synthetic import TASKS, data_source


def positional_match_score(solution_str: str, ground_truth: str) -> float:
    """Fraction of answer positions that are right, over the longer of answer and response:
    partial credit a random policy earns sometimes (so PPO has a signal), 1.0 only when exact."""
    solution = solution_str.strip()
    if not ground_truth:
        return float(solution == "")
    hits = sum(a == b for a, b in zip(solution, ground_truth))
    return hits / max(len(solution), len(ground_truth))


SCORERS: dict[str, Callable[[str, str], float]] = {data_source(task): positional_match_score for task in TASKS}


def compute_score(data_source: str, solution_str: str, ground_truth) -> float:
    scorer = SCORERS.get(data_source)
    if scorer is None:
        raise KeyError(f"no reward function for data_source={data_source!r}; known: {sorted(SCORERS)}")
    score = float(scorer(solution_str, ground_truth))
    if math.isnan(score):
        raise ValueError(
            f"reward for data_source={data_source!r} is NaN on response {solution_str!r} (ground truth {ground_truth!r})"
        )
    return score
