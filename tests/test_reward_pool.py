"""A fourth role group on a pool of its own (placement.roles.reward): the reward group scores the
rollout on its own ranks, beside the critic's values, and sends the scores to the critic group.
Real jobs on gloo under NCCL's point-to-point rules (tests/support/nccl_p2p.py): the layout with a rollout
pool running ahead logs every step, validates and checkpoints; it logs the very numbers of the same
job with the reward group on the critic's pool (moving a role group changes where work runs, never
what it computes); it resumes exactly; a reward model on a pool of its own scores chunked rollouts."""

import os
import pathlib

import pytest

from spmdsplit.checkpoint_files import step_dir
from tests.support.launch import cached_job, job
from tests.support.outputs import scalars, timeline_events
from tests.support.launch import stop_on_request
from tests.support.outputs import assert_repeats, comparable

STEPS = 6
# World ranks: policy 0, gen 1, value 2, rm 3 (the actor's pool first, then the mapping's order), so
# the three-pool twin below gives every rank that both jobs have the same rank, hence the same seeds.
REWARD_POOL = ("placement.mode=custom", "placement.pools={gen: 1, policy: 1, value: 1, rm: 1}",
               "placement.roles={rollout: gen, actor: policy, critic: value, reward: rm}")
THREE_POOLS = ("placement.mode=custom", "placement.pools={gen: 1, policy: 1, value: 1}",
               "placement.roles={rollout: gen, actor: policy, critic: value}")
# One step ahead with IS weights; KL in the reward with an adaptive coefficient (the critic then waits
# for the actor's log-probs as well as the reward pool's scores); validation and checkpoints.
JOB = ("rollout.staleness=1", "algorithm.rollout_correction.rollout_is=token", "algorithm.use_kl_in_reward=true",
       "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=50", f"trainer.total_steps={STEPS}",
       "trainer.seed=3", "data.train_batch_size=16", "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
       "trainer.val_freq=3", "trainer.save_freq=3", "trainer.output_dir=")


@pytest.fixture(scope="module")
def reference():
    result, out = cached_job(4, *REWARD_POOL, *JOB, "trainer.timeline={out}/timeline.json", timeout=400)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result, pathlib.Path(out)


def test_the_reward_pool_scores_every_step_validates_and_checkpoints(reference):
    result, out = reference
    assert ("custom: rollout pool ranks [1] | actor pool ranks [0] | critic pool ranks [2] | reward pool ranks [3] "
            "(1 node x 1+1+1+1)") in result.stdout
    logged = scalars(str(out / "tb"))
    for tag in ("critic/score/mean", "critic/vf_loss", "actor/pg_loss", "actor/reward_kl_penalty"):
        assert [s for s, _ in logged[tag]] == list(range(1, STEPS + 1)), tag
    assert [s for s, _ in logged["val-core/synthetic/repeat/reward/mean@1"]] == [3, 6]
    assert [s for s, _ in logged["timing_s/reward"]] == list(range(1, STEPS + 1))  # the reward pool's report
    assert sorted(os.listdir(out / "ckpt" / "global_step_3")) == ["actor", "critic", "meta.json", "reward", "rollout"]

    events = timeline_events(str(out / "timeline.json"))
    names = {r: {e["name"] for e in events if e["pid"] == r} for r in range(4)}
    assert {"reward", "val_reward"} <= names[3] and not {"values", "gen", "update_critic", "update_actor"} & names[3]
    assert {"values", "exchange/scores", "update_critic"} <= names[2] and not {"reward", "val_reward"} & names[2]


def test_the_reward_pool_changes_no_number(reference, tmp_path):
    """The same job with the reward group on the critic's pool (three pools): every logged scalar,
    wall-clock ones aside, equal bit for bit. Scores routed to the wrong rows, a chunk scored twice,
    scores cut to another width or validation scored on the wrong ranks would each show here."""
    _, out = reference
    result = job(3, *THREE_POOLS, *JOB, f"trainer.log_dir={tmp_path}/tb", f"trainer.default_local_dir={tmp_path}/ckpt",
                 "trainer.timeline=", timeout=400)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    with_reward_pool, three_pools = comparable(str(out / "tb")), comparable(str(tmp_path / "tb"))
    assert with_reward_pool.keys() == three_pools.keys()
    for tag, values in three_pools.items():
        assert with_reward_pool[tag] == values, tag


@pytest.mark.e2e
def test_a_stop_asked_of_the_reward_pool_and_a_resume_repeat_the_uninterrupted_run(tmp_path, reference):
    _, out = reference
    argv = ["trainer.progress_bar=false", *REWARD_POOL, *JOB, f"trainer.log_dir={tmp_path}/tb",
            f"trainer.default_local_dir={tmp_path}/ckpt", "trainer.timeline="]
    stopped_at = stop_on_request(4, argv, tmp_path / "ckpt", after="step 2:", rank=3)  # the reward rank
    assert 2 <= stopped_at < STEPS
    assert (tmp_path / "ckpt" / f"global_step_{stopped_at}" / "reward" / "rank_3.pt").is_file()
    result = job(4, *argv[1:], timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming from {step_dir(str(tmp_path / 'ckpt'), stopped_at)} at step {stopped_at + 1}" in result.stdout
    assert_repeats(tmp_path / "tb", out / "tb")


def test_a_reward_model_on_a_pool_of_its_own_scores_chunked_rollouts_and_remax_baselines(tmp_path):
    """GRPO's kin without a critic: the actor (and the critic group's advantages) on one pool, a
    reward model (FSDP over its own pool) on the other; the rollout streams in two chunks, each
    scored there with its ReMax greedy baseline and sent on to the critic group."""
    from spmdsplit.embedded import ensure_embedded_model

    result = job(2, "placement.mode=custom", "placement.pools={train: 1, rm: 1}",
                 "placement.roles={actor: train, reward: rm}", "algorithm.adv_estimator=remax", "rollout.n=2",
                 f"reward.model.path={ensure_embedded_model()}", "reward.model.micro_batch_size_per_gpu=8",
                 "rollout.stream_chunks=2", "trainer.total_steps=3", "data.train_batch_size=8",
                 "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8", "trainer.val_freq=3",
                 f"trainer.log_dir={tmp_path}/tb", f"trainer.timeline={tmp_path}/timeline.json",
                 "trainer.output_dir=", "trainer.save_freq=-1", timeout=400)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "actor+critic pool ranks [0] | reward pool ranks [1]" in result.stdout
    logged = scalars(str(tmp_path / "tb"))
    scores = [v for _, v in logged["critic/score/mean"]]
    assert len(scores) == 3 and all(v == v for v in scores)  # a random head scores anything but NaN
    assert len(logged["val-core/synthetic/repeat/reward/mean@1"]) == 1
    events = timeline_events(str(tmp_path / "timeline.json"))
    scored = [e["args"].get("chunk") for e in events if e["name"] == "reward"]
    assert {e["pid"] for e in events if e["name"] == "reward"} == {1} and sorted(scored) == [0, 0, 0, 1, 1, 1]
    assert not [e for e in events if e["name"] in ("values", "update_critic")]
