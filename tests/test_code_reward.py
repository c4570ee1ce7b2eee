r"""verl's prime_code scorer as spmdsplit/rewards/code.py reproduces it: every case of
tests/data/verl_prime_code_scores.json (verl 0.9.1's own scores, written by
tools/fixtures/verl_code_fixtures.py; this test needs no verl) scored through the local sandbox,
and the pieces one by one: how the program is loaded (spmdsplit/sandbox/harness.py), how an output
is judged (spmdsplit/rewards/code_compare.py), how a returned value travels
(spmdsplit/sandbox/values.py)."""

import asyncio
import json
import math
from pathlib import Path

import pytest

from spmdsplit.rewards import code, code_compare
from spmdsplit.sandbox import Limits, Sandbox, harness, values

FIXTURE = json.loads((Path(__file__).parent / "data" / "verl_prime_code_scores.json").read_text())
CASES = {case["name"]: case for case in FIXTURE["cases"]}

# Every case where our score is not verl's, with ours and why. None: every case agrees.
PRIME_CODE_DIFFERENCES: dict = {}

# Short enough for the cases that loop forever to end soon; long enough for every other program's
# load (the prelude's imports, numpy's) on two busy cores: half of it is the first run's per test.
TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def ours():
    """Our result on every fixture case, scored concurrently as a rank scores a batch."""
    sandbox = Sandbox(workers=0, limits=Limits(timeout_s=TIMEOUT_S))

    async def score_all():
        return await asyncio.gather(*(code.compute_score(case["response"], case["ground_truth"], sandbox)
                                      for case in FIXTURE["cases"]))

    return dict(zip(CASES, asyncio.run(score_all())))


def test_the_fixture_is_verl_0_9_1s_and_broad():
    assert FIXTURE["verl_version"] == "0.9.1"
    scores = [case["verl"]["score"] for case in CASES.values()]
    assert len(CASES) >= 100 and scores.count(1.0) > 40 and scores.count(0.0) > 40
    assert {0.5, 2 / 3} <= set(scores)  # partly right: k of n
    assert set(PRIME_CODE_DIFFERENCES) <= set(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_score_is_verls(ours, name):
    case = CASES[name]
    expected = PRIME_CODE_DIFFERENCES.get(name, case["verl"]["score"])
    assert ours[name]["score"] == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case["verl"]["single_runs"]])
def test_single_test_runs_are_verls(ours, name):
    """Where the first run failed, the tests scored one by one pass and fail as in verl."""
    single = CASES[name]["verl"]["single_runs"]
    assert ours[name]["tests"] == len(single)
    assert ours[name]["passed"] == single.count("[True]")


def test_extras_tell_what_went_wrong(ours):
    assert ours["stdin-right"] == {"score": 1.0, "passed": 3, "tests": 3, "compile_error": 0, "runtime_error": 0,
                                   "timeout": 0}
    assert ours["syntax-error"]["compile_error"] == 1 and ours["syntax-error"]["tests"] == 3
    assert ours["stdin-raises"]["runtime_error"] == 1 and ours["stdin-raises"]["compile_error"] == 0
    assert ours["stdin-infinite-loop"]["timeout"] == 1
    assert ours["stdin-first-ten-of-twelve"]["tests"] == 10 and ours["stdin-first-ten-of-twelve"]["passed"] == 5
    assert ours["truth-not-json"] == {"score": 0.0, "passed": 0, "tests": 0, "compile_error": 0, "runtime_error": 0,
                                      "timeout": 0}


def test_data_sources_are_verls_code_route():
    assert code.DATA_SOURCES == ("codecontests", "apps", "codeforces", "taco")


# -- the code and the ground truth ---------------------------------------------------------------

@pytest.mark.parametrize("response, extracted", [
    ("```python\nprint(1)\n```", "\nprint(1)\n"),
    ("a\n```python\nprint(1)\n```\nb\n```python\nprint(2)\n```\nc", "\nprint(2)\n"),  # the last fence
    ("```python\nprint(1)", "\nprint(1)"),  # unclosed: to the end
    ("print(1)", "print(1)"),  # no fence: all of it
    ("see\n```\nprint(1)\n```", "see\n"),  # a bare fence is no fence: cut at it
])
def test_extract_code(response, extracted):
    assert code.extract_code(response) == extracted


def test_parse_tests_keeps_what_is_not_json():
    assert code.parse_tests('{"inputs": []}') == {"inputs": []}
    assert code.parse_tests({"inputs": ["1"]}) == {"inputs": ["1"]}
    assert code.parse_tests("not json") == "not json"


# -- the program's load (harness) ----------------------------------------------------------------

def test_prelude_is_verls_star_imports_and_imports():
    lines = harness.PRELUDE.splitlines()
    assert lines[0] == "from string import *" and "from builtins import *" in lines and "from typing import *" in lines
    assert lines.index("from builtins import *") > lines.index("from sys import *")  # builtins' exit (None) wins
    assert lines[-1] == "sys.setrecursionlimit(6*10**5)" and "import builtins" not in lines


def test_stdin_program_is_indented_into_a_function():
    wrapped = harness.as_stdin_function("import sys\nn = int(input())\nimport math\nprint(math.sqrt(n))")
    assert wrapped == ("import sys\nstdin = sys.stdin\nstdout = sys.stdout\ndef code():\n\tn = int(input())\n"
                       "\timport math\n\tprint(math.sqrt(n))\n")


def test_a_fenced_program_has_all_its_imports_inside():
    """A fenced response's code starts with an empty line: nothing stays at the top (which is why
    `from sys import stdin` in a fence reads sys.stdin's lines with their newline)."""
    assert harness.as_stdin_function("\nimport sys\nprint(1)\n").startswith("stdin = sys.stdin\nstdout = sys.stdout\n"
                                                                          "def code():\n\t\n\timport sys\n")


