import re

import pytest
import torch
import torch.distributed as dist

from spmdsplit.groups import Pools, build_pools
from spmdsplit.placement import (
    Placement,
    PlacementError,
    launch_shape_from_env,
    plan_placement,
)
from tests.support.launch import run_ranks


def plan(mode, pools=None, unit="ranks_per_node", *, lws, nnodes=1):
    return plan_placement(mode, pools, unit, lws * nnodes, lws, nnodes)


# --------------------------------------------------------------------------- split


def test_split_one_node_of_4():
    p = plan("split", lws=4)
    assert p.ranks("actor") == (0, 1) and p.ranks("critic") == (2, 3)
    assert not p.together("actor", "critic")
    assert p.roles_of(1) == {"rollout", "actor"} and p.roles_of(2) == {"critic", "reward"}
    assert not p.apart("rollout") and p.ranks("rollout") == p.ranks("actor") == p.ranks("rollout")
    assert p.pool_label(1) == "actor" and p.pool_label(2) == "critic"
    assert p.describe() == "split: actor pool ranks [0, 1] | critic pool ranks [2, 3] (1 node x 2+2)"


def test_split_one_node_of_8():
    p = plan("split", lws=8)
    assert p.ranks("actor") == (0, 1, 2, 3) and p.ranks("critic") == (4, 5, 6, 7)
    assert "(1 node x 4+4)" in p.describe()


def test_split_two_nodes_of_8_splits_whole_nodes():
    p = plan("split", lws=8, nnodes=2)
    assert p.ranks("actor") == tuple(range(8)) and p.ranks("critic") == tuple(range(8, 16))
    assert p.describe() == "split: actor pool ranks [0-7] | critic pool ranks [8-15] (1+1 nodes x 8)"


def test_split_four_nodes_of_2():
    p = plan("split", lws=2, nnodes=4)
    assert p.ranks("actor") == (0, 1, 2, 3) and p.ranks("critic") == (4, 5, 6, 7)
    assert "(2+2 nodes x 2)" in p.describe()


def test_split_odd_node_count_says_what_fits():
    with pytest.raises(PlacementError) as e:
        plan("split", lws=8, nnodes=3)
    msg = str(e.value)
    assert "placement.mode=split" in msg
    assert "use an even number of nodes" in msg
    assert "placement.mode=custom with placement.pool_unit=ranks_per_node, e.g. placement.pools=[4,4]" in msg
    assert "placement.pool_unit=nodes, e.g. placement.pools=[2,1]" in msg


def test_split_one_node_odd_or_single_rank():
    with pytest.raises(PlacementError, match=r"placement\.mode=split.*even number of ranks.*placement\.pools=\[2,1\]"):
        plan("split", lws=3)
    with pytest.raises(PlacementError, match=r"placement\.mode=split.*at least 2 ranks.*placement\.mode=colocate"):
        plan("split", lws=1)


def test_split_rejects_pools():
    with pytest.raises(PlacementError, match=r"placement\.pools=.*only used with placement\.mode=custom"):
        plan("split", [2, 2], lws=4)
    # An empty list is a config's "unset", not sizes.
    assert plan("split", [], lws=4).ranks("actor") == (0, 1)
    with pytest.raises(PlacementError, match=r"placement\.mode=custom needs placement\.pools"):
        plan("custom", [], lws=4)


# --------------------------------------------------------------------------- custom


def test_custom_6_plus_2_per_node_on_two_nodes():
    p = plan("custom", [6, 2], "ranks_per_node", lws=8, nnodes=2)
    assert p.ranks("actor") == (0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13)
    assert p.ranks("critic") == (6, 7, 14, 15)
    assert p.describe() == (
        "custom: actor pool ranks [0-5, 8-13] | critic pool ranks [6, 7, 14, 15] (2 nodes x 6+2)"
    )


