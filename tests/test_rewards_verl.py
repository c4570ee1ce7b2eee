r"""verl's rewards: the GSM8K and MATH rule scorers, dispatch by data_source, a custom reward
function from a file, the errors that stop the job with the sample shown, and the reward model
(`AutoModelForSequenceClassification`) under a real 2-rank FSDP pool."""

import math
import textwrap

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from spmdsplit.batch import Batch
from spmdsplit.embedded import ensure_embedded_model
from spmdsplit.models import load_tokenizer
from spmdsplit.rewards import gsm8k, math_exact, rule
from spmdsplit.rewards.custom import CustomRewardError, load_custom_reward_fn
from spmdsplit.rewards.rule import compute_score, score_sample
from spmdsplit.roles.reward import RewardError, RuleReward, describe_sample
from tests.support.helpers import PlainEngine
from tests.support.launch import run_ranks

# --------------------------------------------------------------------------- GSM8K


@pytest.mark.parametrize(
    "response, truth, strict, flexible",
    [
        ("3 + 4 = 7 apples.\n#### 7", "7", 1.0, 1.0),  # right
        ("3 + 4 = 8 apples.\n#### 8", "7", 0.0, 0.0),  # wrong
        ("3 + 4 = 7 apples, so the answer is 7", "7", 0.0, 1.0),  # no ####: strict finds nothing
        ("first 12, then 5 and finally 9", "9", 0.0, 1.0),  # flexible: the *last* number
        ("first 9, then 5", "9", 0.0, 0.0),
        ("#### 1,200", "1200", 1.0, 1.0),  # commas dropped from the answer...
        ("#### 1200", "1,200", 1.0, 1.0),  # ...and from the ground truth
        ("#### -5", "-5", 1.0, 1.0),  # the sign is kept
        ("#### 5", "-5", 0.0, 0.0),
        ("lost 3 so -3\n#### -3", "-3", 1.0, 1.0),
        ("#### 3.75", "3.75", 1.0, 1.0),  # decimals
        ("#### 3.750", "3.75", 0.0, 0.0),  # compared as strings, as verl
        ("#### 7\nI hope this helps!", "7", 1.0, 1.0),  # trailing text
        ("#### 7.", "7", 1.0, 1.0),  # a sentence's full stop is not part of the number
        ("so it is 7...", "7", 0.0, 1.0),
        ("#### 6\nwait, no\n#### 7", "7", 1.0, 1.0),  # the last #### wins
        ("####7", "7", 0.0, 1.0),  # verl's strict wants "#### " with its space
        ("no number here.", "7", 0.0, 0.0),
        ("", "7", 0.0, 0.0),
        ("cost $1,234 total #### $1,234", "1234", 0.0, 1.0),  # "#### $" is not "#### <number>"
    ],
)
def test_gsm8k_strict_and_flexible(response, truth, strict, flexible):
    assert gsm8k.compute_score(response, truth) == strict  # strict is the default
    assert gsm8k.compute_score(response, truth, method="strict") == strict
    assert gsm8k.compute_score(response, truth, method="flexible") == flexible


def test_gsm8k_extraction():
    assert gsm8k.extract_solution("so #### -1,234.5") == "-1234.5"
    assert gsm8k.extract_solution("nothing") is None
    assert gsm8k.extract_solution("nothing", "flexible") is None
    assert gsm8k.extract_solution("a . b , c", "flexible") is None  # "." alone is no number
    assert gsm8k.extract_solution("it was 12. Then .", "flexible") == "12"
    with pytest.raises(ValueError, match="method"):
        gsm8k.extract_solution("#### 1", "loose")


def test_gsm8k_looks_only_at_the_tail():
    long_tail = "#### 7" + " and so on" * 40  # the answer is more than 300 characters from the end
    assert gsm8k.compute_score(long_tail, "7") == 0.0
    assert gsm8k.compute_score("x" * 1000 + "#### 7", "7") == 1.0


