r"""DAPO's rewards as verl 0.9.1 gives them: the math_dapo scorer (and the data sources routed to
it) against verl's own results on the cases of tests/data/verl_math_dapo_scores.json (written by
tools/fixtures/verl_reward_fixtures.py, which runs verl's code; this test needs no verl), and the
overlong buffer (reward.overlong_buffer) in the rule reward and in the config."""

import json
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from spmdsplit.batch import Batch
from spmdsplit.config import load_config
from spmdsplit.errors import ConfigError
from spmdsplit.preflight import check_config
from spmdsplit.embedded import ensure_embedded_model
from spmdsplit.models import load_tokenizer
from spmdsplit.rewards import math_dapo, rule
from spmdsplit.rewards.rule import compute_score, score_sample
from spmdsplit.roles.reward import RuleReward, overlong_reward

FIXTURE = json.loads((Path(__file__).parent / "data" / "verl_math_dapo_scores.json").read_text())
CASES = {case["name"]: case for case in FIXTURE["cases"]}

# Every case where our result is not verl's, with ours; the fixture holds verl's. Listed in
# docs/algorithms.md ("Rewards"), and in math_dapo's docstring.
DAPO_DIFFERENCES = {
    # A ground truth that is not a string is read as its text (verl raises AttributeError on it:
    # it normalises the ground truth with str methods).
    "truth-int": {"score": 1.0, "acc": True, "pred": "42"},
    # No answer is never right (verl: right when the ground truth itself normalises to "[INVALID]",
    # the placeholder it writes for no answer).
    "truth-invalid-and-no-answer": {"score": -1.0, "acc": False, "pred": "[INVALID]"},
}


def ours(case) -> dict:
    if case["call"] == "strict_box":
        return math_dapo.compute_score(case["response"], case["ground_truth"], strict_box_verify=True)
    return compute_score(case["data_source"], case["response"], case["ground_truth"])


def test_the_fixture_is_verl_0_9_1s_and_broad():
    assert FIXTURE["verl_version"] == "0.9.1"
    assert len(CASES) == len(FIXTURE["cases"]) >= 100
    results = [case["verl"] for case in CASES.values()]
    assert sum(r.get("score") == 1.0 for r in results) > 30 and sum(r.get("score") == -1.0 for r in results) > 30
    assert set(DAPO_DIFFERENCES) <= set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_scores_as_verl(name):
    case = CASES[name]
    verl = case["verl"]
    if verl.get("unknown"):  # verl routes the name nowhere: here it stops the job naming it
        with pytest.raises(KeyError, match="no reward function"):
            ours(case)
        return
    result = ours(case)
    assert set(result) == {"score", "acc", "pred"} and type(result["acc"]) is bool
    if name in DAPO_DIFFERENCES:
        assert result == DAPO_DIFFERENCES[name] and result != verl
    else:
        assert result == verl


def test_routing_follows_verls_default_compute_score():
    routed = {case["data_source"] for case in CASES.values() if case["call"] == "route" and "unknown" not in case["verl"]}
    assert routed == {"math_dapo", "math", "math_dapo_reasoning", "aime", "aime2024", "aime2025", "aime_2024_test"}
    for source in routed:
        assert rule.find_scorer(source) is math_dapo.compute_score
    assert rule.find_scorer("openai/gsm8k") is not math_dapo.compute_score  # the exact names come first
    assert rule.find_scorer("AIME2024") is None  # case matters, as in verl
    with pytest.raises(KeyError) as e:
        compute_score("nobody/knows", "Answer: 1", "1")
    assert "aime*" in str(e.value) and "math_dapo" in str(e.value)


def test_score_sample_keeps_acc_and_drops_pred():
    assert score_sample("math_dapo", "Answer: 42", "42") == (1.0, {"acc": 1.0})
    assert score_sample("aime2024", r"\boxed{41}", "42") == (-1.0, {"acc": 0.0})


