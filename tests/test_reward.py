"""Rule rewards (spmdsplit/rewards/rule.py) and the reward role (spmdsplit/roles/reward.py)."""

import math

import pytest
import torch

from spmdsplit.batch import Batch
from spmdsplit.data.synthetic import TASKS
from spmdsplit.embedded import ensure_embedded_model
from spmdsplit.models import load_tokenizer
from spmdsplit.rewards import rule
from spmdsplit.rewards.rule import compute_score, positional_match_score
from spmdsplit.roles.reward import RuleReward
from tests.support.host_reads import counting_host_reads


# --------------------------------------------------------------------------- positional_match_score


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("5555", "5555", 1.0),  # exact
        ("6789", "6789", 1.0),
        ("5512", "5555", 0.5),  # half right
        ("1255", "5555", 0.5),
        ("0000", "5555", 0.0),
        ("55555", "5555", 0.8),  # too long: 4 hits over 5 positions
        ("55555555", "5555", 0.5),
        ("55", "5555", 0.5),  # too short: 2 hits over 4 positions
        ("5", "5555", 0.25),
        ("", "5555", 0.0),  # empty
        ("", "", 1.0),
        ("5", "", 0.0),
        ("  5555\n", "5555", 1.0),  # surrounding whitespace is ignored
        (" 5512 ", "5555", 0.5),
        ("55 55", "5555", 0.6),  # inner whitespace is a character: 3 hits over 5
    ],
)
def test_positional_match_score(response, truth, expected):
    assert positional_match_score(response, truth) == pytest.approx(expected, abs=1e-12)


def test_score_is_one_only_when_exact():
    assert positional_match_score("5555", "5555") == 1.0
    for near in ("555", "55555", "5556", "6555", "5555 5"):
        assert positional_match_score(near, "5555") < 1.0, near


# --------------------------------------------------------------------------- compute_score


def test_every_task_has_a_scorer():
    assert {f"synthetic/{t}" for t in TASKS} <= set(rule.SCORERS)


def test_compute_score_dispatches_on_data_source(monkeypatch):
    monkeypatch.setitem(rule.SCORERS, "test/a", lambda s, gt: 0.25)
    monkeypatch.setitem(rule.SCORERS, "test/b", lambda s, gt: 0.75)
    assert compute_score("test/a", "x", "y") == 0.25
    assert compute_score("test/b", "x", "y") == 0.75
    assert compute_score("synthetic/repeat", "5512", "5555") == 0.5
    assert compute_score("synthetic/count", "6789", "6789") == 1.0


def test_compute_score_returns_a_float(monkeypatch):
    monkeypatch.setitem(rule.SCORERS, "test/int", lambda s, gt: 1)
    score = compute_score("test/int", "x", "y")
    assert type(score) is float and score == 1.0


def test_unknown_data_source_is_a_key_error_naming_it():
    with pytest.raises(KeyError) as e:
        compute_score("nobody/knows", "42", "42")
    assert "nobody/knows" in str(e.value)
    assert "synthetic/repeat" in str(e.value)  # and says what is known


def test_nan_score_is_a_value_error_showing_the_response(monkeypatch):
    monkeypatch.setitem(rule.SCORERS, "test/nan", lambda s, gt: float("nan"))
    with pytest.raises(ValueError) as e:
        compute_score("test/nan", "the-bad-response-31", "gt-77")
    msg = str(e.value)
    assert "NaN" in msg and "the-bad-response-31" in msg and "test/nan" in msg


# --------------------------------------------------------------------------- RuleReward.compute


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_embedded_model())


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def make_batch(tokenizer, rows, R=5):
    """rows: (response token ids, valid length, data_source, ground_truth); pads the ids to R."""
    pad = tokenizer.pad_token_id
    responses = torch.tensor([r + [pad] * (R - len(r)) for r, *_ in rows])
    mask = torch.tensor([[1] * n + [0] * (R - n) for _, n, *_ in rows])
    return Batch(
        {"responses": responses, "response_mask": mask},
        {"data_source": [ds for *_, ds, _ in rows], "ground_truth": [gt for *_, gt in rows]},
    )


def test_score_sits_on_the_last_valid_token(tokenizer):
    eos = tokenizer.eos_token_id
    rows = [
        (ids(tokenizer, "5555") + [eos], 5, "synthetic/repeat", "5555"),  # exact, EOS last: 1.0 at 4
        (ids(tokenizer, "55") + [eos], 3, "synthetic/repeat", "5555"),  # 0.5 at 2
        (ids(tokenizer, "55555"), 5, "synthetic/repeat", "5555"),  # truncated, no EOS: 0.8 at 4
        ([eos], 1, "synthetic/repeat", ""),  # only EOS: empty answer, right for an empty truth
        (ids(tokenizer, "1"), 1, "synthetic/repeat", "1111"),  # one token, no EOS: 0.25 at 0
    ]
    batch = make_batch(tokenizer, rows)
    token_scores, scores = RuleReward(tokenizer).compute(batch)
    expected = [1.0, 0.5, 0.8, 1.0, 0.25]
    assert scores.tolist() == pytest.approx(expected)
    assert scores.dtype == torch.float32 and token_scores.dtype == torch.float32
    assert token_scores.shape == (5, 5)
    where = [4, 2, 4, 0, 0]
    want = torch.zeros(5, 5)
    for i, (col, s) in enumerate(zip(where, expected)):
        want[i, col] = s
    assert torch.allclose(token_scores, want)


