"""Real Slurm: a one-node cluster on localhost (tools/cluster/slurm_cluster.sh: munged, MariaDB, slurmdbd,
slurmctld, slurmd; installed from Debian's packages when missing, which needs root) runs real
training jobs submitted the way users submit them: `python -m launch.slurm` (submitit)
and `sbatch launch/spmdsplit.sbatch`. Each job is 2 ranks (1+1) on the 4 CPUs the node declares.

The preemption tests signal a running job as Slurm does and check from Slurm's accounting
(sacct -D lists every run of a requeued job), the logs, the checkpoints and TensorBoard that it
stopped after a step, requeued itself, resumed from its checkpoint and ended with every step.
"""

from __future__ import annotations

import io
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from launch import slurm as launcher
from spmdsplit.stop_budget import StopBudget, command_line_signal, script_signal, signal_seconds
from tests.support.outputs import scalars

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "tools" / "cluster" / "slurm_cluster.sh"
TINY = ["data.train_batch_size=16", "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8",
        "actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4", "trainer.progress_bar=false"]
# More than 10 minutes: submitit counts a signal in the last 10 minutes of a job's time limit as a
# time-out (its countdown), not a preemption.
TIME = "20"


def ports_free(base: int, n: int = 6) -> bool:
    for port in range(base, base + n):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


@pytest.fixture(scope="session")
def slurm_cluster():
    """A fresh cluster for the session, its state in a temporary folder and its ports free ones,
    so a developer's own cluster (or a second session) is left alone; stopped at the end. Two
    nodes (two slurmds on this machine, 4 CPUs each), so multi-node jobs run for real."""
    # Not under pytest's tmp folder: that one is private to root, and munged and mariadbd run as
    # their own users.
    state = Path(tempfile.mkdtemp(prefix="spmdsplit-slurm-"))
    state.chmod(0o755)
    base = next(b for b in (random.randrange(15000, 19000) for _ in range(100)) if ports_free(b))
    env = {**os.environ, "SPMDSPLIT_SLURM_PORT": str(base), "SPMDSPLIT_SLURM_NODES": "2"}
    t0 = time.monotonic()
    started = subprocess.run(["bash", str(CLUSTER), "start", str(state)], env=env, capture_output=True, text=True,
                             timeout=600)
    print(f"slurm cluster: start took {time.monotonic() - t0:.1f}s", file=sys.stderr)
    if started.returncode != 0:
        subprocess.run(["bash", str(CLUSTER), "stop", str(state)], env=env, timeout=120)
        pytest.fail(f"could not start the Slurm cluster:\n{started.stdout}\n{started.stderr}")
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(state / "slurm.conf")  # for sbatch/sacct/scontrol and submitit
    try:
        yield state
    finally:
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
        stopped = subprocess.run(["bash", str(CLUSTER), "stop", str(state)], env=env, capture_output=True, text=True,
                                 timeout=120)
        assert stopped.returncode == 0, stopped.stderr
        shutil.rmtree(state, ignore_errors=True)


