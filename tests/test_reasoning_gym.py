"""reasoning-gym's tasks as data (data.train_files=reasoning_gym:<task>) and their own scorers: our
rows scored by our rule reward give exactly reasoning-gym's `score_answer` on the same answers,
in memory and after a parquet round trip; the errors for a bad task name and a missing package."""

import functools
import importlib.util
import json
import random
import sys

import pytest
import torch

from spmdsplit.batch import Batch
from spmdsplit.config import load_config
from spmdsplit.data import reasoning_gym as rg_rows
from spmdsplit.data.parquet import DataError, read_parquet_rows
from spmdsplit.data.sources import build_rows, format_report
from spmdsplit.roles.reward import RESPONSE_TEXT, RuleReward
from spmdsplit.seeds import VALIDATION_DATA_SEED_OFFSET
from tests.support.jobs import SHORT
from tests.support.launch import job

pytestmark = pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None,
                                reason="reasoning-gym is not installed (the reasoning-gym extra)")

# Diverse on purpose: exact numbers, strings, a list, an expression checked by evaluation
# (countdown: many right answers, partial credit), logic whose answer is None (propositional_logic:
# any valid conclusion), sympy-checked roots, and tasks whose entries depend on the dataset's size.
TASKS = ["leg_counting", "basic_arithmetic", "spell_backward", "word_sorting", "countdown", "knights_knaves",
         "propositional_logic", "polynomial_equations", "gsm_symbolic", "list_functions"]
SIZE, SEED = 6, 7


def config(*overrides):
    return load_config(None, [f"data.train_files=reasoning_gym:{','.join(TASKS)}", f"data.reasoning_gym.size={SIZE}",
                              f"data.reasoning_gym.seed={SEED}", "data.max_prompt_length=100000", *overrides])


def responses(row, other_answer: str, seed: int) -> list[str]:
    """Right, wrong, partial and malformed responses to a row: the answer in tags (with reasoning
    before it), another entry's answer, the answer inside longer text, no tags, garbage, an
    unclosed tag, empty tags, two answers (the last counts)."""
    answer = row["reward_model"]["ground_truth"]
    noise = "".join(random.Random(seed).choices("abc 123<>/{}", k=40))
    return [
        f"<think>easy</think>\n<answer>{answer}</answer>",
        f"<answer> {answer} </answer>",
        f"<answer>{other_answer}</answer>",
        f"<answer>so it is {answer}, I think</answer>",
        f"The answer is {answer}.",
        noise,
        f"<answer>{answer}",
        "<answer></answer>",
        f"<answer>{other_answer}</answer> no wait <answer>{answer}</answer>",
        "",
    ]


@functools.cache
def their_dataset(task: str, size: int, seed: int):
    """Built here as reasoning-gym's README does, not through our rows' cache."""
    import reasoning_gym

    return reasoning_gym.create_dataset(task, size=size, seed=seed)


def theirs(task: str, index: int, response: str, size: int = SIZE, seed: int = SEED) -> float:
    """reasoning-gym's own score of a response."""
    from reasoning_gym.utils import extract_answer

    ds = their_dataset(task, size, seed)
    return float(ds.score_answer(extract_answer(response), ds[index]))


def ours(rows, texts) -> list[float]:
    """Our rule reward on (row, response text) pairs, as training scores them: the rows' data_source,
    ground truth and extra_info, the texts as dynamic sampling hands them over (decoded once)."""
    batch = Batch({"responses": torch.zeros(len(rows), 1, dtype=torch.long),
                   "response_mask": torch.ones(len(rows), 1, dtype=torch.long)},
                  {"data_source": [r["data_source"] for r in rows],
                   "ground_truth": [r["reward_model"]["ground_truth"] for r in rows],
                   "extra_info": [r["extra_info"] for r in rows], RESPONSE_TEXT: list(texts)})
    _, scores = RuleReward(None, eos_token_ids=[0]).compute(batch)
    return scores.tolist()