def test_custom_3_plus_5_per_node_on_two_nodes():
    p = plan("custom", [3, 5], "ranks_per_node", lws=8, nnodes=2)
    assert p.ranks("actor") == (0, 1, 2, 8, 9, 10)
    assert p.ranks("critic") == (3, 4, 5, 6, 7, 11, 12, 13, 14, 15)
    for r in range(16):
        assert p.roles_of(r) == ({"rollout", "actor"} if r % 8 < 3 else {"critic", "reward"})


def test_custom_nodes_1_1():
    p = plan("custom", [1, 1], "nodes", lws=8, nnodes=2)
    assert p.ranks("actor") == tuple(range(8)) and p.ranks("critic") == tuple(range(8, 16))
    assert "(1+1 nodes x 8)" in p.describe()


def test_custom_nodes_2_1():
    p = plan("custom", [2, 1], "nodes", lws=4, nnodes=3)
    assert p.ranks("actor") == tuple(range(8)) and p.ranks("critic") == (8, 9, 10, 11)
    assert "(2+1 nodes x 4)" in p.describe()


def test_custom_accepts_a_tuple_or_list_config_value():
    assert plan("custom", (1, 3), lws=4).ranks("actor") == (0,)


# --------------------------------------------------------------------------- colocate


def test_colocate():
    p = plan("colocate", lws=4, nnodes=2)
    assert p.ranks("actor") == p.ranks("critic") == tuple(range(8))
    assert p.together("actor", "critic")
    assert p.roles_of(5) == {"rollout", "actor", "critic", "reward"} and p.pool_label(5) == "actor+critic"
    assert p.describe().startswith("colocate: actor and critic pools share ranks [0-7]")


def test_colocate_single_rank():
    p = plan("colocate", lws=1)
    assert p.ranks("actor") == p.ranks("critic") == (0,)


# --------------------------------------------------------------------------- errors


def test_custom_sizes_must_add_up_per_node():
    with pytest.raises(
        PlacementError,
        match=r"placement\.pools=\[4,2\] adds up to 6.*placement\.pool_unit=ranks_per_node.*"
        r"ranks per node \(8.*e\.g\. placement\.pools=\[4,4\]",
    ):
        plan("custom", [4, 2], "ranks_per_node", lws=8, nnodes=2)


def test_custom_sizes_must_add_up_in_nodes():
    with pytest.raises(
        PlacementError,
        match=r"placement\.pools=\[2,2\] adds up to 4.*placement\.pool_unit=nodes.*"
        r"number of nodes \(3\).*e\.g\. placement\.pools=\[2,1\]",
    ):
        plan("custom", [2, 2], "nodes", lws=8, nnodes=3)


def test_zero_size_pool():
    with pytest.raises(PlacementError, match=r"placement\.pools=\[8,0\].*at least 1.*placement\.pools=\[4,4\]"):
        plan("custom", [8, 0], lws=8)
    with pytest.raises(PlacementError, match=r"placement\.pools=\[0,2\].*at least 1 node.*placement\.pools=\[1,1\]"):
        plan("custom", [0, 2], "nodes", lws=8, nnodes=2)


def test_custom_nodes_on_one_node_points_to_ranks_per_node():
    with pytest.raises(
        PlacementError,
        match=r"placement\.pool_unit=nodes.*no room.*placement\.pool_unit=ranks_per_node, e\.g\. placement\.pools=\[4,4\]",
    ):
        plan("custom", [1, 1], "nodes", lws=8)


def test_custom_without_pools():
    with pytest.raises(PlacementError, match=r"placement\.mode=custom needs placement\.pools.*placement\.pools=\[4,4\]"):
        plan("custom", None, lws=8)


def test_custom_pools_malformed():
    with pytest.raises(PlacementError, match=r"placement\.pools=.*two sizes"):
        plan("custom", [8], lws=8)
    with pytest.raises(PlacementError, match=r"placement\.pools=.*whole numbers"):
        plan("custom", [4.0, 4], lws=8)


def test_world_must_be_local_times_nodes():
    with pytest.raises(PlacementError, match=r"world size 12 != 8 ranks per node x 2 nodes"):
        plan_placement("split", None, "ranks_per_node", 12, 8, 2)


