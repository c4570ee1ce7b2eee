"""verl's code scorer through a SandboxFusion server (reward.sandbox_fusion.url): what verl 0.9.1's
`default_compute_score` gives for codecontests, apps, codeforces and taco when a url is set
(verl.utils.reward_score.sandbox_fusion, continuous=True), with an asyncio client (aiohttp).

The flow is verl's, which differs from prime_code's (spmdsplit/rewards/code.py):

- the code: after the last "```python" up to the next "```"; else, with a bare "```" fence, the
  text inside the first one, less a first line that is a language name (letters only); a
  response with no fence at all scores 0;
- the ground truth: a dict or its JSON text with "inputs" and "outputs" (and "fn_name"), or
  "assert_case": a list of assert statements appended to the code, one test each;
- every test is its own request (stdin: the input; a function-call program is wrapped in a
  program that reads its arguments as JSON lines from stdin and prints what the function
  returns, `json.dumps` for a dict, list, tuple, None or bool, `str` for the rest);
- a test passes when the run finished with return code 0 and its stdout equals the expected
  output, both less trailing newlines (no other leniency); the score is the fraction passed of
  the first 10 tests; a compile error marks every later test a compile error too.

Requests have verl's shape (compile_timeout and run_timeout both `run_timeout_s`, memory_limit_MB,
language "python", empty files and fetch_files) and its retries: only a 504 is retried, after 1 s
and 2 s (three tries); any other failure ends the test as an API error. Each request may take
compile + run + 10 s. At most `max_concurrent` requests are in flight per client.

Deliberate difference: verl sends every test and scores the first 10; only the first 10 are sent
here (the score cannot depend on the others: a compile error only marks later tests).

Returns {"score", "passed", "tests", "compile_error", "runtime_error", "timeout", "api_error"}.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from typing import Any

SCORED_TESTS = 10
TRIES = 3  # verl's MAX_RETRIES: tries in all, retried on a 504 only
RETRY_DELAY_S = 1.0  # after the n-th 504: n times this
API_TIMEOUT_S = 10.0  # on top of compile and run time, for a whole request

# verl's result codes for a test
PASSED = True
WRONG = False
API_ERROR = -1
RUNTIME_ERROR = -2
TIMEOUT = -3
COMPILE_ERROR = -4

# The imports verl's function-call wrapper starts with: a program may use these names unimported.
_STAR_IMPORTED = ("string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random",
                  "statistics", "itertools", "functools", "operator", "io", "sys", "json", "builtins", "typing")
_WRAPPER_HEAD = ("import traceback\n" + "".join(f"from {m} import *\n" for m in _STAR_IMPORTED)
                 + "".join(f"import {m}\n" for m in _STAR_IMPORTED[:-2]))
_WRAPPER_TAIL = '''
def _sandbox_call(_name):
    _text = sys.stdin.read()
    _args = []
    if _text.strip():
        try:
            _args = [json.loads(_line) for _line in _text.split("\\n")]
        except json.JSONDecodeError as _e:
            sys.stderr.write(f"arguments of {_name} are not JSON lines: {_e}\\n")
            return None, True
    try:
        _target = None
        if _name in globals():
            _target = globals()[_name]
        elif "Solution" in globals():
            _target = getattr(globals()["Solution"](), _name)
        if not _target:
            sys.stderr.write(f"no function or Solution method {_name}\\n")
            return None, True
        return _target(*_args), False
    except Exception:
        sys.stderr.write(traceback.format_exc())
        return None, True


if __name__ == "__main__":
    _value, _failed = _sandbox_call(%r)
    if not _failed:
        if isinstance(_value, (dict, list, tuple)) or _value is None or isinstance(_value, bool):
            print(json.dumps(_value))
        else:
            print(str(_value))
'''


def function_call_program(code: str, fn_name: str) -> str:
    """A program that calls `fn_name` (a function, or a method of a `Solution` instance) on the
    JSON lines of its stdin and prints the result as verl's SandboxFusion wrapper does."""
    return _WRAPPER_HEAD + "\n" + code + "\n" + _WRAPPER_TAIL % (fn_name,)


