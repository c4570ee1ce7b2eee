r"""The `numina_*` scorer (PRIME's math data: `numina_aops_forum`, `numina_synthetic_math`,
`numina_amc_aime`, `numina_synthetic_amc`, `numina_cn_k12`, `numina_olympiads`), with verl 0.9.1's
semantics (verl/utils/reward_score/prime_math/): 1.0 for a right answer, else 0.0, what
`default_compute_score` gives (verl's scorer returns a tuple whose first item, right or not, verl
turns into the float). Needs sympy and pylatexenc (the `math` extra).

The answer read from the response (`extract_answer`) is, in turn: what follows the last
`answer:` / `answer is` / `answers are` (any case); what precedes a trailing `is the answer`;
the content of the last `\boxed{...}` (or `\fbox{...}`); the text before the last `. `; and what
follows the last of `be `, `is `, `are `, `=`, `: `, `get `. It is right when

1. PRM800K's check accepts it (rewards/prm800k.py: normalised text, or sympy per element), or
2. ToRA's comparison does (`math_equal`): equal text (case and spaces aside), equal numbers within
   a relative 1e-4 (also the ground truth x100 or /100: `50` is right for `0.5`), `$5` and `5%` as
   5, `1010_2` as 1010, tuples, intervals, lists and matrices element by element. When either side
   has `\pi` it is tried with pi = 3.14159... and with 3.14 (`2\pi` is right for `6.28`).

ToRA's symbolic step (sympy on both sides) never succeeds in verl 0.9.1 (its timeouts are used as
context managers, which raises, and the error is taken for "unequal"), so it is not run here.

Where verl hands answer text to Python's `eval` (an answer with `\pi` once written as arithmetic,
and a list answered for a matrix), only arithmetic is evaluated here (rewards/arithmetic.py): an
answer that names Python functions (`\pi*abs(-2)`) is not run, and so is not the number verl would
get (DIFFERENCES in tests/test_rewards_verl_parity.py). For the same reason a `Matrix(...)` answer
reaches sympy's `parse_expr`, which evals as well, only when it calls nothing but SYMPY_FUNCTIONS.
"""

from __future__ import annotations

import math
import re

from spmdsplit.rewards import arithmetic, prm800k

DATA_SOURCES = ("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
                "numina_cn_k12", "numina_olympiads")
PI_VALUES = (math.pi, 3.14)  # the two values of \pi an answer is tried with
TOLERANCE = 1e-4  # relative, for answers that are numbers
MAX_PREDICTION_CHARS = 1000  # ToRA compares no more of the answer than this
# The functions a `Matrix(...)` answer may call (sympy's own, on plain terms): sympy reads the
# answer with eval, so nothing else is handed to it.
SYMPY_FUNCTIONS = ("sqrt", "cbrt", "root", "exp", "log", "sin", "cos", "tan", "Rational", "Abs")

# --------------------------------------------------------------------------- reading the answer

_AFTER_MARKERS = ("answer:", "answer is", "answers are")
_BEFORE_MARKERS = ("is answer", "is the answer", "are answers", "are the answers")
_LAST_MARKERS = ("be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n", "are\n", ":\n", "get\n")


def last_boxed(text: str) -> str | None:
    r"""The content of the last `\boxed` (or, without one, the last `\fbox`): from the first `{`
    after it to the brace that closes it, stripped; None when there is none or it is not closed."""
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth, opened = 0, None
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
            if opened is None:
                opened = i
        elif text[i] == "}":
            depth -= 1
            if depth == 0:  # so a `{` came first, and `opened` is set
                return text[opened + 1:i].strip()
    return None


def _after_last(text: str, marker: str) -> str:
    # Found in the lower-cased text and cut from the original, as PRIME does (the two line up but
    # for the few characters whose lower case is longer).
    at = text.lower().rfind(marker)
    return text if at < 0 else text[at + len(marker):].strip()