def test_unknown_mode():
    with pytest.raises(PlacementError, match=r"placement\.mode='spilt' is unknown.*split, colocate, custom"):
        plan("spilt", lws=4)


def test_unknown_pool_unit():
    with pytest.raises(PlacementError, match=r"placement\.pool_unit='gpus' is unknown.*ranks_per_node, nodes"):
        plan("custom", [2, 2], "gpus", lws=4)


def hand_built(world, pools, roles, mode="custom"):
    return Placement(mode, world, world, 1, pools, roles)


def test_placement_invariants_on_hand_built_ones():
    with pytest.raises(PlacementError, match="overlap"):
        hand_built(4, {"a": (0, 1), "c": (1, 2, 3)}, {"actor": "a", "critic": "c"})
    with pytest.raises(PlacementError, match="in no pool"):
        hand_built(4, {"a": (0,), "c": (2, 3)}, {"actor": "a", "critic": "c"})
    with pytest.raises(PlacementError, match="empty"):
        hand_built(4, {"a": (), "c": (0, 1, 2, 3)}, {"actor": "a", "critic": "c"})
    with pytest.raises(PlacementError, match="holds no role group"):
        hand_built(4, {"a": (0, 1), "c": (2, 3)}, {"actor": "a"})
    with pytest.raises(PlacementError, match="not one of"):
        hand_built(2, {"a": (0, 1)}, {"actor": "a", "critic": "x"})
    with pytest.raises(ValueError):
        plan("split", lws=4).roles_of(4)
    with pytest.raises(ValueError, match="unknown role group 'judge'"):
        plan("split", lws=4).ranks("judge")


def test_hand_built_rollout_pool_apart():
    p = hand_built(3, {"a": (0,), "c": (1,), "g": (2,)}, {"actor": "a", "critic": "c", "rollout": "g"})
    assert p.apart("rollout") and not p.together("actor", "critic")
    assert p.ranks("rollout") == (2,) and p.roles_of(2) == {"rollout"} and p.roles_of(0) == {"actor"}
    assert p.pool_label(2) == "rollout" and p.ranks("reward") == p.ranks("critic")  # reward follows the critic
    assert p.describe() == (
        "custom: rollout pool ranks [2] | actor pool ranks [0] | critic pool ranks [1] (1 node x 1+1+1)"
    )
    q = hand_built(2, {"t": (0,), "g": (1,)}, {"actor": "t", "rollout": "g"})
    assert q.apart("rollout") and q.together("actor", "critic") and q.roles_of(0) == {"actor", "critic", "reward"}
    assert q.describe() == "custom: rollout pool ranks [1] | actor+critic pool ranks [0] (1 node x 1+1)"
    # unplaced groups follow their hosts: the rollout the actor, the critic the actor, reward the critic
    assert hand_built(4, {"a": (0, 1), "c": (2, 3)}, {"actor": "a", "critic": "c"}, "split").ranks("rollout") == (0, 1)


def test_hand_built_rollout_pool_invariants():
    with pytest.raises(PlacementError, match="placement.roles.rollout=c: the rollout group sits either with the actor"):
        hand_built(3, {"a": (0,), "c": (1, 2)}, {"actor": "a", "critic": "c", "rollout": "c"})
    with pytest.raises(PlacementError, match="in no pool"):
        hand_built(4, {"a": (0,), "c": (1,), "g": (2,)}, {"actor": "a", "critic": "c", "rollout": "g"})
    with pytest.raises(PlacementError, match="world rank 0"):
        hand_built(3, {"a": (1,), "c": (2,), "g": (0,)}, {"actor": "a", "critic": "c", "rollout": "g"})
    with pytest.raises(PlacementError, match="sorted and unique"):
        hand_built(4, {"a": (0,), "c": (1,), "g": (3, 2)}, {"actor": "a", "critic": "c", "rollout": "g"})


