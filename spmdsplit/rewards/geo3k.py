r"""The `hiyouga/geometry3k` scorer (Geometry3K, a vision-language set), with verl 0.9.1's
semantics (verl/utils/reward_score/geo3k.py) and the grader verl's uses, mathruler's (the `math`
extra; it needs sympy and pylatexenc too).

score = 0.9 * acc + 0.1 * format, where

- acc is 1.0 when mathruler's `grade_answer` accepts the content of the response's last
  `\boxed{...}` (mathruler's `extract_boxed_content`; without a closed box, the text "None") for
  the ground truth: the PRM800K check (the MATH normalisation, then sympy), else 0.0;
- format is 1.0 when the response is `<think>...</think>...\boxed{...}...`: it starts with
  `<think>`, and a `</think>`, then a `\boxed{`, then a `}` follow in that order, else 0.0.

So 1.0, 0.9 (right, not in the format), 0.1 (wrong, in the format) or 0.0; the dict also holds
"acc" and "format" (logged as `critic/reward_extra/acc/mean` and `.../format/mean`; verl returns the
score alone). A ground truth that is not a string is read as its text (verl raises on it).

mathruler has no bound on sympy; here the grading is bounded by TIMEOUT_S from whatever thread
(usercode.call_within), and an answer whose grading runs past it is wrong.
"""

from __future__ import annotations

from spmdsplit.usercode import Overrun, call_within

DATA_SOURCES = ("hiyouga/geometry3k",)
FORMAT_SCORE = 0.1  # the weight of the format; the answer's is the rest
TIMEOUT_S = 10.0
INSTALL = "mathruler is not installed; install the extra: pip install -e '.[math]'"

_THINK_OPEN, _THINK_CLOSE, _BOX_OPEN = "<think>", "</think>", "\\boxed{"


def _grader():
    try:
        from mathruler import grader
    except ImportError:
        raise ImportError(INSTALL) from None
    return grader


def well_formed(response: str) -> bool:
    r"""`<think>`, then `</think>`, `\boxed{` and `}` in that order (anything between and after):
    the earliest of each that fits is as good as any, so one pass finds it."""
    if not response.startswith(_THINK_OPEN):
        return False
    think_end = response.find(_THINK_CLOSE, len(_THINK_OPEN))
    box = response.find(_BOX_OPEN, think_end + len(_THINK_CLOSE)) if think_end >= 0 else -1
    return box >= 0 and response.find("}", box + len(_BOX_OPEN)) >= 0


def compute_score(solution_str: str, ground_truth, use_boxed: bool = True, format_score: float = FORMAT_SCORE) -> dict:
    grader = _grader()
    answer = grader.extract_boxed_content(solution_str) if use_boxed else solution_str
    try:
        right = call_within(TIMEOUT_S, grader.grade_answer, answer, str(ground_truth))
    except Overrun:
        right = False
    acc = 1.0 if right else 0.0
    form = 1.0 if well_formed(solution_str) else 0.0
    return {"score": (1.0 - format_score) * acc + format_score * form, "acc": acc, "format": form}