def extract_answer(response: str) -> str:
    for marker in _AFTER_MARKERS:
        response = _after_last(response, marker)
    for marker in _BEFORE_MARKERS:
        at = response.lower().rfind(marker)
        if at >= 0:
            response = response[:at].strip()
    boxed = last_boxed(response)
    if boxed:
        response = boxed
    if ". " in response:  # the last sentence of the answer is dropped
        response = response[:response.lower().rfind(". ")].strip()
    for marker in _LAST_MARKERS:
        response = _after_last(response, marker)
    return response


# --------------------------------------------------------------------------- ToRA's comparison

_DOLLARS = re.compile(r"\$\d+(\.\d+)?")
_PERCENT = (re.compile(r"^\d+(\.\d+)?%$"), re.compile(r"^\d+(\.\d+)?\\%$"))
_INTERVALS = (  # sympy's printed intervals, as brackets
    (re.compile(r"^Interval\((.*)\)$"), "[{}]"),
    (re.compile(r"^Interval\.Ropen\((.*)\)$"), "[{})"),
    (re.compile(r"^Interval\.Lopen\((.*)\)$"), "({}]"),
    (re.compile(r"^Interval\.open\((.*)\)$"), "({})"),
)
_MATRIX_BEGIN, _MATRIX_END = "\\begin{pmatrix}", "\\end{pmatrix}"


def _with_pi(text: str, pi: float) -> object:
    r"""`\pi` replaced by `*<pi>` after a digit, else by `1*<pi>`, then the value of the result when
    it is arithmetic (`2\pi/3` is 2.0943...); the replaced text when it is not (`\frac{\pi}{2}`)."""
    at = text.find("\\pi")
    while at != -1:
        product = f"*{pi}" if at > 0 and text[at - 1].isdigit() else f"1*{pi}"
        text = text[:at] + product + text[at + 3:]
        at = text.find("\\pi", at + 1)
    try:
        return arithmetic.evaluate(text)
    except Exception:  # noqa: BLE001 - not arithmetic (or 1/0): kept as text, as verl keeps it
        return text


def _prepare(answer, pi: float):
    """An answer as ToRA compares it: `$5` and `5%` lose their sign, `1010_2` (a number in a base)
    is its digits read as decimal (an error when they are not a number: the answer is then
    wrong), and `\\pi` is computed."""
    if not isinstance(answer, str):
        return answer
    if _DOLLARS.match(answer):
        return answer[1:]
    if any(p.match(answer) for p in _PERCENT):
        return answer.replace("\\%", "").replace("%", "")
    if "_" in answer:
        return int(float(answer.split("_")[0]))
    if "\\pi" in answer:
        return _with_pi(answer, pi)
    return answer


def _as_number(value) -> float | None:
    try:
        text = str(value)  # an int of more than 4300 digits has no str: not a number then
        return float(text.replace("{,}", "") if "{,}" in text else text.replace(",", ""))
    except ValueError:
        return None


def _as_brackets(prediction: str) -> str:
    for pattern, brackets in _INTERVALS:
        found = pattern.match(prediction)
        if found:
            return brackets.format(found.group(1))
    return prediction


def _all_equal(predictions, references) -> bool:
    # Every pair is compared before the answer is judged: an error in any one (a part that cannot
    # be read) makes the whole answer wrong, even after an unequal pair, as in verl.
    results = [math_equal(p, r) for p, r in zip(predictions, references)]
    return all(results)


