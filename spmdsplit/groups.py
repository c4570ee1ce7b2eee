"""Every process group of a job, created by one function in one visible order, and `Pools`, the
placement made real on a rank (each pool's group, mesh and meeting group, looked up by role group).

`torch.distributed.new_group` is collective over the whole world: every rank must call it for
every group, member or not, in the same order, or the groups' names (a per-process counter)
drift apart and the job hangs at its first collective. The order is therefore part of the
protocol between ranks, and it is written here, once:

  1. the pools' groups (build_pools below): one per pool, in the order of
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
  9. `weights_ready` gloo, over the actor and rollout pools' ranks, only with rollout.continuous:
                the signal that a version of the weights is being sent, which the rollout pool
                looks for between engine steps (weight_sync.WeightsReady)
 10. vLLM's own groups over the world (tensor-, pipeline-, data-parallel, ..., for the device
     and for gloo), only with rollout.name=vllm: vLLM creates them itself, engine or not; with
     tensor parallel > 1 a rank without an engine also builds, eagerly, vLLM's communicators for
     its own tensor-parallel group (PyNccl, custom all-reduce buffers), which it never uses:
     spmdsplit/inference/vllm_engine.py init_vllm_distributed says what that costs. Then the
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

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from spmdsplit.distributed import meet_on
from spmdsplit.placement import Placement, PlacementError


@dataclass
class Pools:
    """The placement made real on one rank: each pool's process group, FSDP mesh and meeting group,
    looked up by role group (None where this rank is not in the group's pool)."""

    placement: Placement
    rank: int
    device: torch.device
    groups: dict[str, ProcessGroup | None]  # pool name -> its group (the backend's)
    meshes: dict[str, DeviceMesh | None]  # pool name -> its 1-D mesh (FSDP2, ZeRO)
    # pool name -> its meeting group (gloo, trainer.pool_wait_timeout_s; spmdsplit/groups.py makes them)
    meets: dict[str, ProcessGroup | None] = field(default_factory=dict)

    def holds(self, group: str) -> bool:
        """This rank is in the pool of role group `group`."""
        return self.rank in self.placement.ranks(group)

    def group(self, role_group: str) -> ProcessGroup | None:
        return self.groups[self.placement.pool_of(role_group)]

    def mesh(self, role_group: str) -> DeviceMesh | None:
        return self.meshes[self.placement.pool_of(role_group)]

    def meet_group(self, role_group: str) -> ProcessGroup | None:
        """The gloo group over `role_group`'s pool with the long timeout (None off the pool)."""
        return self.meets.get(self.placement.pool_of(role_group))

    def meet(self, role_group: str | None = None) -> None:
        """The ranks of `role_group`'s pool (None: this rank's own) wait until all of them are here,
        under the long timeout: after a wait on another pool, whose rows (or go-ahead) reach the
        pool's ranks at different times, or after each rank generated on its own for as long as its
        rows took. Without it the first rank through would wait for the last inside the pool's next
        collective, under trainer.dist_timeout_s: a long generation, or another pool's checkpoint
        of a large model, would trip it (NCCL's watchdog then kills the job). A gloo barrier on the
        host costs about a millisecond."""
        pool = self.placement.pool_at(self.rank) if role_group is None else self.placement.pool_of(role_group)
        group = self.meets.get(pool)
        if group is not None and dist.get_world_size(group) > 1:
            dist.barrier(group=group)


def member_or_none(group) -> ProcessGroup | None:
    """new_group returns GroupMember.NON_GROUP_MEMBER (a sentinel, not None) on ranks outside the
    group; None reads better and cannot be passed to a collective by mistake."""
    return None if group is None or group is dist.GroupMember.NON_GROUP_MEMBER else group


def _mesh_for(group: ProcessGroup | None, device: torch.device) -> DeviceMesh | None:
    if group is None:  # a mesh is only meaningful (and only needed, for FSDP2) on its own members
        return None
    # from_group wraps the existing group (DeviceMesh(..., _init_backend=False) plus a registry
    # entry): no new group and no collective, so members may call it alone. It wants a bare device
    # type ("cuda", "cpu"); "cuda:0" is rejected, hence .type.
    return DeviceMesh.from_group(group, device.type, mesh_dim_names=("fsdp",))


def build_pools(placement: Placement, device: torch.device, timeout: timedelta | None = None) -> Pools:
    """Each pool's process group and 1-D mesh on this rank, one group per pool in the order of
    placement.pools (the actor's pool first).

    Every rank of the world calls this, after init_process_group, with the same placement, and
    calls new_group for every pool, member or not (torch's rule): torch names a group from a
    per-process counter of new_group calls, and the members meet in the store under that name, so
    all ranks must make the same calls in the same order or the names drift apart and the job
    hangs. `timeout`: how long a collective inside a pool may wait (trainer.dist_timeout_s); None =
    torch's default for the backend."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("build_pools needs torch.distributed initialised (init_process_group) first")
    world = dist.get_world_size()
    # Checked before any new_group: every rank sees the same mismatch and raises together, rather
    # than some ranks waiting in a group creation the others never reach.
    if world != placement.world_size:
        raise PlacementError(f"placement was planned for {placement.world_size} ranks but the running world has "
                             f"{world}; plan it from launch_shape_from_env()")
    device = torch.device(device)
    # use_local_synchronization=False (the default): torch's whole-world rule, so correctness never
    # depends on which ranks happen to be members.
    groups = {name: member_or_none(dist.new_group(ranks=list(ranks), timeout=timeout))
              for name, ranks in placement.pools.items()}
    return Pools(placement, dist.get_rank(), device, groups, {n: _mesh_for(g, device) for n, g in groups.items()})


@dataclass
class ProcessGroups:
    pools: Pools
    bulk: ProcessGroup
    control: ProcessGroup
    stop: ProcessGroup
    handoff: ProcessGroup | None
    weights: list[ProcessGroup | None]  # weights[j]: placement.weight_sources[j] + the receiving ranks
    generating: ProcessGroup | None = None  # the ranks that generate, when they span two pools (8)
    weights_ready: ProcessGroup | None = None  # rollout.continuous's signal (9)


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
    if placement.hands_off:  # 6
        handoff = member_or_none(dist.new_group(sorted({*placement.ranks("actor"), *placement.ranks("critic")}),
                                                timeout=between))
    sources, receivers = placement.weight_sources, placement.weight_receivers
    weights = [member_or_none(dist.new_group(sorted({src, *receivers}), timeout=between)) for src in sources]  # 7
    generating = None
    if cfg.algorithm.filter_groups.enable and placement.critic_pool_generates:  # 8
        generating = member_or_none(dist.new_group(sorted(placement.generating_ranks), timeout=between))
    weights_ready = None
    if cfg.rollout.continuous:  # 9 (preflight: only with a rollout pool of its own)
        weights_ready = member_or_none(dist.new_group(sorted({*placement.ranks("actor"), *placement.ranks("rollout")}),
                                                      backend="gloo", timeout=between))
    groups = ProcessGroups(pools, bulk, control, stop, handoff, weights, generating, weights_ready)
    warm_up(groups, device)
    if vllm_engines(cfg):  # 10
        from spmdsplit.models import compute_dtypes
        from spmdsplit.inference.vllm_engine import init_vllm_distributed

        # The rollout's engines', else the judge's: both take one tensor-parallel size where both
        # exist (preflight), so one set of vLLM's groups serves either.
        from spmdsplit.rewards.judge import vllm_view

        view, path = (cfg, cfg.model.path) if cfg.rollout.name == "vllm" else (vllm_view(cfg), cfg.reward.judge.path)
        init_vllm_distributed(view, path, device, compute_dtypes(cfg, device)[0])
    return groups


def vllm_engines(cfg) -> bool:
    """Whether the job runs vLLM engines (the rollout's, or the judge's), so that every rank makes
    vLLM's groups at start (build_process_groups) and destroys them at the end (train.py)."""
    return cfg.rollout.name == "vllm" or bool(cfg.reward.judge.path and cfg.reward.judge.engine == "vllm")


def warm_up(groups: ProcessGroups, device: torch.device) -> list[ProcessGroup]:
    """One collective on each of this rank's device groups (1, 6, 7, 8: NCCL on GPUs), in the order
    they were created, before any engine exists; returns them. torch creates an NCCL communicator
    lazily, at a group's first collective (we pass no device_id to init_process_group), and NCCL
    then allocates its buffers on the device: at the first weight sync in the loop, that was after a
    vLLM engine had reserved its share of the GPU (gpu_memory_utilization, on top of what is
    resident), so the buffers had to fit in what was left. Now they are resident before, and
    tools/plan/memory.py counts them. Every rank walks its groups in the one creation order, so no two
    ranks wait on each other in opposite orders. The links between pools (2) are warmed pair by
    pair by PoolChannel.connect; the gloo groups need nothing."""
    mine = [g for g in (*groups.pools.groups.values(), groups.handoff, *groups.weights, groups.generating)
            if g is not None]
    for group in mine:
        meet_on(group, device)  # the communicator exists when this returns
    return mine
