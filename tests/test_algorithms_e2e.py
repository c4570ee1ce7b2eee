"""The algorithms of issue 28 in real torchrun jobs: the DAPO preset learns the embedded task from
a random start (held-out greedy answers, the number the filter cannot bias), and ReMax with a
non-default policy loss runs through chunked streaming and balancing, its greedy baseline riding
with the rows."""

import pathlib

import pytest

from tests.launch import job
from tests.outputs import scalars

pytestmark = pytest.mark.e2e

CONFIGS = pathlib.Path(__file__).parent.parent / "configs"


def test_the_dapo_preset_learns_the_embedded_task(tmp_path):
    """configs/dapo_rollout_actor.yaml as a user runs it (seed 1, 200 steps, ~1 minute): validation
    0.0 at step 25 and 1.0 from step 175 when measured (docs/algorithms.md)."""
    result = job(2, "--config", str(CONFIGS / "dapo_rollout_actor.yaml"), f"trainer.log_dir={tmp_path}/tb",
                 "trainer.timeline=", "trainer.output_dir=", timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    logged = scalars(str(tmp_path / "tb"))
    val = dict(logged["val-core/synthetic/repeat/reward/mean@1"])
    assert sorted(val) == list(range(25, 201, 25))
    assert val[25] < 0.2, f"the young policy already scores {val[25]:.3f}: the check has no power"
    assert val[200] >= 0.9, f"validation {val} : the DAPO preset did not learn"
    batches = [v for _, v in logged["train/num_gen_batches"]]
    assert len(batches) == 200 and max(batches) > 1  # the filter had work


def test_remax_with_a_sequence_level_loss_streams_and_balances_its_baselines(tmp_path):
    result = job(2, "placement.mode=colocate", "algorithm.adv_estimator=remax", "actor.policy_loss.loss_mode=gspo",
                 "actor.clip_ratio_low=0.0003", "actor.clip_ratio_high=0.0004", "rollout.n=2",
                 "rollout.stream_chunks=2", "trainer.balance_batch=true", "data.train_batch_size=16",
                 "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8", "trainer.total_steps=3",
                 f"trainer.log_dir={tmp_path}/tb", "trainer.timeline=", "trainer.output_dir=", timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    logged = scalars(str(tmp_path / "tb"))
    assert [s for s, _ in logged["actor/pg_loss"]] == [1, 2, 3]
    # GSPO clips the sequence's ratio within 3-4e-4: after the first mini-batch most sequences are clipped
    assert max(v for _, v in logged["actor/pg_clipfrac"]) > 0
