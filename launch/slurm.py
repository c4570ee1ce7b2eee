"""`python -m launch.slurm [Slurm options] -- [--config FILE] [key=value ...]`

Submits a training job to Slurm from the login node, through submitit. The job runs one Slurm
task per rank (`--ranks-per-node` tasks, by default `--gpus-per-node`, on each of `--nodes`
nodes), each calling `spmdsplit.train.main` in-process; there is no torchrun inside the job:
Slurm is the process manager, so its signals reach every rank directly, and
`srun --kill-on-bad-exit=1` ends the whole job when one rank dies.

Preemption and time limits: Slurm sends SIGUSR2 (`--signal-delay` seconds before the time
limit, or `scancel --signal=USR2`), or SIGTERM (preemption, `scontrol requeue`, scancel). Every
rank then finishes its step, the job writes a checkpoint and `train.main` returns EXIT_STOPPED.
While Slurm still runs the job (SIGUSR2), rank 0 then hands over to submitit, which pickles the
job again (`SlurmTrain.checkpoint`) and requeues it (`scontrol requeue`); after SIGTERM, Slurm
has already requeued (or cancelled) the job and the job leaves it at that. A requeued job
resumes from the latest checkpoint (`trainer.resume=auto`) and runs the remaining steps.

Run it from the repository root: the job unpickles `launch.slurm.SlurmTrain`, so its ranks import
this folder too, from the folder Slurm starts them in (the one the job was submitted from).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import submitit

DEFAULT_FOLDER = "outputs/slurm"
# Sized for the 7B preset (two steps and a checkpoint of ~180 GB; docs/slurm.md says how), and the
# longest delay that submitit still counts as a time-out (not a preemption) whatever --time: its
# window is the last 10 minutes or the last 20% of the time limit, whichever is longer.
DEFAULT_SIGNAL_DELAY_S = 600
# Where the job writes, unless the command line or the --config file says otherwise: all under
# the run folder, which must be on a filesystem that every node sees and that outlives the job
# (the requeued job reads its checkpoints from there).
RUN_PATHS = {
    "trainer.default_local_dir": "checkpoints",
    "trainer.log_dir": "tensorboard",
    "trainer.timeline": "timeline.json",
    "trainer.output_dir": "actor_hf",
}

def slurm_job_states(job_id: str) -> set[str]:
    """The job's state now: slurmctld's own (squeue) while the job is in the queue, the accounting
    database's (sacct) only once it has left it. sacct lags behind slurmctld: on the test cluster
    it still said PENDING 0.5 s after squeue said RUNNING when idle, and in a CI run still once the
    job had trained 10 steps, where that stale PENDING, read as "Slurm has requeued this job",
    kept a preempted job from requeueing itself. The spmdsplit.sbatch template reads squeue alone for the same question."""
    return (_states(["squeue", "-h", "-j", job_id, "-o", "%T"])
            or _states(["sacct", "-X", "-n", "-j", job_id, "-o", "State"]))


def _states(cmd: list[str]) -> set[str]:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return {line.split()[0] for line in out.splitlines() if line.strip()}  # "CANCELLED by 0" -> CANCELLED


def resolvable(host: str) -> bool:
    try:
        socket.getaddrinfo(host, None)
        return True
    except socket.gaierror:
        return False


def node_address(node: str) -> str:
    """Slurm's NodeAddr for a node whose name does not resolve (clusters where NodeName is only
    a label, and the test cluster's several nodes on one machine)."""
    out = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True, text=True, timeout=60).stdout
    found = re.search(r"\bNodeAddr=(\S+)", out)
    if not found:
        raise RuntimeError(f"the first node {node!r} does not resolve and `scontrol show node` gives no NodeAddr")
    return found.group(1)