def test_normalize_final_answer():
    assert math_dapo.normalize_final_answer(r"x = \$1,000 dollars") == "1000"
    assert math_dapo.normalize_final_answer(r"\frac12") == r"\frac{1}{2}"
    assert math_dapo.normalize_final_answer(r"\dfrac{1}{2}") == r"\dfrac{1}{2}"  # no MATH-style \dfrac -> \frac
    assert math_dapo.normalize_final_answer("[INVALID]") == math_dapo.NO_ANSWER


def test_last_boxed():
    assert math_dapo.last_boxed(r"\boxed{1} and \boxed{\frac{a^{2}}{b}}") == r"\frac{a^{2}}{b}"
    assert math_dapo.last_boxed(r"\boxed{1} then \fbox{2} and \boxed 3") == "1"  # only \boxed{...} counts
    assert math_dapo.last_boxed(r"\boxed{\frac{1}{2}") is None
    assert math_dapo.last_boxed("none") is None


# --------------------------------------------------------------------------- the overlong buffer


@pytest.mark.parametrize("length, expected", [
    (0, 0.0),
    (11, 0.0),
    (12, 0.0),  # exactly expected_len = 16 - 4: no penalty yet
    (13, -0.25 * 0.5),  # linear over the 4 buffer tokens...
    (14, -0.5 * 0.5),
    (15, -0.75 * 0.5),
    (16, -0.5),  # ...to -penalty_factor at the limit
])
def test_overlong_reward_ramps_over_the_buffer(length, expected):
    assert overlong_reward(length, max_response_length=16, buffer_len=4, penalty_factor=0.5) == pytest.approx(expected)


def test_overlong_reward_is_never_positive():
    assert overlong_reward(16, 16, 4, -1.0) == 0.0  # verl's min(..., 0): a negative factor does not pay for length
    assert overlong_reward(3, 16, 4, 1.0) == 0.0 and math.copysign(1, overlong_reward(3, 16, 4, 1.0)) == 1  # not -0.0


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_embedded_model())


def dapo_batch(tokenizer, rows, R=8):
    """rows: (answer digit, ground truth, response attention-mask length, response_mask holes).
    The embedded tokenizer knows digits and "=" only: a row is its answer digit, then "0"s up to
    its length (scored by `first_digit_dapo`); holes in the response mask are tool tokens."""
    pad = tokenizer.pad_token_id
    digit = {d: tokenizer(d, add_special_tokens=False)["input_ids"] for d in "0123456789"}
    responses, attention, response_mask = [], [], []
    for answer, _, length, holes in rows:
        responses.append(digit[answer] + digit["0"] * (length - 1) + [pad] * (R - length))
        attention.append([1] * length + [0] * (R - length))
        response_mask.append([0 if i in holes else m for i, m in enumerate(attention[-1])])
    prompt = torch.ones(len(rows), 2, dtype=torch.long)
    return Batch(
        {"responses": torch.tensor(responses), "response_mask": torch.tensor(response_mask),
         "attention_mask": torch.cat([prompt, torch.tensor(attention)], 1)},
        {"data_source": ["test/dapo"] * len(rows), "ground_truth": [r[1] for r in rows]},
    )


@pytest.fixture
def first_digit_dapo(monkeypatch):
    """DAPO's scorer on the response's first digit, as "test/dapo"."""
    monkeypatch.setitem(rule.SCORERS, "test/dapo", lambda text, truth: math_dapo.compute_score(f"Answer: {text[:1]}", truth))


def buffer(**kw):
    return OmegaConf.create({"enable": True, "len": 4, "penalty_factor": 1.0, "log": True, **kw})


