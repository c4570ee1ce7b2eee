"""Every process group of a job, created by one function in one visible order.

`torch.distributed.new_group` is collective over the whole world: every rank must call it for
every group, member or not, in the same order, or the groups' names (a per-process counter)
drift apart and the job hangs at its first collective. The order is therefore part of the
protocol between ranks, and it is written here, once:

  1. the pools' groups (spmdsplit/placement.py build_pools): one per pool, in the order of
     placement.pools (the actor's pool first); each pool trains with FSDP2/ZeRO over its own
  2. `bulk`     over the world, the backend's (NCCL on GPUs): rows between the pools
  3. `control`  over the world, gloo: small pickled objects (metrics, checkpoint hand-off)
  4. `stop`     over the world, gloo: the stop vote at each step (spmdsplit/preempt.py)
  5. `meet`     gloo, one per pool over its ranks, in the same order, with the long timeout:
                where a pool's ranks wait for each other after waiting on another pool
                (Pools.meet), before their next collective
  6. `handoff`  over the actor and critic pools' ranks, only with placement.overlap=false and
                the two on ranks of their own: the barrier that makes them take turns (the
                thing that mode measures; a rollout pool apart runs ahead, never calls it)
  7. `weights`  one group per weight source, each with the ranks whose engines it feeds
                (spmdsplit/weight_sync.py): with a rollout pool of its own, every actor rank +
                the rollout pool, in actor-rank order; with rollout.ranks=all, the actor pool's
                first rank + the critic pool
  8. `generating` over the actor and critic pools' ranks, only with algorithm.filter_groups and
                rollout.ranks=all (pools of their own): the ranks that generate a step decide together
                which prompt groups it keeps (spmdsplit/dynamic_sampling.py); elsewhere the generating
                ranks are one pool, and its group does it
  9. vLLM's own groups over the world (tensor-, pipeline-, data-parallel, ..., for the device
     and for gloo), only with rollout.name=vllm: vLLM creates them itself, engine or not; with
     tensor parallel > 1 a rank without an engine also builds, eagerly, vLLM's communicators for
     its own tensor-parallel group (PyNccl, custom all-reduce buffers), which it never uses:
     spmdsplit/rollout/vllm_engine.py init_vllm_distributed says what that costs. Then the
     engine world: one group per engine's ranks (device and gloo), which an engine's vLLM takes
     as its world group, so that nothing vLLM runs over "the world" reaches another rank

Whether a group exists depends only on the config and the placement, which every rank has
alike, so every rank makes the same calls. The one exception is DeepSpeed's one-rank model-
parallel group (spmdsplit/engines/deepspeed.py), which uses `use_local_synchronization`:
named from its ranks, not from the counter, and created by its own rank alone.

The pools meet only through 2-3 (spmdsplit/messages.py lists every message) and 7; nothing in a
pool's work runs a collective on the world.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from spmdsplit.distributed import meet_on
from spmdsplit.placement import Placement, Pools, build_pools, member_or_none


@dataclass
class ProcessGroups:
    pools: Pools
    bulk: ProcessGroup
    control: ProcessGroup
    stop: ProcessGroup
    handoff: ProcessGroup | None
    weight_sources: list[int]  # empty: no engine outside the actor pool
    weights: list[ProcessGroup | None]  # weights[j]: weight_sources[j] + the receiving ranks
    generating: ProcessGroup | None = None  # the ranks that generate, when they span two pools (8)


def blocking_handoff(cfg, placement: Placement) -> bool:
    """verl's blocking calls (placement.overlap=false), for comparison; meaningless when the
    roles share ranks anyway."""
    return not cfg.placement.overlap and not placement.together("actor", "critic")


def critic_pool_generates(cfg, placement: Placement) -> bool:
    """rollout.ranks=all with pools of their own: the critic pool's ranks generate their share too."""
    return cfg.rollout.ranks == "all" and not placement.together("actor", "critic")


