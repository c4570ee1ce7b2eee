"""Environments as episodes end to end, in real ranks under the NCCL-contract layer: the embedded
environment's preset (configs/environment_echo.yaml) learns in batch mode (split) and with
continuous generation on a rollout pool, each run ended once it has learned; an OpenEnv
`Environment` subclass written here trains on 2 ranks in split and on a rollout pool one batch
ahead, every trained row scored by its own episode's reward; and bad environments stop the job
before anything distributed happens, with one line."""

from __future__ import annotations

import collections
import json
import os

import pytest

from tests.support.jobs import POOL, ROOT, learning_run
from tests.support.launch import job

PRESET = os.path.join(ROOT, "configs", "environment_echo.yaml")


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["batch_split", "continuous_rollout_pool"])
def test_the_echo_preset_learns(tmp_path, mode):
    """The preset as a user starts it on 2 ranks; a random policy scores ~0.05 (first 5 steps),
    and the run ends once 5 steps in a row average 0.9 (about 40 steps here)."""
    layout = ["placement.mode=split"] if mode == "batch_split" else [*POOL, "rollout.continuous=true"]
    stdout, first, best = learning_run(tmp_path, PRESET, 0.9, *layout, "trainer.num_threads=1")
    assert first <= 0.15 and best >= 0.9, (first, best, stdout[-1500:])


OPENENV_GAME = '''
"""A stateful OpenEnv environment, as its users write one: shows a digit; the answer scores if it
repeats the digit shown; the next digit depends on the answer. Logs each episode's reward."""
import json, os, random
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class Guess(Action):
    guess: str


class Shown(Observation):
    digit: str = ""


class DigitGame(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, log: str, turns: int = 3):
        super().__init__()
        self.log, self.turns = log, turns
        self._state = State(step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs) -> Shown:
        self.rng, self.total = random.Random(seed), 0.0
        self._state = State(episode_id=episode_id, step_count=0)
        self.digit = str(self.rng.randrange(10))
        return Shown(digit=self.digit, reward=0.0)

    def step(self, action: Guess, timeout_s=None, **kwargs) -> Shown:
        self._state.step_count += 1
        reward = float(action.guess == self.digit) / self.turns
        self.total += reward
        self.digit = str((int(self.digit) + len(action.guess) + self.rng.randrange(1, 10)) % 10)
        done = self._state.step_count >= self.turns
        if done:
            with open(self.log, "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "total": self.total}) + "\\n")
        return Shown(digit=self.digit, reward=reward, done=done)

    @property
    def state(self) -> State:
        return self._state
'''


@pytest.mark.e2e
@pytest.mark.parametrize("layout", ["split", "rollout_pool_staleness_1"])
def test_an_openenv_environment_trains_and_scores_each_row_by_its_episode(tmp_path, layout):
    pytest.importorskip("openenv")
    game, log, dumps = tmp_path / "game.py", tmp_path / "episodes.jsonl", tmp_path / "dumps"
    game.write_text(OPENENV_GAME)
    placement = ["placement.mode=split"] if layout == "split" else POOL
    result = job(2, "--config", PRESET, *placement, f"rollout.multi_turn.environment={game}:DigitGame",
                 f"rollout.multi_turn.environment_kwargs={{log: {log}}}", "trainer.total_steps=3",
                 "data.train_batch_size=16", "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
                 f"trainer.rollout_data_dir={dumps}", f"trainer.log_dir={tmp_path}/tb", "trainer.timeline=",
                 "trainer.output_dir=", timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-5000:]
    episodes = collections.Counter(round(json.loads(line)["total"], 6) for line in log.read_text().splitlines())
    trained = collections.Counter()
    for step in (1, 2, 3):
        rows = [json.loads(line) for line in (dumps / f"{step}.jsonl").read_text().splitlines()]
        assert len(rows) == 16 and all(r["num_turns"] == 6 for r in rows)  # the prompt, 3 turns, 2 observations
        trained.update(round(r["score"], 6) for r in rows)
    # Every trained row's score is an episode's own reward (a pool one batch ahead ran a 4th batch's too).
    assert not trained - episodes, (trained, episodes)
    assert sum(episodes.values()) >= 48 if layout != "split" else sum(episodes.values()) == 48