def test_gsm8k_format_score_and_score():
    assert gsm8k.compute_score("#### 8", "7", format_score=0.1) == 0.1  # found but wrong
    assert gsm8k.compute_score("the answer is 7", "7", format_score=0.1) == 0.0  # none found
    assert gsm8k.compute_score("#### 7", "7", format_score=0.1, score=2.0) == 2.0
    assert gsm8k.compute_score("#### 7", 7) == 1.0  # an int ground truth
    assert type(gsm8k.compute_score("#### 7", "7")) is float


# --------------------------------------------------------------------------- MATH exact match


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        (r"so the answer is $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}", 1.0),  # nested braces
        (r"$\boxed{\frac{1}{2}}$", r"\frac{1}{3}", 0.0),
        (r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}", 1.0),  # dfrac -> frac
        (r"\boxed{\tfrac12}", r"\frac{1}{2}", 1.0),  # tfrac, and \frac12 shorthand
        (r"\boxed{1/2}", r"\frac{1}{2}", 1.0),  # an integer ratio
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"\dfrac{\sqrt3}{2}", 1.0),
        (r"\boxed{10\text{ cm}}", "10", 1.0),  # a unit
        (r"\boxed{10 \mbox{ inches}}", "10", 1.0),
        (r"\boxed{\text{(A)}}", "(A)", 1.0),  # \text around the whole answer is not a unit
        (r"\boxed{ 3 , 4 }", "3,4", 1.0),  # spaces
        (r"\boxed{\left( 1, 2 \right)}", "(1,2)", 1.0),  # \left, \right
        (r"\boxed{90^\circ}", "90", 1.0),  # degrees
        (r"\boxed{90^{\circ}}", "90", 1.0),
        (r"\boxed{\$5}", "5", 1.0),  # dollars
        (r"\boxed{5.}", "5", 1.0),  # a trailing full stop
        (r"\boxed{.5}", "0.5", 1.0),  # the leading 0
        (r"\boxed{-.5}", "-0.5", 1.0),
        (r"\boxed{x = 3}", "3", 1.0),  # a short left-hand side
        (r"\boxed{1\!000}", "1000", 1.0),
        (r"\boxed{50\%}", "50", 1.0),
        (r"\boxed{0.5}", r"\frac{1}{2}", 0.0),  # no symbolic equivalence
        (r"\boxed{x+1}", "1+x", 0.0),
        (r"\boxed{2} no wait \boxed{3}", "3", 1.0),  # the last box
        (r"\boxed{2} no wait \boxed{3}", "2", 0.0),
        (r"\boxed 5$", "5", 1.0),  # the brace-less form
        (r"\fbox{7}", "7", 1.0),
        (r"the answer is 5", "5", 0.0),  # no box, no answer
        (r"cut off: \boxed{\frac{1}{2}", r"\frac{1}{2}", 0.0),  # never closed
        (r"\boxed{4}", r"so we get $\boxed{4}$", 1.0),  # a ground truth that is a full solution
    ],
)
def test_math_exact_match(response, truth, expected):
    assert math_exact.compute_score(response, truth) == expected


def test_last_boxed_content_keeps_nested_braces():
    assert math_exact.last_boxed_content(r"a \boxed{1} b \boxed{\frac{a^{2}}{b}} c") == r"\frac{a^{2}}{b}"
    assert math_exact.last_boxed_content("no box") is None


# --------------------------------------------------------------------------- where verl scores differently

