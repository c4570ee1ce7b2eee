"""`torchrun --nproc-per-node N -m spmdsplit.train [--config FILE] [key=value ...]`

Reads the config, checks it against the launch shape (every rank, before any collective, so a
bad value ends every rank with the same message instead of a hang), joins the world, builds the
pools and runs the PPO loop. `--print-config` prints the resolved config and exits.

Also runs as one Slurm task per rank (`srun python -m spmdsplit.train`, see spmdsplit/launch/): the rank
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
# (vLLM, DeepSpeed) are checked in prepare(), once the config is read.
if __name__ == "__main__" and (_problems := versions.version_problems()):
    print(f"spmdsplit [rank {os.environ.get('RANK', os.environ.get('SLURM_PROCID', 0))}]: error: {_problems[0]}",
          file=sys.stderr, flush=True)
    sys.exit(2)

import torch  # noqa: E402 - after the version check
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from spmdsplit import failure, preempt
from spmdsplit.checkpoint import CheckpointError, ResumeDisagreement, find_resume_after_restart, resume_disagreement
from spmdsplit.cluster import choose_gloo_interface, device_index
from spmdsplit.data.parquet import DataError
from spmdsplit.data.sources import build_rows, format_report
from spmdsplit.agent import check_multi_turn
from spmdsplit.data.synthetic import AGENT_TASKS
from spmdsplit.embedded import ensure_embedded_model
from spmdsplit.models import load_tokenizer
from spmdsplit.metrics import missing_logger
from spmdsplit.rewards.custom import load_custom_reward_fn
from spmdsplit.config import (ConfigError, check_against_placement, check_flash_attn_installed, check_packed_attention,
                              config_warnings, load_config, to_yaml)
from spmdsplit.groups import create_process_groups
from spmdsplit.placement import PlacementError, launch_shape_from_env, plan_from_config
from spmdsplit.rollout.vllm_engine import check_vllm


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


def check_model_path(key: str, path: str, trust_remote_code: bool) -> None:
    """A missing model is found now, on every rank, not by one rank after the others went on."""
    if not path:
        return
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(f"{key}={path!r}: the folder has no config.json (not a Hugging Face model folder)")
        return
    if path.startswith((".", "/", "~")) or os.sep in path.strip("/").replace("/", "", 1):
        raise ConfigError(f"{key}={path!r}: no such folder")
    try:  # a hub id: found in the local cache, or fetched where the hub is reachable
        from transformers import AutoConfig

        AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - any failure here means the same thing to the user
        raise ConfigError(f"{key}={path!r}: not a local folder and not loadable from the Hugging Face hub ({e})") from None


def pick_device(setting: str, local_rank: int) -> torch.device:
    if setting == "cuda" or (setting == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("trainer.device=cuda but CUDA is not available on this machine")
        index = device_index(local_rank, torch.cuda.device_count())  # cuda:0 where one GPU is bound per task
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def prepare(cfg):
    """Everything that can fail without talking to other ranks, the data included, so that bad
    rows stop every rank alike; returns (placement, device, data, checkpoint to resume or None)."""
    problems = versions.version_problems(cfg)  # vLLM and DeepSpeed, when chosen (and the rest, under Slurm)
    if problems:
        raise ConfigError(problems[0])
    missing = missing_logger(cfg.trainer.logger)  # rank 0 alone would import it, mid-job
    if missing:
        raise ConfigError(missing)
    world, local, nnodes = launch_shape_from_env()
    placement = plan_from_config(cfg.placement, world, local, nnodes)
    check_against_placement(cfg, placement)  # the rollout pool's checks (staleness), then batch sizes per pool
    check_model_path("model.path", cfg.model.path, cfg.model.trust_remote_code)
    check_model_path("critic.model_path", cfg.critic.model_path, cfg.model.trust_remote_code)
    check_model_path("reward.model.path", cfg.reward.model.path, cfg.model.trust_remote_code)
    if cfg.reward.custom_fn.path:
        load_custom_reward_fn(cfg.reward.custom_fn.path, cfg.reward.custom_fn.name)  # fails here, on every rank
    device = pick_device(cfg.trainer.device, int(os.environ.get("LOCAL_RANK", 0)))
    check_flash_attn_installed(cfg)
    check_packed_attention(cfg, device.type)  # trainer.device=auto: only now is it known to be cuda
    if not cfg.model.path:
        # Built before the world forms: a file race between ranks, settled by an atomic rename.
        cfg.model.path = ensure_embedded_model(cfg.model.embedded_dir, agent=cfg.data.task in AGENT_TASKS)
    check_vllm(cfg, placement, cfg.model.path, device.type)  # no-op unless rollout.name=vllm
    tokenizer = load_tokenizer(cfg.model.path, cfg.model.trust_remote_code)
    tools = check_multi_turn(cfg, tokenizer)  # the tool config loads here, on every rank, or the job stops
    agents = dict(tools=tools.schemas if tools is not None else None,
                  default_agent=cfg.rollout.agent.default_agent_loop)
    data = {"train": build_rows(cfg.data, tokenizer, "train", **agents)}
    if cfg.trainer.val_freq > 0 or cfg.trainer.val_before_train:
        data["val"] = build_rows(cfg.data, tokenizer, "val", **agents)
    restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    resume_from = find_resume_after_restart(cfg.trainer.resume, cfg.trainer.default_local_dir, restarts)
    return placement, device, data, resume_from


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
    if cfg.rollout.name == "vllm":  # before the trainer's world goes: vLLM's clean-up would take it along
        from spmdsplit.rollout.vllm_engine import shutdown_vllm_distributed

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
            if rank == 0:
                print(to_yaml(cfg), end="")
            return 0
        if rank == 0:
            for warning in config_warnings(cfg):
                print(f"spmdsplit: warning: {warning}", file=sys.stderr, flush=True)
        placement, device, data, resume_from = prepare(cfg)
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
        from spmdsplit.trainer import Trainer

        trainer = Trainer(cfg, groups, {split: rows for split, (rows, _) in data.items()}, resume_from)
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
