"""An environment written for TRL's environment_factory trains end to end: the echo preset with
its gym environment swapped for a TRL-style class written here (tests/test_trl_env.py TRL_ECHO)
and the preset's constructor arguments cleared from the command line, on 2 real ranks in split and
with continuous generation on a rollout pool one batch ahead; every trained row's score is its own
episode's get_reward()."""

from __future__ import annotations

import collections
import json
import os

import pytest

from tests.support.jobs import POOL, ROOT
from tests.support.launch import job
from tests.test_trl_env import TRL_ECHO

PRESET = os.path.join(ROOT, "configs", "environment_echo.yaml")


@pytest.mark.e2e
@pytest.mark.parametrize("layout", ["split", "continuous_rollout_pool"])
def test_a_trl_environment_trains_and_scores_each_row_by_its_get_reward(tmp_path, layout):
    game, log, dumps = tmp_path / "game.py", tmp_path / "episodes.jsonl", tmp_path / "dumps"
    game.write_text(TRL_ECHO.format(log=str(log)))
    # split: batch mode; the pool: continuous generation one batch ahead (its calls and get_reward per episode)
    placement = ["placement.mode=split"] if layout == "split" else [*POOL, "rollout.continuous=true"]
    result = job(2, "--config", PRESET, *placement, f"rollout.multi_turn.environment={game}:EchoGame",
                 "rollout.multi_turn.environment_kwargs={}", "rollout.multi_turn.max_turn_length=2",
                 "data.max_response_length=16", "trainer.total_steps=3", "data.train_batch_size=16",
                 "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8", f"trainer.rollout_data_dir={dumps}",
                 f"trainer.log_dir={tmp_path}/tb", "trainer.timeline=", "trainer.output_dir=", timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-5000:]
    episodes = [json.loads(line) for line in log.read_text().splitlines()]
    rewards = collections.Counter(round(e["reward"], 6) for e in episodes)
    trained, calls = collections.Counter(), 0
    for step in (1, 2, 3):
        rows = [json.loads(line) for line in (dumps / f"{step}.jsonl").read_text().splitlines()]
        assert len(rows) == 16
        trained.update(round(r["score"], 6) for r in rows)
        calls += sum(r["tool_calls"] for r in rows)
    # Every trained row's score is an episode's get_reward (a pool one batch ahead ran a 4th batch's too),
    # each episode's instance scored once; the policy called the environment's method.
    assert not trained - rewards, (trained, rewards)
    assert len({tuple(e["serial"]) for e in episodes}) == len(episodes)
    assert len(episodes) >= 48 if layout != "split" else len(episodes) == 48
    assert calls > 0 and sum(len(e["said"]) for e in episodes) > 0