def check_parity(rows):
    pairs = []
    for i, row in enumerate(rows):
        other = rows[i - 1]["reward_model"]["ground_truth"]
        pairs += [(row, text) for text in responses(row, other, i)]
    got = ours([r for r, _ in pairs], [t for _, t in pairs])
    want = [theirs(r["extra_info"]["task"], r["extra_info"]["index"], t) for r, t in pairs]
    # float32: the reward's score tensor
    assert got == pytest.approx(want, abs=1e-6), [
        (r["data_source"], t, g, w) for (r, t), g, w in zip(pairs, got, want) if abs(g - w) > 1e-6]
    return want


def test_rows_have_verls_shape_and_rebuild_their_entries():
    rows, report = build_rows(config().data, None, "train")
    assert len(rows) == len(TASKS) * SIZE
    assert format_report(report).startswith(f"data (train): {len(rows)} row(s) from reasoning-gym's task(s) leg_counting")
    row = rows[0]
    assert row["data_source"] == "reasoning_gym/leg_counting" and row["ability"] == "arithmetic"
    assert [m["role"] for m in row["prompt"]] == ["system", "user"] and "<answer>" in row["prompt"][0]["content"]
    assert row["extra_info"] == {"task": "leg_counting", "config": json.dumps({"seed": SEED, "size": SIZE}),
                                 "index": 0, "split": "train"}
    import reasoning_gym

    entry = reasoning_gym.create_dataset("leg_counting", size=SIZE, seed=SEED)[0]
    assert row["prompt"][1]["content"] == entry["question"] and row["reward_model"]["ground_truth"] == entry["answer"]


def test_scores_equal_reasoning_gyms_own():
    rows, _ = build_rows(config().data, None, "train")
    want = check_parity(rows)
    # the responses cover what they should: full marks, nothing, and partial credit in between
    assert 1.0 in want and 0.0 in want and any(0 < w < 1 for w in want)


def test_scores_equal_reasoning_gyms_own_after_a_parquet_round_trip(tmp_path):
    """The rows written by tools/data/make_reasoning_gym_parquet.py and read back as any verl parquet:
    extra_info survives the round trip (the entry itself would not, for some tasks)."""
    from tools.data.make_reasoning_gym_parquet import main

    path = str(tmp_path / "rg.parquet")
    assert main([path, "--tasks", ",".join(TASKS), "--size", str(SIZE), "--seed", str(SEED)]) == 0
    rows, _ = read_parquet_rows(path)
    built, _ = build_rows(config().data, None, "train")
    assert [(r["prompt"], r["extra_info"]) for r in rows] == [(r["prompt"], r["extra_info"]) for r in built]
    check_parity(rows)


def test_validation_split_differs_from_training():
    cfg = config(f"data.val_files=reasoning_gym:{','.join(TASKS)}", "data.reasoning_gym.val_size=3")
    train, _ = build_rows(cfg.data, None, "train")
    val, _ = build_rows(cfg.data, None, "val")
    assert len(val) == len(TASKS) * 3 and {r["extra_info"]["split"] for r in val} == {"val"}
    assert not {r["prompt"][1]["content"] for r in val} & {r["prompt"][1]["content"] for r in train}
    row = val[0]
    seed = json.loads(row["extra_info"]["config"])["seed"]
    assert seed == SEED + VALIDATION_DATA_SEED_OFFSET
    text = f"<answer>{row['reward_model']['ground_truth']}</answer>"
    assert ours([row], [text]) == [theirs(row["extra_info"]["task"], 0, text, size=3, seed=seed)] == [1.0]


