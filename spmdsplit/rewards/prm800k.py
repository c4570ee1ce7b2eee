r"""PRM800K's answer check (OpenAI's prm800k grader, as verl 0.9.1's prime_math holds it in
verl/utils/reward_score/prime_math/__init__.py and math_normalize.py): the first and main test of
the `numina_*` scorer (rewards/prime_math.py). Needs sympy and pylatexenc (the `math` extra).

`grade_answer(given, truth)` is True when

1. both are the same after the Hendrycks MATH normalisation (`mathd_normalize`: spaces, `\left`,
   degrees, `\$`, a trailing `\text{ unit}`, `\%` and a short left-hand side dropped, `\frac12` and
   `\sqrt2` braced, `a/b` and `0.5` written as `\frac`), or
2. they are the same after PRM800K's own normalisation (`normalize`: `$`, `%`, words such as `cm`,
   `hours` or `degrees` dropped wherever they stand, `million` as `*10^6`, LaTeX turned into plain
   text by pylatexenc, lower case, integers written plainly), or, split into the elements of a
   tuple or interval (`(1, 2)`, `[0,1)`), sympy simplifies each difference to 0. Two fractions
   `a/b` must be written alike (an unreduced one is wrong), and an integer only matches an integer.

sympy is not given what it may hang on (more than two distinct letters, `^{`, `^(`, stacked or
long exponents). Each sympy check is bounded by TIMEOUT_S from whatever thread (usercode.call_within;
verl forks a process per check), and one that runs past it counts as unequal, as in verl.
"""

from __future__ import annotations

import re

from spmdsplit.usercode import Overrun, call_within

TIMEOUT_S = 10.0  # one sympy check, verl's bound
INSTALL = "sympy and pylatexenc are needed for the numina_* scorer; install the extra: pip install -e '.[math]'"

_WHOLE_TEXT = re.compile(r"^\\text\{(?P<text>.+?)\}$")  # an answer that is one \text{...}

# --------------------------------------------------------------------------- the MATH normalisation

# In order: each sees the previous ones' output (`\\` is collapsed before `\left` is looked for).
_MATHD_REPLACED = (
    ("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"), ("\\left", ""),
    ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", ""),
)
_UNIT = "\\text{ "  # in the MATH answers, a \text{ with a space only ever holds a unit


class _Unreadable(ValueError):
    """The MATH normalisation gives up on the answer: it is compared as written."""


def _braced_sqrt_argument(after: str) -> str:
    return after if after[0] == "{" else "{" + after[0] + "}" + after[1:]


def _braced_frac_arguments(after: str) -> str | None:
    if after[0] == "{":
        return after
    if len(after) < 2:
        return None  # \frac with one character after it: the whole answer is left as it was
    if after[1] == "{":
        return "{" + after[0] + "}" + after[1:]
    return "{" + after[0] + "}{" + after[1] + "}" + after[2:]


def _brace_shorthand(s: str, command: str, braced) -> str:
    r"""`\sqrt2` -> `\sqrt{2}`, `\frac12` -> `\frac{1}{2}`: `braced` rewrites the text after each
    `command` (None: `s` is returned as it was)."""
    pieces = s.split(command)
    out = pieces[0]
    for after in pieces[1:]:
        if not after:
            raise _Unreadable(f"{command} at the end")
        fixed = braced(after)
        if fixed is None:
            return s
        out += command + fixed
    return out


def _slash_to_frac(s: str) -> str:
    r"""`3/4` as `\frac{3}{4}`, for two integers written plainly (no sign but one `-`, no leading 0)."""
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        numerator, denominator = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    if s != f"{numerator}/{denominator}":
        return s
    return "\\frac{" + str(numerator) + "}{" + str(denominator) + "}"


def _mathd_strip(s: str) -> str:
    for old, new in _MATHD_REPLACED:
        s = s.replace(old, new)
    if _UNIT in s:
        pieces = s.split(_UNIT)
        if len(pieces) != 2:
            raise _Unreadable("two units")
        s = pieces[0]
    s = s.replace("\\\\%", "").replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # `x = 3`, `k=3`
        s = sides[1]
    s = _brace_shorthand(s, "\\sqrt", _braced_sqrt_argument).replace(" ", "")
    s = _brace_shorthand(s, "\\frac", _braced_frac_arguments)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_to_frac(s)


def mathd_normalize(answer: str) -> str:
    answer = answer.strip()
    whole = _WHOLE_TEXT.search(answer)
    if whole is not None:
        answer = whole.group("text").strip()
    try:
        return _mathd_strip(answer)
    except _Unreadable:
        return answer


# --------------------------------------------------------------------------- PRM800K's normalisation

_REPLACED = (
    ("\\%", "%"), ("\\$", "$"), ("$", ""), ("%", ""), (" or ", " , "), (" and ", " , "),
    ("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12"),
)
# In this order: `centimeters` loses `meters` only after `cm` was looked for, so `centi` stays.
_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week",
          "month", "year", "foot", "feet", "inch", "yard", "liter")
