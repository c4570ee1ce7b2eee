"""Exact resume under plain torchrun: a job stopped (by a signal), killed (SIGKILL of one rank) or
crashed in the middle of writing a checkpoint, then started again, logs for every later step the
same metrics as a job that never stopped. Timings excepted, everything must be bit-identical:
weights, optimizer moments, LR warmup, the adaptive KL coefficient and each rank's sampling RNG
all come back from the checkpoint."""

import os
import signal
import time

import pytest

from spmdsplit.checkpoint_files import LATEST, partial_dir, step_dir
from tests.support.launch import cached_job, job, read_until, start_torchrun, worker_pid
from spmdsplit.sinks import mlflow_metric_name
from tests.support.outputs import assert_same_scalars, comparable, mlflow_scalars, scalars, wandb_offline_runs, wandb_offline_scalars

# What these tests stop, kill and crash is a job under real torchrun: its signals and teardown.
pytestmark = pytest.mark.e2e

STEPS = 8
JOB = (
    f"trainer.total_steps={STEPS}", "trainer.seed=3", "data.train_batch_size=16", "actor.ppo_mini_batch_size=8",
    "critic.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4",
    # state that lives outside the weights: KL in the reward with an adaptive coefficient, a warmup
    # that spans the stop, a KL loss against the reference
    "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=50",
    "actor.optim.lr_warmup_steps=6", "actor.use_kl_loss=true", "trainer.timeline=", "trainer.output_dir=",
)
FAULT_JOB = os.path.join(os.path.dirname(__file__), "jobs", "ckpt_crash.py")


@pytest.fixture(scope="module")
def reference():
    """The job run straight through, once a session for every test that reads it."""
    result, out = cached_job(2, *JOB, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = comparable(f"{out}/tb")
    assert all(len(v) == STEPS for v in metrics.values())
    return metrics


def start_job(out, *extra, script=None, env=None):
    """Real torchrun: what these tests stop, kill and crash is a job under it."""
    return start_torchrun(2, "trainer.progress_bar=false", *JOB, f"trainer.log_dir={out}/tb",
                          f"trainer.default_local_dir={out}/ckpt", *extra, script=script, env=env)


def resume_to_the_end(out, *extra) -> str:
    result = job(2, *JOB, f"trainer.log_dir={out}/tb", f"trainer.default_local_dir={out}/ckpt", *extra, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def assert_same_as_reference(out, reference):
    resumed = comparable(f"{out}/tb")
    assert resumed.keys() == reference.keys()
    for tag, values in reference.items():
        assert resumed[tag] == values, f"{tag} differs after resume"


def test_sigusr2_stops_after_a_checkpoint_and_the_resumed_run_repeats_the_uninterrupted_one(tmp_path, reference,
                                                                                           monkeypatch):
    # wandb (offline) and MLflow (a file store beside the log dir) too: the resumed job goes on in
    # the runs the stopped one started, so each holds every step once.
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    loggers = "trainer.logger=[console,tensorboard,wandb,mlflow]"
    job = start_job(tmp_path, loggers)  # no save_freq: the stop request alone must checkpoint
    read_until(job, "step 2:")
    os.kill(worker_pid(job.pid, rank=1), signal.SIGUSR2)  # the critic rank only: the others learn by the vote
    output, _ = job.communicate(timeout=240)
    assert job.returncode != 0  # torchrun reports the ranks' EXIT_STOPPED (75) as a failure
    assert "got SIGUSR2" in output and "stopped on request" in output
    stopped_at = int(open(tmp_path / "ckpt" / LATEST).read())
    assert 2 <= stopped_at < STEPS
    assert f"step {stopped_at + 1}:" not in output

    resumed = resume_to_the_end(tmp_path, loggers)
    assert f"resuming from {step_dir(str(tmp_path / 'ckpt'), stopped_at)} at step {stopped_at + 1}" in resumed
    assert_same_as_reference(tmp_path, reference)  # one log dir for both runs: each step once, all equal

    tensorboard = scalars(f"{tmp_path}/tb")
    first, again = wandb_offline_runs(str(tmp_path))  # one directory per job, both of one run
    assert first == again
    assert_same_scalars(wandb_offline_scalars(str(tmp_path)), tensorboard, "wandb")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert_same_scalars(mlflow_scalars(f"file:{tmp_path}/mlruns"),  # one run, or this fails
                        {mlflow_metric_name(k): v for k, v in tensorboard.items()}, "mlflow")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"file:{tmp_path}/mlruns")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.data.params["trainer.total_steps"] == str(STEPS)  # the config, as params
    assert run.data.params["algorithm.kl_ctrl.type"] == "adaptive"


def test_a_rank_killed_mid_step_ends_the_job_fast_and_a_restart_resumes(tmp_path, reference):
    job = start_job(tmp_path, "trainer.save_freq=2")
    read_until(job, "checkpoint of step 2 written")
    read_until(job, "step 3:")
    os.kill(worker_pid(job.pid, rank=1), signal.SIGKILL)
    killed = time.monotonic()
    output, _ = job.communicate(timeout=120)
    elapsed = time.monotonic() - killed
    assert job.returncode != 0
    assert elapsed < 30, f"the job took {elapsed:.0f}s to end after a rank died"
    assert "rank      : 1" in output or "rank: 1" in output, output[-3000:]  # torchrun names the dead rank
    assert "Signal 9 (SIGKILL)" in output

    latest = int(open(tmp_path / "ckpt" / LATEST).read())
    assert latest in (2, 4)  # step 4's may have been published just before the kill
    assert f"resuming from {step_dir(str(tmp_path / 'ckpt'), latest)}" in resume_to_the_end(tmp_path)
    assert_same_as_reference(tmp_path, reference)


def test_a_crash_while_writing_a_checkpoint_leaves_the_previous_one_in_use(tmp_path, reference):
    # The critic rank dies right after writing its half of step 4: never published.
    job = start_job(tmp_path, "trainer.save_freq=2", script=FAULT_JOB, env={"CRASH_RANK": "1", "CRASH_STEP": "4"})
    output, _ = job.communicate(timeout=240)
    assert job.returncode != 0, output[-3000:]
    ckpt = str(tmp_path / "ckpt")
    assert open(os.path.join(ckpt, LATEST)).read() == "2"
    assert os.path.isdir(partial_dir(ckpt, 4)) and not os.path.exists(step_dir(ckpt, 4))

    assert f"resuming from {step_dir(ckpt, 2)} at step 3" in resume_to_the_end(tmp_path, "trainer.save_freq=2")
    assert_same_as_reference(tmp_path, reference)
    # step 4 was written again, this time whole, and published
    assert open(os.path.join(ckpt, LATEST)).read() == str(STEPS)
    assert sorted(os.listdir(ckpt)) == sorted([LATEST] + [f"global_step_{s}" for s in (2, 4, 6, 8)])