def extract_code(response: str) -> str | None:
    """The program in `response`, as verl's SandboxFusion scorer takes it; None when there is no fence."""
    if "```python" in response:
        return response.split("```python")[-1].split("```")[0]
    if "```" in response:
        inside = response.split("```")[1]
        if "\n" in inside:
            first, rest = inside.split("\n", 1)
            if first.strip().isalpha():
                return rest
        return inside
    return None


class SandboxFusionClient:
    """Requests to one SandboxFusion run_code url: one aiohttp session, at most `max_concurrent`
    in flight. Use it from one event loop (the session is bound to the loop that first uses it);
    `await close()` when done, or `async with`."""

    def __init__(self, url: str, max_concurrent: int = 64, memory_limit_mb: int = 1024, run_timeout_s: float = 10.0):
        self.url = url
        self.max_concurrent = max_concurrent
        self.memory_limit_mb = memory_limit_mb
        self.run_timeout_s = run_timeout_s  # verl's per-test `timeout` (10 s, not a config key there either)
        self._session = None
        self._semaphores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def from_config(cls, sandbox_fusion) -> "SandboxFusionClient":
        """From reward.sandbox_fusion (spmdsplit/config.py SandboxFusionConfig)."""
        return cls(sandbox_fusion.url, int(sandbox_fusion.max_concurrent), int(sandbox_fusion.memory_limit_mb))

    async def __aenter__(self) -> "SandboxFusionClient":
        return self

    async def __aexit__(self, *_exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _session_now(self):
        import aiohttp  # the optional extra "remote": imported only by a job that sets a url

        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if loop not in self._semaphores:
            self._semaphores[loop] = asyncio.Semaphore(self.max_concurrent)
        return self._semaphores[loop]

    async def run_code(self, code: str, stdin: str | None) -> tuple[dict | None, str | None]:
        """(the server's JSON answer, None) or (None, why the request failed)."""
        import aiohttp

        seconds = int(self.run_timeout_s) if float(self.run_timeout_s).is_integer() else self.run_timeout_s
        payload = json.dumps({"compile_timeout": seconds, "run_timeout": seconds, "code": code,
                              "stdin": stdin, "memory_limit_MB": self.memory_limit_mb, "language": "python",
                              "files": {}, "fetch_files": []})
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        timeout = aiohttp.ClientTimeout(total=2 * self.run_timeout_s + API_TIMEOUT_S)
        why = "no try made"
        async with self._semaphore():
            for attempt in range(TRIES):
                try:
                    async with self._session_now().post(self.url, data=payload, headers=headers, timeout=timeout) as answer:
                        if answer.status == 504:
                            why = f"gateway timeout (504) on try {attempt + 1} of {TRIES}"
                            if attempt < TRIES - 1:
                                await asyncio.sleep(RETRY_DELAY_S * (attempt + 1))
                            continue
                        if answer.status >= 400:
                            return None, f"HTTP {answer.status}"
                        return json.loads(await answer.text()), None
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                    return None, f"{type(e).__name__}: {e}"
        return None, why


def classify(answer: Any, expected: Any) -> int | bool:
    """verl's result code for one test from the server's answer (None: the request failed).
    Raises, as verl's does, on an answer whose parts are not what SandboxFusion sends."""
    if not answer:
        return API_ERROR
    status = answer.get("status")
    compiled, run = answer.get("compile_result"), answer.get("run_result")
    compile_status = compiled.get("status") if compiled else None
    run_status, stdout, return_code = (run.get("status"), run.get("stdout"), run.get("return_code")) if run else (None,) * 3
    if status == "Success":
        if run and run_status == "Finished":
            stdout = "" if stdout is None else stdout
            return PASSED if expected is None or str(stdout).rstrip("\n") == str(expected).rstrip("\n") else WRONG
        return API_ERROR
    if status != "Failed":
        return API_ERROR  # SandboxError, or a status verl does not know
    if compiled and (compile_status in ("Error", "TimeLimitExceeded")
                     or (compile_status == "Finished" and compiled.get("return_code") != 0)):
        return COMPILE_ERROR
    if run and run_status == "TimeLimitExceeded":
        return TIMEOUT
    if run and (run_status == "Error" or (run_status == "Finished" and return_code != 0)):
        return RUNTIME_ERROR
    return API_ERROR


async def _one_test(client: SandboxFusionClient, code: str, stdin: Any, expected: Any, fn_name: Any) -> int | bool:
    if fn_name:
        code = function_call_program(code, fn_name)
    try:
        answer, _why = await client.run_code(code, None if stdin is None else str(stdin))
        return classify(answer, expected)
    except Exception:  # noqa: BLE001 - verl counts a test whose handling raised as an API error
        return API_ERROR


async def check_tests(client: SandboxFusionClient, code: str, tests: dict) -> list:
    """verl's check_correctness: a result code per test, the first SCORED_TESTS of them run."""
    if not tests or "inputs" not in tests or "outputs" not in tests:
        return [API_ERROR]
    inputs, outputs = tests["inputs"], tests["outputs"]
    count = len(inputs)
    asserts = tests.get("assert_case", [""] * count)
    if count == 0:
        return []
    if len(inputs) != len(outputs) or len(asserts) != count:
        return [API_ERROR] * count
    # All tests' parts, taken as verl takes them (it raises here on a test it cannot read).
    cases = [(code + "\n\n" + asserts[i], stdin, outputs[i]) for i, stdin in enumerate(inputs)]
    fn_name = tests.get("fn_name")
    results = list(await asyncio.gather(*(_one_test(client, program, stdin, expected, fn_name)
                                          for program, stdin, expected in cases[:SCORED_TESTS])))
    if COMPILE_ERROR in results:
        first = results.index(COMPILE_ERROR)
        results[first:] = [COMPILE_ERROR] * (len(results) - first)
    return results


def _tests(ground_truth: Any) -> Any:
    """The ground truth as verl reads it, or None where verl scores 0 (raises where verl does)."""
    tests = ground_truth
    if not isinstance(tests, dict):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError:
            return None
    if tests is not None and "assert_case" in tests and isinstance(tests.get("assert_case"), list):
        asserts = tests.get("assert_case")
        tests.setdefault("inputs", ["" for _ in asserts])
        tests.setdefault("outputs", [None for _ in asserts])
    elif not tests or "inputs" not in tests or "outputs" not in tests:
        return None
    return tests


def _scored(score: float, results: list) -> dict:
    return {
        "score": float(score),
        "passed": sum(result is PASSED for result in results),
        "tests": len(results),
        "compile_error": int(COMPILE_ERROR in results),
        "runtime_error": int(RUNTIME_ERROR in results),
        "timeout": int(TIMEOUT in results),
        "api_error": int(API_ERROR in results),
    }


async def compute_score(solution_str: str, ground_truth: Any, client: SandboxFusionClient) -> dict:
    """The score verl's SandboxFusion scorer gives `solution_str` (see the module's docstring)."""
    code = extract_code(solution_str)
    if code is None:
        return _scored(0.0, [])
    try:
        tests = _tests(ground_truth)
        if tests is None:
            return _scored(0.0, [])
        results = (await check_tests(client, code, tests))[:SCORED_TESTS]
    except Exception:  # noqa: BLE001 - verl scores a ground truth its flow trips on 0
        return _scored(0.0, [])
    if not results:
        return _scored(0.0, results)
    return _scored(sum(result is PASSED for result in results) / len(results), results)