# Every known difference from verl's built-in scorers (verl/utils/reward_score/gsm8k.py and
# math_reward.py, as dispatched by default_compute_score), one row each, as docs/algorithms.md lists them:
# (data_source, response, ground truth, our score, verl's score). verl's scores were read off its
# code, not run (verl is not a dependency); everything not listed here scores as verl does.
VERL_DIFFERENCES = {
    # GSM8K: a "." or "," right after the number is punctuation (verl reads "72." and scores it wrong)
    "gsm8k-strict-full-stop": ("openai/gsm8k", "#### 72.", "72", 1.0, 0.0),
    "gsm8k-flexible-full-stop": ("flexible", "so the answer is 72.", "72", 1.0, 0.0),
    "gsm8k-flexible-ellipsis": ("flexible", "it is 7...", "7", 1.0, 0.0),
    # GSM8K flexible: commas leave the number (verl drops them only in strict mode)
    "gsm8k-flexible-thousands": ("flexible", "the total is 1,200", "1200", 1.0, 0.0),
    # GSM8K flexible: a match without a digit ("," or "-." alone) is no number (verl skips only ".")
    "gsm8k-flexible-lone-comma": ("flexible", "it is 7 , right", "7", 1.0, 0.0),
    "gsm8k-flexible-no-digit": ("flexible", "it is 7 -.", "7", 1.0, 0.0),
    # GSM8K: the ground truth is read as text, trimmed, without commas (verl compares it as given)
    "gsm8k-truth-commas": ("openai/gsm8k", "#### 1200", "1,200", 1.0, 0.0),
    "gsm8k-truth-int": ("openai/gsm8k", "#### 7", 7, 1.0, 0.0),
    "gsm8k-truth-whitespace": ("openai/gsm8k", "#### 7", " 7\n", 1.0, 0.0),
    # MATH: \fbox counts as a box (verl finds it, then fails to unwrap it: 0)
    "math-fbox": ("lighteval/MATH", r"\fbox{7}", "7", 1.0, 0.0),
    # MATH: the last box wins whatever its form (verl prefers any brace-less "\boxed ")
    "math-last-box": ("lighteval/MATH", r"\boxed 3$ no: \boxed{4}", "4", 1.0, 0.0),
    # MATH: a ground truth that is a whole solution is reduced to its box
    "math-truth-solution": ("lighteval/MATH", r"\boxed{4}", r"so we get $\boxed{4}$", 1.0, 0.0),
    # MATH normalisation, more lenient than verl's
    "math-thin-space": ("lighteval/MATH", r"\boxed{1\,000}", "1000", 1.0, 0.0),
    "math-dollar": ("lighteval/MATH", r"\boxed{$5$}", "5", 1.0, 0.0),
    "math-full-stop": ("lighteval/MATH", r"\boxed{5.}", "5", 1.0, 0.0),
    "math-unit-no-space": ("lighteval/MATH", r"\boxed{10\text{cm}}", "10", 1.0, 0.0),
    "math-mbox-unit": ("lighteval/MATH", r"\boxed{10 \mbox{ inches}}", "10", 1.0, 0.0),
    "math-text-answer": ("lighteval/MATH", r"\boxed{\text{(A)}}", "(A)", 1.0, 0.0),
    "math-leading-zero": ("lighteval/MATH", r"\boxed{-.5}", "-0.5", 1.0, 0.0),
    "math-lhs-before-space": ("lighteval/MATH", r"\boxed{ab = 3}", "3", 1.0, 0.0),
    # MATH normalisation, stricter than verl's
    "math-half": ("lighteval/MATH", r"\boxed{0.5}", r"\frac{1}{2}", 0.0, 1.0),
    "math-double-backslash": ("lighteval/MATH", r"\boxed{\\frac{1}{2}}", r"\frac{1}{2}", 0.0, 1.0),
    "math-unit-then-more": ("lighteval/MATH", r"\boxed{10\text{ cm}^2}", "10", 0.0, 1.0),
}


@pytest.mark.parametrize("case", sorted(VERL_DIFFERENCES))
def test_differences_from_verls_scorers(case):
    source, response, truth, ours, verls = VERL_DIFFERENCES[case]
    if source == "flexible":  # verl's and our GSM8K scorer take method="flexible" alike
        score = gsm8k.compute_score(response, truth, method="flexible")
    else:
        score = compute_score(source, response, truth)
    assert score == ours and ours != verls


# --------------------------------------------------------------------------- dispatch


def test_dispatch_by_data_source():
    assert compute_score("openai/gsm8k", "#### 1,200", "1200") == 1.0
    assert compute_score("openai/gsm8k", "the answer is 1200", "1200") == 0.0  # strict by default
    for name in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"):
        assert compute_score(name, r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}") == 1.0
        assert compute_score(name, r"\boxed{3}", "4") == 0.0
    assert compute_score("synthetic/repeat", "5512", "5555") == 0.5  # the built-in tasks stay
    assert compute_score("openai/gsm8k", "#### 7", "7", extra_info={"index": 3}) == 1.0


