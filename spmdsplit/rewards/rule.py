"""Rule scorers, chosen by each sample's `data_source` as verl does (`default_compute_score`).

A scorer is `scorer(solution_str, ground_truth)` and returns a float, or a dict holding the
score under "score" and, optionally, other numbers to log (e.g. "acc"). `compute_score` returns
what the scorer gave (a float, or the dict as is); `normalize_result` turns either, or what a
custom reward function returned, into `(score, extras)` (rewards/calls.py, which makes the calls;
`score_sample` is both in one call, for a single sample).

Names route as in verl's `default_compute_score` (verl 0.9.1): the exact names of SCORERS, then a
name that starts with one of SCORER_PREFIXES (verl's `data_source.startswith("aime")`):

- `openai/gsm8k`: rewards/gsm8k.py;
- `lighteval/MATH`, `DigitalLearningGmbH/MATH-lighteval`, `HuggingFaceH4/MATH-500`: rewards/math_exact.py;
- `math_dapo`, `math`, `math_dapo_reasoning`, `aime*`: rewards/math_dapo.py;
- `numina_aops_forum`, `numina_synthetic_math`, `numina_amc_aime`, `numina_synthetic_amc`,
  `numina_cn_k12`, `numina_olympiads`: rewards/prime_math.py (sympy and pylatexenc: the `math` extra);
- `hiyouga/geometry3k`: rewards/geo3k.py (mathruler: the `math` extra);
- `searchR1_nq`, `searchR1_triviaqa`, `searchR1_popqa`, `searchR1_hotpotqa`,
  `searchR1_2wikimultihopqa`, `searchR1_musique`, `searchR1_bamboogle`: rewards/search_r1.py.

Beyond verl's: `math_verify` (Math-Verify) and `reasoning_gym/<task>` (that task's own scorer),
each with its optional package (the `math` and `reasoning-gym` extras). Optional packages are
imported on first use.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Mapping

from spmdsplit.data.synthetic import TASKS, TOOL_CLOSE, data_source
from spmdsplit.rewards import geo3k, gsm8k, math_dapo, math_exact, math_verify, prime_math, reasoning_gym, search_r1


def positional_match_score(solution_str: str, ground_truth: str) -> float:
    """Fraction of answer positions that are right, over the longer of answer and response:
    partial credit a random policy earns sometimes (so PPO has a signal), 1.0 only when exact."""
    solution = solution_str.strip()
    if not ground_truth:
        return float(solution == "")
    hits = sum(a == b for a, b in zip(solution, ground_truth))
    return hits / max(len(solution), len(ground_truth))


def lookup_score(solution_str: str, ground_truth: str) -> float:
    """The lookup task's score: positional match of the final answer, the text after the last tool
    response (which the embedded template closes with ";"), or the whole response without one.
    The tool's own text never counts as an answer: only what the policy wrote after it."""
    return positional_match_score(solution_str.rpartition(TOOL_CLOSE)[2], ground_truth)


SCORERS: dict[str, Callable[[str, Any], Any]] = {data_source(task): positional_match_score for task in TASKS}
SCORERS[data_source("lookup")] = lookup_score
# The scorers that read the response with its special tokens kept (roles/reward.py decodes every
# other one as verl does, without them): the embedded tasks' answers are short digit strings, and
# with the special tokens dropped a policy learned to pad its answer with them, tokens the scorer
# never saw (a reward hack seen there). Kept, they count against the match.
SEES_SPECIAL_TOKENS = frozenset(data_source(task) for task in TASKS)
SCORERS["openai/gsm8k"] = gsm8k.compute_score  # strict extraction, 1.0 / 0.0, as verl
for _name in math_exact.DATA_SOURCES:
    SCORERS[_name] = math_exact.compute_score
for _name in math_dapo.DATA_SOURCES:  # +1 / -1 with "acc", as verl
    SCORERS[_name] = math_dapo.compute_score
for _name in math_verify.DATA_SOURCES:
    SCORERS[_name] = math_verify.compute_score
for _name in prime_math.DATA_SOURCES:  # PRIME's numina_* sets: 1.0 / 0.0, as verl
    SCORERS[_name] = prime_math.compute_score
for _name in geo3k.DATA_SOURCES:  # 0.9 for the answer + 0.1 for the format, with "acc" and "format"
    SCORERS[_name] = geo3k.compute_score
for _name in search_r1.DATA_SOURCES:  # exact match in <answer> tags, as verl
    SCORERS[_name] = search_r1.compute_score
SCORER_PREFIXES: dict[str, Callable[[str, Any], Any]] = dict.fromkeys(math_dapo.DATA_SOURCE_PREFIXES,
                                                                     math_dapo.compute_score)
