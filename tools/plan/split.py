"""`python -m tools.plan --world-size W [--ranks-per-node L] [-- key=value ...]`

(`python -m tools.plan --memory ...` predicts per-rank memory instead: see tools/plan/memory.py.)

Picks the actor/critic split of a world for a workload: verl's "give the slower pool more
ranks", made automatic. It profiles a short `split` run of the workload (2 ranks, 1+1, with
`placement.overlap=false` so each phase is timed with the other pool idle), then predicts the
step time of every candidate split and prints the best one as a ready override line.

The model is linear scaling:
  * each data-parallel phase (gen, old_log_prob, ref, update_actor on the actor pool; values,
    reward, adv, update_critic on the critic pool) takes  T_measured * profiled_size / pool_size;
    sync_weights (a full copy of the weights) does not shrink with the pool;
  * a pool's busy time is the sum of its phases, and with overlap the step is
    max(actor busy, critic busy) + the measured exchange transfer time;
  * with rollout.ranks=all (the last column) gen is spread over every rank, but the critic pool
    then generates instead of running its update on into the next rollout, and the weights cross
    once more: 2 x sync + gen x actor/(actor+critic) + max(rest of the actor pool, critic busy) +
    exchange. Where that is below the predicted step, `rollout.ranks=all` pays off.
It ignores: how FSDP's all-gathers/reduce-scatters grow with the pool size; the dependencies
inside a step (the critic cannot start values before gen ends, so max() is a steady-state
bound); fixed per-micro-batch costs and what too few rows per rank do to them; memory limits;
exchange time changing with the number of pool pairs; nodes' network vs in-node links.

Candidates: on one node, every a + c = W; with --ranks-per-node L < W, every per-node split
a + c = L (pool_unit=ranks_per_node) and every node-level split (pool_unit=nodes). Only the
candidates that `spmdsplit.preflight` and `spmdsplit.placement` accept (batch sizes dividing
over the pools, ...) are ranked; the others are listed with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tools.bench.analysis import analyze
from tools.jobs import BenchError, pick_device, run_job
from tools.report import fmt

ACTOR_PHASES = ("gen", "old_log_prob", "ref", "update_actor")
CRITIC_PHASES = ("values", "reward", "adv", "update_critic")
ACTOR_FIXED = ("sync_weights",)


def pool_busy(phases: dict[str, float], scaled, fixed, profiled_size: int, size: int) -> float:
    """Seconds a pool of `size` ranks is busy per step, from phase times measured on `profiled_size`."""
    return sum(phases.get(p, 0.0) for p in scaled) * profiled_size / size + sum(phases.get(p, 0.0) for p in fixed)


def predict(profile: dict, actor_size: int, critic_size: int) -> dict[str, float]:
    actor = pool_busy(profile["actor"], ACTOR_PHASES, ACTOR_FIXED, profile["actor_size"], actor_size)
    critic = pool_busy(profile["critic"], CRITIC_PHASES, (), profile["critic_size"], critic_size)
    exchange = profile.get("exchange_s") or 0.0
    return {"actor_s": actor, "critic_s": critic, "exchange_s": exchange, "step_s": max(actor, critic) + exchange,
            "all_step_s": predict_ranks_all(profile, actor_size, critic_size)}


def predict_ranks_all(profile: dict, actor_size: int, critic_size: int) -> float:
    """The step with rollout.ranks=all: generation spread over every rank, but nothing else of the
    step overlaps it any more (the critic ranks generate instead of finishing their update into the
    next rollout), and the weights cross once more (a broadcast costed like the actor's own sync)."""
    actor, critic, size = profile["actor"], profile["critic"], profile["actor_size"]
    sync = actor.get("sync_weights", 0.0)
    gen = actor.get("gen", 0.0) * size / (actor_size + critic_size)
    actor_rest = sum(actor.get(p, 0.0) for p in ACTOR_PHASES if p != "gen") * size / actor_size
    critic_busy = pool_busy(critic, CRITIC_PHASES, (), profile["critic_size"], critic_size)
    return 2 * sync + gen + max(actor_rest, critic_busy) + (profile.get("exchange_s") or 0.0)


def candidates(world: int, ranks_per_node: int | None = None) -> list[tuple[str, int, int, int, int]]:
    """(pool_unit, a, c, actor ranks, critic ranks) for every split of the world into two pools."""
    lws = ranks_per_node or world
    if world % lws:
        raise ValueError(f"--world-size {world} is not a multiple of --ranks-per-node {lws}")
    nnodes = world // lws
    out = [("ranks_per_node", a, lws - a, a * nnodes, (lws - a) * nnodes) for a in range(1, lws)]
    out += [("nodes", a, nnodes - a, a * lws, (nnodes - a) * lws) for a in range(1, nnodes)]
    return out


def override_line(unit: str, a: int, c: int) -> str:
    return f"placement.mode=custom placement.pool_unit={unit} placement.pools=[{a},{c}]"


def rejection(overrides: list[str], unit: str, a: int, c: int, world: int, lws: int) -> str | None:
    """Why the job would refuse this split (the trainer's own checks), or None if it would run."""
    from spmdsplit.config import load_config
    from spmdsplit.errors import ConfigError
    from spmdsplit.placement import PlacementError, plan_placement
    from spmdsplit.preflight import check_against_pools, check_config

    try:
        cfg = load_config(None, list(overrides) + override_line(unit, a, c).split())
        check_config(cfg)
        placement = plan_placement("custom", [a, c], unit, world, lws, world // lws)
        check_against_pools(cfg, {"actor": len(placement.ranks("actor")), "critic": len(placement.ranks("critic"))})
    except (ConfigError, PlacementError) as e:
        return str(e)
    return None


def rank_candidates(profile: dict, world: int, lws: int | None, overrides: list[str]) -> tuple[list[dict], list[dict]]:
    """(accepted candidates best first, rejected ones with their reason). Ties go to the split
    whose pools are busy for the most similar times: less idle on the faster pool."""
    lws = lws or world
    accepted, rejected = [], []
    for unit, a, c, n_actor, n_critic in candidates(world, lws):
        row = {"pool_unit": unit, "pools": [a, c], "actor_ranks": n_actor, "critic_ranks": n_critic,
               "override": override_line(unit, a, c)}
        reason = rejection(overrides, unit, a, c, world, lws)
        if reason:
            rejected.append({**row, "reason": reason})
        else:
            accepted.append({**row, **predict(profile, n_actor, n_critic)})
    accepted.sort(key=lambda r: (r["step_s"], abs(r["actor_s"] - r["critic_s"])))
    return accepted, rejected


def profile_workload(overrides: list[str], nproc: int, steps: int, warmup: int, out: str) -> dict:
    """Per-phase costs of each pool, from a short blocking `split` run on nproc ranks (halves)."""
    device = pick_device(overrides, nproc)
    run = [*overrides, f"trainer.total_steps={steps}", f"trainer.device={device}",
           "placement.mode=split", "placement.pools=[]", "placement.overlap=false"]
    trace, scalars = run_job(nproc, run, os.path.join(out, "profile"))
    m = analyze(trace, scalars, warmup)
    return {"device": device, "workload": list(overrides), "overrides": run,
            "actor_size": nproc // 2, "critic_size": nproc // 2,
            "actor": m["phases"].get("actor", {}), "critic": m["phases"].get("critic", {}),
            "exchange_s": m["exchange"]["transfer_s"], "step_time_s": m["step_time_s"]}


def render(profile: dict, accepted: list[dict], rejected: list[dict]) -> str:
    f = fmt
    lines = [f"Profile: split {profile['actor_size']}+{profile['critic_size']} on {profile['device']}, "
             f"step {f(profile.get('step_time_s'))} s; exchange transfer {f(profile.get('exchange_s'))} s/step", "",
             "| placement.pools | pool_unit | actor ranks | critic ranks | actor busy (s) | critic busy (s) | "
             "predicted step (s) | with rollout.ranks=all (s) |", "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(accepted):
        mark = " (chosen)" if i == 0 else ""
        pays = " (pays off)" if r["all_step_s"] < r["step_s"] else ""
        lines.append(f"| [{r['pools'][0]},{r['pools'][1]}]{mark} | {r['pool_unit']} | {r['actor_ranks']} | "
                     f"{r['critic_ranks']} | {f(r['actor_s'])} | {f(r['critic_s'])} | {f(r['step_s'])} | "
                     f"{f(r['all_step_s'])}{pays} |")
    lines += [f"- not possible: [{r['pools'][0]},{r['pools'][1]}] {r['pool_unit']}: {r['reason']}" for r in rejected]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tools.plan", description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, required=True, help="ranks of the job to plan (W)")
    p.add_argument("--ranks-per-node", type=int, help="ranks per node (L); default: one node of W")
    p.add_argument("--nproc", type=int, default=2, help="ranks of the profiling run (default 2: 1+1)")
    p.add_argument("--steps", type=int, default=5, help="steps of the profiling run")
    p.add_argument("--warmup", type=int, default=2, help="first profiled steps left out of the medians")
    p.add_argument("--profile", help="reuse a profile.json from an earlier plan instead of profiling")
    p.add_argument("--out", default="outputs/plan", help="where the profiling job and plan.json go")
    p.add_argument("overrides", nargs="*", help="key=value train overrides: the workload")
    args = p.parse_args(argv)
    try:
        candidates(args.world_size, args.ranks_per_node)
        if args.profile:
            with open(args.profile) as fh:
                profile = json.load(fh)
            if profile.get("workload") != args.overrides:  # phase costs belong to one workload
                print(f"tools.plan: warning: {args.profile} profiled {profile.get('workload')}", file=sys.stderr)
        else:
            print(f"tools.plan: profiling the workload on {args.nproc} ranks ...", file=sys.stderr, flush=True)
            profile = profile_workload(args.overrides, args.nproc, args.steps, args.warmup, args.out)
    except (ValueError, BenchError) as e:
        print(f"tools.plan: error: {e}", file=sys.stderr)
        return 1
    accepted, rejected = rank_candidates(profile, args.world_size, args.ranks_per_node, args.overrides)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile.json"), "w") as fh:
        json.dump(profile, fh, indent=1)
    with open(os.path.join(args.out, "plan.json"), "w") as fh:
        json.dump({"profile": profile, "candidates": accepted, "rejected": rejected}, fh, indent=1)
    print(render(profile, accepted, rejected))
    if not accepted:
        print("tools.plan: error: no split of this world fits the workload's batch sizes", file=sys.stderr)
        return 1
    print(f"\nChosen, as overrides for `torchrun --nproc-per-node {args.ranks_per_node or args.world_size} "
          "-m spmdsplit.train`:")
    print(accepted[0]["override"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