def test_unknown_data_source_names_it_and_the_known_ones():
    with pytest.raises(KeyError) as e:
        compute_score("nobody/knows", "42", "42")
    msg = str(e.value)
    assert "nobody/knows" in msg and "openai/gsm8k" in msg and "lighteval/MATH" in msg and "synthetic/repeat" in msg


def test_dict_results_pass_through_and_normalise(monkeypatch):
    monkeypatch.setitem(rule.SCORERS, "test/dict", lambda s, gt: {"score": 0.5, "acc": True, "pred": "7"})
    assert compute_score("test/dict", "x", "y") == {"score": 0.5, "acc": True, "pred": "7"}  # as is
    assert score_sample("test/dict", "x", "y") == (0.5, {"acc": 1.0})  # numbers only
    assert score_sample("openai/gsm8k", "#### 7", "7") == (1.0, {})
    monkeypatch.setitem(rule.SCORERS, "test/noscore", lambda s, gt: {"acc": 1.0})
    with pytest.raises(ValueError, match="without 'score'"):
        score_sample("test/noscore", "x", "y")
    monkeypatch.setitem(rule.SCORERS, "test/str", lambda s, gt: "high")
    with pytest.raises(TypeError, match="number or a dict"):
        score_sample("test/str", "x", "y")
    monkeypatch.setitem(rule.SCORERS, "test/inf", lambda s, gt: {"score": float("inf")})
    with pytest.raises(ValueError, match="not finite"):
        score_sample("test/inf", "x", "y")


# --------------------------------------------------------------------------- RuleReward: custom fn, errors


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_embedded_model())


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def rule_batch(tokenizer, rows, R=5, extra_info=None):
    """rows: (response text, ends with EOS, data_source, ground_truth)."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    tokens = [ids(tokenizer, text) + ([eos] if end else []) for text, end, *_ in rows]
    non_tensors = {"data_source": [r[2] for r in rows], "ground_truth": [r[3] for r in rows]}
    if extra_info is not None:
        non_tensors["extra_info"] = extra_info
    return Batch(
        {"responses": torch.tensor([t + [pad] * (R - len(t)) for t in tokens]),
         "response_mask": torch.tensor([[1] * len(t) + [0] * (R - len(t)) for t in tokens])},
        non_tensors,
    )


def write(tmp_path, name, source):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


CUSTOM = """
    import math

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        # a float: 1.0 for an exact answer, plus the row's index / 100 to see extra_info arrive
        bonus = extra_info["index"] / 100 if extra_info else 0.0
        return float(solution_str == ground_truth) + bonus

    def with_acc(data_source, solution_str, ground_truth, extra_info=None):
        right = solution_str == ground_truth
        if data_source == "plain":
            return 0.25
        return {"score": 2.0 if right else -1.0, "acc": right, "pred": solution_str, "len": len(solution_str)}

    def broken(data_source, solution_str, ground_truth, extra_info=None):
        return 1 / 0

    def not_a_number(data_source, solution_str, ground_truth, extra_info=None):
        return math.nan

    NOT_CALLABLE = 3
