r"""Exact-match scorer for MATH-style answers (`lighteval/MATH`, `DigitalLearningGmbH/MATH-lighteval`,
`HuggingFaceH4/MATH-500`): the content of the response's last `\boxed{...}` against the ground
truth, both lightly normalised; 1.0 on a match, else 0.0.

This follows verl's `math` scorer (the Hendrycks MATH string match: last `\boxed`, then
`is_equiv` on normalised strings), not a symbolic checker: `0.5` and `\frac{1}{2}` differ, so do
`x+1` and `1+x`. A ground truth given as a full solution (with its own `\boxed{}`) is reduced to
its boxed answer first. Where its answers differ from verl's (`\fbox`, the normalisation below
is more lenient in places and stricter in three): VERL_DIFFERENCES in tests/test_rewards_verl.py,
listed in docs/algorithms.md.

The normalisation, in order (`normalize_answer`), and only this:

1. outer whitespace and line breaks dropped;
2. `\left` / `\right` and the thin spaces `\!`, `\,`, `\;`, `\:` dropped;
3. `\dfrac` and `\tfrac` become `\frac`;
4. degrees (`^\circ`, `^{\circ}`), dollar signs (`\$`, `$`) and `\%` dropped;
5. a trailing unit `\text{...}` / `\mbox{...}` dropped when something is left before it
   (`10\text{ cm}` -> `10`); any other `\text{X}` becomes `X`;
6. a short left-hand side (`x = 3`, `k=3`: at most 2 characters before a single `=`) dropped;
7. every space dropped, then trailing `.`s;
8. a number starting with `.` gets its `0` (`.5` -> `0.5`, also after `{`, `-`, `(`);
9. one-character shorthand braced: `\frac12` -> `\frac{1}{2}`, `\sqrt2` -> `\sqrt{2}`;
   and an integer ratio `a/b` -> `\frac{a}{b}`.
"""

from __future__ import annotations

import re

DATA_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed_content(text: str) -> str | None:
    r"""Content of the last `\boxed{...}` (or `\fbox{...}`), nested braces kept whole; also the
    brace-less `\boxed 5` form (up to a `$` or the end). None when there is none, or when the
    last one is never closed (a response cut off mid-answer has no answer)."""
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = "\\boxed" if text.startswith("\\boxed", start) else "\\fbox"
    rest = text[start + len(cmd):]
    if rest.startswith(" "):
        return rest[1:].split("$")[0].strip()
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
    return None


_UNIT_AT_END = re.compile(r"\\(?:text|mbox)\{[^{}]*\}$")
_TEXT = re.compile(r"\\(?:text|mbox|textbf|mathrm)\{([^{}]*)\}")
_LEADING_DOT = re.compile(r"(^|[{\-(\[,=])\.(\d)")
_FRAC_SHORT = re.compile(r"\\frac(?!\{)(\w)(?!\{)(\w)")
_FRAC_HALF_SHORT = re.compile(r"\\frac(?!\{)(\w)\{")
_SQRT_SHORT = re.compile(r"\\sqrt(?!\{)(\w)")
_INT_RATIO = re.compile(r"^(-?\d+)/(\d+)$")


def normalize_answer(answer) -> str:
    s = str(answer).strip().replace("\n", "")
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:"):
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for token in ("^{\\circ}", "^\\circ", "\\$", "$", "\\%"):
        s = s.replace(token, "")
    without_unit = _UNIT_AT_END.sub("", s).strip()
    if without_unit:
        s = without_unit
    s = _TEXT.sub(r"\1", s)
    if s.count("=") == 1 and len(s.split("=")[0].strip()) <= 2:
        s = s.split("=")[1]
    s = s.replace(" ", "").rstrip(".")
    s = _LEADING_DOT.sub(r"\g<1>0.\2", s)
    s = _FRAC_SHORT.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC_HALF_SHORT.sub(r"\\frac{\1}{", s)
    s = _SQRT_SHORT.sub(r"\\sqrt{\1}", s)
    s = _INT_RATIO.sub(r"\\frac{\1}{\2}", s)
    return s


def compute_score(solution_str: str, ground_truth) -> float:
    answer = last_boxed_content(solution_str)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    if "\\boxed" in truth or "\\fbox" in truth:
        boxed = last_boxed_content(truth)
        truth = boxed if boxed is not None else truth
    return 1.0 if normalize_answer(answer) == normalize_answer(truth) else 0.0
