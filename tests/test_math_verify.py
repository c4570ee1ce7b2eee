r"""The data_source `math_verify`: Math-Verify's symbolic check under verl's `math_verify.compute_score`
semantics (ground truth read as `\boxed{...}`), from the main thread and from worker threads, where
Math-Verify's own signal-based timeouts would raise; and the bound on a call that does not return."""

import importlib.util
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from spmdsplit import usercode
from spmdsplit.rewards import math_verify
from spmdsplit.rewards.rule import compute_score, score_sample

pytestmark = pytest.mark.skipif(importlib.util.find_spec("math_verify") is None,
                                reason="math-verify is not installed (the math extra)")

ACCEPTED = [  # (response, ground truth): equivalent forms
    (r"so \boxed{1/2}", "0.5"),
    (r"\boxed{0.5}", r"\frac{1}{2}"),
    ("0.5", r"\frac{1}{2}"),
    (r"The answer is $\frac{1}{2}$.", "1/2"),
    (r"\boxed{\dfrac12}", r"\frac{1}{2}"),
    (r"\boxed{2+\sqrt{3}}", r"\sqrt{3}+2"),
    (r"\boxed{x = 3}", "3"),
    (r"\boxed{1,000}", "1000"),
    (r"\boxed{50\%}", "50"),
    (r"\boxed{(1, 2)}", "(1,2)"),
    (r"\boxed{\{1, 2\}}", r"\{2, 1\}"),
    ("first 7, then the answer: \\boxed{42}", "42"),
]
REJECTED = [
    (r"\boxed{1/3}", "1/2"),
    (r"\boxed{0.51}", r"\frac{1}{2}"),
    (r"\boxed{-2}", "2"),
    (r"\boxed{x+1}", "x+2"),
    ("no number at all", "1/2"),
    ("", "7"),
    (r"\boxed{", "7"),
    (r"\boxed{7}", r"\frac{"),  # a ground truth Math-Verify cannot read: 0, as verl's
]


@pytest.mark.parametrize("response, truth", ACCEPTED)
def test_accepts_equivalent_answers(response, truth):
    assert compute_score("math_verify", response, truth) == 1.0


@pytest.mark.parametrize("response, truth", REJECTED)
def test_rejects_wrong_and_unreadable_answers(response, truth):
    assert compute_score("math_verify", response, truth) == 0.0


def test_same_scores_from_worker_threads():
    """Off the main thread, as a reward computed beside other work may be: the same scores."""
    cases = ACCEPTED + REJECTED
    want = [1.0] * len(ACCEPTED) + [0.0] * len(REJECTED)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda case: score_sample("math_verify", *case)[0], cases))
    assert got == want


def test_math_verifys_own_timeouts_raise_off_the_main_thread():
    """Why ours are off: with its defaults (signal.alarm), Math-Verify raises in a worker thread."""
    from math_verify import parse

    errors = []

    def call():
        try:
            parse(r"\boxed{1/2}")
        except ValueError as e:
            errors.append(str(e))
    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    assert errors and "threaded environment" in errors[0]


def test_a_call_past_its_bound_scores_the_timeout_score(monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(math_verify, "TIMEOUT_S", 0.2)
    monkeypatch.setattr(math_verify, "_score", lambda *_: release.wait(30) and 1.0)
    before = usercode.stuck_bounded()
    start = time.monotonic()
    with pytest.warns(UserWarning, match="took more than 0.2 s: scored as a timeout"):
        assert math_verify.compute_score(r"\boxed{1}", "1") == 0.0
    assert time.monotonic() - start < 5 and usercode.stuck_bounded() == before + 1
    release.set()  # the abandoned thread ends


def test_errors_inside_the_bound_reach_the_caller():
    def broken():
        raise KeyError("x")
    with pytest.raises(KeyError):
        usercode.call_within(5, broken)
    assert usercode.call_within(5, lambda a, b=0: a + b, 1, b=2) == 3