_UNIT_WORDS = tuple(re.compile(unit + r"(es)?(s)? *(\^[0-9]+)?") for unit in _UNITS)
_DEGREES = re.compile(r"\^ *\\circ")
_THIN_SPACE_COMMA = re.compile(r",\\! *")
_MINUS_SPACE = re.compile(r"- *")
_MIXED_NUMBER = re.compile(r"([0-9]) +([0-9])")  # `7 3/4` is 7+3/4
_THOUSANDS_COMMA = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
_FRACTION = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")
# sympy may hang on these: exponents in braces or parentheses, stacked or of two or more digits.
_TOO_HARD = ("^{", "^(")
_TOO_HARD_PATTERNS = (re.compile(r"\^[0-9]+\^"), re.compile(r"\^[0-9][0-9]+"))
_MATH_SYMBOLS = (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*"))


def _latex_to_plain(expr: str) -> str:
    from pylatexenc.latex2text import LatexNodes2Text

    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac")
    expr = expr.replace("\\frac", " \\frac")  # `1\frac{1}{2}` stays a mixed number: `1 1/2`
    expr = LatexNodes2Text().latex_to_text(expr)
    for symbol, name in _MATH_SYMBOLS:
        expr = expr.replace(symbol, name)
    return expr.strip()


def _is_integral(x: float) -> bool:
    try:
        return abs(x - round(x)) <= 1e-7
    except (OverflowError, ValueError):  # inf, nan
        return False


def _without_thousands_commas(expr: str) -> str:
    """`1,234,567` -> `1234567`; a comma between elements (`(1,2)`) stays."""
    while True:
        stripped = _THOUSANDS_COMMA.sub(r"\1\3\4", expr)
        if stripped == expr:
            return expr
        expr = stripped


def _text_is_integer(expr: str) -> bool:
    try:
        return _is_integral(float(_without_thousands_commas(expr)))
    except ValueError:
        return False


def normalize(expr: str) -> str:
    whole = _WHOLE_TEXT.search(expr)
    if whole is not None:
        expr = whole.group("text")
    for old, new in _REPLACED:
        expr = expr.replace(old, new)
    for unit in _UNIT_WORDS:
        expr = unit.sub("", expr)
    expr = _DEGREES.sub("", expr)
    if expr and expr[0] == "{" and expr[-1] == "}":
        expr = expr[1:-1]
    expr = _THIN_SPACE_COMMA.sub("", expr)
    try:
        if _is_integral(float(expr)):
            expr = str(round(float(expr)))
    except ValueError:
        pass
    if "\\" in expr:
        try:
            expr = _latex_to_plain(expr)
        except Exception:  # noqa: BLE001 - LaTeX pylatexenc cannot read is compared as written
            pass
    expr = _MINUS_SPACE.sub("-", expr)
    expr = _MIXED_NUMBER.sub(r"\1+\2", expr).lower()
    if _text_is_integer(expr):
        # Truncated, as PRM800K: a number is rounded above, so this only sees what LaTeX or the
        # commas hid there (`2.99999999\ ` is 2, `2.99999999` 3).
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def split_tuple(expr: str) -> list[str]:
    """The elements of `(a, b)` or `[a, b)` (one level of brackets only); else [expr]."""
    expr = _without_thousands_commas(expr)
    if not expr:
        return []
    brackets = "()[]"
    if len(expr) > 2 and expr[0] in brackets and expr[-1] in brackets and not any(ch in brackets for ch in expr[1:-1]):
        return [element.strip() for element in expr[1:-1].split(",")]
    return [expr]


def _sympy_may_read(expr: str) -> bool:
    letters = {ch for ch in expr.replace("sqrt", "").replace("frac", "") if ch.isalpha()}
    if len(letters) > 2:  # words, or a function of more than two variables
        return False
    return not any(s in expr for s in _TOO_HARD) and not any(p.search(expr) for p in _TOO_HARD_PATTERNS)


def _difference_is_zero(truth: str, given: str) -> bool:
    import sympy
    from sympy.parsing import sympy_parser

    difference = f"({truth})-({given})"
    if not _sympy_may_read(difference):
        return False
    transformations = sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,)
    try:
        return sympy.simplify(sympy_parser.parse_expr(difference.replace("^", "**"), transformations=transformations)) == 0
    except Exception:  # noqa: BLE001 - whatever sympy cannot read or simplify is unequal
        return False


def _elements_equal(truth: str, given: str) -> bool:
    if _FRACTION.search(truth) and _FRACTION.search(given):
        return truth == given  # 2/4 is not 1/2: an unreduced fraction is wrong
    if _text_is_integer(truth) != _text_is_integer(given):
        return False  # an integer answer must be written as one (its text already matched if so)
    try:
        return call_within(TIMEOUT_S, _difference_is_zero, truth, given)
    except Overrun:
        return False


def check_installed() -> None:
    try:
        import pylatexenc  # noqa: F401
        import sympy  # noqa: F401
    except ImportError:
        raise ImportError(INSTALL) from None


def grade_answer(given: str, truth: str) -> bool:
    check_installed()
    if mathd_normalize(given) == mathd_normalize(truth):
        return True
    truth_normalized, given_normalized = normalize(truth), normalize(given)
    if truth_normalized == given_normalized:
        return True
    if not given_normalized:
        return False
    truth_elements, given_elements = split_tuple(truth_normalized), split_tuple(given_normalized)
    if len(truth_elements) != len(given_elements):
        return False
    if len(truth_elements) > 1 and (truth_normalized[0] != given_normalized[0]
                                    or truth_normalized[-1] != given_normalized[-1]):
        return False  # (a, b) is not [a, b]
    return all(_elements_equal(t, g) for t, g in zip(truth_elements, given_elements))
