r"""verl's SandboxFusion scorer as spmdsplit/rewards/sandbox_fusion.py reproduces it: every case of
tests/data/verl_sandbox_fusion_scores.json (verl 0.9.1's own client against
tests/support/fake_sandbox_fusion.py, written by tools/fixtures/verl_code_fixtures.py; this test
needs no verl) scored by our client against the same fake server, and the client's requests,
retries and concurrency."""

import asyncio
import json
from pathlib import Path

import pytest

from spmdsplit.rewards import sandbox_fusion
from spmdsplit.rewards.sandbox_fusion import SandboxFusionClient, compute_score
from tests.support.fake_sandbox_fusion import FakeSandboxFusion

FIXTURE = json.loads((Path(__file__).parent / "data" / "verl_sandbox_fusion_scores.json").read_text())
CASES = {case["name"]: case for case in FIXTURE["cases"]}

# Every case where our score is not verl's, with ours and why. None: every case agrees.
SANDBOX_FUSION_DIFFERENCES: dict = {}

# verl's per-test statuses, and the flag of ours that says the same
_FLAGS = {"compile_error": "compile_error", "runtime_error": "runtime_error", "timeout": "timeout",
          "api_error": "api_error", "sandbox_error": "api_error"}


@pytest.fixture(scope="module")
def server():
    with FakeSandboxFusion() as fake:
        yield fake


@pytest.fixture(scope="module")
def ours(server):
    """Every case scored concurrently by one client (1 s to run: the infinite loop's timeout is
    still a timeout, and every other program ends well within it)."""
    async def score_all():
        async with SandboxFusionClient(server.url, max_concurrent=8, run_timeout_s=1) as client:
            return await asyncio.gather(*(compute_score(case["response"], case["ground_truth"], client)
                                          for case in FIXTURE["cases"]))

    return dict(zip(CASES, asyncio.run(score_all())))


def test_the_fixture_is_verl_0_9_1s_and_broad():
    assert FIXTURE["verl_version"] == "0.9.1"
    scores = [case["verl"]["score"] for case in CASES.values()]
    assert len(CASES) >= 30 and scores.count(1.0) > 10 and scores.count(0.0) > 10 and 0.5 in scores
    statuses = {status for case in CASES.values() for status in case["verl"]["statuses"]}
    assert {"success", "wrong_answer", "compile_error", "runtime_error", "timeout", "api_error", "sandbox_error"} <= statuses
    assert set(SANDBOX_FUSION_DIFFERENCES) <= set(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_score_is_verls(ours, name):
    expected = SANDBOX_FUSION_DIFFERENCES.get(name, CASES[name]["verl"]["score"])
    assert ours[name]["score"] == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("name", list(CASES))
def test_failures_are_verls(ours, name):
    statuses = CASES[name]["verl"]["statuses"]
    for status, flag in _FLAGS.items():
        if status in statuses:
            assert ours[name][flag] == 1, (status, ours[name])
    if statuses and None not in statuses:
        assert ours[name]["tests"] == len(statuses) and ours[name]["passed"] == statuses.count("success")


def test_request_is_verls_shape(server):
    server.stats.bodies.clear()

    async def one():
        async with SandboxFusionClient(server.url, memory_limit_mb=512) as client:
            return await client.run_code("print(input())", "hi")

    answer, why = asyncio.run(one())
    assert why is None and answer["status"] == "Success" and answer["run_result"]["stdout"] == "hi\n"
    headers, body = server.stats.bodies[-1]
    assert body == {"compile_timeout": 10, "run_timeout": 10, "code": "print(input())", "stdin": "hi",
                    "memory_limit_MB": 512, "language": "python", "files": {}, "fetch_files": []}
    assert headers["Content-Type"] == "application/json" and headers["Accept"] == "application/json"


def test_only_a_504_is_retried_three_tries_in_all(server, ours):
    """(After the module's cases: their requests are counted too.)"""
    seen = server.stats.seen
    tried = {name: sum(count for code, count in seen.items() if marker in code)
             for name, marker in [("http-504-then-ok", "#fake: 504 x1"), ("http-504-always", "#fake: 504 x3"),
                                  ("http-500", "#fake: 500"), ("response-not-json", "#fake: not-json")]}
    assert tried == {"http-504-then-ok": 2, "http-504-always": 3, "http-500": 1, "response-not-json": 1}
    assert (sandbox_fusion.TRIES, sandbox_fusion.RETRY_DELAY_S) == (3, 1.0)  # verl's: sleeps 1 s, then 2 s


def test_at_most_max_concurrent_requests_in_flight(server):
    server.stats.most_at_once = 0

    async def many():
        async with SandboxFusionClient(server.url, max_concurrent=2) as client:
            programs = [f"import time\ntime.sleep(0.3)\nprint({i})" for i in range(6)]
            return await asyncio.gather(*(client.run_code(program, "") for program in programs))

    answers = asyncio.run(many())
    assert [answer["run_result"]["stdout"] for answer, _ in answers] == [f"{i}\n" for i in range(6)]
    assert server.stats.most_at_once == 2


def test_an_unreachable_server_is_an_api_error():
    async def one():
        async with SandboxFusionClient("http://127.0.0.1:9/run_code") as client:
            return await compute_score("```python\nprint(1)\n```", {"inputs": ["\n"], "outputs": ["1\n"]}, client)

    assert asyncio.run(one()) == {"score": 0.0, "passed": 0, "tests": 1, "compile_error": 0, "runtime_error": 0,
                                  "timeout": 0, "api_error": 1}


@pytest.mark.parametrize("response, extracted", [
    ("```python\nprint(1)\n```", "\nprint(1)\n"),
    ("```\nprint(1)\n```", "\nprint(1)\n"),
    ("```py\nprint(1)\n```", "print(1)\n"),  # a language name on the fence's line goes
    ("```py3\nprint(1)\n```", "py3\nprint(1)\n"),  # not letters only: it stays
    ("print(1)", None),  # no fence: no code
])
def test_extract_code(response, extracted):
    assert sandbox_fusion.extract_code(response) == extracted


def test_function_call_wrapper_prints_as_verls():
    program = sandbox_fusion.function_call_program("def f(a):\n    return a", "f")
    assert program.startswith("import traceback\nfrom string import *\n") and "\ndef f(a):\n    return a\n" in program
    assert "_sandbox_call('f')" in program
