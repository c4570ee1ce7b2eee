"""Checkpoint files: publishing is atomic, the pointer is trusted, pruning keeps the newest; and an
FSDP engine saves and loads its whole training state inside its pool while the rest of the
world does something else."""

import json
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from spmdsplit.checkpoint_files import (
    LATEST, CheckpointError, find_resume, find_resume_after_restart, partial_dir, publish, resume_disagreement, step_dir,
)
from tests.support.helpers import full_weights
from tests.support.launch import job, run_ranks

SLOW_WRITE_JOB = os.path.join(os.path.dirname(__file__), "jobs", "slow_write.py")


def write_half(root, step, pool="actor"):
    os.makedirs(os.path.join(partial_dir(root, step), pool), exist_ok=True)
    with open(os.path.join(partial_dir(root, step), pool, "rank_0.pt"), "w") as f:
        f.write(str(step))


def test_publish_renames_then_points_and_prunes(tmp_path):
    root = str(tmp_path)
    assert find_resume("auto", root) is None  # nothing yet: a fresh start
    for step in (2, 4, 6):
        write_half(root, step)
        publish(root, step, {"step": step}, max_to_keep=2)
    assert sorted(os.listdir(root)) == sorted([LATEST, "global_step_4", "global_step_6"])
    assert find_resume("auto", root) == step_dir(root, 6)
    assert json.load(open(os.path.join(step_dir(root, 6), "meta.json")))["step"] == 6
    assert find_resume("disable", root) is None
    assert find_resume(step_dir(root, 4), root) == step_dir(root, 4)


def test_a_crash_while_writing_leaves_the_previous_checkpoint_in_use(tmp_path):
    root = str(tmp_path)
    write_half(root, 2)
    publish(root, 2, {"step": 2}, max_to_keep=1)
    write_half(root, 4)  # the job dies here, before publishing step 4
    assert find_resume("auto", root) == step_dir(root, 2)
    write_half(root, 4, pool="critic")  # resumed from 2, reached 4 again: the stale half is overwritten
    write_half(root, 6)  # with save_freq=1 the critic may be writing a later step while 4 publishes
    publish(root, 4, {"step": 4}, max_to_keep=1)
    assert sorted(os.listdir(root)) == sorted([LATEST, "global_step_4", "global_step_6.partial"])


def test_a_bad_resume_path_or_pointer_is_a_clear_error(tmp_path):
    root = str(tmp_path)
    with pytest.raises(CheckpointError, match="no such folder"):
        find_resume(str(tmp_path / "nope"), root)
    write_half(root, 3)
    with pytest.raises(CheckpointError, match="no meta.json"):
        find_resume(partial_dir(root, 3), root)
    (tmp_path / LATEST).write_text("7")
    with pytest.raises(CheckpointError, match="names step 7"):
        find_resume("auto", root)


def test_a_run_slurm_restarted_resumes_from_the_jobs_latest_checkpoint(tmp_path):
    """Preemption and `scontrol requeue` rerun the submitted arguments: a job submitted with
    trainer.resume=<a folder> (or disable) must not go back there once it has checkpoints of its own."""
    root = str(tmp_path)
    for step in (3, 7):
        write_half(root, step)
        publish(root, step, {"step": step}, max_to_keep=0)
    given = step_dir(root, 3)
    assert find_resume_after_restart(given, root, restarts=0) == given  # the first run does what it was told
    assert find_resume_after_restart(given, root, restarts=1) == step_dir(root, 7)
    assert find_resume_after_restart("disable", root, restarts=0) is None
    assert find_resume_after_restart("disable", root, restarts=2) == step_dir(root, 7)
    empty = str(tmp_path / "fresh")
    os.makedirs(empty)
    assert find_resume_after_restart("disable", empty, restarts=1) is None  # nothing of its own yet


def _train_save_load(rank, world_size, model_dir, ckpt):
    """Ranks 0-1 form a pool that trains, saves, trains on, then restores into a fresh engine and
    retrains the same step; rank 2 is outside the pool and only runs its own computation. If the
    checkpoint used any world collective, rank 2 would never join it and the test would time out."""
    from spmdsplit.config import OptimConfig
    from spmdsplit.engines.fsdp import FSDPEngine
    from spmdsplit.models import load_causal_lm

    pool = dist.new_group([0, 1])
    if rank == 2:
        return torch.randn(256, 256).matmul(torch.randn(256, 256)).sum().item() is not None
    mesh = DeviceMesh.from_group(pool, "cpu")
    optim = OptimConfig(lr=1e-2, lr_warmup_steps=3)
    inputs = torch.randint(3, 12, (4, 6), generator=torch.Generator().manual_seed(rank))

    def fresh_engine():
        return FSDPEngine(load_causal_lm(model_dir, torch.float32, torch.device("cpu"), seed=5), mesh, optim)

    def train_step(engine):
        loss = engine(input_ids=inputs, labels=inputs).loss / 2
        engine.backward(loss)
        metrics = engine.step()
        engine.scheduler.step()  # one optimizer step per trainer step here: the schedule advances as the roles do
        return metrics

    engine = fresh_engine()
    for _ in range(2):
        train_step(engine)
    engine.save_checkpoint(ckpt)
    after_save = train_step(engine)
    expected = full_weights(engine)

    restored = fresh_engine()
    restored.load_checkpoint(ckpt)
    again = train_step(restored)
    got = full_weights(restored)
    return after_save, again, all(torch.equal(expected[k], got[k]) for k in expected)


