"""Where each role group runs: a layout is named pools (`pools: {name: size}`) and a map from role
group to pool (`roles: {role group: pool}`). Everything after the plan reads only that map.

Four role groups: ``rollout`` (the engines), ``actor`` (policy + reference), ``critic`` (the value
model and the advantages) and ``reward`` (the reward model and the rule reward). A role group sits
with its host or on a pool of its own (:data:`HOSTS`: rollout's host is the actor, the critic's is
the actor, reward's is the critic); placed nowhere, it sits with its host. Every rank runs the same
program and the map says which role groups its pool holds, worked out alike on every rank from the
config and the launch shape, with no communication.

The config's shorthands compile into the same map (:func:`compile_layout`):

* ``split``: {actor: half, critic: half} of the ranks of one node, or of the nodes of several
  (whole nodes, so a pool never straddles a node in the middle); rollout with the actor, reward with
  the critic (verl's split placement).
* ``colocate``: one pool, every role group on it; the roles take turns on the same ranks.
* ``custom`` with ``placement.pools=[a, c]``: {actor: a, critic: c} in ``placement.pool_unit``s,
  ``ranks_per_node`` (local ranks [0, a) of every node to the actor) or ``nodes`` (whole nodes).
* ``custom`` with ``placement.pools`` a mapping and ``placement.roles``: the map itself.

* ``rollout.ranks=all``: the rollout group, with the actor, spans the critic's pool too.

In the manner of torchtitan's ``ParallelDims``, :func:`plan_placement` is pure and returns a frozen,
self-validating :class:`Placement` (or a one-line :class:`PlacementError` naming the key), whose
properties are the facts derived from the map (the generating ranks, the weights' senders and
receivers, the hand-offs). spmdsplit/groups.py makes it real after ``init_process_group``: each
pool's process group and mesh (``Pools``) and every other group, in one order.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

MODES = ("split", "colocate", "custom")
POOL_UNITS = ("ranks_per_node", "nodes")
# The role groups, in the order a step runs them (describe() and the programs follow it).
ROLE_GROUPS = ("rollout", "actor", "critic", "reward")
# Where a role group sits when the map does not place it, and what it may share a pool with.
HOSTS = {"rollout": "actor", "critic": "actor", "reward": "critic"}
TRAINED = ("actor", "critic")  # the role groups whose models a pool trains (and checkpoints' engines)
ROLE_LAYOUTS = (
    "rollout+actor+critic+reward (= placement.mode=colocate)",
    "rollout+actor | critic+reward (= placement.mode=split)",
    "rollout | actor+critic+reward (GRPO: rollout | actor)",
    "rollout | actor | critic+reward",
    "any of these with reward on a pool of its own",
)


class PlacementError(ValueError):
    """A placement config that does not fit the launch shape (the message says what would)."""


# --------------------------------------------------------------------------- formatting


def _fmt(value) -> str:
    """A config value as it is written on the command line: [4,4], {gen: 1, train: 1}."""
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return "[" + ",".join(str(v) for v in value) + "]"
    return repr(value)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _fmt_ranks(ranks: Sequence[int]) -> str:
    """[0, 1] for short lists; runs of 3+ consecutive ranks collapse to 0-31, so that a 64-rank
    pool still reads on one line."""
    parts: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts += [f"{ranks[i]}-{ranks[j]}"] if j - i >= 2 else [str(r) for r in ranks[i: j + 1]]
        i = j + 1
    return "[" + ", ".join(parts) + "]"


def _cut(n: int, k: int) -> list[int]:
    """n cut into k parts as even as can be, the first parts taking the remainder."""
    return [n // k + (1 if i < n % k else 0) for i in range(k)]


def _two_pool_hint(unit: str, total: int) -> str | None:
    """'placement.mode=custom with placement.pool_unit=..., e.g. placement.pools=[a,c]' when
    `total` units leave room for two pools."""
    if total < 2:
        return None
    return f"placement.mode=custom with placement.pool_unit={unit}, e.g. placement.pools={_fmt(_cut(total, 2))}"


def _alternatives(*hints: str | None) -> str:
    return "; or ".join(h for h in hints if h)  # "; or ": the hints themselves hold commas


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Placement:
    """Named pools of world ranks and the pool of each role group. Pure data, no groups; the facts
    the runtime derives from the map (who generates, who sends and receives the policy's weights,
    who hands off) are its properties, each computed once, here.

    Invariants, checked on construction (a hand-built one is as safe as a planned one): every role
    group placed on a pool that exists; each pool non-empty, sorted, holding a role group; the pools
    disjoint and covering the world; world rank 0 (which logs) in the actor's pool; a role group
    with its host or apart from every group it does not host; only the rollout group spans a second
    pool, the critic's, and only from the actor's (rollout.ranks=all)."""

    mode: str
    world_size: int
    local_world_size: int
    nnodes: int
    pools: Mapping[str, tuple[int, ...]]  # name -> world ranks, the actor's pool first
    roles: Mapping[str, str]  # role group -> its own pool's name, every group of ROLE_GROUPS
    # Role group -> the other pools it also runs on: rollout.ranks=all puts the rollout group's
    # engines on the critic's pool too ({"rollout": ("critic",)}); its own pool stays the actor's.
    spans: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    overlap: bool = True  # placement.overlap: false adds the hand-offs that make the pools take turns

    def __post_init__(self):
        object.__setattr__(self, "pools", {str(n): tuple(int(r) for r in rs) for n, rs in self.pools.items()})
        object.__setattr__(self, "roles", placed_with_hosts(self.roles))
        object.__setattr__(self, "spans", {g: tuple(ps) for g, ps in self.spans.items() if ps})
        if self.mode not in MODES:
            raise PlacementError(f"placement.mode={self.mode!r} is not one of {list(MODES)}")
        if self.world_size != self.local_world_size * self.nnodes:
            raise PlacementError(f"world size {self.world_size} != {self.local_world_size} ranks per node x "
                                 f"{self.nnodes} nodes")
        for group, pool in self.roles.items():
            if pool not in self.pools:
                raise PlacementError(f"the {group} group is placed on pool {pool!r}, which is not one of {list(self.pools)}")
        seen: set[int] = set()
        for name, ranks in self.pools.items():
            if not ranks:
                raise PlacementError(f"pool {name} is empty; each pool needs at least 1 rank")
            if list(ranks) != sorted(set(ranks)) or not set(ranks) <= set(range(self.world_size)):
                raise PlacementError(f"pool {name}'s ranks {list(ranks)} must be sorted and unique, within the world "
                                     f"of {self.world_size}")
            if seen & set(ranks):
                raise PlacementError(f"pool {name}'s ranks {list(ranks)} overlap another pool's; pools are disjoint")
            if not self.groups_on(name):
                raise PlacementError(f"pool {name} holds no role group")
            seen |= set(ranks)
        if seen != set(range(self.world_size)):
            raise PlacementError(f"ranks {sorted(set(range(self.world_size)) - seen)} are in no pool")
        if 0 not in self.ranks("actor"):
            raise PlacementError(f"the actor's pool {list(self.ranks('actor'))} must include world rank 0 (it logs); "
                                 "lay the actor's pool out first")
        for group, host in HOSTS.items():
            strangers = [g for g in self.groups_on(self.roles[group]) if g != group and HOSTS.get(g) != group]
            if self.apart(group) and strangers:
                raise PlacementError(
                    f"placement.roles.{group}={self.roles[group]}: the {group} group sits either with the {host} "
                    f"(placement.roles.{group}={self.roles[host]}) or on a pool of its own, not on the "
                    f"{self.label(self.roles[group]).replace(group, '').strip('+')} pool; the maps that work: "
                    + "; ".join(ROLE_LAYOUTS))
        for group, others in self.spans.items():
            if (group != "rollout" or self.apart("rollout") or self.together("actor", "critic")
                    or others != (self.pool_of("critic"),)):
                raise PlacementError(f"the {group} group spans pools {[self.pool_of(group), *others]}: only the rollout "
                                     "group, with the actor, spans the critic's pool of its own too (rollout.ranks=all)")
        if (self.mode == "colocate" and len(self.pools) != 1) or (
                self.mode == "split" and (len(self.pools) != 2 or self.apart("rollout") or self.apart("reward"))):
            raise PlacementError(f"placement.mode={self.mode} does not match the pools {dict(self.pools)} and "
                                 f"roles {dict(self.roles)}")

    def ranks(self, group: str) -> tuple[int, ...]:
        """The world ranks of the pool `group` sits on (its own: `spans` adds none)."""
        return self.pools[self.pool_of(group)]

    def pools_of(self, group: str) -> tuple[str, ...]:
        """Every pool `group` runs on: its own, then the ones it spans."""
        return (self.pool_of(group), *self.spans.get(group, ()))

    # ---------------------------------------------------------------- derived: who runs where

    @cached_property
    def layout(self) -> dict[str, list[int]]:
        """Each role group's ranks (its own pool's), by group: the channel's addresses, and what a
        checkpoint records to tell on a resume whether the groups sit where they sat."""
        return {group: list(self.ranks(group)) for group in ROLE_GROUPS}

    @cached_property
    def generating_ranks(self) -> tuple[int, ...]:
        """The ranks that generate a training step's rollout, in the order of its global batch:
        a rollout pool's, the actor pool's, or with rollout.ranks=all the actor's then the critic's."""
        return tuple(r for pool in self.pools_of("rollout") for r in self.pools[pool])

    @cached_property
    def critic_pool_generates(self) -> bool:
        """rollout.ranks=all with pools of their own: the critic pool's ranks generate their share."""
        return self.pool_of("critic") in self.spans.get("rollout", ())

    @cached_property
    def generated_elsewhere(self) -> bool:
        """Rows the actor pool trains on come from another pool (a rollout pool of its own, or the
        critic pool's share): the GENERATED message (spmdsplit/messages.py) runs."""
        return self.apart("rollout") or self.critic_pool_generates

    @cached_property
    def weight_sources(self) -> tuple[int, ...]:
        """The actor ranks that send the policy's weights to engines outside the actor pool (a
        rollout pool: every actor rank, a bucket each; the critic pool's engines: the first)."""
        actor = self.ranks("actor")
        return actor if self.apart("rollout") else actor[:1] if self.critic_pool_generates else ()

    @cached_property
    def weight_receivers(self) -> tuple[int, ...]:
        """The ranks whose engines take the policy's weights from the weight sources."""
        return tuple(r for pool in self.pools_of("rollout") if pool != self.pool_of("actor") for r in self.pools[pool])

    @cached_property
    def engines_share_device(self) -> bool:
        """The rollout engines share their ranks' devices with training, so they sleep between
        generations; on a rollout pool of its own an engine stays awake, taking each version in place."""
        return not self.apart("rollout")

    @cached_property
    def hands_off(self) -> bool:
        """verl's blocking calls (placement.overlap=false), for comparison: the actor and critic
        pools take turns; meaningless when the two share ranks anyway."""
        return not self.overlap and not self.together("actor", "critic")

    def pool_of(self, group: str) -> str:
        if group not in self.roles:
            raise ValueError(f"unknown role group {group!r}; expected one of {list(ROLE_GROUPS)}")
        return self.roles[group]

    def groups_on(self, pool: str) -> list[str]:
        return [g for g in ROLE_GROUPS if self.roles[g] == pool]

    def together(self, a: str, b: str) -> bool:
        return self.pool_of(a) == self.pool_of(b)

    def apart(self, group: str) -> bool:
        """`group` is on a pool of its own, not its host's (then it runs a program of its own)."""
        return group in HOSTS and not self.together(group, HOSTS[group])

    def pool_at(self, rank: int) -> str:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size}")
        return next(name for name, ranks in self.pools.items() if rank in ranks)

    def roles_of(self, rank: int) -> set[str]:
        """The role groups on this rank's pool."""
        return set(self.groups_on(self.pool_at(rank)))

    def label(self, pool: str) -> str:
        """A pool as logs and timelines name it, by what it trains: "actor", "critic",
        "actor+critic"; a pool that trains nothing by its role group ("rollout", "reward")."""
        groups = self.groups_on(pool)
        return "+".join(g for g in groups if g in TRAINED) or "+".join(groups)

    def pool_label(self, rank: int) -> str:
        return self.label(self.pool_at(rank))

    def describe(self) -> str:
        """One line for the log, e.g. 'split: actor pool ranks [0, 1] | critic pool ranks [2, 3] (1 node x 2+2)'."""
        head = self.mode + ": "
        if len(self.pools) == 1:
            return (f"{head}actor and critic pools share ranks {_fmt_ranks(self.ranks('actor'))} "
                    f"({_plural(self.nnodes, 'node')} x {self.local_world_size}, roles take turns)")
        # In the order a step reaches them: a rollout pool apart first, then the actor's, ...
        order = sorted(self.pools, key=lambda name: min(ROLE_GROUPS.index(g) for g in self.groups_on(name)))
        lws = self.local_world_size
        per_node = [[sum(1 for r in self.pools[name] if r // lws == n) for n in range(self.nnodes)] for name in order]
        if all(len(set(counts)) == 1 and 0 < counts[0] < lws for counts in per_node):  # every node cut alike
            shape = f"{_plural(self.nnodes, 'node')} x " + "+".join(str(c[0]) for c in per_node)
        else:  # whole nodes per pool
            shape = "+".join(str(len(self.pools[name]) // lws) for name in order) + f" nodes x {lws}"
        return head + " | ".join(f"{self.label(n)} pool ranks {_fmt_ranks(self.pools[n])}" for n in order) + f" ({shape})"


def placed_with_hosts(roles: Mapping[str, str]) -> dict[str, str]:
    """Every role group's pool: as placed, else its host's (the critic's before reward's)."""
    where = dict(roles)
    for group in ROLE_GROUPS:
        where.setdefault(group, where.get(HOSTS.get(group, ""), ""))
    return {group: where[group] for group in ROLE_GROUPS}


def _is_empty(value) -> bool:
    return value is None or (isinstance(value, (Sequence, Mapping)) and not isinstance(value, (str, bytes))
                             and len(value) == 0)


def compile_layout(mode: str, pools, pool_unit: str, lws: int, nnodes: int, roles) -> tuple[dict, dict, str]:
    """The config's placement as (sizes {pool: size}, roles {role group: pool}, unit): the
    shorthands (split, colocate, custom [a, c]) written as the map they mean."""
    if mode not in MODES:
        raise PlacementError(f"placement.mode={mode!r} is unknown; use one of {', '.join(MODES)} "
                             "(e.g. placement.mode=split)")
    if pool_unit not in POOL_UNITS:  # checked whatever the mode: a typo should not sit silently
        raise PlacementError(f"placement.pool_unit={pool_unit!r} is unknown; use one of {', '.join(POOL_UNITS)} "
                             "(e.g. placement.pool_unit=ranks_per_node)")
    pools = None if _is_empty(pools) else pools  # an empty list is how a config leaves the sizes unset
    roles = None if _is_empty(roles) else roles
    shape = f"{_plural(nnodes, 'node')} x {_plural(lws, 'rank')}"
    if mode != "custom" and pools is not None:  # ignoring them would hide a config that means something else
        raise PlacementError(f"placement.pools={_fmt(pools)} is only used with placement.mode=custom "
                             f"(got placement.mode={mode}); drop placement.pools or set placement.mode=custom")
    if roles is not None:
        if not isinstance(roles, Mapping):
            raise PlacementError(f"placement.roles={_fmt(roles)}: expected a mapping role group -> pool name, "
                                 "e.g. placement.roles='{rollout: gen, actor: train, critic: train}'")
        if mode != "custom":
            raise PlacementError(
                f"placement.roles={_fmt(roles)} is only used with placement.mode=custom and placement.pools "
                f"a mapping name -> size (got placement.mode={mode}); drop placement.roles, or use e.g. "
                "placement.mode=custom placement.pools='{gen: 1, train: 1}' "
                "placement.roles='{rollout: gen, actor: train, critic: train}'")
        if not isinstance(pools, Mapping):
            raise PlacementError(
                f"placement.roles={_fmt(roles)} needs placement.pools as a mapping pool name -> size "
                + (f"(got placement.pools={_fmt(pools)}, which is [actor, critic]); " if pools is not None
                   else "(placement.pools is unset); ") + "e.g. placement.pools='{gen: 1, train: 1}'")
        return dict(pools), dict(roles), pool_unit
    if isinstance(pools, Mapping):
        raise PlacementError(f"placement.pools={_fmt(pools)} names pools: place the role groups on them with "
                             f"placement.roles, e.g. placement.roles='{{rollout: {next(iter(pools))}, "
                             f"actor: {list(pools)[-1]}}}'")
    two_pools = {"actor": "actor", "critic": "critic"}  # rollout and reward follow their hosts
    if mode == "colocate":
        return {"all": lws}, {"actor": "all"}, "ranks_per_node"
    if mode == "split":
        if nnodes == 1:
            if lws < 2 or lws % 2:
                alt = _alternatives(f"{_two_pool_hint('ranks_per_node', lws)} (an uneven split)" if lws >= 2 else None,
                                    "placement.mode=colocate")
                need = "at least 2 ranks" if lws < 2 else "an even number of ranks"
                raise PlacementError(f"placement.mode=split on one node needs {need} to cut in half, got {shape}; "
                                     f"launch an even number of ranks, or use {alt}")
            return {"actor": lws // 2, "critic": lws // 2}, two_pools, "ranks_per_node"
        if nnodes % 2:
            alt = _alternatives(_two_pool_hint("ranks_per_node", lws), _two_pool_hint("nodes", nnodes),
                                "placement.mode=colocate")
            raise PlacementError(f"placement.mode=split over several nodes gives each pool half of the nodes, "
                                 f"which needs an even number of nodes, got {shape}; use an even number of nodes, "
                                 f"or {alt}")
        return {"actor": nnodes // 2, "critic": nnodes // 2}, two_pools, "nodes"
    # custom [actor, critic]
    per_node = pool_unit == "ranks_per_node"
    total, other = (lws, _two_pool_hint("nodes", nnodes)) if per_node else (nnodes, _two_pool_hint("ranks_per_node", lws))
    if pools is None:
        alt = _alternatives(_two_pool_hint("ranks_per_node", lws), _two_pool_hint("nodes", nnodes))
        raise PlacementError("placement.mode=custom needs placement.pools=[actor, critic]" + (
            f"; for {shape} use {alt}" if alt else f"; {shape} has no room for two pools, use placement.mode=colocate"))
    if isinstance(pools, (str, bytes)) or not isinstance(pools, Sequence) or len(pools) != 2:
        raise PlacementError(f"placement.pools={_fmt(pools)} must be two sizes [actor, critic], e.g. placement.pools=[4,4]")
    if any(isinstance(p, bool) or not isinstance(p, int) for p in pools):  # True as a size is surely a mistake
        raise PlacementError(f"placement.pools={_fmt(pools)} must hold whole numbers, e.g. placement.pools=[4,4]")
    a, c = pools
    what = f"the ranks per node ({lws}, LOCAL_WORLD_SIZE)" if per_node else f"the number of nodes ({nnodes})"
    if total < 2:
        raise PlacementError(f"placement.pools={_fmt(pools)} with placement.pool_unit={pool_unit} must add up to "
                             f"{what}, which leaves no room for two pools of at least 1; use "
                             + _alternatives(other, "placement.mode=colocate"))
    example = f"placement.pools={_fmt(_cut(total, 2))}"
    if a < 1 or c < 1:
        raise PlacementError(f"placement.pools={_fmt(pools)}: each pool needs at least 1 "
                             f"{'rank per node' if per_node else 'node'}; with placement.pool_unit={pool_unit} the "
                             f"sizes add up to {what}, e.g. {example} (or placement.mode=colocate to put both roles "
                             "on every rank)")
    if a + c != total:
        raise PlacementError(f"placement.pools={_fmt(pools)} adds up to {a + c}, but with placement.pool_unit="
                             f"{pool_unit} it must add up to {what}, e.g. {example}")
    return {"actor": a, "critic": c}, two_pools, pool_unit


def lay_out(mode: str, sizes: Mapping, roles: Mapping, pool_unit: str, world_size: int, lws: int,
            nnodes: int) -> Placement:
    """The map made into ranks: pool by pool, the actor's pool first (world rank 0 logs), then
    the mapping's order; with ranks_per_node every node cut alike, with nodes whole nodes."""
    names = [str(n) for n in sizes]
    unit = "rank per node" if pool_unit == "ranks_per_node" else "node"
    for group, pool in roles.items():
        if group not in ROLE_GROUPS:
            raise PlacementError(f"placement.roles.{group}={pool}: unknown role group; the role groups are "
                                 f"{', '.join(ROLE_GROUPS)} (reward: the reward model and the rule reward, with the "
                                 "critic unless placed)")
        if not isinstance(pool, str) or pool not in names:
            raise PlacementError(f"placement.roles.{group}={pool}: no pool of that name in placement.pools="
                                 f"{_fmt(sizes)}; use one of {', '.join(names)}")
    if "actor" not in roles:
        raise PlacementError(f"placement.roles={_fmt(roles)} does not place the actor; add placement.roles.actor=<pool>, "
                             f"e.g. placement.roles.actor={names[0]} (the other role groups follow it unless placed)")
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int):
            raise PlacementError(f"placement.pools.{name}={size!r}: expected a whole number of {unit}s")
    where = placed_with_hosts(roles)
    unused = [n for n in names if n not in where.values()]
    if unused:
        raise PlacementError(f"placement.pools.{unused[0]}={sizes[unused[0]]}: no role group is placed on pool "
                             f"{unused[0]}; drop it or name it in placement.roles (e.g. placement.roles.rollout={unused[0]})")
    for name, size in sizes.items():
        if size < 1:
            raise PlacementError(f"placement.pools.{name}={size}: each pool needs at least 1 {unit}")
    total, what = ((lws, f"the ranks per node ({lws}, LOCAL_WORLD_SIZE)") if pool_unit == "ranks_per_node"
                   else (nnodes, f"the number of nodes ({nnodes})"))
    if sum(sizes.values()) != total:
        fit = f", e.g. placement.pools={_fmt(dict(zip(names, _cut(total, len(names)))))}" if total >= len(names) else (
            f", which has no room for {len(names)} pools of at least 1; put more role groups on one pool, or use "
            "placement.mode=colocate")
        raise PlacementError(f"placement.pools={_fmt(sizes)} adds up to {sum(sizes.values())}, but with "
                             f"placement.pool_unit={pool_unit} it must add up to {what}{fit}")
    order = [where["actor"]] + [n for n in names if n != where["actor"]]
    ranks: dict[str, list[int]] = {n: [] for n in order}
    start = 0
    for n in order:
        if pool_unit == "ranks_per_node":  # global rank = node * ranks per node + local rank (torchrun's numbering)
            ranks[n] = [node * lws + lr for node in range(nnodes) for lr in range(start, start + sizes[n])]
        else:
            ranks[n] = list(range(start * lws, (start + sizes[n]) * lws))
        start += sizes[n]
    return Placement(mode, world_size, lws, nnodes, ranks, where)


def plan_placement(mode: str, pools, pool_unit: str, world_size: int, local_world_size: int, nnodes: int,
                   roles: Mapping[str, str] | None = None, rollout_ranks: str = "actor",
                   overlap: bool = True) -> Placement:
    """Work out the pools from the config and the launch shape. Pure: no torch.distributed, so
    every rank gets the same answer and a bad config fails before any group exists. `pools`: a
    list [actor, critic] or a mapping pool name -> size (in `pool_unit`s); with a mapping, `roles`
    maps role groups to pool names. `rollout_ranks="all"` (rollout.ranks) puts the rollout group,
    sitting with the actor, on the critic's pool too, where that is a pool of its own (a rollout
    pool of its own keeps its ranks: preflight refuses that combination by name)."""
    for name, v in (("world size", world_size), ("ranks per node", local_world_size), ("nodes", nnodes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PlacementError(f"launch shape: {name} must be a positive integer, got {v!r}")
    if world_size != local_world_size * nnodes:
        raise PlacementError(f"launch shape: world size {world_size} != {local_world_size} ranks per node x "
                             f"{nnodes} nodes; launch the same number of ranks on every node "
                             "(torchrun --nproc-per-node N on each node)")
    sizes, where, unit = compile_layout(mode, pools, pool_unit, local_world_size, nnodes, roles)
    laid_out = lay_out(mode, sizes, where, unit, world_size, local_world_size, nnodes)
    spans = {}
    if rollout_ranks == "all" and not laid_out.apart("rollout") and not laid_out.together("actor", "critic"):
        spans = {"rollout": (laid_out.pool_of("critic"),)}
    return dataclasses.replace(laid_out, spans=spans, overlap=overlap)


def plan_from_config(cfg, world_size: int, local_world_size: int, nnodes: int) -> Placement:
    """plan_placement from the config (OmegaConf or any object with `placement.mode`, `.pools`,
    `.pool_unit`, `.roles`, `.overlap` and `rollout.ranks`), containers turned into plain lists and dicts."""
    def plain(value):
        if isinstance(value, Mapping):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
            return [plain(v) for v in value]
        return value

    placement_cfg = cfg.placement
    return plan_placement(
        placement_cfg.mode, plain(placement_cfg.pools), placement_cfg.pool_unit,
        world_size, local_world_size, nnodes, plain(placement_cfg.roles),
        rollout_ranks=cfg.rollout.ranks, overlap=placement_cfg.overlap,
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