def test_a_reward_pool_of_its_own():
    p = named({"gen": 1, "policy": 1, "value": 1, "rm": 1},
              {"rollout": "gen", "actor": "policy", "critic": "value", "reward": "rm"}, lws=4)
    assert [p.ranks(g) for g in ("actor", "rollout", "critic", "reward")] == [(0,), (1,), (2,), (3,)]
    assert p.apart("reward") and p.roles_of(3) == {"reward"} and p.pool_label(3) == "reward"
    assert p.describe() == ("custom: rollout pool ranks [1] | actor pool ranks [0] | critic pool ranks [2] | "
                            "reward pool ranks [3] (1 node x 1+1+1+1)")
    # GRPO with a reward model apart: rollout | actor+critic | reward
    q = named({"gen": 2, "train": 4, "rm": 2}, {"rollout": "gen", "actor": "train", "reward": "rm"}, lws=8)
    assert q.ranks("critic") == q.ranks("actor") == (0, 1, 2, 3) and q.ranks("reward") == (6, 7)
    assert q.describe() == "custom: rollout pool ranks [4, 5] | actor+critic pool ranks [0-3] | reward pool ranks [6, 7] (1 node x 2+4+2)"


@pytest.mark.parametrize("roles, message", [
    ({"actor": "a", "critic": "b", "reward": "a"},
     "placement.roles.reward=a: the reward group sits either with the critic (placement.roles.reward=b) or on a pool "
     "of its own, not on the actor pool"),
    ({"actor": "a", "rollout": "b", "reward": "b"},
     "placement.roles.rollout=b: the rollout group sits either with the actor (placement.roles.rollout=a) or on a "
     "pool of its own, not on the reward pool"),
    ({"actor": "a", "critic": "b", "judge": "b"}, "placement.roles.judge=b: unknown role group; the role groups are "
                                                   "rollout, actor, critic, reward"),
])
def test_a_role_group_where_it_cannot_sit_or_not_in_the_map_is_refused_in_one_line(roles, message):
    with pytest.raises(PlacementError) as e:
        named({"a": 1, "b": 1}, roles, lws=2)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


# --------------------------------------------------------------------------- launch shape


def test_launch_shape_from_env():
    assert launch_shape_from_env({}) == (1, 1, 1)
    assert launch_shape_from_env({"WORLD_SIZE": "4"}) == (4, 4, 1)
    assert launch_shape_from_env({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}) == (16, 8, 2)
    assert launch_shape_from_env({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "2"}) == (16, 8, 2)


def test_launch_shape_from_env_errors():
    with pytest.raises(PlacementError, match=r"WORLD_SIZE=12 is not a multiple of LOCAL_WORLD_SIZE=8"):
        launch_shape_from_env({"WORLD_SIZE": "12", "LOCAL_WORLD_SIZE": "8"})
    with pytest.raises(PlacementError, match=r"GROUP_WORLD_SIZE=3 nodes disagrees"):
        launch_shape_from_env({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "3"})
    with pytest.raises(PlacementError, match=r"WORLD_SIZE='x' is not an integer"):
        launch_shape_from_env({"WORLD_SIZE": "x"})


def test_launch_shape_from_process_env(monkeypatch):
    for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert launch_shape_from_env() == (1, 1, 1)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert launch_shape_from_env() == (8, 4, 2)


# --------------------------------------------------------------------------- role groups on named pools


def named(pools, roles, *, lws, nnodes=1, unit="ranks_per_node"):
    return plan_placement("custom", pools, unit, lws * nnodes, lws, nnodes, roles)


def test_named_pools_all_on_one_pool_is_colocate():
    p = named({"all": 4}, {"rollout": "all", "actor": "all", "critic": "all"}, lws=4)
    assert p.ranks("actor") == p.ranks("critic") == p.ranks("rollout") == (0, 1, 2, 3)
    assert p.together("actor", "critic") and not p.apart("rollout")
    assert p.describe() == "custom: actor and critic pools share ranks [0-3] (1 node x 4, roles take turns)"


