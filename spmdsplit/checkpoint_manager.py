"""When a checkpoint is written and what goes in it, on every rank: the trainer asks `due` after each
step and calls `save`, and `load` once before the first step of a resumed run. The folders, the
files and their atomic publishing are spmdsplit/checkpoint_files.py's (which needs no process group, so
train.py can choose the checkpoint to resume from before the world forms).

What a rank writes, for each role group it runs a program of: inside the group's pool, its
rank_<r>.pt (the step, the RNG, dynamic sampling's data position, the program's `state`) and the
program's engine (DCP, every rank of the pool); world rank 0 publishes once every other pool's
first rank says its parts are on disk (a point-to-point message: no collective on the world)."""

from __future__ import annotations

import os
import shutil
import time

import torch
from omegaconf import OmegaConf

from spmdsplit import checkpoint_files
from spmdsplit.data.prompts import PromptDataset
from spmdsplit.dynamic_sampling import DynamicSampling
from spmdsplit.messages import PoolChannel
from spmdsplit.groups import Pools
from spmdsplit.programs import Program
from spmdsplit.reporting import Reports, other_pools
from spmdsplit.seeds import sampling_seed
from spmdsplit.stop_at_score import ScoreTarget
from spmdsplit.timing import PhaseTimer


def save_due(step: int, stop: bool, save_freq: int, last: bool) -> bool:
    """A checkpoint after `step`: every trainer.save_freq steps and after the last (save_freq > 0;
    `last`: trainer.total_steps, or the step the run ends at for its target score), and whenever
    the ranks voted to stop (spmdsplit/preempt.py), whatever save_freq says."""
    return stop or (save_freq > 0 and (step % save_freq == 0 or last))


def seed_sampling(seed: int, rank: int, after_step: int = 0) -> None:
    """Sampling must differ between ranks (else every shard draws the same responses); a resume
    that cannot restore the RNG state (other pool sizes) seeds from the step too."""
    torch.manual_seed(sampling_seed(seed, rank, after_step))