def generating_ranks(cfg, placement: Placement) -> list[int]:
    """The ranks that generate a training step's rollout, in the order of its global batch."""
    if placement.apart("rollout"):
        return list(placement.ranks("rollout"))
    if critic_pool_generates(cfg, placement):
        return list(placement.ranks("actor")) + list(placement.ranks("critic"))
    return list(placement.ranks("actor"))


def weight_sources_and_receivers(cfg, placement: Placement) -> tuple[list[int], list[int]]:
    """Who sends the policy's weights to engines outside the actor pool, and who receives them."""
    actor = list(placement.ranks("actor"))
    if placement.apart("rollout"):
        return actor, list(placement.ranks("rollout"))
    if critic_pool_generates(cfg, placement):
        return actor[:1], list(placement.ranks("critic"))
    return [], []


def create_process_groups(cfg, placement: Placement, device: torch.device) -> ProcessGroups:
    """Every rank, right after init_process_group and before anything else talks: the groups of
    the module docstring, in its order. A collective inside a pool waits trainer.dist_timeout_s;
    the links between pools wait trainer.pool_wait_timeout_s (a busy pool is not a dead one)."""
    in_pool = timedelta(seconds=cfg.trainer.dist_timeout_s)
    between = timedelta(seconds=cfg.trainer.pool_wait_timeout_s)
    world = list(range(placement.world_size))
    pools = build_pools(placement, device, in_pool)  # 1
    bulk = dist.new_group(world, timeout=between)  # 2
    control = dist.new_group(world, backend="gloo", timeout=between)  # 3
    stop = dist.new_group(world, backend="gloo", timeout=between)  # 4
    pools.meets = {name: member_or_none(dist.new_group(list(ranks), backend="gloo", timeout=between))  # 5
                   for name, ranks in placement.pools.items()}
    handoff = None
    if blocking_handoff(cfg, placement):  # 6
        handoff = member_or_none(dist.new_group(sorted({*placement.ranks("actor"), *placement.ranks("critic")}),
                                                timeout=between))
    sources, receivers = weight_sources_and_receivers(cfg, placement)
    weights = [member_or_none(dist.new_group(sorted({src, *receivers}), timeout=between)) for src in sources]  # 7
    generating = None
    if cfg.algorithm.filter_groups.enable and critic_pool_generates(cfg, placement):  # 8
        generating = member_or_none(dist.new_group(sorted({*placement.ranks("actor"), *placement.ranks("critic")}),
                                                   timeout=between))
    groups = ProcessGroups(pools, bulk, control, stop, handoff, sources, weights, generating)
    warm_up(groups, device)
    if cfg.rollout.name == "vllm":  # 9
        from spmdsplit.roles.build import compute_dtypes
        from spmdsplit.rollout.vllm_engine import init_vllm_distributed

        init_vllm_distributed(cfg, cfg.model.path, device, compute_dtypes(cfg, device)[0])
    return groups


def warm_up(groups: ProcessGroups, device: torch.device) -> list[ProcessGroup]:
    """One collective on each of this rank's device groups (1, 6, 7, 8: NCCL on GPUs), in the order
    they were created, before any engine exists; returns them. torch creates an NCCL communicator
    lazily, at a group's first collective (we pass no device_id to init_process_group), and NCCL
    then allocates its buffers on the device: at the first weight sync in the loop, that was after a
    vLLM engine had reserved its share of the GPU (gpu_memory_utilization, on top of what is
    resident), so the buffers had to fit in what was left. Now they are resident before, and
    tools/memory.py counts them. Every rank walks its groups in the one creation order, so no two
    ranks wait on each other in opposite orders. The links between pools (2) are warmed pair by
    pair by PoolChannel.connect; the gloo groups need nothing."""
    mine = [g for g in (*groups.pools.groups.values(), groups.handoff, *groups.weights, groups.generating)
            if g is not None]
    for group in mine:
        meet_on(group, device)  # the communicator exists when this returns
    return mine
