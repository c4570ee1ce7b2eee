"""A rollout pool of its own (placement.roles) and generation that runs ahead (rollout.staleness):
real torchrun jobs on gloo, checked for what a user relies on — every step logged with
validation and checkpoints, generation of batch k+1 overlapping the training on batch k, the
staleness visible (and corrected) in the log-probs, exact resume across a stop with batches
generated ahead, three pools — and the weight schedule both sides follow, checked exhaustively."""

import os
import pathlib

import pytest
import torch
from omegaconf import OmegaConf

from spmdsplit.batch import Batch
from spmdsplit.checkpoint_files import step_dir
from spmdsplit.staleness import check_weights_version, next_version_sent, validates_after, weights_needed
from tests.support.launch import cached_job, job
from tests.support.outputs import scalars, timeline_events
from tests.support.launch import stop_on_request
from tests.support.outputs import assert_repeats

STEPS = 6
# rollout | actor+critic, one step off-policy, corrected by token-level truncated IS weights.
AHEAD = ("placement.mode=custom", "placement.pools={gen: 1, train: 1}",
         "placement.roles={rollout: gen, actor: train, critic: train}", "rollout.staleness=1",
         "algorithm.rollout_correction.rollout_is=token", f"trainer.total_steps={STEPS}", "trainer.seed=3",
         "data.train_batch_size=16", "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
         "trainer.val_freq=3", "trainer.output_dir=")


def ahead_job(out, *extra):
    return (*AHEAD, f"trainer.log_dir={out}/tb", f"trainer.default_local_dir={out}/ckpt", *extra)


@pytest.fixture(scope="module")
def reference():
    """The job run straight through, once a session for every test that reads it."""
    result, out = cached_job(2, *AHEAD, "trainer.timeline={out}/timeline.json", timeout=400)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "rollout pool ranks [1] | actor+critic pool ranks [0]" in result.stdout
    return pathlib.Path(out)


def test_the_rollout_pool_generates_the_next_batch_while_the_train_pool_trains(reference):
    logged = scalars(str(reference / "tb"))
    assert [s for s, _ in logged["critic/score/mean"]] == list(range(1, STEPS + 1))
    # The rollout pool's own timings reach rank 0's log (its work during each step: at the last
    # one, with the last batch generated ahead, there is none), and validation came from its engine.
    assert [s for s, _ in logged["timing_s/gen"]] == list(range(1, STEPS))
    assert [s for s, _ in logged["val-core/synthetic/repeat/reward/mean@1"]] == [3, 6]
    assert "rollout_corr/rollout_is_mean" in logged
    # Batch 1 comes from the initial weights, which the actor still holds: the engine's
    # log-probs equal the actor's (fp32). Every later batch is one update behind.
    diff = dict(logged["training/rollout_probs_diff_max"])
    assert diff[1] < 1e-5, diff
    assert all(diff[k] > 1e-4 for k in range(2, STEPS + 1)), diff

    events = timeline_events(str(reference / "timeline.json"))
    names = {r: {e["name"] for e in events if e["pid"] == r} for r in (0, 1)}
    assert "gen" in names[1] and not {"update_actor", "values", "old_log_prob"} & names[1]
    assert "gen" not in names[0] and {"update_actor", "update_critic", "old_log_prob"} <= names[0]
    # Generation runs ahead: batch k+1 is generated while the train pool works on batch k, not after its
    # update (whose weights it does not need). It starts as the train pool takes batch k, so it may be
    # done before the train pool, still logging step k-1, starts its first phase of step k: the check is
    # that it starts before step k's training ends (it would wait for update k without staleness).
    gen = {e["args"]["step"]: (e["ts"], e["ts"] + e["dur"]) for e in events if e["pid"] == 1 and e["name"] == "gen"}
    for k in range(2, STEPS):
        train = [(e["ts"], e["ts"] + e["dur"]) for e in events
                 if e["pid"] == 0 and e["args"]["step"] == k and e["name"] in ("old_log_prob", "ref", "values",
                                                                                "update_critic", "update_actor")]
        start, _ = gen[k + 1]
        assert start < max(e for _, e in train), f"gen of batch {k + 1} waited for step {k}'s update"


def test_the_rollout_pools_engine_wakes_once_and_never_sleeps(reference):
    """Its device is its own: the engine wakes with the first weights and takes every later version
    in place (a sleep and a wake per version would unmap and map its whole share of a GPU)."""
    events = [e for e in timeline_events(str(reference / "timeline.json")) if e["pid"] == 1]
    sleeps = [e["args"]["step"] for e in events if e["name"] == "rollout_sleep"]
    assert not sleeps, f"the rollout pool's engine slept at steps {sleeps}"
    syncs = [e["args"]["engine"] for e in events if e["name"] == "sync_weights"]
    assert syncs == ["wake_up"] + ["update_weights"] * (len(syncs) - 1) and len(syncs) == STEPS, syncs