class SlurmTrain(submitit.helpers.Checkpointable):
    """What every Slurm task of the job runs: one training rank."""

    def __init__(self, train_args: list[str]):
        self.train_args = list(train_args)

    def __call__(self) -> dict:
        from spmdsplit import train

        env = submitit.JobEnvironment()
        # A result this task left before a requeue would make submitit report the task done
        # while the requeued job still runs: it goes now, and the new one replaces it.
        env.paths.result_pickle.unlink(missing_ok=True)
        # RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE from Slurm; MASTER_ADDR = the first node
        # (its NodeAddr if its name does not resolve),
        # MASTER_PORT drawn from the job id (the same after a requeue). CUDA_VISIBLE_DEVICES is left
        # alone: every task sees the node's GPUs and train.py takes cuda:LOCAL_RANK. overwrite:
        # sbatch copies the submitting shell's environment, which may hold a torchrun's RANK.
        dist_env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        if not resolvable(dist_env.master_addr):
            os.environ["MASTER_ADDR"] = node_address(dist_env.master_addr)
        # submitit installed its SIGUSR2 handler before calling us; train.main replaces it with
        # one that only asks the ranks to stop after the step (a step cut short on one rank
        # would leave the others hanging in a collective). Kept to be called once the
        # checkpoint is on disk.
        requeue = signal.getsignal(signal.SIGUSR2)
        code = train.main(self.train_args)
        if code == 0:
            return {"rank": dist_env.rank, "exit_code": 0}
        if code == train.EXIT_STOPPED:
            if dist_env.rank != 0:
                return {"rank": dist_env.rank, "exit_code": code}  # rank 0 requeues the job
            if not callable(requeue):
                raise RuntimeError("spmdsplit stopped and checkpointed, but this task was not started by submitit, "
                                   "so nothing requeues it: submit it again to resume")
            # Requeue only a job that Slurm still runs: SIGUSR2 before the time limit, or a
            # signal sent by hand. scancel, `scontrol requeue` and preemption send SIGTERM and
            # have already moved the job on (CANCELLED, REQUEUED, PREEMPTED, COMPLETING):
            # requeueing a cancelled job would bring it back against the user's will, and a
            # requeued or preempted one is Slurm's to restart.
            ending = slurm_job_states(env.job_id) - {"RUNNING"}
            if not ending:
                print(f"spmdsplit: rank 0 stopped after checkpointing; requeueing Slurm job {env.job_id}", flush=True)
                # submitit 1.5.4's SignalHandler.checkpoint_and_try_requeue (an implementation
                # detail of submitit, checked by tests/test_slurm.py): on global rank 0 it calls
                # self.checkpoint(), pickles the DelayedSubmission it returns, runs
                # `scontrol requeue <job>` and exits (SystemExit); past the time limit more than
                # --max-requeues times it raises UncompletedJobError instead.
                try:
                    requeue(signal.SIGUSR2, None)
                except subprocess.CalledProcessError:
                    ending = slurm_job_states(env.job_id) - {"RUNNING"}  # Slurm moved first
                    if not ending:
                        raise
                else:
                    raise RuntimeError("submitit's SIGUSR2 handler returned without requeuing the job")
            print(f"spmdsplit: stopped after checkpointing; Slurm is ending this run of job {env.job_id} "
                  f"({', '.join(sorted(ending))}), so the job does not requeue itself", flush=True)
            # SystemExit, which submitit does not catch: it then writes no result for this task,
            # and a job that Slurm requeues does not look finished while it waits in the queue.
            sys.exit(0)
        raise RuntimeError(
            f"spmdsplit.train failed on rank {dist_env.rank} with exit code {code} (2 = bad config or data); "
            f"see this rank's log {env.paths.stderr}"
        )

    def checkpoint(self, *args, **kwargs) -> submitit.helpers.DelayedSubmission:
        # The training state is already on disk (train.main wrote it before returning
        # EXIT_STOPPED). The requeued run reruns the same arguments; train.main sees
        # SLURM_RESTART_COUNT > 0 and resumes from the job's latest checkpoint, whatever
        # trainer.resume said (checkpoint_files.find_resume_after_restart).
        return submitit.helpers.DelayedSubmission(type(self)(self.train_args))


