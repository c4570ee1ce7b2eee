"""The `openai/gsm8k` rule scorer, with verl's semantics (verl/utils/reward_score/gsm8k.py).

GSM8K solutions end with `#### <answer>`; the prompts verl's preprocessing writes ask the model
to do the same. Two ways to read the model's final answer:

- strict (verl's default): the number right after the *last* `#### ` (one space, as in the
  dataset). No `#### ` means no answer, which also grades the format.
- flexible: the last number anywhere in the text (a run of digits, `.` and `,`, with an optional
  leading `-`) that is not just `.` or `,`.

Either way commas and `$` are dropped from the number (`#### 1,200` reads as `1200`), the sign is
kept, and the result is compared as a *string* with the ground truth (commas removed there too):
`72.0` is not `72`, as in verl. Deliberately more lenient than verl: a `.` or `,` trailing the
number is sentence punctuation, not part of it (`... is 72.` reads `72`; verl reads `72.` and
scores it wrong); the flexible mode drops commas too and skips matches without a digit; the
ground truth is read as trimmed text. Each difference is a row of VERL_DIFFERENCES in
tests/test_rewards_verl.py (and a line of docs/algorithms.md).

Scores: `score` (1.0) when the answer equals the ground truth, `format_score` (0.0) when an answer
was found but is wrong, 0.0 when none was found.
"""

from __future__ import annotations

import re

# Only the last characters of a response are searched. The final answer sits at the end, and
# the regexes are linear but run over every response of every step on the critic pool: a long
# chain of thought (thousands of characters) would cost time for nothing. verl clips the same
# way (its comment: ~300 characters is a safe stand-in for ~300 tokens), and clipping at the same
# place keeps the scores equal to verl's for the same text.
SOLUTION_CLIP_CHARS = 300

_NUMBER = r"-?[0-9.,]+"
_STRICT = re.compile(r"#### (" + _NUMBER + r")")
_FLEXIBLE = re.compile(r"(" + _NUMBER + r")")


def _clean(number: str) -> str | None:
    number = number.replace(",", "").replace("$", "").rstrip(".")
    return number if number not in ("", "-") else None


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The final answer as a string with commas removed, or None when there is none."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    text = solution_str[-SOLUTION_CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(text)
        return _clean(found[-1]) if found else None
    for candidate in reversed(_FLEXIBLE.findall(text)):
        if candidate.strip(".,") == "":  # "." or "," alone (an ellipsis, a list separator)
            continue
        cleaned = _clean(candidate)
        if cleaned is not None:
            return cleaned
    return None


def normalize_ground_truth(ground_truth) -> str:
    return str(ground_truth).strip().replace(",", "")


def compute_score(solution_str: str, ground_truth, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> float:
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return float(score) if answer == normalize_ground_truth(ground_truth) else float(format_score)