def test_main_guard_is_unwrapped_only_when_last():
    assert harness.without_main_guard('def f():\n    pass\nif __name__ == "__main__":\n    f()') == "def f():\n    pass\nf()"
    kept = "if __name__ == '__main__':\n    f()\nx = 1"
    assert harness.without_main_guard(kept) == kept
    assert harness.without_main_guard("if __name__ == '__main__':\n    a()\nelse:\n    b()") == "\na()"
    assert harness.without_main_guard("not python (") == "not python ("


def test_function_arguments_get_int_keys_from_the_first_dict():
    assert harness.call_arguments('{"1": 2, "3": 4}\n5') == [{1: 2, 3: 4}]  # the other arguments go
    assert harness.call_arguments('{"a": 1}\n5') == [{"a": 1}, 5]
    assert harness.call_arguments("[1, 2]\n3") == [[1, 2], 3]


# -- stdin/stdout output: each step of verl's cascade ----------------------------------------------

@pytest.mark.parametrize("printed, expected, right", [
    # 1. whole text, stripped; or each line stripped
    ("1\n2\n", "1\n2", True),
    ("  1\n2  \n\n", "1\n2\n", True),
    ("1 \n 2\n", "1\n2\n", True),
    ("1\r\n2\r\n", "1\n2\n", True),  # splitlines ends lines at \r too
    ("", "\n", True),
    # 2. one line equal to the expected text exactly
    ("a b", "a b", True),
    # 3. lines against the expected non-empty lines, stripped
    ("1\n2", "1 \n\n 2", True),
    # 4. non-empty lines
    ("1\n\n2\n", "1\n2\n", True),
    # 5. floats, within numpy.allclose's defaults
    ("0.3333333333\n", "0.333333\n", True),
    ("0.3333\n", "0.333333\n", False),
    ("2.0\n", "2\n", True),
    ("-2.0\n", "-2\n", True),
    ("1e-9\n", "0\n", True),  # atol 1e-8
    ("01\n", "1\n", False),  # both digit strings: no float comparison
    ("1.0 2.0\n", "1 2\n", False),  # a line of two numbers is not a float
    ("1.0\n2.0\n", "1\n", False),  # as many lines, or no float comparison
    ("nan\n", "nan\n", True),  # equal text (step 1), though nan is not close to nan
    ("nan\n", "NaN\n", False),
    ("inf\n", "Infinity\n", True),
    ("1e400\n", "inf\n", True),
    # the set comparisons verl makes after these never decide anything
    ("b a\n", "a b\n", False),
    ("1  2\n", "1 2\n", False),
    ("yes\n", "YES\n", False),
])
def test_stdout_cascade(printed, expected, right):
    assert code_compare.stdout_matches(printed, expected) is right


@pytest.mark.parametrize("a, b, close", [
    (1.0, 1.0 + 1e-6, True), (1.0, 1.0 + 2e-5, False), (1e10, 1.00001e10, True), (0.0, 1e-8, True),
    (0.0, 2e-8, False), (math.inf, math.inf, True), (math.inf, -math.inf, False), (1.0, math.inf, False),
    (math.nan, math.nan, False), (1e308, -1e308, False),
])
def test_float_closeness_is_numpys(a, b, close):
    np = pytest.importorskip("numpy")
    assert code_compare._close(a, b) is close is bool(np.isclose(a, b))


# -- a function's returned value ---------------------------------------------------------------

@pytest.mark.parametrize("returned, output_text, right", [
    (3, "3", True),
    (3, "[3]", True),  # the expected value's first element
    ((1, 1), "[1, 1]", True),  # a tuple is a list
    ([(1, 1)], "[[1, 1]]", False),  # a list of tuples is not a list of lists...
    ([(1, 1)], "[[[1, 1]]]", True),  # ...but is, against the first element
    ({3: 6}, '{"3": 6}', True),  # int keys on both sides
    ({"3": 6}, '{"3": 6}', False),  # the expected side's keys became ints
    ({"a": 1}, '{"a": 1}', True),  # keys that are not ints stay
    (True, "1", True),
    (None, "null", True),
    (0.30000000000000004, "0.3", False),  # no tolerance for functions
])
def test_returned_value_against_expected(returned, output_text, right):
    assert code_compare.value_matches(returned, code_compare.expected_value(output_text)) is right


def test_expected_value_raises_on_text_that_is_not_json():
    with pytest.raises(ValueError):
        code_compare.expected_value("not json")


@pytest.mark.parametrize("value", [
    1, 1.5, "x", None, True, [1, [2]], (1, (2, [3])), {1: "a", "b": (2,), None: 3, 1.5: 4, False: 5}, [],
    {"tuple": [1]},  # a dict that looks like a tag
])
def test_values_keep_their_types_across_json(value):
    carried = values.decode(json.loads(json.dumps(values.encode(value))))
    assert carried == value and type(carried) is type(value)
    if isinstance(value, dict):
        assert [type(k) for k in carried] == [type(k) for k in value]


def test_values_carry_the_value_not_the_object():
    class Always(int):
        def __eq__(self, other):
            return True

        __hash__ = int.__hash__

    assert values.decode(json.loads(json.dumps(values.encode(Always(2))))) != 3


@pytest.mark.parametrize("data", [{"tuple": [1], "x": 2}, {"set": [1]}, {"dict": [[[1], 2]]}, {"dict": [1]}])
def test_values_refuse_what_encode_cannot_write(data):
    with pytest.raises(ValueError):
        values.decode(data)