def test_named_pools_rollout_with_the_actor_is_todays_split():
    p = named({"train": 2, "value": 2}, {"actor": "train", "critic": "value"}, lws=4)  # rollout defaults to the actor's
    q = plan("split", lws=4)
    assert (p.ranks("actor"), p.ranks("critic"), p.ranks("rollout")) == (q.ranks("actor"), q.ranks("critic"), q.ranks("rollout"))
    assert p.describe() == "custom: actor pool ranks [0, 1] | critic pool ranks [2, 3] (1 node x 2+2)"


def test_named_pools_rollout_apart_from_actor_and_critic():
    p = named({"gen": 1, "train": 1}, {"rollout": "gen", "actor": "train", "critic": "train"}, lws=2)
    assert p.ranks("actor") == p.ranks("critic") == (0,) and p.ranks("rollout") == (1,)
    assert p.apart("rollout") and p.together("actor", "critic")
    assert p.roles_of(0) == {"actor", "critic", "reward"} and p.roles_of(1) == {"rollout"}
    assert p.describe() == "custom: rollout pool ranks [1] | actor+critic pool ranks [0] (1 node x 1+1)"


def test_named_pools_grpo_rollout_actor_puts_the_critic_group_with_the_actor():
    p = named({"gen": 2, "train": 6}, {"rollout": "gen", "actor": "train"}, lws=8, nnodes=2)
    assert p.ranks("actor") == p.ranks("critic") == (0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13)
    assert p.ranks("rollout") == (6, 7, 14, 15)
    assert p.describe() == (
        "custom: rollout pool ranks [6, 7, 14, 15] | actor+critic pool ranks [0-5, 8-13] (2 nodes x 2+6)"
    )


def test_named_pools_three_pools_actor_first_then_the_mappings_order():
    p = named({"gen": 1, "policy": 1, "value": 1}, {"rollout": "gen", "actor": "policy", "critic": "value"}, lws=3)
    assert (p.ranks("actor"), p.ranks("rollout"), p.ranks("critic")) == ((0,), (1,), (2,))
    assert p.describe() == (
        "custom: rollout pool ranks [1] | actor pool ranks [0] | critic pool ranks [2] (1 node x 1+1+1)"
    )


def test_named_pools_whole_nodes():
    p = named({"gen": 1, "policy": 2, "value": 1}, {"rollout": "gen", "actor": "policy", "critic": "value"},
              lws=4, nnodes=4, unit="nodes")
    assert p.ranks("actor") == tuple(range(8)) and p.ranks("rollout") == tuple(range(8, 12))
    assert p.ranks("critic") == tuple(range(12, 16))
    assert p.describe().endswith("(1+2+1 nodes x 4)")


@pytest.mark.parametrize(
    "pools, roles, lws, message",
    [
        ({"gen": 1, "train": 1}, {"rollout": "gen", "critic": "gen", "actor": "train"}, 2,
         "placement.roles.rollout=gen: the rollout group sits either with the actor"),
        ({"gen": 1, "train": 1, "x": 1}, {"rollout": "gen", "actor": "train"}, 3,
         "placement.pools.x=1: no role group is placed on pool x"),
        ({"gen": 1, "train": 1}, {"rollout": "gen", "actor": "tr"}, 2,
         "placement.roles.actor=tr: no pool of that name in placement.pools={gen: 1, train: 1}; use one of gen, train"),
        ({"gen": 1, "train": 1}, {"rolout": "gen", "actor": "train"}, 2,
         "placement.roles.rolout=gen: unknown role group; the role groups are rollout, actor, critic, reward"),
        ({"gen": 0, "train": 2}, {"rollout": "gen", "actor": "train"}, 2,
         "placement.pools.gen=0: each pool needs at least 1 rank per node"),
        ({"gen": 1, "train": 2}, {"rollout": "gen", "actor": "train"}, 2,
         "placement.pools={gen: 1, train: 2} adds up to 3, but with placement.pool_unit=ranks_per_node it must add "
         "up to the ranks per node (2, LOCAL_WORLD_SIZE), e.g. placement.pools={gen: 1, train: 1}"),
        ({"gen": 1, "train": 1}, {"rollout": "gen"}, 2, "does not place the actor; add placement.roles.actor="),
        ({"gen": 1, "train": 1}, None, 2, "placement.pools={gen: 1, train: 1} names pools: place the role groups"),
    ],
)
def test_named_pools_refusals_name_the_key(pools, roles, lws, message):
    with pytest.raises(PlacementError) as e:
        named(pools, roles, lws=lws)
    assert str(e.value).startswith(message) or message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "mode, pools, message",
    [
        ("split", None, "placement.roles={actor: x} is only used with placement.mode=custom"),
        ("colocate", None, "placement.roles={actor: x} is only used with placement.mode=custom"),
        ("custom", [1, 1], "placement.roles={actor: x} needs placement.pools as a mapping pool name -> size"),
    ],
)
def test_roles_need_custom_and_named_pools(mode, pools, message):
    with pytest.raises(PlacementError, match="^" + re.escape(message)):
        plan_placement(mode, pools, "ranks_per_node", 2, 2, 1, {"actor": "x"})