def job_env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def launch(folder: Path, *args: str, timeout: float, nodes: int = 1) -> tuple[subprocess.CompletedProcess, str]:
    """`python -m launch.slurm` as a user types it from the repository root, 2 ranks on `nodes`
    nodes; returns the result and the job id."""
    cmd = [sys.executable, "-m", "launch.slurm", "--nodes", str(nodes), "--ranks-per-node", str(2 // nodes),
           "--time", TIME, "--folder", str(folder), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=job_env(), cwd=REPO)
    found = re.search(r"submitted job (\d+)", out.stdout)
    assert found, out.stdout + out.stderr
    return out, found.group(1)


def slurm_runs(job_id: str) -> list[str]:
    """The state of every run of the job, oldest first (a requeued run shows as REQUEUED)."""
    out = subprocess.run(["sacct", "-D", "-X", "-n", "-P", "-j", job_id, "-o", "State"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def wait_until(what: str, check, timeout: float, job_id: str, log: Path | None = None, poll: float = 0.3):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(poll)
    subprocess.run(["scancel", job_id], timeout=60)
    tail = log.read_text()[-4000:] if log and log.exists() else ""
    pytest.fail(f"job {job_id}: {what} not seen within {timeout:.0f}s; sacct: {slurm_runs(job_id)}\n{tail}")


def steps_logged(log: Path, after: int = 0) -> list[int]:
    """Steps rank 0 printed after the `after`-th resume (0: from the start)."""
    text = log.read_text() if log.exists() else ""
    part = re.split(r"^spmdsplit: resuming from .*$", text, flags=re.M)
    return [int(s) for s in re.findall(r"^step (\d+):", part[after], re.M)] if len(part) > after else []


def resumes(log: Path) -> list[tuple[int, int]]:
    """(checkpoint step, first step run) for every resume rank 0 printed."""
    text = log.read_text() if log.exists() else ""
    return [(int(a), int(b)) for a, b in re.findall(r"^spmdsplit: resuming from \S*global_step_(\d+) at step (\d+)",
                                                    text, re.M)]


def signal_delay_warnings(log: Path) -> list[str]:
    """The lines where a job said its --signal-delay is too short for a clean stop."""
    return [line for line in log.read_text().splitlines() if "--signal-delay" in line]


def assert_every_step_once(folder_tb: Path, total: int):
    logged = scalars(str(folder_tb))
    steps = [s for s, _ in logged["critic/score/mean"]]
    assert steps == list(range(1, total + 1)), f"TensorBoard steps: {steps}"


# -- the launcher's command line, no cluster needed ---------------------------------------------------------------


@pytest.mark.parametrize("text, minutes", [("90", 90), ("1:30", 2), ("2:00:00", 120), ("1-0", 1440),
                                            ("1-2:30", 1590), ("0-0:0:30", 1)])
def test_time_limit_in_sbatch_formats_becomes_minutes(text, minutes):
    assert launcher.parse_time(text) == minutes


def test_run_folder_paths_fill_only_the_keys_left_at_their_defaults(tmp_path):
    preset = tmp_path / "preset.yaml"
    preset.write_text("trainer:\n  log_dir: /shared/tb\n")
    given = ["--config", str(preset), "trainer.output_dir=/shared/hf"]
    args = launcher.with_run_paths(given, tmp_path / "run")
    assert args[:3] == given
    assert args[3:] == [f"trainer.default_local_dir={tmp_path}/run/checkpoints",
                        f"trainer.timeline={tmp_path}/run/timeline.json"]


def test_bad_override_fails_on_the_login_node_before_submitting(tmp_path, capsys):
    code = launcher.main(["--ranks-per-node", "2", "--folder", str(tmp_path), "--", "trainer.no_such_key=1"])
    assert code == 2
    assert "trainer.no_such_key" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()


def test_the_requeued_job_reruns_the_submitted_arguments():
    """Requeued through submitit, the job reruns what was submitted; train.main itself turns a
    restarted run towards the job's latest checkpoint (tests/test_checkpoint.py)."""
    submitted = ["trainer.resume=/somewhere/global_step_3", "trainer.total_steps=9"]
    assert launcher.SlurmTrain(submitted).checkpoint().function.train_args == submitted


def fake_slurm_commands(monkeypatch, folder: Path, **printed: str) -> None:
    """`squeue`/`sacct` found first on PATH, scripts that print the given text."""
    for name, text in printed.items():
        script = folder / name
        script.write_text(f"#!/bin/sh\nprintf '{text}'\n")
        script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")


def test_the_job_state_is_slurmctlds_while_the_job_is_queued(tmp_path, monkeypatch):
    """sacct lags behind slurmctld (PENDING for a job squeue already runs: a CI run saw it once
    the job had trained 10 steps, and the job then did not requeue itself after a preemption),
    which no real cluster here produces on demand; so fake commands print what each said then."""
    fake_slurm_commands(monkeypatch, tmp_path, squeue="RUNNING\\n", sacct="   PENDING \\n")
    assert launcher.slurm_job_states("7") == {"RUNNING"}
    # Once the job has left the queue, the database is all there is.
    fake_slurm_commands(monkeypatch, tmp_path, squeue="", sacct="CANCELLED by 0\\n")
    assert launcher.slurm_job_states("7") == {"CANCELLED"}


def test_cpu_job_needs_ranks_per_node(tmp_path):
    with pytest.raises(SystemExit):
        launcher.main(["--folder", str(tmp_path)])


def test_a_signal_delay_as_long_as_the_time_limit_is_refused(tmp_path, capsys):
    """Slurm would signal such a job as it starts: it would stop and requeue itself at once."""
    with pytest.raises(SystemExit):
        launcher.main(["--ranks-per-node", "2", "--time", "10", "--folder", str(tmp_path)])  # the default 600 s
    assert "--signal-delay 600 s is not shorter than --time (10 min)" in capsys.readouterr().err


# -- the signal's delay against two steps and a checkpoint ---------------------------------------------------------


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def run_laps(laps: list[tuple[str, float]], delay: int | None) -> str:
    """A StopBudget through `laps` (what, seconds), the delay Slurm gives; returns what it printed."""
    clock, out = Clock(), io.StringIO()
    budget = StopBudget(None if delay is None else (lambda: delay), clock=clock, out=out)
    budget.start()
    for what, seconds in laps:
        clock.now += seconds
        budget.lap(what)
    return out.getvalue()


def test_two_steps_and_a_checkpoint_longer_than_the_signals_delay_warn_once_in_one_line():
    # The first step (start-up) is left out; then steps of 100 s and a checkpoint of 300 s: 500 s > 120 s.
    laps = [("step", 900), ("step", 100), ("checkpoint", 300), ("step", 100), ("step", 100), ("step", 100)]
    printed = run_laps(laps, 120)
    assert printed.count("\n") == 1 and printed.count("--signal-delay") == 1
    assert printed == ("spmdsplit: warning: Slurm signals this job 120 s before its time limit, but a clean stop takes "
                       "up to two steps and a checkpoint, here 100 s + 100 s + a checkpoint's 300 s = 500 s: at the "
                       "limit the job would be killed before its checkpoint is written; submit with --signal-delay 780 "
                       "(sbatch --signal=USR2@780; 1.5x this run's)\n")
    assert run_laps(laps, 600) == ""  # 500 s fit
    assert run_laps(laps, None) == ""  # not under Slurm (and every rank but 0)
    assert "signals this job 0 s before" in run_laps(laps, 0)  # --signal=USR2@0: at the limit itself
    assert run_laps([("step", 900), ("step", 100)], 120) == ""  # one step after the first: nothing to judge yet
    assert "here 100 s + 100 s (no checkpoint yet) = 200 s" in run_laps([("step", 9), ("step", 100), ("step", 100)], 150)


def test_the_signals_delay_is_read_as_sbatch_applied_it():
    assert signal_seconds("USR2@600") == 600 and signal_seconds("B:USR2@90") == 90 and signal_seconds("USR2") == 60
    script = "#!/bin/bash\n#SBATCH --time=20\n#SBATCH --signal=USR2@600  # before the limit\n\necho\n#SBATCH --signal=USR2@1\n"
    assert script_signal(script) == "USR2@600"  # sbatch stops reading #SBATCH lines at the first command
    # The command line's option, not the batch script's arguments after it; both spellings.
    line = "sbatch --parsable -o out/%j.out --signal USR2@900 run/spmdsplit.sbatch --signal=USR2@5 trainer.x=1"
    assert command_line_signal(line, "/home/u/run/spmdsplit.sbatch") == "USR2@900"
    assert command_line_signal("sbatch --signal=USR2@30 --wrap 'python x.py'", None) == "USR2@30"
    assert command_line_signal("sbatch /home/u/job.sh", "/home/u/job.sh") is None


def test_gpu_presets_save_periodically_and_keep_few_checkpoints():
    """A 7B job killed before its stop's checkpoint (past KillWait) must not go back to step 1; and
    checkpoints of ~180 GB are not kept by the dozen."""
    from spmdsplit.config import load_config

    presets = sorted((REPO / "configs").glob("gpu_*.yaml"))
    assert presets
    for preset in presets:
        trainer = load_config(str(preset)).trainer
        assert 0 < trainer.save_freq <= 50 and 0 < trainer.max_ckpt_to_keep <= 3, preset.name


# -- real jobs on the cluster -----------------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_launcher_job_runs_to_the_end_with_tensorboard_and_checkpoints(slurm_cluster, tmp_path):
    folder = tmp_path / "run"
    # No warning before the time limit (USR2 at the limit itself): less than any two steps, which the
    # job reads from its batch script (submitit writes --signal there) and says once.
    out, job_id = launch(folder, "--signal-delay", "0", "--wait", "--", *TINY, "trainer.total_steps=6",
                         "trainer.save_freq=3", timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    assert slurm_runs(job_id) == ["COMPLETED"]
    warnings = signal_delay_warnings(folder / "logs" / job_id / f"{job_id}_0_log.err")
    assert len(warnings) == 1 and "Slurm signals this job 0 s before its time limit" in warnings[0], warnings

    assert_every_step_once(folder / "tensorboard", 6)
    ckpt = folder / "checkpoints"
    assert int((ckpt / "latest_checkpointed_iteration.txt").read_text()) == 6
    assert (ckpt / "global_step_3").is_dir() and (ckpt / "global_step_6").is_dir()
    assert (folder / "actor_hf" / "config.json").is_file()

    # One Slurm task per rank, the warning signal, requeue allowed, a dead rank ends the job.
    script = (folder / "logs" / job_id / f"{job_id}_submission.sh").read_text()
    for flag in ("--nodes=1", "--ntasks-per-node=2", "--signal=USR2@0", "--requeue", "--time=20",
                 "srun --unbuffered", "--kill-on-bad-exit=1"):
        assert flag in script, flag
    for rank in (0, 1):
        assert f"global_rank={rank}(2)" in (folder / "logs" / job_id / f"{job_id}_{rank}_log.out").read_text()


@pytest.mark.e2e
@pytest.mark.timeout(540)
def test_preempted_job_requeues_itself_resumes_and_ends_with_every_step(slurm_cluster, tmp_path):
    """Two preemptions of one 2-node job (one rank per node: actor pool on node 0, critic pool on
    node 1): submitit's (scancel --signal SIGTERM, then USR2: the job requeues itself through
    submitit's checkpointing) and Slurm's own (`scontrol requeue`: SIGTERM, Slurm requeues the
    job, and its tasks have KillWait=5 s to checkpoint)."""
    import submitit

    folder, total = tmp_path / "run", 24
    out, job_id = launch(folder, "--", *TINY, f"trainer.total_steps={total}", timeout=120, nodes=2)
    assert out.returncode == 0, out.stdout + out.stderr
    job = submitit.SlurmJob(folder=folder / "logs" / "%j", job_id=job_id, tasks=(0, 1))
    log = folder / "logs" / job_id / f"{job_id}_0_log.out"
    times = {"submitted": time.monotonic()}

    wait_until("step 3", lambda: 3 in steps_logged(log), 240, job_id, log)
    times["signal 1"] = time.monotonic()
    job._interrupt()  # submitit's preemption, for testing: SIGTERM then SIGUSR2 to every rank
    first = wait_until("the first resume", lambda: resumes(log), 120, job_id, log)[0]
    times["resume 1"] = time.monotonic()
    seen_before = steps_logged(log)
    assert first[0] >= 3 and first[1] == first[0] + 1, (first, seen_before)
    assert seen_before == list(range(1, first[0] + 1)), "the first run stopped right after its checkpoint step"

    wait_until(f"step {first[0] + 3}", lambda: first[0] + 3 in steps_logged(log, after=1), 120, job_id, log)
    times["signal 2"] = time.monotonic()
    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60)
    second = wait_until("the second resume", lambda: resumes(log)[1:], 120, job_id, log)[0]
    times["resume 2"] = time.monotonic()
    assert second[0] >= first[0] + 3 and second[1] == second[0] + 1, (first, second)

    wait_until("the end", lambda: job.done() and slurm_runs(job_id)[-1] == "COMPLETED", 240, job_id, log, poll=1)
    times["completed"] = time.monotonic()
    assert job.results() == [{"rank": 0, "exit_code": 0}, {"rank": 1, "exit_code": 0}]
    assert slurm_runs(job_id) == ["REQUEUED", "REQUEUED", "COMPLETED"]
    assert steps_logged(log, after=2) == list(range(second[1], total + 1))
    assert_every_step_once(folder / "tensorboard", total)

    text = log.read_text()
    assert text.count("(1+1 nodes x 1)") == 3, "every run split the two nodes into the two pools"
    # The default delay (600 s) covers two of these steps and a checkpoint: no warning in any run.
    assert signal_delay_warnings(log.with_suffix(".err")) == []
    # After the first stop rank 0 handed over to submitit, whose handler requeued the job (its
    # own log line); after the second, Slurm had requeued it already.
    assert text.count("requeueing Slurm job") == 1 and text.count("Requeued job") == 1, text[-4000:]
    assert text.count("so the job does not requeue itself") == 1
    marks = list(times.items())
    print(f"job {job_id}: stopped at step {first[0]} and {second[0]} of {total}; "
          + ", ".join(f"{k} +{t - marks[0][1]:.1f}s" for k, t in marks[1:]), file=sys.stderr)


@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_sbatch_template_stops_checkpoints_and_requeues_itself(slurm_cluster, tmp_path):
    """The plain template on 2 nodes: SIGUSR2 as Slurm sends it before the time limit (--signal,
    here by scancel), every rank stops with a checkpoint, the script requeues the job, which
    resumes. Submitted with --signal=USR2@0 over the script's 600 s: the job reads sbatch's command
    line from Slurm's accounting and warns that no time is too short, once per run."""
    total, run = 16, tmp_path / "run"
    paths = [f"trainer.default_local_dir={run}/checkpoints", f"trainer.log_dir={run}/tensorboard",
             f"trainer.timeline={run}/timeline.json", f"trainer.output_dir={run}/actor_hf"]
    run.mkdir()
    submitted = subprocess.run(
        ["sbatch", "--parsable", f"--output={run}/%j.out", "--time=20", "--signal=USR2@0", "--nodes=2",
         "--ntasks-per-node=1",
         str(REPO / "launch" / "spmdsplit.sbatch"),
         *TINY, f"trainer.total_steps={total}", *paths],
        capture_output=True, text=True, timeout=60, cwd=run, env={**job_env(), "PYTHON": sys.executable},
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    log = run / f"{job_id}.out"

    wait_until("step 3", lambda: 3 in steps_logged(log), 240, job_id, log)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=60)
    ended = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
    wait_until("the end", lambda: set(slurm_runs(job_id)[-1:]) & ended, 300, job_id, log, poll=1)
    text = log.read_text()
    assert slurm_runs(job_id) == ["REQUEUED", "COMPLETED"], text[-3000:]
    (resumed,) = resumes(log)
    assert resumed[0] >= 3
    assert "stopped with a checkpoint; requeueing job" in text and "(restart 1)" in text
    assert text.count("2 ranks on 2 node(s)") == 2 and text.count("(1+1 nodes x 1)") == 2
    assert_every_step_once(run / "tensorboard", total)
    warnings = signal_delay_warnings(log)
    assert len(warnings) == 2 and all("Slurm signals this job 0 s before" in w for w in warnings), warnings


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_cancelled_job_checkpoints_and_stays_cancelled(slurm_cluster, tmp_path):
    """scancel sends SIGTERM too: the ranks still stop after a step with a checkpoint (to resume
    by hand), but the job must not requeue itself against the user's will."""
    folder = tmp_path / "run"
    out, job_id = launch(folder, "--", *TINY, "trainer.total_steps=40", timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    log = folder / "logs" / job_id / f"{job_id}_0_log.out"
    wait_until("step 3", lambda: 3 in steps_logged(log), 240, job_id, log)
    subprocess.run(["scancel", job_id], check=True, timeout=60)

    def gone():
        queued = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=60)
        return not queued.stdout.strip()

    wait_until("the job leaving the queue", gone, 120, job_id, log, poll=1)
    assert slurm_runs(job_id) == ["CANCELLED"]
    text = log.read_text()
    assert "so the job does not requeue itself" in text, text[-3000:]
    (step,) = re.findall(r"^spmdsplit: checkpoint of step (\d+) written", text, re.M)
    assert int((folder / "checkpoints" / "latest_checkpointed_iteration.txt").read_text()) == int(step) >= 3
