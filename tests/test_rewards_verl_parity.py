r"""The `numina_*`, `hiyouga/geometry3k` and `searchR1_*` scorers against verl 0.9.1's own results
(tests/data/verl_{prime_math,geo3k,search_r1}_scores.json, written by
tools/fixtures/verl_reward_fixtures.py, which runs verl's code; this test needs no verl), and their
routing by data_source."""

import importlib.util
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from spmdsplit.rewards import arithmetic, geo3k, prime_math, rule, search_r1
from spmdsplit.rewards.rule import compute_score, score_sample

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("sympy", "pylatexenc", "mathruler")),
    reason="the math extra (sympy, pylatexenc, mathruler) is not installed")

DATA = Path(__file__).parent / "data"
FIXTURES = {family: json.loads((DATA / f"verl_{family}_scores.json").read_text())
            for family in ("prime_math", "geo3k", "search_r1")}
CASES = {(family, case["name"]): case for family, fixture in FIXTURES.items() for case in fixture["cases"]}
SCORERS = {"prime_math": prime_math, "geo3k": geo3k, "search_r1": search_r1}

# Every case where our result is not verl's, with ours; the fixtures hold verl's. Listed in
# docs/algorithms.md ("Rewards") and in each scorer's docstring.
DIFFERENCES = {
    # An answer with \pi is evaluated as arithmetic only: verl evals `1*3.14159*abs(-2)` and gets
    # 2 pi (abs is Python's); here no model text runs as code, so it stays text, and is wrong.
    ("prime_math", "pi-python-call"): {"score": 0.0},
    # A ground truth that is not a string is read as its text (mathruler's normalisation, in verl,
    # raises AttributeError on an int).
    ("geo3k", "truth-int"): {"score": 1.0, "acc": 1.0, "format": 1.0},
    # A ground truth that is the answers themselves, not verl's {"target": answers} (verl indexes
    # it with "target": TypeError), and answers that are not strings (verl lower-cases them:
    # AttributeError) are read as their text.
    ("search_r1", "truth-string"): {"score": 1.0},
    ("search_r1", "truth-list"): {"score": 1.0},
    ("search_r1", "truth-non-string-answer"): {"score": 1.0},
}


def ours(family: str, case) -> dict:
    """Our result, shaped as the fixture's: through the route (rule.compute_score), the family's
    compute_score called with the case's options, or prime_math's ToRA comparison alone."""
    if case["call"] == "math_equal":
        return {"equal": prime_math.math_equal(case["response"], case["ground_truth"])}
    if case["call"] == "route":
        result = compute_score(case["data_source"], case["response"], case["ground_truth"])
    else:
        result = SCORERS[family].compute_score(case["response"], case["ground_truth"], **case["kwargs"])
    got = dict(result) if isinstance(result, dict) else {"score": result}
    assert type(got["score"]) is float
    if family == "prime_math":
        got["pred"] = prime_math.extract_answer(case["response"])
    elif family == "search_r1":
        got["pred"] = search_r1.extract_answer(case["response"])
    return got


def test_the_fixtures_are_verl_0_9_1s_and_broad():
    for family, fixture in FIXTURES.items():
        assert fixture["verl_version"] == "0.9.1"
        results = [case["verl"] for case in fixture["cases"]]
        right = sum(r.get("score", 0) > 0.5 for r in results)
        wrong = sum(r.get("score", 1) < 0.5 for r in results)
        assert right >= 10 and wrong >= 8, family
        assert len({case["name"] for case in fixture["cases"]}) == len(results)
    assert set(DIFFERENCES) <= set(CASES)