"""


def test_custom_fn_returning_a_float_gets_extra_info(tmp_path, tokenizer):
    fn = load_custom_reward_fn(write(tmp_path, "my_reward.py", CUSTOM), "compute_score")
    batch = rule_batch(tokenizer, [("12", True, "any/source", "12"), ("13", True, "unknown/too", "12")],
                       extra_info=[{"index": 5}, {"index": 7}])
    token_scores, scores, extras = RuleReward(tokenizer, custom_fn=fn).compute_with_extras(batch)
    # The custom function replaces the built-in dispatch: unknown data sources are fine.
    assert scores.tolist() == pytest.approx([1.05, 0.07])
    assert extras == {}
    assert torch.allclose(token_scores, torch.tensor([[0, 0, 1.05, 0, 0], [0, 0, 0.07, 0, 0]]))


@pytest.mark.parametrize("extra_info, complaint", [
    ([{"index": 7, "split": "train"}, {"index": 7, "split": "train"}], "is not the row of ground truth '0080'"),
    ([{"index": 7, "split": "train"}, {"index": 8, "split": "test"}], "is not the row of ground truth '0080'"),
    ([{"index": 7, "split": "train"}, {}], "extra_info {} is not the row"),
    ([{"index": 7, "split": "train"}, None], "extra_info is None, not the row's dict"),
])
def test_the_e2e_extra_info_check_stops_on_another_rows_extra_info(tmp_path, tokenizer, monkeypatch, extra_info,
                                                                   complaint):
    """The check the real jobs run (tests/support/extra_info_check.py): a row given another row's
    extra_info, or none, stops the job with a RewardError that shows the sample."""
    from tests.support.extra_info_check import calls, write_job_files

    overrides, log = write_job_files(tmp_path)
    path = next(o for o in overrides if o.startswith("reward.custom_fn.path=")).split("=", 1)[1]
    fn = load_custom_reward_fn(path, "compute_score")
    monkeypatch.setenv("RANK", "3")
    rows = [("0070", True, "synthetic/copy", "0070"), ("0080", True, "synthetic/copy", "0080")]
    with pytest.raises(RewardError, match=r"(?s)custom reward function.*sample 1.*'0080'") as e:
        RuleReward(tokenizer, custom_fn=fn).compute(rule_batch(tokenizer, rows, extra_info=extra_info))
    assert complaint in str(e.value)
    assert calls(log) == [(3, "train", 7)]  # the right row went through


def test_custom_fn_returning_a_dict_collects_extras(tmp_path, tokenizer):
    fn = load_custom_reward_fn(write(tmp_path, "my_reward.py", CUSTOM), "with_acc")
    batch = rule_batch(tokenizer, [("12", True, "a", "12"), ("9", False, "a", "12"), ("12", True, "plain", "12")])
    reward = RuleReward(tokenizer, custom_fn=fn)
    token_scores, scores, extras = reward.compute_with_extras(batch)
    assert scores.tolist() == [2.0, -1.0, 0.25]
    assert set(extras) == {"acc", "len"}  # "pred" is a string: not a metric
    assert extras["acc"][:2] == [1.0, 0.0] and math.isnan(extras["acc"][2])  # a float result has no acc
    assert extras["len"][:2] == [2.0, 1.0]
    assert token_scores[0, 2] == 2.0 and token_scores[1, 0] == -1.0 and token_scores[2, 2] == 0.25
    # compute() is the same, without the extras (the trainer's call)
    t2, s2 = reward.compute(batch)
    assert torch.equal(t2, token_scores) and torch.equal(s2, scores)


def test_custom_fn_errors_name_the_config_keys(tmp_path):
    path = write(tmp_path, "my_reward.py", CUSTOM)
    with pytest.raises(CustomRewardError, match=r"reward\.custom_fn\.path.*no such file"):
        load_custom_reward_fn(str(tmp_path / "missing.py"), "compute_score")
    with pytest.raises(CustomRewardError, match=r"reward\.custom_fn\.name='nope'") as e:
        load_custom_reward_fn(path, "nope")
    assert "with_acc" in str(e.value)  # says what is there
    with pytest.raises(CustomRewardError, match=r"reward\.custom_fn\.name.*not a function"):
        load_custom_reward_fn(path, "NOT_CALLABLE")
    bad = write(tmp_path, "bad_import.py", "import math\nVALUE = 1 / 0\n")
    with pytest.raises(CustomRewardError, match=r"reward\.custom_fn\.path.*ZeroDivisionError"):
        load_custom_reward_fn(bad, "compute_score")
    syntax = write(tmp_path, "bad_syntax.py", "def compute_score(:\n")
    with pytest.raises(CustomRewardError, match=r"reward\.custom_fn\.path.*SyntaxError"):
        load_custom_reward_fn(syntax, "compute_score")
    from spmdsplit.errors import ConfigError

    assert issubclass(CustomRewardError, ConfigError)  # stops every rank before the world forms


def test_two_custom_files_with_the_same_function_name_stay_apart(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    fa = load_custom_reward_fn(write(tmp_path / "a", "reward.py", "def f(**kw):\n    return 1.0\n"), "f")
    fb = load_custom_reward_fn(write(tmp_path / "b", "reward.py", "def f(**kw):\n    return 2.0\n"), "f")
    assert fa() == 1.0 and fb() == 2.0


def test_a_raising_scorer_stops_with_the_sample_shown(monkeypatch, tokenizer):
    def scorer(text, gt):
        raise ZeroDivisionError("scorer blew up")

    monkeypatch.setitem(rule.SCORERS, "test/raise", scorer)
    batch = rule_batch(tokenizer, [("5", True, "synthetic/repeat", "5555"), ("9081", True, "test/raise", "4242")])
    with pytest.raises(RewardError) as e:
        RuleReward(tokenizer).compute(batch)
    msg = str(e.value)
    assert "test/raise" in msg and "'9081'" in msg and "4242" in msg
    assert "ZeroDivisionError: scorer blew up" in msg
    assert isinstance(e.value, RuntimeError) and isinstance(e.value.__cause__, ZeroDivisionError)


def test_a_nan_score_stops_with_the_sample_shown(monkeypatch, tokenizer):
    monkeypatch.setitem(rule.SCORERS, "test/nan", lambda s, gt: float("nan"))
    batch = rule_batch(tokenizer, [("3141", False, "test/nan", "2718")])
    with pytest.raises(RewardError) as e:
        RuleReward(tokenizer).compute(batch)
    msg = str(e.value)
    assert "NaN" in msg and "'3141'" in msg and "2718" in msg and "test/nan" in msg


@pytest.mark.parametrize("name", ["broken", "not_a_number"])
def test_custom_fn_failures_are_reward_errors(tmp_path, tokenizer, name):
    fn = load_custom_reward_fn(write(tmp_path, "my_reward.py", CUSTOM), name)
    with pytest.raises(RewardError, match=r"custom reward function(.|\n)*'777'"):
        RuleReward(tokenizer, custom_fn=fn).compute(rule_batch(tokenizer, [("777", True, "x", "1")]))


def test_unknown_data_source_in_a_batch_is_a_reward_error_and_a_key_error(tokenizer):
    with pytest.raises(RewardError) as e:
        RuleReward(tokenizer).compute(rule_batch(tokenizer, [("5", True, "nope/task", "5")]))
    assert isinstance(e.value, KeyError)
    assert "nope/task" in str(e.value) and "openai/gsm8k" in str(e.value) and "\n" in str(e.value)


def test_long_responses_are_shortened_in_the_error():
    text = "HEAD" + "x" * 5000 + "#### 42"
    shown = describe_sample(3, text, "openai/gsm8k", "42")
    assert len(shown) < 800 and "HEAD" in shown and "#### 42" in shown and "chars cut" in shown


# --------------------------------------------------------------------------- reward model

P, R = 6, 5
RM_ROWS = [  # (prompt, response, ends with EOS)
    ("2815=", "5555", True),
    ("12=", "33", True),
    ("99999=", "12345", False),  # cut at max length: no EOS
    ("7=", "", True),  # EOS only: scored on the prompt alone, placed on the EOS
    ("345=", "6789", True),
    ("0=", "0", False),
    ("4444=", "4", True),
    ("58=", "555", True),
]


def rm_batch(tokenizer, rows=RM_ROWS):
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    prompts, prompt_mask, responses, response_mask = [], [], [], []
    for prompt, response, end in rows:
        p = ids(tokenizer, prompt)
        r = ids(tokenizer, response) + ([eos] if end else [])
        prompts.append([pad] * (P - len(p)) + p)
        prompt_mask.append([0] * (P - len(p)) + [1] * len(p))
        responses.append(r + [pad] * (R - len(r)))
        response_mask.append([1] * len(r) + [0] * (R - len(r)))
    prompts, responses = torch.tensor(prompts), torch.tensor(responses)
    response_mask = torch.tensor(response_mask)
    return Batch(
        {"input_ids": torch.cat([prompts, responses], 1),
         "attention_mask": torch.cat([torch.tensor(prompt_mask), response_mask], 1),
         "responses": responses, "response_mask": response_mask},
        {"data_source": ["synthetic/repeat"] * len(rows), "ground_truth": ["0000"] * len(rows)},
    )


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    """A tiny random Qwen2ForSequenceClassification saved as a checkpoint, with no pad id in its
    config (RewardModel must set one)."""
    from tests.support.helpers import load_reward_model

    folder = ensure_embedded_model()
    model = load_reward_model(folder, torch.float32, torch.device("cpu"), seed=11)
    assert type(model).__name__ == "Qwen2ForSequenceClassification"
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(0))  # scores of size ~1
    model.config.pad_token_id = None
    out = tmp_path_factory.mktemp("tiny-rm")
    model.save_pretrained(out)
    load_tokenizer(folder).save_pretrained(out)
    return str(out)


def reference_scores(rm_dir, texts):
    """A plain single-process forward of each text on its own, no padding: the per-token output
    at its last token."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, num_labels=1).eval()
    tok = load_tokenizer(rm_dir)
    out = []
    with torch.no_grad():
        for text in texts:
            x = torch.tensor([tok(text)["input_ids"]])
            hf = model(input_ids=x).logits[0, 0]  # batch of 1: HF keeps the last token
            per_token = model.score(model.model(input_ids=x).last_hidden_state)[0, -1, 0]
            assert torch.allclose(hf, per_token)
            out.append(per_token.item())
    return torch.tensor(out)


