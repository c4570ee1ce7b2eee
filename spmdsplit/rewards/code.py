"""verl's code scorer for data_sources codecontests, apps, codeforces and taco, run locally: what
verl 0.9.1's `default_compute_score` gives through prime_code (`compute_score(solution, ground
truth, continuous=True)`), each program run in spmdsplit/sandbox/ instead of a fork of the trainer.

The flow is prime_code's:

1. The code is the text after the response's last "```python" up to the next "```" (the whole
   response when there is no such fence; a bare "```" fence is not one: its text is cut at it).
2. The ground truth is a dict, or a JSON string of one: "inputs" and "outputs", lists of texts,
   and "fn_name" for a function-call program (each input line a JSON argument, each output a JSON
   value) rather than a stdin/stdout one. Text that is not JSON scores 0.
3. One run of all tests together, each test (and the program's load) getting half of
   reward.sandbox.timeout_s (verl's 5 s of 10), the run 1 s more; if every test passes: 1.0.
4. Else each of the first 10 tests in a run of its own (the full timeout each, 1 s more for the
   run; concurrently here, one after another in verl), and the score is the fraction that pass.
   These single-test runs carry no fn_name (verl builds them without it): a function-call
   program is then run as a stdin/stdout one, prints nothing, and fails, so such programs score
   1.0 or 0.0, never in between.

How a run goes: spmdsplit/sandbox/harness.py (the program's side) and
spmdsplit/rewards/code_compare.py (whether an output is right). A run stops at its first failed
test. Where verl's run process dies (a timeout, a SystemExit in a function-call program, an
input or output it cannot read), every result of that run counts as failed.

Returns {"score", "passed", "tests", "compile_error", "runtime_error", "timeout"}: the tests passed
of those scored (all of them when the first run passed them all; else the first 10), and 1/0
flags: the program did not load, a test raised, a run overran.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from spmdsplit.rewards import code_compare
from spmdsplit.sandbox import pool
from spmdsplit.sandbox.pool import Outcome, Sandbox

DATA_SOURCES = ("codecontests", "apps", "codeforces", "taco")
SCORED_TESTS = 10  # the tests verl's continuous score runs one by one

PASSED = True
FAILED = False
RAN_BADLY = -1  # verl's code for a test that raised, or a run that died
NOT_LOADED = -2  # verl's code for a program that did not compile or has no entry point


class _RunLost(Exception):
    """verl's own scorer raised here (a ground truth it cannot read): the run counts for nothing."""


def extract_code(response: str) -> str:
    return response.split("```python")[-1].split("```")[0]


def parse_tests(ground_truth: Any) -> Any:
    """The ground truth as verl reads it: a dict as is, else JSON-decoded, else left as it is."""
    if isinstance(ground_truth, dict):
        return ground_truth
    try:
        return json.loads(ground_truth)
    except Exception:  # noqa: BLE001 - verl prints it and goes on; the score is 0 further down
        return ground_truth


def _all_lost(tests: Any) -> list:
    """A dead run's results: one failure per input (raises where verl's count raises)."""
    try:
        return [RAN_BADLY] * len(tests["inputs"])
    except Exception as e:  # noqa: BLE001
        raise _RunLost(str(e)) from None


def _plan(tests: dict, inputs: list, calls: bool) -> tuple[list[str], list[Any]]:
    """The inputs verl's run reaches and what each must produce, up to the first test whose data
    it cannot read (it dies there, before running it)."""
    texts, expected = [], []
    for index, text in enumerate(inputs):
        try:
            output = tests["outputs"][index]
            if not isinstance(text, str) or not isinstance(output, str):
                break
            if calls:
                [json.loads(line) for line in text.split("\n")]
                output = code_compare.expected_value(output)
        except Exception:  # noqa: BLE001
            break
        texts.append(text)
        expected.append(output)
    return texts, expected


class _Run:
    """One of prime_code's runs: results in verl's codes, and the run's status."""

    def __init__(self, results: list, status: str):
        self.results = results
        self.status = status

    @property
    def all_passed(self) -> bool:
        return all(result is PASSED for result in self.results)


async def run_tests(sandbox: Sandbox, code: str, tests: Any, test_timeout_s: float) -> _Run:
    """verl's check_correctness on `tests` (a dict of inputs, outputs, fn_name)."""
    if not isinstance(tests, dict) or not tests or "inputs" not in tests:
        return _Run(_all_lost(tests), pool.CRASHED)
    calls = tests.get("fn_name") is not None
    try:
        inputs = list(tests["inputs"])
    except TypeError:
        return _Run(_all_lost(tests), pool.CRASHED)
    texts, expected = _plan(tests, inputs, calls)
    results: list = []

    def judge(outcome: Outcome) -> bool:
        want = expected[outcome.index]
        right = (code_compare.value_matches(outcome.value, want) if calls
                 else code_compare.stdout_matches(outcome.output, want))
        results.append(PASSED if right else FAILED)
        return right

    program = {"code": code, "fn_name": tests.get("fn_name"), "inputs": texts}
    run = await sandbox.run(program, test_timeout_s, judge)
    if run.status == pool.LOAD_ERROR:
        return _Run([NOT_LOADED], run.status)
    if run.status == pool.STOPPED and run.outcomes[-1].error is not None:
        return _Run(results + [RAN_BADLY], run.status)
    if run.status == pool.STOPPED or (run.status == pool.DONE and len(texts) == len(inputs)):
        return _Run(results, run.status)
    return _Run(_all_lost(tests), run.status)  # timed out, crashed, or died on unreadable data


def _single_tests(tests: Any) -> list[dict]:
    """One test each, as verl splits them (no fn_name); raises where verl's split raises."""
    inputs, outputs = tests["inputs"], tests["outputs"]
    return [{"inputs": [inputs[i]], "outputs": [outputs[i]]} for i in range(len(inputs))]


def _scored(score: float, runs: list[_Run], passed: int, tests: int) -> dict:
    return {
        "score": float(score),
        "passed": passed,
        "tests": tests,
        "compile_error": int(bool(runs) and runs[0].status == pool.LOAD_ERROR),
        "runtime_error": int(any(run.status == pool.STOPPED and RAN_BADLY in run.results for run in runs)),
        "timeout": int(any(run.status == pool.TIMEOUT for run in runs)),
    }


async def compute_score(solution_str: str, ground_truth: Any, sandbox: Sandbox) -> dict:
    """The score verl gives `solution_str` against `ground_truth` (see the module's docstring)."""
    code = extract_code(solution_str)
    tests = parse_tests(ground_truth)
    runs: list[_Run] = []
    try:
        first = await run_tests(sandbox, code, tests, sandbox.limits.timeout_s / 2)
        runs.append(first)
        if first.all_passed:
            return _scored(1.0, runs, len(first.results), len(first.results))
    except _RunLost:
        pass
    try:
        singles = _single_tests(tests)[:SCORED_TESTS]
    except Exception:  # noqa: BLE001 - a ground truth verl cannot split: it scores 0
        return _scored(0.0, runs, 0, 0)
    single_runs = await asyncio.gather(*(run_tests(sandbox, code, single, sandbox.limits.timeout_s)
                                         for single in singles))
    runs.extend(single_runs)
    results = [result for run in single_runs for result in run.results]
    passed = sum(result is PASSED for result in results)
    return _scored(passed / (len(results) or 1), runs, passed, len(results))