@pytest.mark.parametrize("key", sorted(CASES), ids=lambda key: "/".join(key))
def test_scores_as_verl(key):
    family, _ = key
    case = CASES[key]
    verl = case["verl"]
    if verl.get("unknown"):  # verl routes the name nowhere: here it stops the job naming it
        with pytest.raises(KeyError, match="no reward function"):
            ours(family, case)
        return
    if key in DIFFERENCES:
        got = ours(family, case)
        assert {k: got[k] for k in DIFFERENCES[key]} == DIFFERENCES[key]
        assert {k: verl.get(k) for k in DIFFERENCES[key]} != DIFFERENCES[key]
        return
    if "error" in verl:  # verl raises on it, and so do we, alike
        with pytest.raises(Exception) as raised:
            ours(family, case)
        # ToRA's comparison may fail otherwise than verl's (NotArithmetic where eval raised
        # NameError): its caller scores any error as a wrong answer.
        if case["call"] != "math_equal":
            assert type(raised.value).__name__ == verl["error"]
        return
    assert ours(family, case) == verl


def test_same_scores_from_worker_threads():
    """Off the main thread, as a reward computed beside other work may be (verl's sympy bound is a
    process, ours a thread with a deadline): the same scores as verl's."""
    keys = [key for key, case in CASES.items() if case["call"] == "route" and key not in DIFFERENCES
            and "score" in case["verl"]]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda key: score_sample(CASES[key]["data_source"], CASES[key]["response"],
                                                     CASES[key]["ground_truth"])[0], keys))
    assert got == [CASES[key]["verl"]["score"] for key in keys]


def test_routing_follows_verls_default_compute_score():
    routed = {(family, case["data_source"]) for (family, _), case in CASES.items()
              if case["call"] == "route" and "unknown" not in case["verl"]}
    assert {source for family, source in routed if family == "prime_math"} == set(prime_math.DATA_SOURCES) == {
        "numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc", "numina_cn_k12",
        "numina_olympiads"}
    assert {source for family, source in routed if family == "geo3k"} == set(geo3k.DATA_SOURCES) == {"hiyouga/geometry3k"}
    assert {source for family, source in routed if family == "search_r1"} == set(search_r1.DATA_SOURCES) == {
        "searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa", "searchR1_2wikimultihopqa",
        "searchR1_musique", "searchR1_bamboogle"}
    for family, source in routed:
        assert rule.find_scorer(source) is SCORERS[family].compute_score
    unknown = {case["data_source"] for case in CASES.values() if case["verl"].get("unknown")}
    assert len(unknown) >= 10
    for source in unknown:
        assert rule.find_scorer(source) is None


def test_score_sample_gives_geo3ks_parts_as_extras():
    assert score_sample("hiyouga/geometry3k", r"<think>a</think>\boxed{5}", "5") == (1.0, {"acc": 1.0, "format": 1.0})
    assert score_sample("hiyouga/geometry3k", r"\boxed{4}", "5") == (0.0, {"acc": 0.0, "format": 0.0})
    assert score_sample("numina_cn_k12", r"\boxed{5}", "5") == (1.0, {})
    assert score_sample("searchR1_nq", "<answer>x</answer>", {"target": ["y"]}) == (0.0, {})


def test_search_r1_reads_a_parquet_style_target():
    """A list column comes back from parquet as a list (pyarrow) or an array (pandas): both are answers."""
    np = pytest.importorskip("numpy")
    assert search_r1.compute_score("<answer>Obama</answer>", {"target": np.array(["Barack Obama", "Obama"])}) == 1.0
    assert search_r1.compute_score("<answer>Obama</answer>", {"target": ("Barack Obama",)}) == 0.0