def _rm_on_pool(rank, world_size, rm_dir, policy_dir):
    from spmdsplit.engines.fsdp import FSDPEngine
    from spmdsplit.roles.reward_model import RewardModel
    from tests.support.helpers import load_reward_model

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    device = torch.device("cpu")
    model = load_reward_model(rm_dir, torch.float32, device, seed=1)
    rm = RewardModel(FSDPEngine(model, mesh, optim=None), load_tokenizer(rm_dir), load_tokenizer(policy_dir),
                     micro_batch_size=3, device=device)
    batch = rm_batch(load_tokenizer(policy_dir))
    results = {}
    # equal shards (4 + 4 rows: 2 forwards each), then unequal ones (5 + 3 rows in micro-batches
    # of 2: 3 forwards against 2, which must not hang the pool)
    for name, cut, mbs in (("equal", 4, 3), ("unequal", 5, 2)):
        rm.micro_batch_size = mbs
        shard = batch.slice(0, cut) if rank == 0 else batch.slice(cut, len(batch))
        results[name] = rm.compute(shard)
    return results


def test_reward_model_on_a_two_rank_pool_matches_a_plain_forward(rm_dir):
    policy_dir = ensure_embedded_model()
    expected = reference_scores(rm_dir, [p + r for p, r, _ in RM_ROWS])
    tokenizer = load_tokenizer(policy_dir)
    mask = rm_batch(tokenizer)["response_mask"]
    ranks = run_ranks(_rm_on_pool, 2, rm_dir, policy_dir)
    for name in ("equal", "unequal"):
        token_scores = torch.cat([r[name][0] for r in ranks])
        scores = torch.cat([r[name][1] for r in ranks])
        assert scores.dtype == torch.float32 and scores.shape == (len(RM_ROWS),)
        torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)
        last = mask.sum(-1) - 1
        want = torch.zeros(len(RM_ROWS), R)
        want[torch.arange(len(RM_ROWS)), last] = expected
        torch.testing.assert_close(token_scores, want, rtol=1e-5, atol=1e-5)
        assert (token_scores != 0).sum(-1).tolist() == [1] * len(RM_ROWS)  # one score per row, on its last token