def test_eos_only_row_scores_the_empty_string(tokenizer, monkeypatch):
    seen = []

    def scorer(text, gt):
        seen.append(text)
        return 0.1 + len(text)

    monkeypatch.setitem(rule.SCORERS, "test/len", scorer)
    eos = tokenizer.eos_token_id
    batch = make_batch(tokenizer, [([eos], 1, "test/len", "x"), (ids(tokenizer, "12") + [eos], 3, "test/len", "x")])
    token_scores, scores = RuleReward(tokenizer).compute(batch)
    assert seen == ["", "12"]  # the EOS itself is not part of the answer
    assert scores.tolist() == pytest.approx([0.1, 2.1])
    assert torch.allclose(token_scores, torch.tensor([[0.1, 0, 0, 0, 0], [0, 0, 2.1, 0, 0]]))


def test_text_after_the_mask_is_never_scored(tokenizer, monkeypatch):
    seen = []
    monkeypatch.setitem(rule.SCORERS, "test/seen", lambda text, gt: seen.append(text) or 0.5)
    eos = tokenizer.eos_token_id
    # Garbage digits after the EOS (masked 0) must not reach the scorer.
    batch = Batch(
        {"responses": torch.tensor([ids(tokenizer, "3") + [eos] + ids(tokenizer, "999")]),
         "response_mask": torch.tensor([[1, 1, 0, 0, 0]])},
        {"data_source": ["test/seen"], "ground_truth": ["3"]},
    )
    token_scores, _ = RuleReward(tokenizer).compute(batch)
    assert seen == ["3"]
    assert token_scores.tolist() == [[0, 0.5, 0, 0, 0]]


def test_special_tokens_other_than_eos_are_not_stripped(tokenizer):
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    five = ids(tokenizer, "5")
    assert len(five) == 1
    padded = five + [pad] + five + five + [eos]  # "5<pad>55</s>"
    plain = five * 3 + [eos]  # "555</s>"
    batch = make_batch(tokenizer, [(padded, 5, "synthetic/repeat", "5555"), (plain, 4, "synthetic/repeat", "5555")])
    _, scores = RuleReward(tokenizer).compute(batch)
    assert scores[1].item() == pytest.approx(0.75)  # 3 of 4 positions
    # "5<pad>55": only the first character lines up, over 8 characters.
    assert scores[0].item() == pytest.approx(1 / 8)
    assert scores[0].item() < scores[1].item()


@pytest.mark.parametrize("special", ["bos_token_id", "unk_token_id"])
def test_other_special_tokens_count_against_the_answer(tokenizer, special):
    token = getattr(tokenizer, special)
    five = ids(tokenizer, "5")
    batch = make_batch(tokenizer, [(five * 2 + [token] + five * 2, 5, "synthetic/repeat", "5555")])
    _, scores = RuleReward(tokenizer).compute(batch)
    assert scores.item() < 1.0 and not math.isnan(scores.item())


def test_unknown_data_source_in_a_batch_fails_loudly(tokenizer):
    batch = make_batch(tokenizer, [(ids(tokenizer, "5"), 1, "nope/task", "5")])
    with pytest.raises(KeyError, match="nope/task"):
        RuleReward(tokenizer).compute(batch)


def test_other_scorers_and_custom_functions_read_the_text_as_verl_decodes_it(tokenizer, monkeypatch):
    """verl's reward managers decode with skip_special_tokens=True: every scorer but the embedded
    tasks' own (rule.SEES_SPECIAL_TOKENS) reads the response that way, custom functions too."""
    seen = []
    monkeypatch.setitem(rule.SCORERS, "test/seen", lambda text, gt: seen.append(text) or 0.5)
    pad, bos, eos = tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id
    five = ids(tokenizer, "5")
    padded = five + [pad] + five + [bos] + five  # "5<pad>5<s>5", cut at max length
    rows = [(padded, 5, "test/seen", "555"), (padded + [eos], 5, "synthetic/repeat", "5555")]
    batch = make_batch(tokenizer, [(r[:5], n, ds, gt) for r, n, ds, gt in rows])
    _, scores = RuleReward(tokenizer).compute(batch)
    assert seen == ["555"]
    assert scores[1].item() < 0.5  # the embedded task's scorer saw "5<pad>5<s>5"

    def custom(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(solution_str)
        return 0.0

    seen.clear()
    RuleReward(tokenizer, custom_fn=custom).compute(batch)
    assert seen == ["555", "555"]  # a custom function decides for itself, on verl's text


def test_each_call_gets_its_rows_extra_info_as_its_own_copy(tokenizer):
    """A custom function that changes the extra_info it gets (verl's reward managers add keys)
    changes neither the batch nor the next row of its group, which shares the same dict."""
    seen = []

    def custom(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(dict(extra_info))
        extra_info["num_turns"] = 1
        return 0.0

    five = ids(tokenizer, "5")
    batch = make_batch(tokenizer, [(five, 1, "x", "5")] * 3)
    group = {"index": 7, "split": "train"}
    batch["extra_info"] = [group, group, {"index": 8}]  # rollout.n=2 repeats a row's dict
    RuleReward(tokenizer, custom_fn=custom).compute(batch)
    assert seen == [{"index": 7, "split": "train"}] * 2 + [{"index": 8}]
    assert batch["extra_info"] == [{"index": 7, "split": "train"}] * 2 + [{"index": 8}]


def test_the_rule_reward_reads_the_device_a_fixed_number_of_times_per_batch(tokenizer):
    """Issue 25: the reward path read each row's length and tokens on their own (two device syncs
    per row); now the batch's tensors come to the host once, whatever the row count."""
    eos = tokenizer.eos_token_id
    row = (ids(tokenizer, "5555") + [eos], 5, "synthetic/repeat", "5555")
    reads = {}
    for n in (2, 16):
        with counting_host_reads() as during:  # tests/support/host_reads.py
            RuleReward(tokenizer).compute(make_batch(tokenizer, [row] * n))
        reads[n] = len(during)
    assert reads[2] == reads[16] <= 4, reads
