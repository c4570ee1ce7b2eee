r"""DAPO's math scorer, with verl 0.9.1's semantics (verl/utils/reward_score/math_dapo.py): what
`default_compute_score` gives for `math_dapo`, `math`, `math_dapo_reasoning` and every
data_source that starts with `aime` (DATA_SOURCES, DATA_SOURCE_PREFIXES).

Returns `{"score": 1.0 or -1.0, "acc": bool, "pred": str}`: +1 for a right answer, -1 for a wrong
one *and* for none at all (DAPO's recipe trains on exactly this). "acc" is logged as
`critic/reward_extra/acc/mean`; "pred" (the answer read) is text and is not logged.

Only the last 300 characters of the response are read (the answer is at the end; verl cuts at
the same place, which keeps the scores equal for the same text). Then, in order:

1. Minerva: the text after the last `Answer:` (any case, spaces around the colon allowed) up to
   the end of its line, normalised by `normalize_final_answer`, against the ground truth
   normalised the same way;
2. when there is no such line: the content of the last `\boxed{...}` within the last 100
   characters, against the ground truth exactly as written (no normalisation: `\boxed{ 42}` is
   not `42`, `\boxed{1,000}` is not `1000`);
3. when there is neither: no answer, -1, pred "[INVALID]".

`strict_box_verify=True` tries (2) only (pred None without a box). verl's route never sets it;
a custom reward function may. verl's `pause_tokens_index` is not offered (its route never sets
it either).

The normalisation is Minerva's (Lewkowycz et al., 2022), not the MATH one of `math_exact`: it
keeps what follows the last `=`, drops spaces, units and a list of words, unwraps `\text{}`,
`\textbf{}`, `\overline{}`, `\boxed{}` and the first `$...$`, braces `\frac12` and `\sqrt2`, and
drops the commas of a number made only of digits and commas (`1,000` is `1000`, and so is
`1,0,0,0`). `\dfrac` stays `\dfrac`, and `0.5` is not `\frac{1}{2}`. Nothing of math_exact's is the
same thing, so nothing is shared.

Deliberate differences from verl (DAPO_DIFFERENCES in tests/test_rewards_dapo.py, listed in
docs/algorithms.md): a ground truth that is not a string is read as its text (verl raises), and
no answer is never right (verl counts it right when the ground truth itself normalises to
"[INVALID]").
"""

from __future__ import annotations

import re

DATA_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")
DATA_SOURCE_PREFIXES = ("aime",)  # aime2024, aime2025, ...: DAPO's validation sets

TAIL_CHARS = 300  # all of the response that is read (MATH-500's longest answer has 159 characters)
BOX_TAIL_CHARS = 100  # of those, where a \boxed{} answer may be
NO_ANSWER = "[INVALID]"  # the pred of a response without an answer, as verl writes it

_ANSWER_LINE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)

# Minerva's normalisation tables. Order matters: each replacement sees the previous ones' output
# (spaces go before the units are dropped, so "10 cm" -> "10cm" -> "10"; "\ldots" before "\dots").
_REPLACED = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
_DROPPED = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
    "edges", "students", "childrentickets", "multiples",
    "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}",
    "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)
_FIRST_MATH_SPAN = re.compile(r".*?\$(.*?)\$.*")  # a line with $...$ becomes its first span
_UNWRAPPED = tuple(re.compile(p) for p in (r"\\text\{(.*?)\}", r"\\textbf\{(.*?)\}", r"\\overline\{(.*?)\}",
                                           r"\\boxed\{(.*)\}"))
_FRAC_SHORTHAND = re.compile(r"frac([^{])(.)")  # \frac12 -> \frac{1}{2}
_SQRT_SHORTHAND = re.compile(r"sqrt([^{])")  # \sqrt2 -> \sqrt{2}


def normalize_final_answer(answer: str) -> str:
    s = answer.split("=")[-1]
    for old, new in _REPLACED:
        s = s.replace(old, new)
    for word in _DROPPED:
        s = s.replace(word, "")
    s = _FIRST_MATH_SPAN.sub(r"$\1$", s)
    for pattern in _UNWRAPPED:
        s = pattern.sub(r"\1", s)
    s = _FRAC_SHORTHAND.sub(r"frac{\1}{\2}", s)
    s = _SQRT_SHORTHAND.sub(r"sqrt{\1}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def last_boxed(text: str) -> str | None:
    r"""Content of the last `\boxed{...}`, nested braces kept whole; None when there is none or it
    is never closed. Only the braced form counts (`\boxed 5` and `\fbox{5}` do not, as in verl)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    open_brace = start + len("\\boxed")
    depth = 0
    for i in range(open_brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_brace + 1:i]
    return None


def _boxed_answer(tail: str, truth: str) -> tuple[bool, str | None]:
    pred = last_boxed(tail[-BOX_TAIL_CHARS:])
    return pred is not None and pred == truth, pred


def compute_score(solution_str: str, ground_truth, strict_box_verify: bool = False) -> dict:
    tail = solution_str[-TAIL_CHARS:]
    truth = str(ground_truth)
    if strict_box_verify:
        right, pred = _boxed_answer(tail, truth)
    else:
        lines = _ANSWER_LINE.findall(tail)
        pred = normalize_final_answer(lines[-1]) if lines else NO_ANSWER
        # An `Answer:` line that normalises to "[INVALID]" counts as none, as in verl.
        if pred != NO_ANSWER:
            right = pred == normalize_final_answer(truth)
        else:
            right, boxed = _boxed_answer(tail, truth)
            pred = boxed if boxed is not None else NO_ANSWER
    return {"score": 1.0 if right else -1.0, "acc": right, "pred": pred}
