"""DAPO's dynamic sampling (algorithm.filter_groups) in real torchrun jobs under NCCL's
point-to-point rules: in every layout the batch is full every step (the pools' exchanges and FSDP
check the row counts), several generation batches on some steps, and the data position in the
checkpoint advanced by every prompt generated; on a rollout pool at staleness 1 the extra batches
are generated ahead, and a stop and resume repeats the uninterrupted run exactly."""

import pathlib

import pytest
import torch

from spmdsplit.checkpoint_files import step_dir
from tests.support.launch import cached_job, job
from tests.support.outputs import scalars
from tests.support.launch import stop_on_request
from tests.support.outputs import assert_repeats

pytestmark = pytest.mark.e2e

REWARD = str(pathlib.Path(__file__).parent / "data" / "first_digit_reward.py")
STEPS = 4
GEN_BATCH = 16  # prompts per generation batch (data.gen_batch_size), the training batch's size
# A young policy's groups of 4 mostly agree under an all-or-nothing reward: about a third are kept.
DAPO = ("algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
        f"reward.custom_fn.path={REWARD}", "rollout.n=4", f"data.train_batch_size={GEN_BATCH}",
        "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8", f"trainer.total_steps={STEPS}",
        "trainer.save_freq=2", "trainer.output_dir=", "trainer.timeline=")
LAYOUTS = {
    "colocate": ("placement.mode=colocate", "algorithm.adv_estimator=grpo"),
    "split": ("placement.mode=split",),
    "rollout.ranks=all": ("placement.mode=split", "rollout.ranks=all"),
}
AHEAD = ("placement.mode=custom", "placement.pools={gen: 1, train: 1}",
         "placement.roles={rollout: gen, actor: train, critic: train}", "rollout.staleness=1",
         "algorithm.adv_estimator=grpo", "algorithm.rollout_correction.rollout_is=token")


def generation_batches(tb) -> dict[int, float]:
    return dict(scalars(str(tb))["train/num_gen_batches"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_step_is_filled_from_as_many_generation_batches_as_it_takes(layout, tmp_path):
    result = job(2, *DAPO, *LAYOUTS[layout], f"trainer.log_dir={tmp_path}/tb",
                 f"trainer.default_local_dir={tmp_path}/ckpt", timeout=400)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    batches = generation_batches(tmp_path / "tb")
    assert sorted(batches) == list(range(1, STEPS + 1))
    assert all(b >= 1 for b in batches.values()) and max(batches.values()) > 1, batches
    kept = dict(scalars(str(tmp_path / "tb"))["train/filter_groups/kept_ratio"])
    assert all(0 < k < 1 for k in kept.values()), kept
    # The data position: every prompt of every generation batch, kept or not.
    state = torch.load(tmp_path / "ckpt" / f"global_step_{STEPS}" / "actor" / "rank_0.pt", weights_only=False)
    assert state["dynamic_sampling"]["next_gen_batch"] == 1 + sum(batches.values())
    assert state["data"]["prompts_consumed"] == sum(batches.values()) * GEN_BATCH


@pytest.fixture(scope="module")
def ahead_reference():
    result, out = cached_job(2, *DAPO, *AHEAD, timeout=400)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return pathlib.Path(out)


def test_a_rollout_pool_generates_the_extra_batches_ahead_and_a_resume_repeats_the_run(tmp_path, ahead_reference):
    batches = generation_batches(ahead_reference / "tb")
    assert sorted(batches) == list(range(1, STEPS + 1)) and max(batches.values()) > 1, batches
    # The rollout pool's part of the checkpoint: the batch generated ahead, and where it began.
    part = torch.load(ahead_reference / "ckpt" / "global_step_2" / "rollout" / "rank_1.pt", weights_only=False)
    assert list(part["ahead"]) == [3]
    sampling = part["dynamic_sampling"]
    assert sampling["first_gen_batch"] == {3: 1 + batches[1] + batches[2]}
    assert sampling["next_gen_batch"] == 1 + batches[1] + batches[2] + batches[3]

    out = (f"trainer.log_dir={tmp_path}/tb", f"trainer.default_local_dir={tmp_path}/ckpt")
    stopped_at = stop_on_request(2, ["trainer.progress_bar=false", *DAPO, *AHEAD, *out], tmp_path / "ckpt",
                                 after="step 1:", rank=1)  # the rollout rank
    assert 1 <= stopped_at < STEPS
    result = job(2, *DAPO, *AHEAD, *out, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming from {step_dir(str(tmp_path / 'ckpt'), stopped_at)} at step {stopped_at + 1}" in result.stdout
    assert_repeats(tmp_path / "tb", ahead_reference / "tb")


def test_turned_on_at_a_resume_it_goes_on_from_the_prompts_the_stopped_run_took(tmp_path):
    plain = [o for o in DAPO if not o.startswith(("algorithm.filter_groups", "trainer.total_steps"))]
    out = (f"trainer.log_dir={tmp_path}/tb", f"trainer.default_local_dir={tmp_path}/ckpt", *LAYOUTS["colocate"])
    first = job(2, *plain, "trainer.total_steps=2", *out, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = job(2, *DAPO, "trainer.total_steps=3", *out, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    batches = generation_batches(tmp_path / "tb")
    state = torch.load(tmp_path / "ckpt" / "global_step_3" / "actor" / "rank_0.pt", weights_only=False)
    # two steps of 16 prompts taken without filtering, then step 3's generation batches
    assert state["dynamic_sampling"]["next_gen_batch"] == 3 + batches[3]