def test_reward_model_reads_the_last_real_token_even_when_it_is_the_pad_id(rm_dir, tokenizer):
    from transformers import AutoModelForSequenceClassification

    from spmdsplit.roles.reward_model import RewardModel

    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, num_labels=1)
    five = ids(tokenizer, "5")[0]
    model.config.pad_token_id = five  # "2815=5555" ends with the pad id: HF's own pooling would miss it
    rm = RewardModel(PlainEngine(model), load_tokenizer(rm_dir), tokenizer, micro_batch_size=8, device="cpu")
    assert rm.pad_token_id == five
    batch = rm_batch(tokenizer)
    _, scores = rm.compute(batch)
    torch.testing.assert_close(scores, reference_scores(rm_dir, [p + r for p, r, _ in RM_ROWS]), rtol=1e-5, atol=1e-5)
    prompts, answers = rm.texts(batch)
    assert prompts == [p for p, _, _ in RM_ROWS] and answers == [r for _, r, _ in RM_ROWS]


def test_reward_model_decodes_and_tokenises_the_batch_at_once_as_row_by_row(rm_dir, tokenizer, monkeypatch):
    """Issue 36: the reward model decoded each prompt and tokenised each text alone, a tokenizer
    call per row; now one call per batch (one per value of add_special_tokens, which differs for
    texts that open with the BOS), with the ids that row by row gives, on rows of all lengths."""
    from transformers import AutoModelForSequenceClassification

    from spmdsplit.roles.reward_model import RewardModel

    rm_tokenizer = load_tokenizer(rm_dir)
    rm = RewardModel(PlainEngine(AutoModelForSequenceClassification.from_pretrained(rm_dir, num_labels=1)),
                     rm_tokenizer, tokenizer, micro_batch_size=3, device="cpu")
    rows = RM_ROWS + [("<s>7=", "55", True), ("<s>123=", "", False)]  # prompts that open with the BOS
    batch = rm_batch(tokenizer, rows)
    # Row by row, as the reward model did.
    prompt_ids, prompt_mask = batch["input_ids"][:, :P].tolist(), batch["attention_mask"][:, :P].tolist()
    prompts = [tokenizer.decode([t for t, keep in zip(ids, mask) if keep]) for ids, mask in zip(prompt_ids, prompt_mask)]
    texts = [p + r for p, (_, r, _) in zip(prompts, rows)]
    by_row = [rm_tokenizer(text, add_special_tokens=not text.startswith("<s>"))["input_ids"][-6:] for text in texts]
    calls = {"decode": 0, "encode": 0}
    cls = type(tokenizer)
    decode, encode = cls.decode, cls.__call__

    def counted_decode(self, *args, **kwargs):
        calls["decode"] += self is tokenizer
        return decode(self, *args, **kwargs)

    def counted_encode(self, *args, **kwargs):
        calls["encode"] += self is rm_tokenizer
        return encode(self, *args, **kwargs)

    monkeypatch.setattr(cls, "decode", counted_decode)
    monkeypatch.setattr(cls, "__call__", counted_encode)
    got_prompts, answers = rm.texts(batch)
    encoded = rm.encode([p + a for p, a in zip(got_prompts, answers)], 6)
    assert got_prompts == prompts and answers == [r for _, r, _ in rows]
    assert encoded == by_row and len({len(ids) for ids in encoded}) > 2  # rows of several lengths, cut at 6
    assert calls == {"decode": 2, "encode": 2}  # prompts and responses; texts with and without the BOS


