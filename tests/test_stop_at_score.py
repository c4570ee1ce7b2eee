"""trainer.stop_at_score: a run ends once it has learned (spmdsplit/stop_at_score.py, the vote in
spmdsplit/preempt.py). The window's rule by hand, and a job on a rollout pool one batch ahead that
ends the step after its target was reached, as after its last step."""

from __future__ import annotations

import os

from spmdsplit.stop_at_score import ScoreTarget
from tests.support.launch import job
from tests.support.outputs import scalars


def test_the_target_is_reached_at_the_first_full_window_whose_mean_reaches_it():
    target = ScoreTarget(0.5, window=3)
    reached = [target.add(step, score) for step, score in enumerate([0.9, 0.9, 0.1, 0.5, 0.6, 0.9, 0.9], start=1)]
    # windows: (.9 .9 .1) .633 at step 3 -- the first full window, and it reaches 0.5
    assert reached == [False, False, True, False, False, False, False] and target.reached_at == 3

    later = ScoreTarget(0.7, window=3)
    reached = [later.add(step, score) for step, score in enumerate([0.9, 0.9, 0.1, 0.5, 0.6, 0.9, 0.9], start=1)]
    # (.1 .5 .6) .4 at 5, (.5 .6 .9) .667 < .7 at 6, (.6 .9 .9) .8 at 7
    assert reached.index(True) + 1 == 7 and later.reached_at == 7


def test_no_threshold_never_stops_and_the_window_survives_a_checkpoint():
    assert not any(ScoreTarget(None, 2).add(s, 1.0) for s in range(1, 10))
    before = ScoreTarget(0.5, window=3)
    before.add(1, 0.4)
    before.add(2, 0.5)
    after = ScoreTarget(0.5, window=3)
    after.load_state_dict(before.state_dict())
    assert after.add(3, 0.6) and after.reached_at == 3  # the resumed run stops where the straight one would


def test_a_job_ends_the_step_after_its_target_is_reached_with_a_batch_generated_ahead(tmp_path):
    """Rollout | train at staleness 1: batch 4 is generated ahead while step 3 trains, and the run
    ends after step 3 all the same (the target, 0.0, is reached by the first full window of 2, at
    step 2): exit 0, the policy exported, a checkpoint after the last step as save_freq asks."""
    out = tmp_path / "run"
    result = job(2, "--config", "configs/grpo_rollout_actor.yaml", "trainer.total_steps=10", "trainer.stop_at_score=0.0",
                 "trainer.stop_at_score_window=2", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
                 "trainer.save_freq=5", f"trainer.log_dir={out}/tb", f"trainer.default_local_dir={out}/ckpt",
                 f"trainer.output_dir={out}/hf", "trainer.timeline=", cwd=os.path.dirname(os.path.dirname(__file__)),
                 timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "reaching trainer.stop_at_score=0.0: the run ends after step 3" in result.stdout
    assert "over 3 steps" in result.stdout and "stopped on request" not in result.stdout
    assert [s for s, _ in scalars(str(out / "tb"))["critic/score/mean"]] == [1, 2, 3]
    assert (out / "hf" / "config.json").is_file()
    assert sorted(os.listdir(out / "ckpt")) == ["global_step_3", "latest_checkpointed_iteration.txt"]
