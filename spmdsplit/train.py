"""`torchrun --nproc-per-node N -m spmdsplit.train [--config FILE] [key=value ...]`

Reads the config, starts (`start`: every start-up check of spmdsplit/preflight.py and the actions
between them, on every rank before any collective, so a bad value ends every rank with the same
message instead of a hang), joins the world, builds the pools and runs the PPO loop. `--print-config` prints the resolved config and exits.

Also runs as one Slurm task per rank (`srun python -m spmdsplit.train`, see the repository's launch/): the rank
comes from SLURM_PROCID when torchrun's variables are absent. Exit codes: 0 done, 2 bad config
or data, 75 (EXIT_STOPPED) stopped early on SIGUSR2/SIGTERM after writing a checkpoint.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import warnings
from datetime import timedelta

from spmdsplit import versions

# Before the imports below: an older transformers may not even import. The job's own choices
# (vLLM, DeepSpeed) are checked in start(), once the config is read.
if __name__ == "__main__" and (_problems := versions.version_problems()):
    print(f"spmdsplit [rank {os.environ.get('RANK', os.environ.get('SLURM_PROCID', 0))}]: error: {_problems[0]}",
          file=sys.stderr, flush=True)
    sys.exit(2)

import torch  # noqa: E402 - after the version check
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from spmdsplit import failure, preempt
from spmdsplit.agent import check_harness, check_multi_turn, default_agent, environment_tools
from spmdsplit.checkpoint_files import CheckpointError, ResumeDisagreement, find_resume_after_restart, resume_disagreement
from spmdsplit.cluster import choose_gloo_interface, device_index
from spmdsplit.config import config_warnings, load_config, to_yaml
from spmdsplit.data.parquet import DataError
from spmdsplit.data.sources import build_rows, format_report
from spmdsplit.data.synthetic import AGENT_TASKS
from spmdsplit.embedded import ensure_embedded_model
from spmdsplit.errors import ConfigError
from spmdsplit.groups import create_process_groups
from spmdsplit.models import load_tokenizer
from spmdsplit.placement import PlacementError
from spmdsplit.preflight import check_config, check_device, check_job, check_judge_fits, check_model


EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped on request, checkpoint written; run again to go on


def env_from_slurm(env=os.environ) -> None:
    """Under `srun` without torchrun: torchrun's variables from Slurm's. MASTER_ADDR/PORT must
    come from the batch script (the first node of the allocation) when there are several nodes."""
    if "RANK" in env or "SLURM_PROCID" not in env:
        return
    tasks = int(env["SLURM_NTASKS"])
    nodes = int(env.get("SLURM_NNODES", 1))
    env.update(RANK=env["SLURM_PROCID"], WORLD_SIZE=str(tasks), LOCAL_RANK=env.get("SLURM_LOCALID", "0"),
               LOCAL_WORLD_SIZE=str(tasks // nodes))
    if nodes == 1:
        env.setdefault("MASTER_ADDR", "127.0.0.1")
    elif "MASTER_ADDR" not in env:
        raise ConfigError("running under Slurm on several nodes without torchrun: export MASTER_ADDR (the first "
                          "node, e.g. $(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)) and MASTER_PORT")


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="spmdsplit.train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="a YAML preset (see configs/); keys are overridden by key=value")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.total_steps=10")
    # Intermixed: overrides may come before and after --config (a launcher script adds its own
    # key=value in front of the user's line); plain parse_args stops taking them at the option.
    return parser.parse_intermixed_args(argv)


def pick_device(setting: str, local_rank: int) -> torch.device:
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("trainer.device=cuda but CUDA is not available on this machine")
        index = device_index(local_rank, torch.cuda.device_count())  # cuda:0 where one GPU is bound per task
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def start(cfg):
    """Everything before the world forms, on every rank, in one order: the start-up checks
    (spmdsplit/preflight.py, whose docstring lists them) and the actions they wait for, the data
    included, so that bad input stops every rank alike. Returns (placement, device, data,
    checkpoint to resume or None, start-up lines for rank 0 to print). Fills model.path with the
    embedded model's folder when empty."""
    placement = check_job(cfg)
    device = pick_device(cfg.trainer.device, int(os.environ.get("LOCAL_RANK", 0)))
    check_device(cfg, device.type)
    if not cfg.model.path:
        # Built before the world forms: a file race between ranks, settled by an atomic rename.
        cfg.model.path = ensure_embedded_model(cfg.model.embedded_dir, agent=cfg.data.task in AGENT_TASKS)
    check_model(cfg, placement, device.type)
    check_judge_fits(cfg, device)
    tokenizer = load_tokenizer(cfg.model.path, cfg.model.trust_remote_code)
    tools = check_multi_turn(cfg, tokenizer)  # the tool config loads here, on every rank, or the job stops
    check_harness(cfg)
    agents = dict(tools=tools.schemas if tools is not None else None, default_agent=default_agent(cfg),
                  environment_tools=environment_tools(cfg) if tools is not None else None)
    data = {"train": build_rows(cfg.data, tokenizer, "train", **agents)}
    if cfg.trainer.val_freq > 0 or cfg.trainer.val_before_train:
        data["val"] = build_rows(cfg.data, tokenizer, "val", **agents)
    notes = [line for line in [code_sandbox(cfg, data)] if line]
    restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    resume_from = find_resume_after_restart(cfg.trainer.resume, cfg.trainer.default_local_dir, restarts)
    return placement, device, data, resume_from, notes


