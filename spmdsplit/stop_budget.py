"""Is Slurm's warning before the time limit long enough for a clean stop?

Slurm sends SIGUSR2 `--signal-delay` seconds before a job's time limit (sbatch
`--signal=USR2@SECONDS`). The job then finishes the step it is in and the next one (the stop vote,
spmdsplit/preempt.py) and writes a checkpoint: up to two steps and a checkpoint. If those take
longer than the delay, Slurm kills the job at its limit before the checkpoint is on disk, and
the requeued job goes back to the last periodic checkpoint, or to step 1. So rank 0 times each
step and each checkpoint of the run and, the first time the last two steps and the last
checkpoint add up to more than the delay, says so in one line naming `--signal-delay`. The
run's first step (start-up, CUDA graphs, caches) is left out.

The delay comes from Slurm, as sbatch applied it. Slurm shows it in no job record (22.05, the
test cluster's: neither `scontrol show job` nor `squeue --json`), so it is read where sbatch took
it from, in sbatch's order: its command line (sacct's SubmitLine, which the accounting database
records seconds after the job starts: read at the run's third step, and asked again for up to
10 s while it has no record yet), SBATCH_SIGNAL in the submitting environment (which sbatch passes
on to the job), then the batch script's `#SBATCH --signal` lines (`scontrol write batch_script`:
submitit writes its --signal-delay there). A spec without `@` means 60 s. Outside Slurm, or with
none of these, nothing is checked.
"""

from __future__ import annotations

import math
import os
import shlex
import subprocess
import sys
import time

DEFAULT_WARNING_S = 60  # sbatch: "--signal=USR2" without @ sends it 60 s before the limit


def signal_seconds(spec: str) -> int:
    """Seconds before the limit of a --signal spec `[{R|B}:]<sig>[@<time>]`."""
    _, at, seconds = spec.strip().partition("@")
    return int(seconds) if at else DEFAULT_WARNING_S


def signal_option(args: list[str]) -> str | None:
    """The last --signal value among sbatch options (`--signal=SPEC` or `--signal SPEC`)."""
    found = None
    for i, arg in enumerate(args):
        if arg.startswith("--signal="):
            found = arg.partition("=")[2]
        elif arg == "--signal" and i + 1 < len(args):
            found = args[i + 1]
    return found


def command_line_signal(submit_line: str, script: str | None) -> str | None:
    """--signal on sbatch's command line `submit_line`: among the options before the batch script
    (`script`: its path as Slurm's Command= has it; what follows it are the script's own arguments)."""
    try:
        args = shlex.split(submit_line)[1:]
    except ValueError:
        return None
    if script:
        name = os.path.basename(script)
        ends = [i for i, arg in enumerate(args) if os.path.basename(arg) == name]
        args = args[:ends[0]] if ends else args
    return signal_option(args)


def script_signal(script_text: str) -> str | None:
    """--signal in a batch script's #SBATCH lines (sbatch reads them up to the first command)."""
    args = []
    for line in script_text.splitlines()[1:]:
        line = line.strip()
        if line and not line.startswith("#"):
            break
        if line.startswith("#SBATCH"):
            args += shlex.split(line[len("#SBATCH"):], comments=True)
    return signal_option(args)


def _slurm(*cmd: str) -> str | None:
    """The command's output; None when it failed (no such command, no accounting, ...)."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def submit_line(job: str, tries: int = 5, wait_s: float = 2.0) -> str:
    """sbatch's command line from the accounting database, which records a job some seconds
    after it starts (4 s on the test cluster): asked again while it answers with nothing."""
    for attempt in range(tries):
        line = _slurm("sacct", "-X", "-n", "-P", "-j", job, "-o", "SubmitLine")
        if line is None or line.strip():
            return (line or "").strip()
        if attempt + 1 < tries:
            time.sleep(wait_s)
    return ""


def signal_delay_s(env=os.environ) -> int | None:
    """This Slurm job's warning before its time limit, in seconds (None: not under Slurm, or none)."""
    job = env.get("SLURM_JOB_ID")
    if not job:
        return None
    shown = _slurm("scontrol", "show", "job", "-o", job) or ""
    script = next((f.partition("=")[2] for f in shown.split() if f.startswith("Command=")), None)
    for spec in (command_line_signal(submit_line(job), script), env.get("SBATCH_SIGNAL"),
                 script_signal(_slurm("scontrol", "write", "batch_script", job, "-") or "")):
        if spec:
            try:
                return signal_seconds(spec)
            except ValueError:
                return None
    return None


class StopBudget:
    """Rank 0's laps through the loop: `lap("step")` after each step, `lap("checkpoint")` after
    each checkpoint; `read_delay` gives the signal's delay (None: no check, as on other ranks)."""

    def __init__(self, read_delay=signal_delay_s, clock=time.monotonic, out=sys.stderr):
        self.read_delay, self.clock, self.out = read_delay, clock, out
        self.delay: int | None = None
        self.delay_read = False
        self.steps: list[float] = []  # this run's steps, the first left out
        self.checkpoint: float | None = None
        self.first_step_seen = self.warned = False
        self.mark = 0.0

    def start(self) -> None:
        self.mark = self.clock()

    def lap(self, what: str) -> None:
        if self.read_delay is None or self.warned:
            return
        now = self.clock()
        took, self.mark = now - self.mark, now
        if what == "checkpoint":
            self.checkpoint = took
        elif self.first_step_seen:
            self.steps = [*self.steps[-1:], took]
        else:
            self.first_step_seen = True
        if len(self.steps) < 2:
            return
        if not self.delay_read:  # once, at the run's third step: the accounting database has the job by then
            self.delay, self.delay_read = self.read_delay(), True
            self.mark += self.clock() - now  # asking Slurm is not the next step's time
        need = sum(self.steps) + (self.checkpoint or 0.0)
        if self.delay is not None and need > self.delay:
            self.warned = True
            took = " + ".join(f"{s:.0f} s" for s in self.steps) + (
                f" + a checkpoint's {self.checkpoint:.0f} s" if self.checkpoint is not None else " (no checkpoint yet)")
            enough = math.ceil(1.5 * need / 60) * 60
            print(f"spmdsplit: warning: Slurm signals this job {self.delay} s before its time limit, but a clean stop "
                  f"takes up to two steps and a checkpoint, here {took} = {need:.0f} s: at the limit the job would be "
                  f"killed before its checkpoint is written; submit with --signal-delay {enough} "
                  f"(sbatch --signal=USR2@{enough}; 1.5x this run's)", file=self.out, flush=True)