class CheckpointManager:
    def __init__(self, cfg, pools: Pools, channel: PoolChannel, timer: PhaseTimer, programs: dict[str, Program],
                 sampler: DynamicSampling | None, dataset: PromptDataset, reports: Reports, score_target: ScoreTarget):
        """`programs`: this rank's, by role group (those with a part: Program.checkpointed); `sampler`: dynamic sampling on a generating rank;
        `reports`: rank 0 logs the steps up to a checkpoint's before publishing it; `score_target`:
        trainer.stop_at_score's window, kept with the critic group's part."""
        self.cfg, self.pools, self.channel, self.timer = cfg, pools, channel, timer
        self.programs = {group: program for group, program in programs.items() if program.checkpointed}
        self.sampler, self.dataset, self.reports = sampler, dataset, reports
        self.score_target = score_target
        self.placement, self.rank = pools.placement, pools.rank
        self.other_pools = other_pools(self.placement)  # their first ranks say "written" to rank 0
        self.layout = self.placement.layout  # written into meta.json, compared on a resume (the same layout?)

    def due(self, step: int, stop: bool, last: bool) -> bool:
        return save_due(step, stop, self.cfg.trainer.save_freq, last)

    def rank_state(self, group: str, step: int) -> dict:
        state = {"step": step, "rng": checkpoint_files.rng_state(self.pools.device), **self.programs[group].state(step)}
        if group == "critic":  # the ranks that hold the score's window (trainer.stop_at_score)
            state["score_target"] = self.score_target.state_dict()
        if self.sampler:  # dynamic sampling's data position (and where the steps generated ahead began)
            state["dynamic_sampling"] = self.sampler.state_dict()
        return state

    def save(self, step: int) -> None:
        """Each role group's program writes its part inside its pool's group; world rank 0 publishes
        the whole once every other pool's first rank says its parts are on disk."""
        cfg, placement, pools = self.cfg, self.placement, self.pools
        root = cfg.trainer.default_local_dir
        partial = checkpoint_files.partial_dir(root, step)
        for group, program in self.programs.items():
            leader = placement.ranks(group)[0]
            folder = os.path.join(partial, group)
            with self.timer.phase(f"save_checkpoint/{group}", step):
                if self.rank == leader:  # a crash may have left a half of this step behind
                    shutil.rmtree(folder, ignore_errors=True)
                    os.makedirs(folder)
                # The pool's gloo meeting group, not its NCCL one: a wait for files on the host,
                # under the long timeout (one rank's write of a large part may outlast
                # trainer.dist_timeout_s), and no device picked for a barrier (the first GPU run
                # warned of it here).
                pools.meet(group)
                checkpoint_files.save_rank_state(os.path.join(folder, f"rank_{self.rank}.pt"), self.rank_state(group, step))
                if program.engine is not None:  # its waits on the meeting group too: the long timeout
                    program.engine.save_checkpoint(os.path.join(folder, "engine"), pools.meet_group(group))
                pools.meet(group)  # every rank's files are written
        my_pool = placement.pool_at(self.rank)
        if my_pool in self.other_pools and self.rank == placement.pools[my_pool][0]:
            self.channel.send_checkpoint_written(step)
        if self.rank == 0:
            self.reports.receive(upto=step)  # a resumed run logs from step + 1 on
            for pool in self.other_pools:
                self.channel.recv_checkpoint_written(step, pool)
            meta = {"step": step, "world_size": placement.world_size, "ranks": self.layout, "time": time.time(),
                    "config": OmegaConf.to_container(cfg, resolve=True), "tracking_runs": self.reports.run_ids()}
            path = checkpoint_files.publish(root, step, meta, cfg.trainer.max_ckpt_to_keep)
            # Its size: with LoRA the trained models' parts are their adapters and their optimizer state.
            print(f"spmdsplit: checkpoint of step {step} written to {path} "
                  f"({checkpoint_files.folder_bytes(path) / 2**20:.1f} MB)", flush=True)
        if self.other_pools and my_pool not in self.other_pools:
            # Rank 0 waited for the other pools' parts (a large critic's save may take minutes);
            # its pool's next collectives need it, so the pool waits for it here instead.
            pools.meet("actor")

    def load(self, path: str) -> int:
        """Each program's part and engine from the checkpoint at `path` (DCP reshards where the pool
        sizes changed; the RNG is restored, or with other sizes sampling reseeded). Returns the
        step it was written after."""
        meta = checkpoint_files.read_meta(path)
        step = meta["step"]
        saved = checkpoint_files.saved_ranks(meta)
        same_layout = saved == self.layout
        for group, program in self.programs.items():
            folder = os.path.join(path, group)
            if program.engine is None and not os.path.isdir(folder):
                continue  # written without this group's pool apart: nothing generated ahead, nothing kept
            if program.engine is not None:
                # DCP reshards if the pool size changed; its waits run on the meeting group, as on save
                program.engine.load_checkpoint(os.path.join(folder, "engine"), self.pools.meet_group(group))
            mine = os.path.join(folder, f"rank_{self.rank}.pt")
            state = checkpoint_files.load_rank_state(mine if same_layout else os.path.join(folder, f"rank_{saved[group][0]}.pt"))
            if same_layout:
                checkpoint_files.set_rng_state(state["rng"], self.pools.device)
            else:
                seed_sampling(self.cfg.trainer.seed, self.rank, after_step=step)
            if self.sampler and "dynamic_sampling" in state:
                # Batches generated ahead and kept (the same layout) are past the position; else
                # they are generated again from where the first of them began.
                self.sampler.load_state_dict(state["dynamic_sampling"], keep_ahead=same_layout)
            program.load_state(state, same_layout)
            if "score_target" in state:
                self.score_target.load_state_dict(state["score_target"])
        if self.sampler and meta["config"]["algorithm"].get("filter_groups", {}).get("enable") is not True:
            # Dynamic sampling turned on at a resume: the stopped run took train_batch_size prompts a step.
            self.sampler.next_gen_batch = step * self.cfg.data.train_batch_size // self.dataset.batch_size + 1
        if self.rank == 0:
            note = "" if same_layout else (" (the pools have other sizes now: weights and optimizer are resharded, "
                                           "sampling is reseeded, so the run will not repeat the stopped one exactly)")
            print(f"spmdsplit: resuming from {path} at step {step + 1}{note}", flush=True)
        return step