def code_sandbox(cfg, data) -> str:
    """Where the rewards run programs in the rank's sandbox: its isolation, probed on every rank
    (reward.sandbox.isolation=namespaces where the kernel refuses them stops the job here), as the
    line rank 0 prints; "" otherwise."""
    from spmdsplit.rewards.calls import runs_code_in_sandbox

    sources = {row["data_source"] for rows, _ in data.values() for row in rows}
    if not runs_code_in_sandbox(cfg.reward, sources):
        return ""
    from spmdsplit.sandbox import Sandbox, SandboxError

    try:
        return Sandbox.from_config(cfg.reward.sandbox).describe()
    except SandboxError as e:
        raise ConfigError(str(e)) from None


def agree_on_resume(resume_from: str | None, group) -> None:
    """Every rank chose its checkpoint alone, from its own view of trainer.default_local_dir, before
    the world formed; a node whose filesystem lags behind (a pointer or folder not there yet) would
    resume from another step, or start afresh, and the pools' first exchange would mismatch or
    hang. So, once the world has formed and before any pool's work: one gather of the choices over
    the control group (gloo, the long timeout), and the same verdict on every rank."""
    choices = [None] * dist.get_world_size(group)
    dist.all_gather_object(choices, resume_from, group=group)
    disagreement = resume_disagreement(choices)
    if disagreement:
        raise ResumeDisagreement(disagreement)


def leave_vllm(cfg) -> None:
    from spmdsplit.groups import vllm_engines

    if vllm_engines(cfg):  # before the trainer's world goes: vLLM's clean-up would take it along
        from spmdsplit.inference.vllm_engine import shutdown_vllm_distributed

        shutdown_vllm_distributed()


def quiet_libraries(rank: int) -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()  # load reports x every rank x every model
    transformers.utils.logging.disable_progress_bar()
    # FSDP2 warns that HF returns views of its outputs; only in-place ops on them are unsafe,
    # and the roles never do those.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


@record  # torchrun then shows this rank's traceback in its failure summary
def main(argv=None) -> int:
    # A rank that dies in native code (a segfault in a kernel or a collective) prints every
    # thread's Python stack before it goes: torchrun alone would report only "exitcode: -11".
    faulthandler.enable()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))
    try:
        env_from_slurm()
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            check_config(cfg)  # a config whose keys cannot work together is not printed
            if rank == 0:
                print(to_yaml(cfg), end="")
            return 0
        if rank == 0:
            for warning in config_warnings(cfg):
                print(f"spmdsplit: warning: {warning}", file=sys.stderr, flush=True)
        placement, device, data, resume_from, notes = start(cfg)
    except (ConfigError, PlacementError, DataError, CheckpointError) as e:
        print(f"spmdsplit [rank {rank}]: error: {e}", file=sys.stderr, flush=True)
        return 2

    if cfg.trainer.num_threads > 0 and device.type == "cpu":
        torch.set_num_threads(cfg.trainer.num_threads)
    quiet_libraries(rank)
    preempt.install_handlers()  # from here on, SIGUSR2/SIGTERM mean "checkpoint and stop", not "die now"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # a plain single-process `python -m` run
    os.environ.setdefault("MASTER_PORT", "29512")
    gloo_line = choose_gloo_interface(placement.nnodes)  # before any gloo group: GLOO_SOCKET_IFNAME
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, rank=rank, world_size=placement.world_size, timeout=timedelta(seconds=cfg.trainer.dist_timeout_s)
    )
    role = placement.pool_label(rank) + " pool"
    # From here on an error ends the whole job at once: spmdsplit/failure.py.
    failure.start_watch(rank, role)
    try:
        groups = create_process_groups(cfg, placement, device)  # every group of the job, in one order
        agree_on_resume(resume_from, groups.control)
        if rank == 0:
            print(f"spmdsplit: {placement.describe()}; device={device.type}, backend={backend}"
                  + (f"; {gloo_line}" if gloo_line else ""), flush=True)
            for _, data_report in data.values():
                print(f"spmdsplit: {format_report(data_report, cfg.data.max_prompt_length)}", flush=True)
            for note in notes:
                print(f"spmdsplit: {note}", file=sys.stderr if note.startswith("WARNING") else sys.stdout, flush=True)
        from spmdsplit.builder import build
        from spmdsplit.trainer import Trainer

        trainer = Trainer(cfg, build(cfg, groups, {split: rows for split, (rows, _) in data.items()}, resume_from))
        completed = trainer.fit()
        if completed:
            trainer.reports.summary()
        leave_vllm(cfg)
    except ResumeDisagreement as e:  # every rank has the same answer: they leave together, one line said
        failure.stop_watch()
        if rank == 0:
            print(f"spmdsplit: error: {e}", file=sys.stderr, flush=True)
        leave_vllm(cfg)
        dist.destroy_process_group()
        return 2
    except BaseException as e:  # noqa: BLE001 - any error, a KeyboardInterrupt too, ends every rank now
        failure.fail(e, rank, role)
    failure.stop_watch()
    dist.destroy_process_group()  # nothing is pending now: every rank passed the trainer's last barrier
    if not completed:
        if rank == 0:
            print(f"spmdsplit: stopped on request; run the same command again to resume "
                  f"(trainer.resume=auto reads {cfg.trainer.default_local_dir})", flush=True)
        return EXIT_STOPPED
    return 0


if __name__ == "__main__":
    sys.exit(main())