def test_prime_math_never_runs_answer_text(capsys):
    """verl evals answer text in two places; here only arithmetic is evaluated."""
    assert arithmetic.evaluate("2*3.14") == 6.28 and arithmetic.evaluate("[1, (2, -3)]") == [1, (2, -3)]
    for text in ("__import__('os').system('true')", "abs(-2)", "x", "'text'", "(1).real", "1 if 2 else 3", "True"):
        with pytest.raises(arithmetic.NotArithmetic):
            arithmetic.evaluate(text)
    with pytest.raises(ZeroDivisionError):
        arithmetic.evaluate("1/0")  # eval's own error
    with pytest.raises(arithmetic.NotArithmetic):
        arithmetic.evaluate("9**9**9")  # would hold the interpreter for minutes
    assert arithmetic.is_plain_call("Matrix([[1, sqrt(2)], [x, -y/2]])", "Matrix", ("sqrt",))
    for text in ("Matrix([[__import__('os')]])", "Matrix([[open(0)]])", "Matrix([['1']])", "Matrix([[x.y]])",
                 "Matrix([[1]]).T", "sqrt(2)"):
        assert not arithmetic.is_plain_call(text, "Matrix", ("sqrt",)), text
    assert prime_math.compute_score("The answer is Matrix([[print('ran')]])", r"\begin{pmatrix} ran \end{pmatrix}") == 0.0
    assert prime_math.compute_score(r"\boxed{[print('ran')]}", r"\begin{pmatrix} ran \end{pmatrix}") == 0.0
    assert "ran" not in capsys.readouterr().out


def test_the_normalisations():
    """Steps the parity cases cannot tell apart (a later step gives the same score)."""
    from spmdsplit.rewards import prm800k

    assert prm800k.mathd_normalize("0.5") == prm800k.mathd_normalize(" .5 ") == "\\frac{1}{2}"
    assert prm800k.mathd_normalize("k = \\dfrac12") == "\\frac{1}{2}"
    assert prm800k.mathd_normalize("3/4") == "\\frac{3}{4}" and prm800k.mathd_normalize("03/4") == "03/4"
    assert prm800k.mathd_normalize("10\\text{ cm}") == "10"
    assert prm800k.mathd_normalize("1\\text{ a}2\\text{ b}") == "1\\text{ a}2\\text{ b}"  # two units: as written
    assert prm800k.mathd_normalize("\\sqrt") == "\\sqrt" and prm800k.mathd_normalize("\\frac1") == "\\frac1"
    assert prm800k.normalize("1,234,567 cm") == "1234567" and prm800k.normalize("(1,2)") == "(1,2)"
    assert prm800k.normalize("2.99999999") == "3" and prm800k.normalize("2.99999999\\ ") == "2"  # as PRM800K
    assert prm800k.split_tuple("[0, 1)") == ["0", "1"] and prm800k.split_tuple("((1, 2))") == ["((1, 2))"]


def test_a_sympy_check_past_its_bound_is_unequal(monkeypatch):
    """The bound on each sympy check (verl's is a process per check, 10 s): past it, unequal."""
    from spmdsplit.rewards import prm800k
    from spmdsplit.usercode import Overrun

    def overrun(*args, **kwargs):
        raise Overrun("slow")
    monkeypatch.setattr(prm800k, "call_within", overrun)
    assert prime_math.compute_score(r"\boxed{x + 1}", "1 + x") == 0.0
    assert prime_math.compute_score(r"\boxed{42}", "42") == 1.0  # equal text needs no sympy


def test_a_missing_package_is_named(monkeypatch):
    """The optional packages are imported on first use; without one, one line names the extra."""
    monkeypatch.setitem(sys.modules, "mathruler", None)  # `import mathruler` raises ImportError
    with pytest.raises(ImportError, match=r"^mathruler is not installed; install the extra: pip install -e '\.\[math\]'$"):
        compute_score("hiyouga/geometry3k", r"\boxed{5}", "5")
    monkeypatch.setitem(sys.modules, "pylatexenc", None)
    with pytest.raises(ImportError, match=r"numina_\* scorer; install the extra: pip install -e '\.\[math\]'$"):
        compute_score("numina_olympiads", r"\boxed{5}", "5")
    assert compute_score("searchR1_nq", "<answer>5</answer>", {"target": ["5"]}) == 1.0  # needs nothing
