"""verifiers v1 environments trained through the endpoint (rollout.agent.harness=verifiers:<env>,
spmdsplit/agent/verifiers_env.py), with the real `verifiers` package: tests/support/verifiers_echo.py
(a taskset whose task shows a digit, a reward matching the answer with it, and an in-process
harness) plays rows of verl's shape on the served embedded model, its rewards become the rows'
scores, and a job trains on them; a bad name stops the job in one line before it starts."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.support.jobs import ROOT
from tests.support.launch import job

pytest.importorskip("verifiers.v1", reason="verifiers is installed by tools/setup/setup_cpu.sh")

PRESET = f"{ROOT}/configs/environment_echo.yaml"
ENV = f"{ROOT}/tests/support/verifiers_echo.py"
HARNESS = ["rollout.multi_turn.enable=false", f"rollout.agent.harness=verifiers:{ENV}",
           "rollout.agent.verifiers_env_kwargs={agent: {runtime: {type: subprocess}}}"]


def verl_rows(count: int) -> list[dict]:
    """Rows as verl's preprocessing writes them: chat prompts for the agent model's template, the
    digit to echo as the ground truth, and the environment's own prompt in extra_info."""
    return [{"prompt": [{"role": "user", "content": str(i % 10)}], "data_source": "verifiers/echo",
             "reward_model": {"ground_truth": str(i % 10), "style": "rule"},
             "extra_info": {"index": i, "prompt": str(i % 10)}} for i in range(count)]


def test_a_row_maps_to_the_tasksets_task_data():
    from spmdsplit.agent.verifiers_env import row_task_data
    from tests.support.verifiers_echo import EchoData

    row = {"prompt": "<rendered>", "ground_truth": "7", "extra_info": {"index": 3, "prompt": "7", "idx": 9}}
    assert row_task_data(EchoData, row) == {"prompt": "7", "answer": "7"}  # not index/idx: no such fields
    plain = {"prompt": "5", "ground_truth": "5", "extra_info": None}  # a plain-text prompt, no extra_info
    assert row_task_data(EchoData, plain) == {"prompt": "5", "answer": "5"}
    assert row_task_data(EchoData, {"prompt": "5", "ground_truth": "5", "extra_info": {"answer": "4"}})["answer"] == "4"


@pytest.fixture(scope="module")
def rollout(embedded_cache, tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from spmdsplit.config import load_config
    from spmdsplit.data.prompts import collate_prompts
    from spmdsplit.data.sources import build_rows
    from spmdsplit.embedded import ensure_embedded_model
    from spmdsplit.models import eos_token_ids, load_tokenizer
    from spmdsplit.inference import build_generator

    data = tmp_path_factory.mktemp("verifiers") / "train.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows(10)), str(data))
    cfg = load_config(PRESET, [*HARNESS, f"data.train_files={data}", "rollout.agent.harness_timeout_s=20"])
    cfg.model.path = ensure_embedded_model(agent=True)
    tokenizer = load_tokenizer(cfg.model.path)
    rows, _ = build_rows(cfg.data, tokenizer, "train")
    prompts = collate_prompts(rows, tokenizer, cfg.data.max_prompt_length, step=1, first_row=0)
    rollout = build_generator(cfg, cfg.model.path, tokenizer, eos_token_ids(cfg.model.path, tokenizer),
                              torch.device("cpu"), torch.float32, seed=3)
    yield rollout, prompts, tokenizer
    rollout.close()


def test_each_row_is_an_episode_of_the_environment_scored_by_its_reward(rollout):
    """The environment's harness calls the endpoint through verifiers' interception server; the
    row trained is the call the server recorded, and the row's reward is the task's: 1.0 exactly
    where the answer is the row's digit."""
    from spmdsplit.rewards.rule import ENVIRONMENT_REWARD, positional_match_score

    rollout, prompts, tokenizer = rollout
    batch = rollout.generate(prompts)
    rewards = [info[ENVIRONMENT_REWARD] for info in batch["extra_info"]]
    answers = [tokenizer.decode(ids[mask.bool()]) for ids, mask in zip(batch["responses"], batch["response_mask"])]
    assert batch["response_mask"].sum(-1).tolist() == [1] * 10 and batch["tool_calls"].tolist() == [1] * 10
    assert rewards == [positional_match_score(a, str(i % 10)) for i, a in enumerate(answers)], (rewards, answers)
    assert batch["tool_errors"].sum() == 0


def test_a_bad_environment_stops_the_job_before_it_starts_with_one_line(tmp_path, monkeypatch):
    from spmdsplit.agent import check_harness
    from spmdsplit.config import load_config
    from spmdsplit.errors import ConfigError

    cases = [("verifiers:no_such_env_here", {}, "taskset 'no_such_env_here' not found"),
             (f"verifiers:{tmp_path}/gone.py", {}, "no such file"),
             (f"verifiers:{ENV}", {"taskset": 3}, "must be a mapping"),
             (f"verifiers:{ENV}", {"agent": {"runtime": {"type": "nowhere"}}}, "runtime")]
    for harness, kwargs, expected in cases:
        cfg = load_config(PRESET, ["rollout.multi_turn.enable=false", f"rollout.agent.harness={harness}",
                                   f"rollout.agent.verifiers_env_kwargs={json.dumps(kwargs)}"])
        with pytest.raises(ConfigError) as e:
            check_harness(cfg)
        message = str(e.value)
        assert expected in message and "\n" not in message and "rollout.agent.harness=verifiers:" in message, message
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)  # what `import verifiers.v1` meets when it is not installed
    cfg = load_config(PRESET, [*HARNESS[:2]])
    with pytest.raises(ConfigError) as e:
        check_harness(cfg)
    assert "verifiers is not installed" in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.e2e
def test_a_verifiers_environment_trains_through_the_endpoint(tmp_path):
    """2 ranks in split, 3 steps of 16 rows: every row an episode of the environment, its reward
    the task's, in the dumps."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(verl_rows(48)), str(tmp_path / "train.parquet"))
    dumps = tmp_path / "dumps"
    result = job(2, "--config", PRESET, *HARNESS, f"data.train_files={tmp_path}/train.parquet", "placement.mode=split",
                 "trainer.total_steps=3", "data.train_batch_size=16", "actor.ppo_mini_batch_size=8",
                 "critic.ppo_mini_batch_size=8", "trainer.num_threads=1", f"trainer.rollout_data_dir={dumps}",
                 f"trainer.log_dir={tmp_path}/tb", "trainer.timeline=", "trainer.output_dir=", timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for step in (1, 2, 3) for line in (dumps / f"{step}.jsonl").read_text().splitlines()]
    assert len(rows) == 48 and all(r["num_turns"] == 2 for r in rows), rows[:2]  # the prompt and one call
    from spmdsplit.rewards.rule import positional_match_score

    for r in rows:
        assert r["score"] == positional_match_score(r["output"], r["gts"]), r
    assert any(r["score"] == 1.0 for r in rows) and any(r["score"] == 0.0 for r in rows)