# --------------------------------------------------------------------------- real groups (gloo)


def _pool_report(pools: Pools, pool: str):
    """On a member rank: all_reduce of the global rank over the pool group, plus what the
    mesh says. None on a non-member."""
    group, mesh = pools.group(pool), pools.mesh(pool)
    if group is None:
        assert mesh is None
        return None
    t = torch.tensor([float(pools.rank)])
    dist.all_reduce(t, group=group)
    return {
        "sum": t.item(),
        "group_ranks": dist.get_process_group_ranks(group),
        "dist_rank_in": dist.get_rank(group),
        "mesh_size": mesh.size(),
        "mesh_ranks": mesh.mesh.tolist(),
        "mesh_group_ranks": dist.get_process_group_ranks(mesh.get_group()),
        "mesh_local_rank": mesh.get_local_rank(),
    }


def _rollout_report(pools: Pools):
    group = pools.group("rollout") if pools.placement.apart("rollout") else None
    if group is None:
        return None
    t = torch.tensor([float(pools.rank)])
    dist.all_reduce(t, group=group)
    return {"sum": t.item(), "group_ranks": dist.get_process_group_ranks(group)}


def _probe(pools: Pools):
    return {
        "rank": pools.rank,
        "is_actor": pools.holds("actor"),
        "is_critic": pools.holds("critic"),
        "in_rollout_pool": pools.placement.apart("rollout") and pools.holds("rollout"),
        "rollout": _rollout_report(pools),
        "actor": _pool_report(pools, "actor"),
        "critic": _pool_report(pools, "critic"),
        "same_group": pools.group("actor") is pools.group("critic") and pools.group("actor") is not None,
        "same_mesh": pools.mesh("actor") is pools.mesh("critic") and pools.mesh("actor") is not None,
    }


def _build_scenarios(rank, world_size, scenarios):
    """Builds the pools of several placements one after another in the same world (every
    rank in the same order, as build_pools requires) and probes each. Starting processes
    costs seconds here, so one world serves several scenarios."""
    out = {"env_shape": launch_shape_from_env()}
    for name, mode, pools_cfg, unit, shape, *roles in scenarios:
        shape = shape or out["env_shape"]  # None: plan from torchrun's env, as a real run does
        pools = build_pools(plan_placement(mode, pools_cfg, unit, *shape, *roles), torch.device("cpu"))
        assert pools.rank == rank
        out[name] = _probe(pools)
    # The world group still works after all the pool groups: nobody was left in a creation.
    t = torch.ones(1)
    dist.all_reduce(t)
    out["world_sum"] = t.item()
    return out