SHORT_RUN = ["trainer.total_steps=3", "data.train_batch_size=16", "actor.ppo_mini_batch_size=8",
             "critic.ppo_mini_batch_size=8", "trainer.timeline=", "trainer.output_dir="]


def rows_of(dumps, steps=(1, 2, 3)) -> list[dict]:
    return [json.loads(line) for step in steps for line in (dumps / f"{step}.jsonl").read_text().splitlines()]


@pytest.mark.e2e
def test_a_gymnasium_environment_trains_in_split_its_ends_and_info_logged(tmp_path):
    """tests/support/gym_envs.py GymEcho (gymnasium's tuples, cut by a time limit) on 2 ranks in
    split: every row truncated, none terminated, in the dumps; the info's numbers logged."""
    from tests.support.outputs import scalars

    result = job(2, "--config", PRESET, "placement.mode=split", "rollout.multi_turn.environment=tests.support.gym_envs.GymEcho",
                 *SHORT_RUN, f"trainer.rollout_data_dir={tmp_path}/dumps", f"trainer.log_dir={tmp_path}/tb",
                 timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-5000:]
    rows = rows_of(tmp_path / "dumps")
    assert len(rows) == 48 and all(r["env_truncated"] == 1 and r["env_terminated"] == 0 for r in rows)
    assert all(0 <= r["score"] <= 1 for r in rows) and any(r["score"] > 0 for r in rows)
    logged = scalars(str(tmp_path / "tb"))
    assert [v for _, v in logged["env/truncated"]] == [16] * 3 and [v for _, v in logged["env/info/steps/mean"]] == [3] * 3
    assert len(logged["env/info/match/mean"]) == 3 and "env/info/task/mean" not in logged


@pytest.mark.e2e
def test_a_gem_textarena_game_runs_on_a_rollout_pool(tmp_path):
    """GEM's Guess The Number (its TextArena game, `gem.make` as the factory, as GEM's users call
    it) for 3 steps on a rollout pool one batch ahead; the embedded model cannot play it (no
    \\boxed{} guess: GEM's format-error reward, the episode terminated)."""
    pytest.importorskip("gem")
    result = job(2, "--config", PRESET, *POOL, "rollout.multi_turn.environment=gem.make",
                 "rollout.multi_turn.environment_kwargs={env_id: 'game:GuessTheNumber-v0-easy'}", *SHORT_RUN,
                 f"trainer.rollout_data_dir={tmp_path}/dumps", f"trainer.log_dir={tmp_path}/tb", timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-5000:]
    rows = rows_of(tmp_path / "dumps")
    assert len(rows) == 48 and all(r["env_terminated"] == 1 and r["tool_calls"] >= 1 for r in rows)
    assert {round(r["score"], 6) for r in rows} <= {-0.1, 0.0, 1.0}


def test_bad_environments_stop_the_job_before_it_starts_with_one_line(tmp_path):
    from spmdsplit.agent import check_multi_turn
    from spmdsplit.config import load_config
    from spmdsplit.embedded import ensure_embedded_model
    from spmdsplit.errors import ConfigError
    from spmdsplit.models import load_tokenizer

    tokenizer = load_tokenizer(ensure_embedded_model(agent=True))
    (tmp_path / "env.py").write_text("class Env:\n    def __init__(self, size):\n        pass\n"
                                     "    def reset(self):\n        return ''\n    def step(self, a):\n        return ''\n")
    cases = [(["rollout.multi_turn.enable=false"], "set rollout.multi_turn.enable=true"),
             ([f"rollout.multi_turn.environment={tmp_path}/env.py:Gone"], "has no attribute 'Gone'"),
             ([f"rollout.multi_turn.environment={tmp_path}/env.py:Env"], "raised TypeError")]
    for overrides, expected in cases:
        cfg = load_config(PRESET, overrides)
        with pytest.raises(ConfigError) as e:
            check_multi_turn(cfg, tokenizer)
        assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)