SCORER_PREFIXES[reasoning_gym.DATA_SOURCE_PREFIX] = reasoning_gym.compute_score
# The scorers that also read the row's extra_info (where the entry they score is described).
READS_EXTRA_INFO = frozenset({reasoning_gym.compute_score})


def find_scorer(data_source: str) -> Callable[[str, Any], Any] | None:
    """The built-in scorer of `data_source`, or None when there is none."""
    scorer = SCORERS.get(data_source)
    if scorer is None and isinstance(data_source, str):
        scorer = next((fn for prefix, fn in SCORER_PREFIXES.items() if data_source.startswith(prefix)), None)
    return scorer


def _check_finite(score: float, data_source: str, solution_str: str, ground_truth) -> float:
    if not math.isfinite(score):
        what = "NaN" if math.isnan(score) else f"{score} (not finite)"
        raise ValueError(
            f"reward for data_source={data_source!r} is {what} on response {solution_str!r} "
            f"(ground truth {ground_truth!r})"
        )
    return score


# An environment's episode carries its reward here (agent/loop.py): the environment is its scorer.
ENVIRONMENT_REWARD = "environment_reward"


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None):
    """The built-in scorer of `data_source` on one response: a float, or the scorer's dict as is.
    `extra_info` is verl's argument; only the scorers of READS_EXTRA_INFO read it. An environment's
    episode is scored by its environment, whatever its data_source (a custom reward function gets
    that reward in extra_info and decides)."""
    if isinstance(extra_info, Mapping) and ENVIRONMENT_REWARD in extra_info:
        return normalize_result(extra_info[ENVIRONMENT_REWARD], data_source, solution_str, ground_truth)[0]
    scorer = find_scorer(data_source)
    if scorer is None:
        from spmdsplit.rewards.code import DATA_SOURCES as CODE

        if data_source in CODE:  # its scorer waits on programs: rewards/calls.py runs it, concurrently
            raise KeyError(f"data_source={data_source!r} is scored by running its program in the reward's sandbox "
                           "(rewards/code.py, through rewards/calls.py RewardCalls), not by this call")
        known = sorted(SCORERS) + [f"{prefix}*" for prefix in SCORER_PREFIXES] + list(CODE)
        raise KeyError(f"no reward function for data_source={data_source!r}; known: {known}")
    if scorer in READS_EXTRA_INFO:
        result = scorer(solution_str, ground_truth, extra_info)
    else:
        result = scorer(solution_str, ground_truth)
    if isinstance(result, Mapping):
        return result
    return normalize_result(result, data_source, solution_str, ground_truth)[0]


def _as_number(value) -> float | None:
    """A real number (bool, int, float, a numpy scalar, a one-element tensor) as a float; else None."""
    if isinstance(value, numbers.Real):
        return float(value)
    item = getattr(value, "item", None)  # numpy scalars and arrays, torch tensors
    if callable(item):
        try:
            value = item()
        except (ValueError, RuntimeError, TypeError):  # more than one element
            return None
        if isinstance(value, numbers.Real):
            return float(value)
    return None


def normalize_result(result, data_source: str = "", solution_str: str = "", ground_truth=None) -> tuple[float, dict[str, float]]:
    """(score, extras) from what a scorer returned: a number, or a dict with "score" and other
    keys; of those, the numeric ones become extras (strings and the like are dropped). A missing
    "score", a score that is not a number, or a score that is NaN/inf is an error."""
    if isinstance(result, Mapping):
        if "score" not in result:
            raise ValueError(f"the reward function returned a dict without 'score' (keys: {sorted(map(str, result))})")
        score = _as_number(result["score"])
        if score is None:
            raise TypeError(f"the reward function's 'score' must be a number, got {type(result['score']).__name__}: {result['score']!r}")
        extras = {}
        for key, value in result.items():
            if key == "score":
                continue
            number = _as_number(value)
            if number is not None:
                extras[str(key)] = number
    else:
        score = _as_number(result)
        if score is None:
            raise TypeError(
                f"the reward function must return a number or a dict with 'score', got {type(result).__name__}: {result!r}"
            )
        extras = {}
    return _check_finite(score, data_source, solution_str, ground_truth), extras


def score_sample(data_source: str, solution_str: str, ground_truth, extra_info=None,
                 fn: Callable | None = None) -> tuple[float, dict[str, float]]:
    """Scores one response: with `fn` (a custom reward function, called as verl calls it, by
    keyword) when given, else with the built-in scorer of `data_source`."""
    if fn is None:
        result = compute_score(data_source, solution_str, ground_truth, extra_info)
    else:
        result = fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info)
    return normalize_result(result, data_source, solution_str, ground_truth)