def parse_time(text: str) -> int:
    """sbatch's --time formats to whole minutes (submitit needs a number to judge time-outs):
    MIN, MIN:SEC, H:MIN:SEC, D-H, D-H:MIN, D-H:MIN:SEC."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"--time {text!r}: expected minutes, H:MM:SS or D-HH:MM:SS")
    days, a, b, c = (int(x) if x else None for x in m.groups())
    if days is not None:  # D-H, D-H:M, D-H:M:S
        seconds = days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    elif c is not None:  # H:M:S
        seconds = a * 3600 + b * 60 + c
    elif b is not None:  # M:S
        seconds = a * 60 + b
    else:  # M
        seconds = a * 60
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"--time {text!r}: must be positive")
    return max(1, -(-seconds // 60))


def key_value(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not key:
        raise argparse.ArgumentTypeError(f"--sbatch-arg {text!r}: expected KEY=VALUE or KEY")
    return key.lstrip("-"), (value if sep else True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m launch.slurm",
        description="Submit a spmdsplit training job to Slurm (one task per rank) through submitit.",
        epilog="Everything after `--` goes to spmdsplit.train: [--config FILE] [key=value ...].",
    )
    g = p.add_argument_group("allocation (sbatch's names)")
    g.add_argument("-N", "--nodes", type=int, default=1)
    g.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (default 0: a CPU job)")
    g.add_argument("--ranks-per-node", "--ntasks-per-node", type=int, dest="ranks_per_node",
                   help="training ranks = Slurm tasks per node (default: --gpus-per-node; required without GPUs)")
    g.add_argument("-c", "--cpus-per-task", type=int, help="CPU cores per rank")
    g.add_argument("--mem", help="memory per node, e.g. 64G (sbatch --mem)")
    g.add_argument("-p", "--partition")
    g.add_argument("-A", "--account")
    g.add_argument("-q", "--qos")
    g.add_argument("-t", "--time", type=parse_time, default=parse_time("60"),
                   help="time limit per run of the job: minutes, H:MM:SS or D-HH:MM:SS (default 60)")
    g.add_argument("-J", "--job-name", default="spmdsplit")
    g.add_argument("--sbatch-arg", action="append", type=key_value, default=[], metavar="KEY=VALUE",
                   help="any other sbatch option, repeatable: --sbatch-arg constraint=a100 --sbatch-arg exclusive")
    g.add_argument("--srun-arg", action="append", default=[], metavar="ARG",
                   help="an extra srun argument, repeatable: --srun-arg=--cpu-bind=none")
    g.add_argument("--setup", action="append", default=[], metavar="LINE",
                   help="a shell line the batch script runs before srun, repeatable: --setup 'module load cuda'")
    g = p.add_argument_group("run")
    g.add_argument("--folder", default=DEFAULT_FOLDER,
                   help="run folder on a filesystem every node sees: submitit's logs/<job id>/ and, unless the "
                        "train config says otherwise, checkpoints/, tensorboard/, timeline.json, actor_hf/ "
                        f"(default {DEFAULT_FOLDER})")
    g.add_argument("--signal-delay", type=int, default=DEFAULT_SIGNAL_DELAY_S, metavar="SECONDS",
                   help="Slurm sends SIGUSR2 this long before the time limit: the job checkpoints and requeues "
                        "itself (sbatch --signal=USR2@SECONDS). It must cover two steps and a checkpoint; the job "
                        f"warns if not (default {DEFAULT_SIGNAL_DELAY_S}: two 7B steps and a checkpoint, docs/slurm.md)")
    g.add_argument("--max-requeues", type=int, default=3,
                   help="how many times the job may reach its time limit and requeue itself (submitit's "
                        "timeout countdown; preemptions do not count)")
    g.add_argument("--wait", action="store_true", help="follow the job until it ends, then print its log's tail")
    return p


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def with_run_paths(train_args: list[str], folder: Path) -> list[str]:
    """The train arguments, checked here on the login node (a typo fails now, not after the
    queue), plus the run folder's paths for the keys the user left at their defaults."""
    from spmdsplit.config import load_config
    from spmdsplit.errors import ConfigError
    from spmdsplit.preflight import check_config
    from spmdsplit.train import parse_args

    args = parse_args(train_args)
    if args.print_config:
        raise ConfigError("--print-config: run `python -m spmdsplit.train --print-config ...` instead")
    cfg, defaults = load_config(args.config, args.overrides), load_config()
    check_config(cfg)  # the keys together too: the world's checks wait for the job's ranks
    given = {o.partition("=")[0] for o in args.overrides}
    extra = []
    for key, name in RUN_PATHS.items():
        section, leaf = key.split(".")
        if key not in given and cfg[section][leaf] == defaults[section][leaf]:
            extra.append(f"{key}={folder / name}")
    return train_args + extra