def _matrix_equal(prediction: str, reference: str) -> bool:
    """A `Matrix(...)` answer (sympy's printing) or a list answer for a `pmatrix` ground truth,
    element by element (ToRA's reading of the ground truth's elements, kept as it is)."""
    if prediction.startswith("Matrix"):
        if not arithmetic.is_plain_call(prediction, "Matrix", SYMPY_FUNCTIONS):
            return False  # sympy's parse_expr evals its text: only plain terms are given to it
        try:
            from sympy.parsing.sympy_parser import parse_expr

            elements = list(parse_expr(prediction))
            items = reference.split()[1:-1:2]
            return len(elements) == len(items) and _all_equal(elements, items)
        except Exception:  # noqa: BLE001 - not a matrix, or a part that cannot be read
            return False
    if prediction.startswith("[") and prediction.endswith("]"):
        rows = arithmetic.evaluate(prediction)  # raises as verl's eval does: the answer is wrong
        if not isinstance(rows, list):
            return False
        body = reference.removeprefix("\\" + _MATRIX_BEGIN).removeprefix(_MATRIX_BEGIN)
        body = body.removesuffix("\\" + _MATRIX_END).removesuffix(_MATRIX_END)
        items = [row.split("&") if "&" in row else row for row in body.split("\\")]
        try:
            return len(rows) == len(items) and _all_equal(rows, items)
        except Exception:  # noqa: BLE001 - a part that cannot be read
            return False
    return False


def math_equal(prediction, reference, pi: float = math.pi) -> bool:
    """ToRA's comparison of an answer with the ground truth. Raises where verl's raises (a `_`
    in text that is no number before it); the caller scores that as wrong. Parts of tuples and
    matrices are compared with pi = math.pi whatever `pi` is: verl passes it only at the top."""
    prediction, reference = _prepare(prediction, pi), _prepare(reference, pi)
    if isinstance(prediction, str):
        prediction = prediction[:MAX_PREDICTION_CHARS]
        if isinstance(reference, str) and (prediction.strip().lower() == reference.strip().lower()
                                           or prediction.replace(" ", "") == reference.replace(" ", "")):
            return True
    predicted, expected = _as_number(prediction), _as_number(reference)
    if predicted is not None and expected is not None:
        return any(math.isclose(candidate, predicted, rel_tol=TOLERANCE)
                   for candidate in (expected / 100, expected, expected * 100))
    if not prediction and prediction not in (0, False):
        return False  # no answer (0 is one)

    reference, prediction = str(reference).strip(), _as_brackets(str(prediction).strip())
    bare_prediction, bare_reference = prediction, reference
    if ((prediction.startswith("[") and prediction.endswith("]") and not reference.startswith("("))
            or (prediction.startswith("(") and prediction.endswith(")") and not reference.startswith("["))):
        bare_prediction, bare_reference = prediction.strip("[]()"), reference.strip("[]()")
    for bracket in "{}()":
        bare_prediction, bare_reference = bare_prediction.replace(bracket, ""), bare_reference.replace(bracket, "")
    if bare_prediction == bare_reference:
        return True

    if (prediction and reference and prediction[0] in "([" and prediction[-1] in ")]"
            and prediction[0] == reference[0] and prediction[-1] == reference[-1]):
        parts, reference_parts = prediction[1:-1].split(","), reference[1:-1].split(",")
        if len(parts) == len(reference_parts) and _all_equal(parts, reference_parts):
            return True
    if "," in prediction and "," in reference:
        parts = [part.strip() for part in prediction.split(",")]
        reference_parts = [part.strip() for part in reference.split(",")]
        if len(parts) == len(reference_parts):
            return _all_equal(parts, reference_parts)
    if prediction.startswith("Point") and reference[0] == "(" and reference[-1] == ")":  # an empty reference raises
        parts = prediction[prediction.find("(") + 1:-1].split(",")
        reference_parts = reference[1:-1].split(",")
        if len(parts) == len(reference_parts) and _all_equal(parts, reference_parts):
            return True
    if _MATRIX_BEGIN in reference:
        return _matrix_equal(prediction, reference)
    return False


def compute_score(solution_str: str, ground_truth) -> float:
    response, truth = str(solution_str), str(ground_truth)
    answer = extract_answer(response)
    if prm800k.grade_answer(answer, truth):
        return 1.0
    try:
        if "\\pi" in answer or "\\pi" in truth:
            right = any([math_equal(answer, truth, pi=pi) for pi in PI_VALUES])  # both tried: either may raise
        else:
            right = math_equal(answer, truth)
    except Exception:  # noqa: BLE001 - an answer ToRA's comparison cannot read is wrong
        right = False
    return 1.0 if right else 0.0