def _check_pool(results, pool, ranks):
    for rank, res in enumerate(results):
        rep = res[pool]
        if rank not in ranks:
            assert rep is None, (pool, rank)
            continue
        assert rep["sum"] == float(sum(ranks))
        assert rep["group_ranks"] == list(ranks)
        assert rep["dist_rank_in"] == ranks.index(rank)  # the pool's group keeps the placement's order
        assert rep["mesh_size"] == len(ranks)
        assert rep["mesh_ranks"] == list(ranks)
        assert rep["mesh_group_ranks"] == list(ranks)
        assert rep["mesh_local_rank"] == ranks.index(rank)


@pytest.fixture(scope="module")
def four_ranks():
    # 4 gloo ranks launched as 2 "nodes" x 2 (LOCAL_WORLD_SIZE=2). The one-node scenarios
    # pass their shape (4, 4, 1) explicitly; the per-node one reads the env.
    scenarios = [
        ("split", "split", None, "ranks_per_node", (4, 4, 1)),
        ("custom_3_1", "custom", [3, 1], "ranks_per_node", (4, 4, 1)),
        ("per_node_1_1", "custom", [1, 1], "ranks_per_node", None),
        # a rollout pool apart, after pools with none: every rank makes the same calls in order
        ("gen_train_per_node", "custom", {"gen": 1, "train": 1}, "ranks_per_node", None,
         {"rollout": "gen", "actor": "train"}),
        ("three_pools", "custom", {"gen": 1, "policy": 2, "value": 1}, "ranks_per_node", (4, 4, 1),
         {"rollout": "gen", "actor": "policy", "critic": "value"}),
        ("colocate_again", "colocate", None, "ranks_per_node", (4, 4, 1)),
    ]
    results = run_ranks(_build_scenarios, 4, scenarios, timeout=60, local_world_size=2)
    assert all(r["world_sum"] == 4.0 for r in results)
    return {name: [r[name] for r in results] for name in results[0]}


def test_build_pools_split_4_ranks(four_ranks):
    results = four_ranks["split"]
    assert [r["is_actor"] for r in results] == [True, True, False, False]
    assert [r["is_critic"] for r in results] == [False, False, True, True]
    _check_pool(results, "actor", [0, 1])
    _check_pool(results, "critic", [2, 3])


def test_build_pools_custom_3_plus_1(four_ranks):
    results = four_ranks["custom_3_1"]
    assert [r["is_critic"] for r in results] == [False, False, False, True]
    _check_pool(results, "actor", [0, 1, 2])
    _check_pool(results, "critic", [3])


def test_build_pools_custom_per_node_on_two_simulated_nodes(four_ranks):
    # 2 nodes x 2 ranks, 1+1 per node: interleaved pools actor [0, 2], critic [1, 3].
    assert four_ranks["env_shape"] == [(4, 2, 2)] * 4
    results = four_ranks["per_node_1_1"]
    _check_pool(results, "actor", [0, 2])
    _check_pool(results, "critic", [1, 3])


def _check_rollout_pool(results, ranks):
    for rank, res in enumerate(results):
        assert res["in_rollout_pool"] == (rank in ranks)
        if rank in ranks:
            assert res["rollout"] == {"sum": float(sum(ranks)), "group_ranks": list(ranks)}
        else:
            assert res["rollout"] is None


def test_build_pools_rollout_pool_apart_per_node(four_ranks):
    # 2 nodes x 2 ranks, {gen: 1, train: 1} per node: train (actor+critic) [0, 2], gen [1, 3].
    results = four_ranks["gen_train_per_node"]
    _check_pool(results, "actor", [0, 2])
    _check_pool(results, "critic", [0, 2])
    assert all(r["same_group"] for r in results[::2])
    _check_rollout_pool(results, [1, 3])
    assert [r["is_actor"] or r["is_critic"] for r in results] == [True, False, True, False]


def test_build_pools_three_pools(four_ranks):
    results = four_ranks["three_pools"]
    _check_pool(results, "actor", [0, 1])
    _check_pool(results, "critic", [3])
    _check_rollout_pool(results, [2])


def test_build_pools_no_rollout_group_when_it_sits_with_the_actor(four_ranks):
    for name in ("split", "custom_3_1", "per_node_1_1", "colocate_again"):
        assert all(r["rollout"] is None and not r["in_rollout_pool"] for r in four_ranks[name])