@pytest.mark.e2e
def test_a_stop_and_resume_with_batches_generated_ahead_repeats_the_uninterrupted_run(tmp_path, reference):
    """The batch generated ahead is part of the checkpoint (the rollout pool's part), so the
    resumed run trains on exactly the rows the uninterrupted one did."""
    stopped_at = stop_on_request(2, ["trainer.progress_bar=false", *ahead_job(tmp_path)], tmp_path / "ckpt",
                                 after="step 2:", rank=1)  # the rollout rank
    assert 2 <= stopped_at < STEPS
    part = tmp_path / "ckpt" / f"global_step_{stopped_at}" / "rollout" / "rank_1.pt"
    ahead = torch.load(part, weights_only=False)["ahead"]
    assert list(ahead) == [stopped_at + 1] and ahead[stopped_at + 1]["weights_version"].unique().tolist() == [stopped_at - 1]

    result = job(2, *ahead_job(tmp_path), timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming from {step_dir(str(tmp_path / 'ckpt'), stopped_at)} at step {stopped_at + 1}" in result.stdout
    assert_repeats(tmp_path / "tb", reference / "tb")


def test_three_pools_two_steps_ahead_with_validation_and_checkpoints(tmp_path):
    # configs/rollout_actor_critic.yaml's placement; the critic on DeepSpeed (ZeRO-2), the actor on FSDP2;
    # the actor and critic pools take turns (placement.overlap=false) while the rollout pool runs
    # ahead: the hand-off barrier spans those two pools only (over the world it hung: the rollout
    # pool never calls it).
    result = job(3, "placement.mode=custom", "placement.pools={gen: 1, policy: 1, value: 1}",
                      "placement.roles={rollout: gen, actor: policy, critic: value}", "rollout.staleness=2",
                      "placement.overlap=false",
                      "critic.engine=deepspeed", "critic.zero_stage=2",
                      "algorithm.rollout_correction.rollout_is=sequence", "trainer.total_steps=4",
                      "data.train_batch_size=16", "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
                      "trainer.val_freq=2", "trainer.save_freq=2", f"trainer.log_dir={tmp_path}/tb",
                      f"trainer.default_local_dir={tmp_path}/ckpt", "trainer.timeline=", "trainer.output_dir=",
                      timeout=400)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "rollout pool ranks [1] | actor pool ranks [0] | critic pool ranks [2]" in result.stdout
    logged = scalars(str(tmp_path / "tb"))
    assert [s for s, _ in logged["critic/vf_loss"]] == [1, 2, 3, 4]
    assert [s for s, _ in logged["val-core/synthetic/repeat/reward/mean@1"]] == [2, 4]
    assert sorted(os.listdir(tmp_path / "ckpt" / "global_step_2")) == ["actor", "critic", "meta.json", "rollout"]
    ahead = torch.load(tmp_path / "ckpt" / "global_step_2" / "rollout" / "rank_1.pt", weights_only=False)["ahead"]
    assert {b: rows["weights_version"].unique().tolist() for b, rows in ahead.items()} == {3: [0], 4: [1]}


@pytest.mark.parametrize("staleness", [0, 1, 2, 3])
@pytest.mark.parametrize("val_freq, val_before_train", [(-1, False), (2, True), (3, False)])
def test_every_weights_version_sent_is_taken_once_and_every_batch_keeps_its_bound(staleness, val_freq,
                                                                                   val_before_train):
    """Both sides of the weight stream, walked as rollout_pool.py and actor_pool.py walk them:
    the actor pool sends update k's weights when `weights_needed`; the rollout pool takes them at
    validation or at the end of its step, in order, each once; each batch is generated with a
    version within the staleness bound, from exactly step k-1-s on."""
    total = 7
    cfg = OmegaConf.create({"rollout": {"staleness": staleness, "continuous": False},
                            "trainer": {"total_steps": total, "val_freq": val_freq, "val_before_train": val_before_train}})
    sent = [k for k in range(1, total + 1) if weights_needed(cfg, k)]
    taken, version, generated_with = [], 0, {}
    for k in range(1, total + 1):  # the rollout pool's step k, then its validation
        for batch in range(max(generated_with, default=0) + 1, min(k + staleness, total) + 1):
            generated_with[batch] = version
        if weights_needed(cfg, k) and not validates_after(cfg, k):
            taken.append(k)
            version = k
        if validates_after(cfg, k):
            assert version < k
            taken.append(k)
            version = k
    assert taken == sent
    assert generated_with == {b: max(0, b - 1 - staleness) for b in range(1, total + 1)}


def test_continuous_generation_is_sent_every_version_but_the_last_unless_it_validates_after_it():
    cfg = OmegaConf.create({"rollout": {"staleness": 1, "continuous": True},
                            "trainer": {"total_steps": 5, "val_freq": -1, "val_before_train": False}})
    assert [k for k in range(1, 6) if weights_needed(cfg, k)] == [1, 2, 3, 4]
    assert next_version_sent(cfg, 3) == 4 and next_version_sent(cfg, 4) is None
    cfg.trainer.val_freq = 5  # validation after the last step takes its weights too
    assert weights_needed(cfg, 5) and next_version_sent(cfg, 4) == 5


def test_rows_of_the_wrong_weights_version_are_refused_in_one_line():
    rows = Batch({"weights_version": torch.tensor([3, 3, 2])})
    check_weights_version(rows, step=5, staleness=2)  # 2..4 allowed
    with pytest.raises(RuntimeError, match=r"^step 5: rows generated with the weights of update 1\.\.3, but "
                                           r"rollout.staleness=1 allows updates 3\.\.4$"):
        check_weights_version(Batch({"weights_version": torch.tensor([3, 1])}), step=5, staleness=1)
    with pytest.raises(RuntimeError, match="allows updates 4..4"):
        check_weights_version(Batch({"weights_version": torch.tensor([5])}), step=5, staleness=0)

