"""Whether a program's output on a test is the expected one, as verl 0.9.1's prime_code
testing_util decides (pure Python, in the rank: the expected outputs never enter the program's
process). spmdsplit/rewards/code.py runs the programs; this judges what they produced.

A stdin/stdout program's captured text passes when any of these holds, tried in this order:

1. its lines joined, stripped, equal the expected text stripped; or its lines each stripped,
   joined, stripped, do;
2. it is exactly one line, equal to the expected text;
3. its lines (`str.splitlines`: also \\r, \\x0b, \\x1c... end a line) equal the expected text's
   non-empty lines (split on \\n only), each stripped;
4. its non-empty lines, unstripped, equal those;
5. those lines and the expected ones are as many, not all both digit strings (`str.isdigit`), and
   all read as floats (`float()`) that agree within numpy.allclose's default tolerances
   (|a - b| <= 1e-8 + 1e-5 * |b|, or a == b).

verl goes on to compare sets of the words of each line, but the result is never used: a list of
strings is compared with a list of sets, equal only when both are empty, which (1) has passed
already. So words in another order, or spaced otherwise, fail here as in verl.

A function's returned value (its plain-typed copy, spmdsplit/sandbox/values.py) passes when it
equals the expected value, JSON-decoded from the test's output text (a dict with keys that all read
as ints gets int keys, and becomes a one-element list holding it; so does the dict that is the first
element of a list), or that value's first element when it is a non-empty list; a tuple returned
counts as a list, and a list of tuples as a list of lists against that first element.
"""

from __future__ import annotations

import json
import math
from typing import Any

_RTOL = 1e-5
_ATOL = 1e-8


def _digits(text: str) -> bool:
    return text.isdigit()


def _close(a: float, b: float) -> bool:
    """numpy.isclose with its defaults, on two Python floats (both IEEE doubles)."""
    return (abs(a - b) <= _ATOL + _RTOL * abs(b) and math.isfinite(b)) or a == b


def _floats_agree(lines: list[str], expected: list[str]) -> bool:
    if len(lines) != len(expected) or all(_digits(a) and _digits(b) for a, b in zip(lines, expected)):
        return False
    try:
        ours, theirs = [float(a) for a in lines], [float(b) for b in expected]
    except ValueError:
        return False
    return all(_close(a, b) for a, b in zip(ours, theirs))


def stdout_matches(printed: str, expected: str) -> bool:
    """A stdin/stdout program's output against the test's expected text (both str)."""
    lines = printed.splitlines()
    wanted = expected.strip()
    if "\n".join(lines).strip() == wanted or "\n".join(line.strip() for line in lines).strip() == wanted:
        return True
    if lines == [expected]:
        return True
    expected_lines = [line.strip() for line in expected.split("\n") if line]
    if lines == expected_lines:
        return True
    non_empty = [line for line in lines if line]
    return non_empty == expected_lines or _floats_agree(non_empty, expected_lines)


def _with_int_keys(mapping: Any) -> Any:
    return [{int(key): item for key, item in mapping.items()}]


def expected_value(output_text: str) -> Any:
    """A function-call test's expected value, from its output text (raises on text that is not
    JSON: verl's run dies there)."""
    value = json.loads(output_text)
    # Each step is skipped when it raises: keys that are not ints, a value with no first element.
    try:
        if isinstance(value, dict):
            value = _with_int_keys(value)
    except Exception:  # noqa: BLE001
        pass
    try:
        if isinstance(value[0], dict):
            value = _with_int_keys(value[0])
    except Exception:  # noqa: BLE001
        pass
    return value


def value_matches(returned: Any, expected: Any) -> bool:
    """A function's returned value against `expected_value(...)`."""
    if isinstance(returned, tuple):
        returned = list(returned)
    if returned == expected:
        return True
    if isinstance(expected, list) and expected and returned == expected[0]:
        return True
    try:
        return isinstance(returned[0], tuple) and [list(item) for item in returned] == expected[0]
    except Exception:  # noqa: BLE001 - no first element, elements that are not sequences
        return False