def make_executor(args, folder: Path) -> submitit.SlurmExecutor:
    ranks = args.ranks_per_node or args.gpus_per_node
    executor = submitit.SlurmExecutor(folder=folder / "logs" / "%j", max_num_timeout=args.max_requeues)
    params = dict(
        nodes=args.nodes,
        ntasks_per_node=ranks,
        time=args.time,
        job_name=args.job_name,
        signal_delay_s=args.signal_delay,
        # One rank that dies ends the job instead of leaving the others waiting in a collective.
        srun_args=["--kill-on-bad-exit=1", *args.srun_arg],
        # --requeue: `scontrol requeue` and preemption put the job back in the queue.
        additional_parameters={"requeue": True, **dict(args.sbatch_arg)},
    )
    if args.setup:
        params["setup"] = list(args.setup)
    optional = dict(gpus_per_node=args.gpus_per_node or None, cpus_per_task=args.cpus_per_task, mem=args.mem,
                    partition=args.partition, account=args.account, qos=args.qos)
    params.update({k: v for k, v in optional.items() if v is not None})
    executor.update_parameters(**params)
    return executor


def follow(job, poll_s: float = 5.0) -> int:
    """Prints each state change until the job has ended, then the tail of rank 0's log."""
    last = None
    while not job.done():
        state = job.state
        if state != last:
            print(f"launch.slurm: {time.strftime('%H:%M:%S')} job {job.job_id} {state}", flush=True)
            last = state
        time.sleep(poll_s)
    # The ranks' results appear just before their processes end: wait for Slurm to say so too.
    deadline = time.monotonic() + 120
    while (state := job.watcher.get_state(job.job_id, mode="force")) in ("RUNNING", "COMPLETING", "CONFIGURING"):
        if time.monotonic() > deadline:
            break
        time.sleep(1)
    rank0 = job.task(0)
    print(f"launch.slurm: job {job.job_id} {state}; the end of {rank0.paths.stdout}:")
    print("\n".join((rank0.stdout() or "").splitlines()[-15:]))
    try:
        job.results()
    except Exception as e:  # noqa: BLE001 - submitit re-raises whatever the job raised
        # submitit's message is the job's traceback followed by log paths: show the error line.
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        errors = [line for line in lines if re.match(r"[\w.]+(Error|Exception): ", line)]
        print(f"launch.slurm: job {job.job_id} failed: {(errors or lines or [repr(e)])[-1]}", file=sys.stderr)
        print(f"launch.slurm: every rank's log: {rank0.paths.folder}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    from spmdsplit.errors import ConfigError

    ours, train_args = split_argv(sys.argv[1:] if argv is None else list(argv))
    parser = build_parser()
    args = parser.parse_args(ours)
    if not (args.ranks_per_node or args.gpus_per_node):
        parser.error("--ranks-per-node is required without --gpus-per-node (e.g. 2 on CPU)")
    if args.nodes < 1:
        parser.error("--nodes must be at least 1")
    if args.signal_delay >= args.time * 60:
        parser.error(f"--signal-delay {args.signal_delay} s is not shorter than --time ({args.time} min): Slurm would "
                     "signal the job as it starts, and it would stop and requeue itself at once; give a longer "
                     "--time or a shorter --signal-delay")
    folder = Path(args.folder).expanduser().absolute()
    try:
        train_args = with_run_paths(train_args, folder)
    except ConfigError as e:
        print(f"launch.slurm: error: {e}", file=sys.stderr)
        return 2
    job = make_executor(args, folder).submit(SlurmTrain(train_args))
    ranks = args.ranks_per_node or args.gpus_per_node
    print(f"launch.slurm: submitted job {job.job_id}: {args.nodes} node(s) x {ranks} ranks", flush=True)
    print(f"  rank 0 log:  {job.task(0).paths.stdout}  (stderr: {job.task(0).paths.stderr})")
    print(f"  all logs:    {job.paths.folder}")
    print(f"  train args:  {' '.join(train_args)}")
    if args.wait:
        return follow(job)
    return 0


if __name__ == "__main__":
    # Run as `python -m`, this file is __main__; submit through the module imported under its own
    # name so the job pickles `launch.slurm.SlurmTrain` by reference, not `__main__`'s copy.
    from launch import slurm

    sys.exit(slurm.main())