def test_reward_model_sets_a_pad_id_and_truncates_from_the_left(rm_dir, tokenizer):
    from spmdsplit.roles.reward_model import RewardModel
    from tests.support.helpers import load_reward_model

    model = load_reward_model(rm_dir, torch.float32, torch.device("cpu"), seed=1)
    assert model.config.pad_token_id is None
    rm = RewardModel(PlainEngine(model), load_tokenizer(rm_dir), tokenizer, micro_batch_size=3, device="cpu",
                     max_length=4)
    assert model.config.pad_token_id == tokenizer.pad_token_id
    assert rm.encode(["2815=5555"], 4) == [ids(tokenizer, "5555")]  # the end (the response) is kept
    _, scores = rm.compute(rm_batch(tokenizer))
    expected = reference_scores(rm_dir, [(p + r)[-4:] for p, r, _ in RM_ROWS])
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)


def test_reward_model_nan_stops_with_the_sample_shown(rm_dir, tokenizer):
    from spmdsplit.roles.reward_model import RewardModel
    from tests.support.helpers import load_reward_model

    model = load_reward_model(rm_dir, torch.float32, torch.device("cpu"), seed=1)
    with torch.no_grad():
        model.score.weight.fill_(float("nan"))
    rm = RewardModel(PlainEngine(model), load_tokenizer(rm_dir), tokenizer, micro_batch_size=3, device="cpu")
    with pytest.raises(RewardError) as e:
        rm.compute(rm_batch(tokenizer))
    msg = str(e.value)
    assert "nan" in msg.lower() and "'2815='" in msg and "'5555'" in msg and "8 of 8 rows" in msg
