"""Every process group of a job comes from spmdsplit/groups.py create_process_groups, in one order.

On 4 real gloo ranks, for each layout and option that adds a group: every rank makes the same
new_group calls in the same order (the rule whose breach hangs a job at its first collective),
the calls are the ones the module's docstring lists, and every group then works for its members
(a group whose name drifted between ranks would hang here, which run_ranks turns into a failure).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.support.launch import run_ranks

# overrides, and how many groups: one per pool, bulk, control, stop, a meeting group per pool, +
# handoff with placement.overlap=false, + one weight group per source: the actor pool's first rank
# with rollout.ranks=all, every actor rank with a rollout pool of its own.
LAYOUTS = {
    "split": (["placement.mode=split"], 7),
    "colocate": (["placement.mode=colocate"], 5),
    "custom 3+1, blocking": (["placement.mode=custom", "placement.pools=[3,1]", "placement.overlap=false"], 8),
    "split, rollout.ranks=all": (["placement.mode=split", "rollout.ranks=all"], 8),
    "rollout | actor+critic": (["placement.mode=custom", "placement.pools={gen: 1, train: 3}",
                                "placement.roles={rollout: gen, actor: train, critic: train}"], 2 + 3 + 2 + 3),
    "rollout | actor | critic": (["placement.mode=custom", "placement.pools={gen: 1, policy: 2, value: 1}",
                                  "placement.roles={rollout: gen, actor: policy, critic: value}"], 3 + 3 + 3 + 2),
    # The hand-off spans the actor and critic pools only: the rollout pool runs ahead, never calls it.
    "rollout | actor | critic, blocking": (["placement.mode=custom", "placement.pools={gen: 1, policy: 2, value: 1}",
                                            "placement.roles={rollout: gen, actor: policy, critic: value}",
                                            "placement.overlap=false"], 3 + 3 + 3 + 1 + 2),
    # A fourth role group on a pool of its own adds its pool's group and meeting group, nothing else.
    "rollout | actor | critic | reward": (["placement.mode=custom", "placement.pools={gen: 1, policy: 1, value: 1, rm: 1}",
                                           "placement.roles={rollout: gen, actor: policy, critic: value, reward: rm}"],
                                          4 + 3 + 4 + 1),
}


def _create(rank, world, overrides):
    from spmdsplit.config import load_config
    from spmdsplit.groups import create_process_groups
    from spmdsplit.placement import plan_from_config

    cfg = load_config(None, overrides)
    placement = plan_from_config(cfg, world, world, 1)
    calls, warmed = [], []
    real, real_all_reduce = dist.new_group, dist.all_reduce

    def recording(*args, **kwargs):
        ranks = kwargs.get("ranks", args[0] if args else None)
        calls.append((tuple(ranks) if ranks is not None else "world", kwargs.get("backend")))
        return real(*args, **kwargs)

    def all_reduce(tensor, *args, group=None, **kwargs):
        warmed.append(tuple(dist.get_process_group_ranks(group)))
        return real_all_reduce(tensor, *args, group=group, **kwargs)

    dist.new_group, dist.all_reduce = recording, all_reduce
    try:
        groups = create_process_groups(cfg, placement, torch.device("cpu"))
    finally:
        dist.new_group, dist.all_reduce = real, real_all_reduce
    # Every device group of this rank (not the world's P2P links, not gloo) had its one collective
    # at start-up, in the order created: NCCL builds a communicator there, before any engine.
    bulk = len(placement.pools)  # the links' group comes right after the pools'
    assert warmed == [r for i, (r, backend) in enumerate(calls) if backend is None and i != bulk and rank in r], \
        (warmed, calls)
    # Every group works for its members, in the order created.
    one = torch.ones(1)
    for group in (*groups.pools.groups.values(), groups.bulk, groups.control, groups.stop,
                  *groups.pools.meets.values(), groups.handoff):
        if group is not None:
            dist.all_reduce(one.clone(), group=group)
    for src, group in zip(groups.pools.placement.weight_sources, groups.weights):
        if group is not None:
            t = torch.tensor([float(rank)])
            dist.broadcast(t, src=src, group=group)
            assert t.item() == src
    return calls


def _create_every_layout(rank, world):
    return {layout: _create(rank, world, overrides) for layout, (overrides, _) in LAYOUTS.items()}


def test_every_rank_creates_the_same_groups_in_the_same_order():
    # One world for every layout (one spawn of 4 ranks is most of the cost), groups made layout
    # after layout as every rank goes through the same sequence.
    per_rank = run_ranks(_create_every_layout, 4, timeout=180)
    for layout, (_, expected) in LAYOUTS.items():
        calls = [mine[layout] for mine in per_rank]
        assert all(c == calls[0] for c in calls), (layout, calls)
        assert len(calls[0]) == expected, (layout, calls[0])
        # The links between pools and the stop vote span the world; control and stop are gloo.
        pools = {"colocate": 1, "rollout | actor+critic": 2, "rollout | actor | critic | reward": 4}.get(
            layout, 3 if layout.startswith("rollout") else 2)
        world = tuple(range(4))
        assert calls[0][pools:pools + 3] == [(world, None), (world, "gloo"), (world, "gloo")], layout
        if layout.endswith("blocking"):  # after the meeting groups, the hand-off: the actor and critic pools' ranks
            handoff = (0, 1, 2, 3) if layout.startswith("custom") else (0, 1, 3)  # gen is rank 2: rank 0 is always the actor pool's
            assert calls[0][pools + 3 + pools] == (handoff, None), calls[0]


def test_no_group_is_created_anywhere_else():
    """The order lives in one function only if nothing else in the runtime package calls
    new_group: groups.py (build_pools, its step 1, lives there too) and DeepSpeed's one-rank group
    (named from its ranks, `use_local_synchronization`) are the only callers."""
    import pathlib

    import spmdsplit

    root = pathlib.Path(spmdsplit.__file__).parent
    callers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if "new_group(" in p.read_text())
    assert callers == ["engines/deepspeed.py", "groups.py"], callers
