"""Where each role runs: one torchrun world cut into an actor pool, a critic pool and,
optionally, a rollout pool of its own.

By default the actor pool holds actor + reference + rollout, the critic pool holds critic +
reward model (verl's "split placement"). Every rank runs the same program; the placement only says
which ranks take which roles, so it is worked out the same way on every rank from the
config and the launch shape, with no communication.

Two steps, in the manner of torchtitan's ``ParallelDims``:

* :func:`plan_placement` is pure: it checks the config against the launch shape up front
  and returns a frozen :class:`Placement` (rank lists only), or raises a
  :class:`PlacementError` that names the config key and a value that would fit.
* :func:`build_pools` runs after ``init_process_group`` and turns the placement into
  process groups and 1-D device meshes (for FSDP2) on this rank, as :class:`Pools`.

Layouts (``placement.mode``):

* ``split``: one node -> first half of its ranks actor, second half critic; several nodes ->
  first half of the nodes actor, the rest critic (whole nodes, so a pool never straddles a
  node boundary in the middle of a node).
* ``custom`` with ``placement.pools=[a, c]``: ``placement.pool_unit=ranks_per_node`` puts
  local ranks ``[0, a)`` of every node in the actor pool and ``[a, a+c)`` in the critic pool
  (a + c == ranks per node); ``placement.pool_unit=nodes`` gives the first ``a`` whole nodes
  to the actor pool and the next ``c`` to the critic pool (a + c == nodes).
* ``colocate``: every rank is in both pools; the roles take turns on the same ranks.
* ``custom`` with ``placement.pools`` a mapping name -> size and ``placement.roles`` a mapping
  role group -> pool name: three role groups, ``rollout`` (the engines), ``actor`` (policy +
  reference) and ``critic`` (critic + reward model + rule reward), each on a named pool. The
  rollout group sits with the actor (as in every layout above) or on a pool of its own
  (``Placement.rollout_apart``); see :data:`ROLE_LAYOUTS` for the maps that are accepted.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

MODES = ("split", "colocate", "custom")
POOL_UNITS = ("ranks_per_node", "nodes")
POOL_NAMES = ("actor", "critic")
ROLE_GROUPS = ("rollout", "actor", "critic")


class PlacementError(ValueError):
    """A placement config that does not fit the launch shape (the message says what would)."""


# --------------------------------------------------------------------------- helpers


def _fmt_pools(a: int, c: int) -> str:
    # Written the way it goes on a command line as an override: placement.pools=[4,4].
    return f"[{a},{c}]"


def _fmt_list(value) -> str:
    """A config list as it is written on the command line ([4,4]); anything else as repr."""
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return "[" + ",".join(str(v) for v in value) + "]"
    return repr(value)


def _halves(n: int) -> tuple[int, int]:
    """An example split of n into two non-empty parts, actor side taking the odd one."""
    return (n + 1) // 2, n // 2


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _fmt_ranks(ranks: Sequence[int]) -> str:
    """[0, 1] for short lists; runs of 3+ consecutive ranks collapse to 0-31 so that a
    64-rank pool still reads on one line."""
    parts: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{ranks[i]}-{ranks[j]}")
        else:
            parts.extend(str(r) for r in ranks[i : j + 1])
        i = j + 1
    return "[" + ", ".join(parts) + "]"


def _ranks_per_node_hint(lws: int) -> str | None:
    """'placement.mode=custom with placement.pool_unit=ranks_per_node, e.g. ...' if a
    per-node split exists for this node size (needs >= 2 ranks per node)."""
    if lws < 2:
        return None
    return (
        "placement.mode=custom with placement.pool_unit=ranks_per_node, "
        f"e.g. placement.pools={_fmt_pools(*_halves(lws))}"
    )


def _nodes_hint(nnodes: int) -> str | None:
    if nnodes < 2:
        return None
    return (
        "placement.mode=custom with placement.pool_unit=nodes, "
        f"e.g. placement.pools={_fmt_pools(*_halves(nnodes))}"
    )


def _alternatives(*hints: str | None) -> str:
    # "; or " because the hints themselves contain commas.
    return "; or ".join(h for h in hints if h)


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Placement:
    """Which global ranks form the actor pool and the critic pool. Pure data, no groups.

    Invariants (checked on construction, so a hand-built one is as safe as a planned one):
    rank lists sorted and non-empty, together they cover the whole world, and they are
    either disjoint (split/custom) or identical (colocate).
    """

    mode: str
    world_size: int
    local_world_size: int
    nnodes: int
    actor_ranks: tuple[int, ...]
    critic_ranks: tuple[int, ...]
    # The rollout group's ranks (the generation engines). () = the actor's ranks, where the
    # rollout group has always sat; otherwise a pool of its own, disjoint from both others.
    rollout_ranks: tuple[int, ...] = ()

    def __post_init__(self):
        # Accept lists/ranges but store tuples: the dataclass is frozen and hashable.
        object.__setattr__(self, "actor_ranks", tuple(int(r) for r in self.actor_ranks))
        object.__setattr__(self, "critic_ranks", tuple(int(r) for r in self.critic_ranks))
        rollout = tuple(int(r) for r in self.rollout_ranks) or self.actor_ranks
        object.__setattr__(self, "rollout_ranks", rollout)
        if self.mode not in MODES:
            raise PlacementError(f"placement.mode={self.mode!r} is not one of {list(MODES)}")
        if self.world_size != self.local_world_size * self.nnodes:
            raise PlacementError(
                f"world size {self.world_size} != {self.local_world_size} ranks per node x "
                f"{self.nnodes} nodes"
            )
        world = set(range(self.world_size))
        for name, ranks in (("actor", self.actor_ranks), ("critic", self.critic_ranks)):
            if not ranks:
                raise PlacementError(f"the {name} pool is empty; each pool needs at least 1 rank")
            if list(ranks) != sorted(set(ranks)):
                raise PlacementError(f"{name} pool ranks must be sorted and unique, got {list(ranks)}")
            if not set(ranks) <= world:
                raise PlacementError(
                    f"{name} pool ranks {list(ranks)} fall outside the world of {self.world_size}"
                )
        if list(self.rollout_ranks) != sorted(set(self.rollout_ranks)):
            raise PlacementError(f"rollout pool ranks must be sorted and unique, got {list(self.rollout_ranks)}")
        if not set(self.rollout_ranks) <= world:
            raise PlacementError(
                f"rollout pool ranks {list(self.rollout_ranks)} fall outside the world of {self.world_size}"
            )
        a, c, g = set(self.actor_ranks), set(self.critic_ranks), set(self.rollout_ranks)
        if a != c and a & c:
            raise PlacementError(
                f"actor pool {sorted(a)} and critic pool {sorted(c)} overlap without being the "
                "same ranks; pools are either disjoint or, with placement.mode=colocate, identical"
            )
        if g != a and g & (a | c):
            raise PlacementError(
                f"rollout pool {sorted(g)} overlaps the actor pool {sorted(a)} or the critic pool "
                f"{sorted(c)} without being the actor's ranks; the rollout group sits either with "
                "the actor or on ranks of its own"
            )
        if a | c | g != world:
            raise PlacementError(f"ranks {sorted(world - (a | c | g))} are in no pool")
        if self.actor_ranks[0] != 0:
            # World rank 0 logs, reports metrics and writes checkpoints' metadata as the actor.
            raise PlacementError(
                f"actor pool ranks {list(self.actor_ranks)} must include world rank 0 (it logs); "
                "lay the actor's pool out first"
            )
        # colocate: every group on the same ranks; split: rollout+actor | critic; custom: any
        # of the layouts above (plan_placement decides which maps it plans).
        if (self.mode == "colocate" and not a == c == g) or (self.mode == "split" and (a == c or g != a)):
            raise PlacementError(
                f"placement.mode={self.mode} does not match the rank lists "
                f"({'identical' if a == c else 'disjoint'} actor and critic pools, "
                f"rollout {'apart' if g != a else 'with the actor'})"
            )

    @property
    def colocated(self) -> bool:
        """The actor and the critic share ranks (says nothing about the rollout group)."""
        return self.actor_ranks == self.critic_ranks

    @property
    def rollout_apart(self) -> bool:
        """The rollout group has ranks of its own, disjoint from the actor's and the critic's."""
        return self.rollout_ranks != self.actor_ranks

    def ranks_of(self, pool: str) -> tuple[int, ...]:
        if pool == "actor":
            return self.actor_ranks
        if pool == "critic":
            return self.critic_ranks
        if pool == "rollout":
            return self.rollout_ranks
        raise ValueError(f"unknown pool {pool!r}; expected one of {list(ROLE_GROUPS)}")

    def roles_of(self, rank: int) -> set[str]:
        """The role groups on this rank, a subset of {"rollout", "actor", "critic"}; "rollout"
        on every rank of the rollout ranks, also when they are the actor's."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size}")
        return {p for p in ROLE_GROUPS if rank in self.ranks_of(p)}

    def pool_label(self, rank: int) -> str:
        """The pool a rank is in, for logs and timelines: "actor", "critic", "actor+critic"
        or "rollout". A rollout group sitting with the actor is not named (as before it had a
        pool of its own): its ranks are the actor pool."""
        return "+".join(sorted(self.roles_of(rank) - {"rollout"})) or "rollout"

    def describe(self) -> str:
        """One line for the log, e.g.
        'split: actor pool ranks [0, 1] | critic pool ranks [2, 3] (1 node x 2+2)'."""
        head = self.mode + ": "
        if self.colocated and not self.rollout_apart:
            return (
                f"{head}actor and critic pools share ranks {_fmt_ranks(self.actor_ranks)} "
                f"({_plural(self.nnodes, 'node')} x {self.local_world_size}, roles take turns)"
            )
        # The rollout pool apart first (the group that starts each step), then actor, critic.
        pools: list[tuple[str, tuple[int, ...]]] = []
        if self.rollout_apart:
            pools.append(("rollout", self.rollout_ranks))
        pools.append(("actor+critic" if self.colocated else "actor", self.actor_ranks))
        if not self.colocated:
            pools.append(("critic", self.critic_ranks))
        lws = self.local_world_size
        per_node = [[sum(1 for r in ranks if r // lws == n) for n in range(self.nnodes)] for _, ranks in pools]
        if all(len(set(counts)) == 1 and 0 < counts[0] < lws for counts in per_node):
            # every node cut the same way
            shape = f"{_plural(self.nnodes, 'node')} x " + "+".join(str(c[0]) for c in per_node)
        else:
            # whole nodes per pool
            shape = "+".join(str(len(ranks) // lws) for _, ranks in pools) + f" nodes x {lws}"
        return (
            head
            + " | ".join(f"{name} pool ranks {_fmt_ranks(ranks)}" for name, ranks in pools)
            + f" ({shape})"
        )


def _check_pools_value(pools) -> tuple[int, int]:
    if isinstance(pools, (str, bytes)) or not isinstance(pools, Sequence) or len(pools) != 2:
        raise PlacementError(
            f"placement.pools={_fmt_list(pools)} must be two sizes [actor, critic], e.g. placement.pools=[4,4]"
        )
    for p in pools:
        # bool is an int subclass; True as a pool size is surely a mistake.
        if isinstance(p, bool) or not isinstance(p, int):
            raise PlacementError(
                f"placement.pools={_fmt_list(pools)} must hold whole numbers, e.g. placement.pools=[4,4]"
            )
    return int(pools[0]), int(pools[1])


def _fmt_map(value: Mapping) -> str:
    """A config mapping as it is written on the command line: {gen: 1, train: 1}."""
    return "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"


def _fmt_pools_value(pools) -> str:
    return _fmt_map(pools) if isinstance(pools, Mapping) else _fmt_list(pools)


def _is_empty(value) -> bool:
    return value is None or (isinstance(value, (Sequence, Mapping)) and not isinstance(value, (str, bytes))
                             and len(value) == 0)


# The maps plan_placement accepts, as the role groups on each pool (the actor's pool first).
ROLE_LAYOUTS = (
    "rollout+actor+critic (= placement.mode=colocate)",
    "rollout+actor | critic (= placement.mode=split)",
    "rollout | actor+critic (GRPO: rollout | actor, the reward computed with the actor)",
    "rollout | actor | critic",
)


def _plan_named_pools(
    pools: Mapping, roles: Mapping, pool_unit: str, world_size: int, lws: int, nnodes: int
) -> Placement:
    """placement.mode=custom with placement.pools a mapping name -> size and placement.roles a
    mapping role group -> pool name (see plan_placement)."""
    names = [str(n) for n in pools]
    shown = _fmt_map(pools)
    for role, pool in roles.items():
        if role not in ROLE_GROUPS:
            raise PlacementError(
                f"placement.roles.{role}={pool}: unknown role group; the role groups are "
                f"{', '.join(ROLE_GROUPS)} (critic also holds the reward model and the rule reward)"
            )
        if not isinstance(pool, str) or pool not in names:
            raise PlacementError(
                f"placement.roles.{role}={pool}: no pool of that name in placement.pools={shown}; "
                f"use one of {', '.join(names)}"
            )
    if "actor" not in roles:
        raise PlacementError(
            f"placement.roles={_fmt_map(roles)} does not place the actor; add placement.roles.actor=<pool>, "
            f"e.g. placement.roles.actor={names[0]} (rollout and critic default to the actor's pool)"
        )
    actor_pool = roles["actor"]
    where = {"actor": actor_pool, "critic": roles.get("critic", actor_pool), "rollout": roles.get("rollout", actor_pool)}
    for name, size in pools.items():
        if isinstance(size, bool) or not isinstance(size, int):
            raise PlacementError(f"placement.pools.{name}={size!r}: expected a whole number of "
                                 f"{'ranks per node' if pool_unit == 'ranks_per_node' else 'nodes'}")
    unused = [n for n in names if n not in where.values()]
    if unused:
        raise PlacementError(
            f"placement.pools.{unused[0]}={pools[unused[0]]}: no role group is placed on pool {unused[0]}; "
            f"drop it or name it in placement.roles (e.g. placement.roles.rollout={unused[0]})"
        )
    if where["rollout"] != actor_pool and where["rollout"] == where["critic"]:
        raise PlacementError(
            f"placement.roles.rollout={where['rollout']}: the rollout group sits either with the actor "
            f"(placement.roles.rollout={actor_pool}) or on a pool of its own, not with the critic alone "
            "(the engines take their weights from the actor); the maps that work: " + "; ".join(ROLE_LAYOUTS)
        )
    for name, size in pools.items():
        if size < 1:
            raise PlacementError(
                f"placement.pools.{name}={size}: each pool needs at least 1 "
                f"{'rank per node' if pool_unit == 'ranks_per_node' else 'node'}"
            )
    if pool_unit == "ranks_per_node":
        total, what = lws, f"the ranks per node ({lws}, LOCAL_WORLD_SIZE)"
    else:
        total, what = nnodes, f"the number of nodes ({nnodes})"
    if sum(pools.values()) != total:
        fit = "" if total < len(names) else (
            "e.g. placement.pools=" + _fmt_map(dict(zip(names, _cut(total, len(names))))))
        raise PlacementError(
            f"placement.pools={shown} adds up to {sum(pools.values())}, but with placement.pool_unit={pool_unit} "
            f"it must add up to {what}"
            + (f", {fit}" if fit else f", which has no room for {len(names)} pools of at least 1; "
               "put more role groups on one pool, or use placement.mode=colocate")
        )
    # The actor's pool first, so world rank 0 (which logs) is in it; then the mapping's order.
    order = [actor_pool] + [n for n in names if n != actor_pool]
    ranks: dict[str, list[int]] = {n: [] for n in order}
    if pool_unit == "ranks_per_node":
        for node in range(nnodes):  # every node cut the same way
            start = 0
            for n in order:
                ranks[n] += [node * lws + lr for lr in range(start, start + pools[n])]
                start += pools[n]
    else:
        start = 0
        for n in order:  # whole nodes
            ranks[n] = list(range(start * lws, (start + pools[n]) * lws))
            start += pools[n]
    return Placement(
        "custom", world_size, lws, nnodes,
        ranks[actor_pool], ranks[where["critic"]], ranks[where["rollout"]],
    )


def _cut(n: int, k: int) -> list[int]:
    """n cut into k parts as even as can be, the first parts taking the remainder."""
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def plan_placement(
    mode: str,
    pools: Sequence[int] | Mapping[str, int] | None,
    pool_unit: str,
    world_size: int,
    local_world_size: int,
    nnodes: int,
    roles: Mapping[str, str] | None = None,
) -> Placement:
    """Work out the pools from the config and the launch shape. Pure: no torch.distributed,
    so every rank gets the same answer and a bad config fails before any group exists.

    `pools` is a list [actor, critic] (custom's two pools, as always) or a mapping pool name ->
    size (in `pool_unit`s); with a mapping, `roles` maps role groups (rollout, actor, critic)
    to pool names: critic and rollout default to the actor's pool. Ranks are laid out pool by
    pool, the actor's pool first (world rank 0 logs), then the mapping's order."""
    for name, v in (("world size", world_size), ("ranks per node", local_world_size), ("nodes", nnodes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PlacementError(f"launch shape: {name} must be a positive integer, got {v!r}")
    if world_size != local_world_size * nnodes:
        raise PlacementError(
            f"launch shape: world size {world_size} != {local_world_size} ranks per node x "
            f"{nnodes} nodes; launch the same number of ranks on every node "
            "(torchrun --nproc-per-node N on each node)"
        )
    if mode not in MODES:
        raise PlacementError(
            f"placement.mode={mode!r} is unknown; use one of {', '.join(MODES)} "
            "(e.g. placement.mode=split)"
        )
    # Checked whatever the mode: a typo should not sit silently in a config.
    if pool_unit not in POOL_UNITS:
        raise PlacementError(
            f"placement.pool_unit={pool_unit!r} is unknown; use one of {', '.join(POOL_UNITS)} "
            "(e.g. placement.pool_unit=ranks_per_node)"
        )
    lws = local_world_size
    all_ranks = tuple(range(world_size))
    shape = f"{_plural(nnodes, 'node')} x {_plural(lws, 'rank')}"

    if _is_empty(pools):
        pools = None  # an empty list is how a config leaves the sizes unset
    roles = None if _is_empty(roles) else roles
    if mode != "custom" and pools is not None:
        # Only custom reads the sizes; ignoring them would hide a config that means something else.
        raise PlacementError(
            f"placement.pools={_fmt_pools_value(pools)} is only used with placement.mode=custom "
            f"(got placement.mode={mode}); drop placement.pools or set placement.mode=custom"
        )
    if roles is not None:
        if not isinstance(roles, Mapping):
            raise PlacementError(f"placement.roles={_fmt_list(roles)}: expected a mapping role group -> pool name, "
                                 "e.g. placement.roles='{rollout: gen, actor: train, critic: train}'")
        if mode != "custom":
            raise PlacementError(
                f"placement.roles={_fmt_map(roles)} is only used with placement.mode=custom and placement.pools "
                f"a mapping name -> size (got placement.mode={mode}); drop placement.roles, or use e.g. "
                "placement.mode=custom placement.pools='{gen: 1, train: 1}' "
                "placement.roles='{rollout: gen, actor: train, critic: train}'"
            )
        if not isinstance(pools, Mapping):
            raise PlacementError(
                f"placement.roles={_fmt_map(roles)} needs placement.pools as a mapping pool name -> size "
                + (f"(got placement.pools={_fmt_list(pools)}, which is [actor, critic]); " if pools is not None
                   else "(placement.pools is unset); ")
                + "e.g. placement.pools='{gen: 1, train: 1}'"
            )
    if mode == "custom" and isinstance(pools, Mapping):
        if roles is None:
            raise PlacementError(
                f"placement.pools={_fmt_map(pools)} names pools: place the role groups on them with placement.roles, "
                f"e.g. placement.roles='{{rollout: {next(iter(pools))}, actor: {list(pools)[-1]}}}'"
            )
        return _plan_named_pools(pools, roles, pool_unit, world_size, lws, nnodes)

    if mode == "colocate":
        return Placement(mode, world_size, lws, nnodes, all_ranks, all_ranks)

    if mode == "split":
        if nnodes == 1:
            if lws < 2 or lws % 2:
                alt = _alternatives(
                    f"{_ranks_per_node_hint(lws)} (an uneven split)" if lws >= 2 else None,
                    "placement.mode=colocate",
                )
                need = "at least 2 ranks" if lws < 2 else "an even number of ranks"
                raise PlacementError(
                    f"placement.mode=split on one node needs {need} to cut in half, got {shape}; "
                    f"launch an even number of ranks, or use {alt}"
                )
            half = lws // 2
            return Placement(mode, world_size, lws, nnodes, all_ranks[:half], all_ranks[half:])
        if nnodes % 2:
            alt = _alternatives(_ranks_per_node_hint(lws), _nodes_hint(nnodes), "placement.mode=colocate")
            raise PlacementError(
                f"placement.mode=split over several nodes gives each pool half of the nodes, "
                f"which needs an even number of nodes, got {shape}; use an even number of nodes, "
                f"or {alt}"
            )
        cut = (nnodes // 2) * lws
        return Placement(mode, world_size, lws, nnodes, all_ranks[:cut], all_ranks[cut:])

    # custom
    if pools is None:
        alt = _alternatives(_ranks_per_node_hint(lws), _nodes_hint(nnodes))
        raise PlacementError(
            "placement.mode=custom needs placement.pools=[actor, critic]"
            + (f"; for {shape} use {alt}" if alt else f"; {shape} has no room for two pools, use placement.mode=colocate")
        )
    a, c = _check_pools_value(pools)
    if pool_unit == "ranks_per_node":
        total, what = lws, f"the ranks per node ({lws}, LOCAL_WORLD_SIZE)"
        other = _nodes_hint(nnodes)
    else:
        total, what = nnodes, f"the number of nodes ({nnodes})"
        other = _ranks_per_node_hint(lws)
    if total < 2:
        alt = _alternatives(other, "placement.mode=colocate")
        raise PlacementError(
            f"placement.pools={_fmt_pools(a, c)} with placement.pool_unit={pool_unit} must add up to "
            f"{what}, which leaves no room for two pools of at least 1; use {alt}"
        )
    example = f"placement.pools={_fmt_pools(*_halves(total))}"
    if a < 1 or c < 1:
        raise PlacementError(
            f"placement.pools={_fmt_pools(a, c)}: each pool needs at least 1 "
            f"{'rank per node' if pool_unit == 'ranks_per_node' else 'node'}; with "
            f"placement.pool_unit={pool_unit} the sizes add up to {what}, e.g. {example} "
            "(or placement.mode=colocate to put both roles on every rank)"
        )
    if a + c != total:
        raise PlacementError(
            f"placement.pools={_fmt_pools(a, c)} adds up to {a + c}, but with "
            f"placement.pool_unit={pool_unit} it must add up to {what}, e.g. {example}"
        )
    if pool_unit == "ranks_per_node":
        # global rank = node * ranks_per_node + local rank (torchrun's contiguous numbering).
        actor = tuple(n * lws + lr for n in range(nnodes) for lr in range(a))
        critic = tuple(n * lws + lr for n in range(nnodes) for lr in range(a, lws))
    else:
        actor, critic = all_ranks[: a * lws], all_ranks[a * lws :]
    return Placement(mode, world_size, lws, nnodes, actor, critic)


def plan_from_config(placement_cfg, world_size: int, local_world_size: int, nnodes: int) -> Placement:
    """plan_placement from the config's `placement` section (OmegaConf or any object with
    mode, pools, pool_unit and roles), its containers turned into plain lists and dicts."""
    def plain(value):
        if isinstance(value, Mapping):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            return [plain(v) for v in value]
        return value

    return plan_placement(
        placement_cfg.mode, plain(placement_cfg.pools), placement_cfg.pool_unit,
        world_size, local_world_size, nnodes, plain(getattr(placement_cfg, "roles", None)),
    )


def _env_int(env: Mapping[str, str], key: str) -> int | None:
    raw = env.get(key)
    if raw is None or raw == "":
        return None
    try:
        v = int(raw)
    except ValueError:
        raise PlacementError(f"launch shape: {key}={raw!r} is not an integer") from None
    if v < 1:
        raise PlacementError(f"launch shape: {key}={v} must be at least 1")
    return v


def launch_shape_from_env(env: Mapping[str, str] | None = None) -> tuple[int, int, int]:
    """(world_size, local_world_size, nnodes) from torchrun's environment.

    WORLD_SIZE and LOCAL_WORLD_SIZE (ranks on this node) come from torchrun;
    GROUP_WORLD_SIZE is torchrun's count of node groups, i.e. nodes. Missing values fall back
    to a single node (a plain ``python`` run is (1, 1, 1)). ``env`` defaults to os.environ,
    read at call time.
    """
    env = os.environ if env is None else env
    world = _env_int(env, "WORLD_SIZE") or 1
    local = _env_int(env, "LOCAL_WORLD_SIZE") or world
    if world % local:
        raise PlacementError(
            f"launch shape: WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}; "
            "every node must run the same number of ranks"
        )
    nnodes = world // local
    group = _env_int(env, "GROUP_WORLD_SIZE")
    if group is not None and group != nnodes:
        raise PlacementError(
            f"launch shape: GROUP_WORLD_SIZE={group} nodes disagrees with WORLD_SIZE={world} / "
            f"LOCAL_WORLD_SIZE={local} = {nnodes} nodes"
        )
    return world, local, nnodes


# --------------------------------------------------------------------------- runtime side


@dataclass
class Pools:
    """The placement made real on one rank: groups and meshes for the pools it is in."""

    placement: Placement
    rank: int
    device: torch.device
    actor_group: ProcessGroup | None
    critic_group: ProcessGroup | None
    actor_mesh: DeviceMesh | None
    critic_mesh: DeviceMesh | None
    # The group over a rollout pool apart (None on non-members, and when the rollout group
    # sits with the actor: then its engines use the actor's group).
    rollout_group: ProcessGroup | None = None
    # Each trained pool's meeting group (gloo, trainer.pool_wait_timeout_s; spmdsplit/groups.py
    # makes them): None on non-members.
    actor_meet: ProcessGroup | None = None
    critic_meet: ProcessGroup | None = None

    @property
    def is_actor(self) -> bool:
        return self.actor_group is not None

    @property
    def in_rollout_pool(self) -> bool:
        """This rank is in a rollout pool apart (it generates and trains nothing)."""
        return self.placement.rollout_apart and self.rank in self.placement.rollout_ranks

    @property
    def is_critic(self) -> bool:
        return self.critic_group is not None

    def group(self, pool: str) -> ProcessGroup | None:
        self.placement.ranks_of(pool)  # validates the name
        if pool == "rollout":  # the rollout group's ranks: its own pool, or the actor's
            return self.rollout_group if self.placement.rollout_apart else self.actor_group
        return self.actor_group if pool == "actor" else self.critic_group

    def meet(self, pool: str) -> None:
        """This rank's `pool` (actor or critic) waits until all its ranks are here, under the long
        timeout: after a wait on another pool, whose rows (or go-ahead) reach the pool's ranks at
        different times. Without it the first rank through would wait for the last inside the
        pool's next collective, under trainer.dist_timeout_s: a long generation elsewhere, or the
        critic pool's checkpoint of a large model, would trip it (NCCL's watchdog then kills the
        job). A gloo barrier on the host costs about a millisecond."""
        group = self.actor_meet if pool == "actor" else self.critic_meet
        if group is not None and dist.get_world_size(group) > 1:
            dist.barrier(group=group)

    def mesh(self, pool: str) -> DeviceMesh | None:
        if pool == "rollout":
            raise ValueError("the rollout group has no FSDP mesh (its engines hold whole copies); use group('rollout')")
        self.placement.ranks_of(pool)
        return self.actor_mesh if pool == "actor" else self.critic_mesh


def _member_or_none(group) -> ProcessGroup | None:
    # new_group returns GroupMember.NON_GROUP_MEMBER (a sentinel, not None) on ranks outside
    # the group; None reads better and cannot be passed to a collective by mistake.
    if group is None or group is dist.GroupMember.NON_GROUP_MEMBER:
        return None
    return group


def _mesh_for(group: ProcessGroup | None, device: torch.device) -> DeviceMesh | None:
    if group is None:
        # A DeviceMesh is only meaningful (and only needed, for FSDP2) on its own members.
        return None
    # from_group wraps the existing group (DeviceMesh(..., _init_backend=False) plus a
    # registry entry): no new group and no collective, so members may call it alone.
    # It wants a bare device type ("cuda", "cpu"); "cuda:0" is rejected, hence .type.
    return DeviceMesh.from_group(group, device.type, mesh_dim_names=("fsdp",))


def build_pools(placement: Placement, device: torch.device, timeout: timedelta | None = None) -> Pools:
    """Create the pool process groups and 1-D meshes on this rank.

    Must be called by every rank of the world, after init_process_group, with the same
    placement. Every rank calls new_group for every pool, members or not (torch's rule):
    torch names a group from a per-process counter of new_group calls, and the members meet
    in the store under that name, so all ranks must make the same calls in the same order or
    the names drift apart and the job hangs; with TORCH_DIST_INIT_BARRIER=1 each call also
    waits on the whole world. Order: actor pool, then critic pool (colocate makes one group
    that both pools share), then, only with a rollout pool apart, the rollout pool. `timeout`: how long a collective inside a pool may wait
    (trainer.dist_timeout_s); None = torch's default for the backend.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("build_pools needs torch.distributed initialised (init_process_group) first")
    world = dist.get_world_size()
    rank = dist.get_rank()
    # Checked before any new_group: every rank sees the same mismatch and raises together,
    # rather than some ranks waiting in a group creation the others never reach.
    if world != placement.world_size:
        raise PlacementError(
            f"placement was planned for {placement.world_size} ranks but the running world has "
            f"{world}; plan it from launch_shape_from_env()"
        )
    device = torch.device(device)

    # use_local_synchronization=False (the default): keep torch's whole-world rule, so
    # correctness never depends on which ranks happen to be members.
    if placement.colocated:
        actor = critic = _member_or_none(dist.new_group(ranks=list(placement.actor_ranks), timeout=timeout))
        # One group and one mesh for both pools: the roles take turns on the same ranks,
        # so a second, identical group would only cost another communicator.
        actor_mesh = critic_mesh = _mesh_for(actor, device)
    else:
        actor = _member_or_none(dist.new_group(ranks=list(placement.actor_ranks), timeout=timeout))
        critic = _member_or_none(dist.new_group(ranks=list(placement.critic_ranks), timeout=timeout))
        actor_mesh, critic_mesh = _mesh_for(actor, device), _mesh_for(critic, device)
    rollout = None
    if placement.rollout_apart:
        # After the actor's and critic's groups, on every rank, members or not (see above).
        rollout = _member_or_none(dist.new_group(ranks=list(placement.rollout_ranks), timeout=timeout))
    return Pools(placement, rank, device, actor, critic, actor_mesh, critic_mesh, rollout)