def _wrong_world_then_colocate(rank, world_size):
    # A placement planned for another world size is refused on every rank before any
    # new_group, so no rank is left waiting in a group creation; the world stays usable.
    try:
        build_pools(plan_placement("split", None, "ranks_per_node", 4, 4, 1), torch.device("cpu"))
        refused = None
    except PlacementError as e:
        refused = str(e)
    out = _build_scenarios(rank, world_size, [("colocate", "colocate", None, "ranks_per_node", None)])
    out["refused"] = refused
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_wrong_world_then_colocate, 2, timeout=60)


def test_build_pools_colocate_2_ranks(two_ranks):
    results = [r["colocate"] for r in two_ranks]
    for r in results:
        assert r["is_actor"] and r["is_critic"]
        assert r["same_group"] and r["same_mesh"]
    _check_pool(results, "actor", [0, 1])
    _check_pool(results, "critic", [0, 1])


def test_build_pools_rejects_a_placement_for_another_world(two_ranks):
    assert all("planned for 4 ranks" in r["refused"] and "has 2" in r["refused"] for r in two_ranks)


# --------------------------------------------------------------------------- derived facts


def test_who_generates_and_who_takes_weights_in_each_layout():
    """The facts the runtime reads off the placement (issue 38: once, here), in every layout:
    the generating ranks in the global batch's order, whether rows come from another pool, who
    sends the policy's weights and who receives them, whether engines sleep, who hands off."""
    def facts(p):
        return (p.generating_ranks, p.generated_elsewhere, p.critic_pool_generates, p.weight_sources,
                p.weight_receivers, p.engines_share_device, p.hands_off)

    split = plan("split", lws=4)
    assert facts(split) == ((0, 1), False, False, (), (), True, False)
    colocate = plan("colocate", lws=4)
    assert facts(colocate) == ((0, 1, 2, 3), False, False, (), (), True, False)
    # rollout.ranks=all compiles into the map: the rollout group spans the critic's pool too.
    every = plan_placement("split", None, "ranks_per_node", 4, 4, 1, rollout_ranks="all")
    assert every.pools_of("rollout") == ("actor", "critic") and every.ranks("rollout") == (0, 1)
    assert facts(every) == ((0, 1, 2, 3), True, True, (0,), (2, 3), True, False)
    # Across nodes the order is the actor pool's ranks, then the critic's (the batch's order).
    every = plan_placement("custom", [2, 2], "ranks_per_node", 8, 4, 2, rollout_ranks="all")
    assert every.generating_ranks == (0, 1, 4, 5, 2, 3, 6, 7)
    # With one pool, or a rollout pool of its own, rollout.ranks=all changes nothing here.
    assert plan_placement("colocate", None, "ranks_per_node", 4, 4, 1, rollout_ranks="all").spans == {}
    gen = plan_placement("custom", {"gen": 1, "train": 2}, "ranks_per_node", 3, 3, 1,
                         {"rollout": "gen", "actor": "train"}, rollout_ranks="all")
    assert gen.spans == {} and facts(gen) == ((2,), True, False, (0, 1), (2,), False, False)
    blocking = plan_placement("split", None, "ranks_per_node", 4, 4, 1, overlap=False)
    assert blocking.hands_off and not plan_placement("colocate", None, "ranks_per_node", 4, 4, 1,
                                                     overlap=False).hands_off


def test_only_the_rollout_group_spans_and_only_onto_the_critics_pool():
    with pytest.raises(PlacementError, match="only the rollout group"):
        Placement("custom", 4, 4, 1, {"a": (0, 1), "c": (2, 3)}, {"actor": "a", "critic": "c"},
                  spans={"reward": ("a",)})
    with pytest.raises(PlacementError, match="only the rollout group"):  # one pool: nothing to span
        Placement("colocate", 2, 2, 1, {"all": (0, 1)}, {"actor": "all"}, spans={"rollout": ("all",)})