def test_plain_prompts_for_a_model_without_a_chat_template(embedded_model_dir):
    from spmdsplit.models import load_tokenizer

    tokenizer = load_tokenizer(embedded_model_dir)
    with pytest.raises(DataError, match=r"no chat template.*\(data.reasoning_gym.chat=false\)$"):
        build_rows(config().data, tokenizer, "train")
    rows, _ = build_rows(config("data.reasoning_gym.chat=false", "data.reasoning_gym.system_prompt=",
                                "data.truncation=left").data, tokenizer, "train")
    import reasoning_gym

    assert rows[0]["prompt"] == reasoning_gym.create_dataset("leg_counting", size=SIZE, seed=SEED)[0]["question"]
    direct, _ = build_rows(config("data.reasoning_gym.chat=false", "data.reasoning_gym.system_prompt=direct",
                                  "data.truncation=left").data, tokenizer, "train")
    assert direct[0]["prompt"].startswith("Answer the question directly.") and direct[0]["prompt"].endswith(rows[0]["prompt"])


def test_parquet_files_and_tasks_in_one_list(tmp_path):
    from tools.data.make_reasoning_gym_parquet import main

    path = str(tmp_path / "chain_sum.parquet")
    assert main([path, "--tasks", "chain_sum", "--size", "4"]) == 0
    rows, report = build_rows(load_config(None, [f"data.train_files=[{path},reasoning_gym:leg_counting]",
                                                 "data.reasoning_gym.size=3", "data.max_prompt_length=100000"]).data,
                              None, "train")
    assert [r["data_source"] for r in rows] == ["reasoning_gym/chain_sum"] * 4 + ["reasoning_gym/leg_counting"] * 3
    assert [r["index"] for r in rows] == list(range(7))
    assert format_report(report).startswith("data (train): 7 row(s) from 1 parquet file(s) and reasoning-gym's task(s) leg_counting")


@pytest.mark.parametrize("spec, message", [
    ("reasoning_gym:leg_counting,leg_countin",
     ("data.train_files='reasoning_gym:leg_counting,leg_countin': reasoning-gym has no task 'leg_countin' "
      "(did you mean 'leg_counting'?)")),
    ("reasoning_gym:leg_counting,,", None),  # empty names are skipped
])
def test_a_bad_task_name_is_one_line_naming_the_key(spec, message):
    cfg = load_config(None, [f"data.train_files={spec}", "data.reasoning_gym.size=2", "data.max_prompt_length=100000"])
    if message is None:
        assert len(build_rows(cfg.data, None, "train")[0]) == 2
        return
    with pytest.raises(DataError) as e:
        build_rows(cfg.data, None, "train")
    assert str(e.value) == message


def test_a_spec_without_tasks():
    with pytest.raises(DataError, match=r"^--tasks='reasoning_gym:': no task named; e.g. reasoning_gym:leg_counting,"):
        rg_rows.parse_tasks("reasoning_gym:", "--tasks")


def test_an_unknown_system_prompt_names_its_key():
    with pytest.raises(DataError, match=r"^data.reasoning_gym.system_prompt='nope': expected one of \["):
        build_rows(config("data.reasoning_gym.system_prompt=nope").data, None, "train")


def test_without_the_package_one_line_says_which_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # as if not installed
    with pytest.raises(DataError) as e:
        build_rows(config().data, None, "train")
    assert str(e.value) == ("data.train_files: reasoning-gym is not installed; install the extra: "
                            "pip install -e '.[reasoning-gym]'")


@pytest.mark.e2e
def test_a_short_job_trains_on_a_reasoning_gym_task(tmp_path):
    """Two steps on the embedded model: plain prompts (it has no chat template), cut to its 64
    positions; the scores come from the task's scorer (0 for a random policy without tags)."""
    result = job(2, *SHORT[1:], "trainer.total_steps=2", "data.train_files=reasoning_gym:leg_counting",
                 "data.reasoning_gym.size=32", "data.reasoning_gym.chat=false", "data.reasoning_gym.system_prompt=direct",
                 "data.max_prompt_length=40", "data.truncation=left", "data.max_response_length=8",
                 f"trainer.log_dir={tmp_path}/tb", f"trainer.output_dir={tmp_path}/hf", timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "data (train): 32 row(s) from reasoning-gym's task(s) leg_counting" in result.stdout + result.stderr
    assert "step 2:" in result.stdout + result.stderr