def test_rule_reward_adds_the_overlong_reward_and_logs_it(tokenizer, first_digit_dapo):
    rows = [
        ("7", "7", 4, ()),  # at expected_len 8 - 4: +1
        ("7", "7", 6, ()),  # 2 of the 4 buffer tokens: +1 - 0.5
        ("9", "7", 8, ()),  # at the limit: -1 - 1
        ("7", "7", 7, (4, 5)),  # multi-turn: its 2 tool tokens count, as in verl: +1 - 0.75
    ]
    reward = RuleReward(tokenizer, overlong_buffer=buffer(), max_response_length=8)
    token_scores, scores, extras = reward.compute_with_extras(dapo_batch(tokenizer, rows))
    assert scores.tolist() == pytest.approx([1.0, 0.5, -2.0, 0.25])
    assert extras["overlong_reward"] == pytest.approx([0.0, -0.5, -1.0, -0.75])
    assert extras["overlong"] == [0.0, 1.0, 1.0, 1.0]
    assert extras["acc"] == [1.0, 1.0, 0.0, 1.0]  # the scorer's own, unshaped
    assert token_scores[1, 5] == pytest.approx(0.5) and token_scores[3, 6] == pytest.approx(0.25)
    # training keeps the extras for critic/reward_extra/<key>/mean; validation gets the same scores
    _, validation_scores = reward.compute(dapo_batch(tokenizer, rows))
    assert torch.equal(validation_scores, scores)
    reward.compute(dapo_batch(tokenizer, rows), keep_extras=True)
    assert reward.extra_sums["overlong"] == [3.0, 4.0] and reward.extra_sums["overlong_reward"] == pytest.approx([-2.25, 4.0])


def test_overlong_log_off_and_buffer_off(tokenizer, first_digit_dapo):
    rows = [("7", "7", 8, ())]
    _, scores, extras = RuleReward(tokenizer, overlong_buffer=buffer(log=False), max_response_length=8).compute_with_extras(
        dapo_batch(tokenizer, rows))
    assert scores.tolist() == [0.0] and set(extras) == {"acc"}
    for off in (None, buffer(enable=False, len=0)):
        _, scores, extras = RuleReward(tokenizer, overlong_buffer=off, max_response_length=8).compute_with_extras(
            dapo_batch(tokenizer, rows))
        assert scores.tolist() == [1.0] and set(extras) == {"acc"}


def test_rule_reward_refuses_a_buffer_that_does_not_fit(tokenizer):
    for length, limit in ((0, 8), (8, 8), (4, None)):
        with pytest.raises(ValueError, match="reward.overlong_buffer.len"):
            RuleReward(tokenizer, overlong_buffer=buffer(len=length), max_response_length=limit)


@pytest.mark.parametrize("overrides, complaint", [
    (["reward.overlong_buffer.len=0"], "reward.overlong_buffer.len=0: expected > 0 and < data.max_response_length=6"),
    (["reward.overlong_buffer.len=6"], "reward.overlong_buffer.len=6: expected > 0"),
    (["reward.overlong_buffer.len=-2"], "reward.overlong_buffer.len=-2: expected > 0"),
    (["reward.overlong_buffer.len=2", "reward.model.path=/some/rm"], "reward.model.path replaces it"),
])
def test_config_refuses_an_overlong_buffer_that_cannot_work(overrides, complaint):
    with pytest.raises(ConfigError) as e:
        check_config(load_config(None, ["reward.overlong_buffer.enable=true", "data.max_response_length=6", *overrides]))
    assert complaint in str(e.value) and "\n" not in str(e.value)


def test_config_overlong_buffer_keys():
    cfg = load_config(None, ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=4",
                             "reward.overlong_buffer.penalty_factor=0.5", "reward.overlong_buffer.log=true",
                             "data.max_response_length=16"])
    check_config(cfg)
    assert dict(cfg.reward.overlong_buffer) == {"enable": True, "len": 4, "penalty_factor": 0.5, "log": True}
    check_config(off := load_config(None, ["reward.overlong_buffer.len=0"]))
    assert off.reward.overlong_buffer.enable is False  # off: unchecked
    with pytest.raises(ConfigError, match=r"reward\.overlong_buffer\.penalty_factor=-1\.0: expected >= 0"):
        load_config(None, ["reward.overlong_buffer.penalty_factor=-1"])
