"""Prompt data (spmdsplit/data/prompts.py, spmdsplit/data/synthetic.py): per-step batches, shards,
collation, and the synthetic rows' schema."""

import pytest
import torch

from spmdsplit.data.prompts import PromptDataset, collate_prompts
from spmdsplit.data.synthetic import AGENT_TASKS, DIGITS, SEPARATOR, TASKS, make_dataset
from spmdsplit.embedded import ensure_embedded_model
from spmdsplit.models import load_tokenizer


def numbered_rows(n):
    return [{"id": i} for i in range(n)]


def ids(batch):
    return [r["id"] for r in batch]


# --------------------------------------------------------------------------- PromptDataset


def test_global_batch_is_a_pure_function_of_the_step():
    a = PromptDataset(numbered_rows(40), 8, shuffle=True, seed=3)
    b = PromptDataset(numbered_rows(40), 8, shuffle=True, seed=3)
    for step in (7, 1, 12, 3, 1):  # any order, any instance
        assert ids(a.global_batch(step)) == ids(b.global_batch(step))
        assert ids(a.global_batch(step)) == ids(a.global_batch(step))
        assert len(a.global_batch(step)) == 8
    assert ids(PromptDataset(numbered_rows(40), 8, True, seed=4).global_batch(1)) != ids(a.global_batch(1))


@pytest.mark.parametrize("shuffle", [True, False])
def test_each_epoch_covers_every_row_exactly_once(shuffle):
    n, bs = 48, 8
    data = PromptDataset(numbered_rows(n), bs, shuffle=shuffle, seed=1)
    assert data.steps_per_epoch == 6
    for epoch in range(3):
        seen = [i for step in range(epoch * 6 + 1, epoch * 6 + 7) for i in ids(data.global_batch(step))]
        assert sorted(seen) == list(range(n)), epoch


def test_shuffle_reshuffles_every_epoch():
    data = PromptDataset(numbered_rows(48), 8, shuffle=True, seed=1)
    epoch1 = [i for s in range(1, 7) for i in ids(data.global_batch(s))]
    epoch2 = [i for s in range(7, 13) for i in ids(data.global_batch(s))]
    assert epoch1 != list(range(48))  # shuffled at all
    assert epoch2 != epoch1  # and differently in the next epoch
    assert sorted(epoch2) == sorted(epoch1)


def test_no_shuffle_keeps_the_order_every_epoch():
    data = PromptDataset(numbered_rows(48), 8, shuffle=False, seed=1)
    epoch1 = [i for s in range(1, 7) for i in ids(data.global_batch(s))]
    epoch2 = [i for s in range(7, 13) for i in ids(data.global_batch(s))]
    assert epoch1 == epoch2 == list(range(48))


def test_incomplete_tail_batch_is_skipped():
    data = PromptDataset(numbered_rows(21), 8, shuffle=False, seed=1)
    assert data.steps_per_epoch == 2
    assert ids(data.global_batch(3)) == list(range(8))  # step 3 starts epoch 2, not rows 16..20
    assert all(len(data.global_batch(s)) == 8 for s in range(1, 10))


@pytest.mark.parametrize("batch_size", [8, 10, 7])
@pytest.mark.parametrize("num_parts", [1, 2, 3, 4])
def test_shards_concatenate_to_the_global_batch(batch_size, num_parts):
    data = PromptDataset(numbered_rows(50), batch_size, shuffle=True, seed=2)
    for step in (1, 2, 9):
        shards = [data.shard(step, part, num_parts) for part in range(num_parts)]
        assert [i for s in shards for i in ids(s)] == ids(data.global_batch(step))
        sizes = [len(s) for s in shards]
        assert max(sizes) - min(sizes) <= 1 and sum(sizes) == batch_size


def test_dataset_smaller_than_a_batch_is_an_error():
    with pytest.raises(ValueError, match="train_batch_size"):
        PromptDataset(numbered_rows(5), 8, shuffle=True, seed=1)
    PromptDataset(numbered_rows(8), 8, shuffle=True, seed=1)  # exactly one batch is fine


# --------------------------------------------------------------------------- collate_prompts


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ensure_embedded_model())