def test_fsdp_engine_checkpoint_round_trip_inside_its_pool(tmp_path):
    from spmdsplit.embedded import ensure_embedded_model

    results = run_ranks(_train_save_load, 3, ensure_embedded_model(), str(tmp_path / "engine"), timeout=180)
    for after_save, again, same_weights in results[:2]:
        assert same_weights, "weights after save->load->step differ from save->step"
        assert after_save == again  # same grad norm, and the LR schedule resumed mid-warmup
        assert after_save["lr"] == pytest.approx(1e-2)  # step 3 of a 3-step warmup


def test_the_ranks_choices_of_a_checkpoint_are_compared():
    assert resume_disagreement([None, None]) is None
    assert resume_disagreement(["/c/global_step_4"] * 3) is None
    line = resume_disagreement(["/c/global_step_4", "/c/global_step_4", None, "/c/global_step_2"])
    assert "\n" not in line
    assert "ranks 0, 1: /c/global_step_4; rank 2: no checkpoint (a fresh start); rank 3: /c/global_step_2" in line


SHORT = ("trainer.seed=1", "data.train_batch_size=16", "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
         "actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4", "trainer.timeline=",
         "trainer.output_dir=")


def test_ranks_that_see_different_checkpoints_stop_together_with_one_line(tmp_path):
    """A node whose view of the shared filesystem lags: rank 0 finds a checkpoint of step 2, rank 1
    (its own trainer.default_local_dir, by its RANK) finds none. Each rank picks alone before the
    world forms; without the agreement rank 0 resumed at step 3 while rank 1 started at step 1."""
    first = job(2, *SHORT, "trainer.total_steps=2", "trainer.save_freq=2", f"trainer.log_dir={tmp_path}/tb0",
                f"trainer.default_local_dir={tmp_path}/ckpt0", timeout=180)
    assert first.returncode == 0, first.stderr[-3000:]
    started = time.monotonic()
    result = job(2, *SHORT, "trainer.total_steps=4", f"trainer.log_dir={tmp_path}/tb1",
                 f"trainer.default_local_dir={tmp_path}/ckpt${{oc.env:RANK}}", timeout=120)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if "do not agree on the checkpoint" in line]
    assert lines == [f"spmdsplit: error: the ranks do not agree on the checkpoint to resume from (rank 0: "
                     f"{tmp_path}/ckpt0/global_step_2; rank 1: no checkpoint (a fresh start)): every node must see "
                     "the same, up-to-date trainer.default_local_dir (a shared filesystem whose view lags on some "
                     "node?); or name one with trainer.resume=<a checkpoint folder>"], result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "step 1:" not in result.stdout and "resuming" not in result.stdout
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("engine", ["fsdp", pytest.param("deepspeed", marks=pytest.mark.e2e)])
def test_a_checkpoint_write_longer_than_the_pools_timeout_completes(tmp_path, engine):
    """One rank of a 2-rank pool writes its part of the checkpoint 8 s longer than the other, past
    trainer.dist_timeout_s=4: the engine's wait for the slowest writer (DCP's gather of the write
    results; DeepSpeed's barrier after writing) runs on the pool's gloo meeting group under the
    long timeout, not on the pool's own group, where it failed after 4 s."""
    overrides = [*SHORT, "placement.mode=colocate", "trainer.total_steps=2", "trainer.save_freq=2",
                 "trainer.dist_timeout_s=4", f"trainer.log_dir={tmp_path}/tb", f"trainer.default_local_dir={tmp_path}/ckpt"]
    env = {"SLOW_WRITE": "1:8"}
    if engine == "deepspeed":
        overrides += ["actor.engine=deepspeed", "critic.engine=deepspeed"]
        env["SLOW_WRITE_DEEPSPEED"] = "1"
    result = job(2, *overrides, script=SLOW_WRITE_JOB, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "checkpoint of step 2 written" in result.stdout