def rows_of(prompts, task="repeat"):
    return [
        {"prompt": p, "data_source": f"synthetic/{task}", "reward_model": {"ground_truth": f"gt{i}"}, "extra_info": {}}
        for i, p in enumerate(prompts)
    ]


def test_collate_left_pads_to_max_prompt_length(tokenizer):
    batch = collate_prompts(rows_of(["12=", "98765=", "4="]), tokenizer, 8, step=3, first_row=5)
    pad = tokenizer.pad_token_id
    tok = {c: tokenizer.convert_tokens_to_ids(c) for c in "0123456789="}
    assert batch["input_ids"].tolist() == [
        [pad] * 5 + [tok["1"], tok["2"], tok["="]],
        [pad] * 2 + [tok[c] for c in "98765="],
        [pad] * 6 + [tok["4"], tok["="]],
    ]
    assert batch["attention_mask"].tolist() == [[0] * 5 + [1] * 3, [0] * 2 + [1] * 6, [0] * 6 + [1] * 2]
    assert batch["attention_mask"].dtype == torch.long
    assert batch["ground_truth"] == ["gt0", "gt1", "gt2"]
    assert batch["data_source"] == ["synthetic/repeat"] * 3
    assert batch["uid"] == ["3-5", "3-6", "3-7"]  # unique per step and global row


def test_collate_a_prompt_of_exactly_max_length(tokenizer):
    batch = collate_prompts(rows_of(["1234567="]), tokenizer, 8, step=1, first_row=0)
    assert batch["attention_mask"].tolist() == [[1] * 8]


def test_collate_rejects_a_too_long_prompt_naming_the_key_and_row(tokenizer):
    with pytest.raises(ValueError) as e:
        collate_prompts(rows_of(["12=", "123456789="]), tokenizer, 8, step=1, first_row=40)
    msg = str(e.value)
    assert "data.max_prompt_length" in msg and "8" in msg
    assert "41" in msg  # the global row of the long prompt (first_row + 1)
    assert "(41, 10)" in msg  # with its length in tokens


# --------------------------------------------------------------------------- make_dataset


@pytest.mark.parametrize("task", sorted(set(TASKS) - set(AGENT_TASKS)))
def test_make_dataset_follows_verls_schema(task):
    rows = make_dataset(task, 50, seed=7)
    assert len(rows) == 50
    for i, row in enumerate(rows):
        assert set(row) >= {"prompt", "data_source", "reward_model", "extra_info"}
        assert isinstance(row["prompt"], str) and row["prompt"].endswith(SEPARATOR)
        digits = row["prompt"][:-1]
        assert digits and set(digits) <= set(DIGITS)
        assert row["data_source"] == f"synthetic/{task}"
        assert isinstance(row["reward_model"]["ground_truth"], str) and row["reward_model"]["ground_truth"]
        assert isinstance(row["extra_info"], dict)
    assert make_dataset(task, 50, seed=7) == rows  # seeded
    assert make_dataset(task, 50, seed=8) != rows


def test_task_answers_by_hand():
    assert TASKS["repeat"]("2815") == "5555"
    assert TASKS["count"]("345") == "6789"
    assert TASKS["count"]("18") == "9012"
    assert TASKS["copy"]("3141") == "3141"
    assert TASKS["reverse"]("3141") == "1413"
    row = make_dataset("repeat", 1, seed=0)[0]
    assert row["reward_model"]["ground_truth"] == row["prompt"][-2] * 4


def test_unknown_task_is_a_value_error():
    with pytest.raises(ValueError, match="nope"):
        make_dataset("nope", 10, seed=1)


def test_the_lookup_task_is_verls_agent_data_and_hides_its_code():
    rows = make_dataset("lookup", 50, seed=7)
    for row in rows:
        code = row["reward_model"]["ground_truth"]
        assert row["agent_name"] == "tool_agent" and row["prompt"][0]["role"] == "user"
        assert row["extra_info"]["tools_kwargs"] == {"lookup": {"create_kwargs": {"code": code}}}
    assert len({r["reward_model"]["ground_truth"] for r in rows}) > 5
