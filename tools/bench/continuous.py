"""`python -m tools.bench --continuous [--steps S] [--warmup W] [--engine vllm|hf]`

Issue 40's question: on a long-tailed generation shape, what does continuous generation
(rollout.continuous) give over today's batches a step ahead (rollout.staleness=1)? Two real
`torchrun -m spmdsplit.train` jobs on 2 ranks (rollout | actor, GRPO, no critic), the same workload:

  * the model: a random Qwen2 (tools.models) whose EOS comes with probability 1/32 at every
    position, so response lengths spread geometrically: mean ~31 of at most 128 tokens (the
    issue's shape: the mean at most a quarter of the maximum), the longest of a batch near 128;
  * training cheap beside generation (one mini-batch, one epoch, a small model), as on GPUs where
    decoding long answers dominates an RL step.

Per mode, medians over the steps after the warmup (async_rollout.analyze: the period between rank
0's step ends; rank 0 is the actor): trained tokens per second (the response tokens each step
trains, over the step period), the engine's occupancy (requests running per engine step:
measured by the continuous engine; for batches derived as rows x mean length / longest, since each
request runs for its length and the batch for its longest), and the staleness of the trained
tokens (mean versions behind the policy that trains them); with partial rollouts the answers
running when a batch is handed over wait for the next weights instead of going on.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

from tools.bench import analysis, async_rollout
from tools.jobs import run_job
from tools.models import build_random_qwen2
from tools.report import fmt, run_and_write

MODEL = dict(hidden=64, layers=2, heads=2, kv_heads=1, mlp=128, max_positions=256)  # heads of 32: vLLM's CPU kernel
EOS_RATE = 1 / 32
PROMPTS, N, MAX_RESPONSE = 16, 4, 128
# configs/grpo_rollout_actor.yaml's layout and algorithm (a job's overrides follow the tools' own)
GRPO_ROLLOUT_ACTOR = ["placement.mode=custom", "placement.pool_unit=ranks_per_node", "placement.pools={gen: 1, train: 1}",
                      "placement.roles={rollout: gen, actor: train}", "algorithm.adv_estimator=grpo",
                      "algorithm.rollout_correction.rollout_is=token"]
WORKLOAD = [*GRPO_ROLLOUT_ACTOR, f"data.train_batch_size={PROMPTS}", f"rollout.n={N}",
            f"data.max_response_length={MAX_RESPONSE}", f"actor.ppo_mini_batch_size={PROMPTS}",
            f"actor.ppo_micro_batch_size_per_gpu={PROMPTS * N}", "trainer.num_threads=1", "trainer.seed=1",
            "trainer.device=cpu", "rollout.max_num_batched_tokens=16384", "trainer.val_freq=0",
            "trainer.val_before_train=false", "trainer.save_freq=-1"]
# With a bound on every token's staleness a request may only start when the batch it will land in
# allows the weights held (ContinuousGeneration.admits): at s=1 that keeps at most about one
# batch in flight, as batches a step ahead do; a larger bound lets more in, the tokens' mean
# staleness (measured) says what that costs.
KEEP_KV = ["rollout.kv_after_load=keep", "rollout.enable_prefix_caching=false"]
MODES = {
    "batches s=1": ["rollout.staleness=1"],
    "continuous s=1": ["rollout.staleness=1", "rollout.continuous=true"],
    "continuous s=1, KV kept": ["rollout.staleness=1", "rollout.continuous=true", *KEEP_KV],
    "continuous s=2, KV kept": ["rollout.staleness=2", "rollout.continuous=true", *KEEP_KV],
    "continuous + partial rollouts s=1, KV kept": ["rollout.staleness=1", "rollout.continuous=true",
                                                   "rollout.partial_rollout=true", *KEEP_KV],
}
TARGET_SPEEDUP = 1.8


def occupancy(mode: dict, scalars: dict) -> float | None:
    """Requests running per engine step: the continuous engine counts it; a batch's is its rows x
    mean length / longest (every request runs for its length, the batch for its longest)."""
    steady = mode["steady"]
    if "rollout/occupancy" in scalars:
        return analysis.median(v for k, v in scalars["rollout/occupancy"].items() if k in steady)
    means, maxes = scalars.get("response_length/mean", {}), scalars.get("response_length/max", {})
    return analysis.median(PROMPTS * N * means[k] / maxes[k] for k in steady if k in means and maxes.get(k))


def engine_steps(mode: dict, scalars: dict) -> float | None:
    """Engine steps per batch: counted by the continuous engine; a batch's is its longest response
    (vLLM decodes one token per request per step). On a GPU a decode step costs about the same at
    any occupancy this small, so the ratio of these is the speedup a GPU would see on this shape;
    on CPU a step costs more the more requests it runs."""
    steady = set(mode["steady"])
    by_step = scalars.get("rollout/engine_steps") or scalars.get("response_length/max", {})
    return analysis.median(v for k, v in by_step.items() if k in steady)


def staleness(scalars: dict, steady: set[int], s: int) -> float | None:
    """Mean versions behind the trained policy: measured per token in continuous mode; s for batches
    (every token of batch k is update k-1-s's, k > s)."""
    if "rollout/token_staleness_mean" in scalars:
        return analysis.median(v for k, v in scalars["rollout/token_staleness_mean"].items() if k in steady)
    return float(s)


def run(args) -> dict:
    import torch

    os.makedirs(args.out, exist_ok=True)
    model = os.path.join(args.out, "continuous_model")
    params = build_random_qwen2(model, **MODEL, eos_rate=EOS_RATE)
    workload = WORKLOAD + [f"model.path={os.path.abspath(model)}", f"trainer.total_steps={args.steps}",
                           f"rollout.name={args.engine}"] + list(args.overrides)
    modes = {}
    for i, (name, extra) in enumerate(MODES.items(), 1):
        print(f"tools.bench: [{i}/{len(MODES)}] {name}: {' '.join(extra)}", file=sys.stderr, flush=True)
        start = time.time()
        slug = name.replace(" ", "_").replace("=", "")
        trace, scalars = run_job(2, workload + extra, os.path.join(args.out, slug))
        s = async_rollout.staleness_of(extra)
        mode = {"overrides": extra, "wall_s": time.time() - start,
                **async_rollout.analyze(trace, scalars, args.warmup, PROMPTS * N, s)}
        mode["steady"] = set(async_rollout.steady_steps(args.steps, args.warmup, s))
        mode["occupancy"] = occupancy(mode, scalars)
        mode["token_staleness"] = staleness(scalars, mode["steady"], s)
        mode["restarted"] = sum(scalars.get("rollout/requests_restarted", {}).values())
        mode["engine_steps"] = engine_steps(mode, scalars)
        mode["steady"] = sorted(mode["steady"])
        modes[name] = mode
    base = modes["batches s=1"]["tokens_per_s"]
    speedups = {name: analysis.ratio(d["tokens_per_s"], base) for name, d in modes.items() if name != "batches s=1"}
    speedup = max((v for v in speedups.values() if v is not None), default=None)
    meta = {"device": "cpu", "torch": torch.__version__, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "model": MODEL, "params": params, "eos_rate": EOS_RATE, "workload": workload, "steps": args.steps,
            "warmup": args.warmup, "engine": args.engine}
    return {"schema": "spmdsplit.bench_continuous/1", "meta": meta, "modes": modes,
            "target": {"speedup": speedup, "speedups": speedups, "bound": TARGET_SPEEDUP,
                       "met": speedup is not None and speedup >= TARGET_SPEEDUP}}


def render_markdown(report: dict) -> str:
    m, modes, t = report["meta"], report["modes"], report["target"]
    lines = [f"# Continuous generation vs batches a step ahead ({m['date']}, {m['device']}, {m['engine']} engine)", "",
             f"Random Qwen2 {m['model']} ({m['params']:,} parameters), EOS rate {m['eos_rate']:.4f}; "
             f"{PROMPTS} prompts x {N}, responses up to {MAX_RESPONSE} tokens; {m['steps']} steps, medians after "
             f"step {m['warmup']}.", "",
             "| mode | step (s) | trained tokens/s | x batches | tokens/step | engine steps/batch | occupancy "
             "(requests/engine step) | staleness (versions) | restarted | rollout gen (s) | rollout busy | "
             "actor update (s) | actor waits for rows (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, d in modes.items():
        phases = d.get("phases", {})
        rollout = phases.get("rollout", {})
        actor = next((v for k, v in phases.items() if "actor" in k.split("+")), {})
        gen = (rollout.get("gen") or 0) + (rollout.get("gen_ahead") or 0)
        lines.append(f"| {name} | {fmt(d['step_time_s'])} | {fmt(d['tokens_per_s'])} | "
                     f"{fmt(t['speedups'].get(name, 1.0), '{:.2f}')} | {fmt(d['response_tokens_per_step'])} | "
                     f"{fmt(d['engine_steps'], '{:.0f}')} | {fmt(d['occupancy'], '{:.1f}')} | "
                     f"{fmt(d['token_staleness'], '{:.2f}')} | {d['restarted']:.0f} | {fmt(gen)} | "
                     f"{fmt(d['busy_share'].get('rollout'), '{:.2f}')} | {fmt(actor.get('update_actor'))} | "
                     f"{fmt(actor.get('exchange/generated'))} |")
    lines += ["", f"Best continuous mode over batches: {fmt(t['speedup'], '{:.2f}')}x trained tokens/s (target >= "
              f"{t['bound']}x: {'met' if t['met'] else 'missed'}). Rollout gen: the rollout pool's generating time "
              "per step (continuous: its batch's and the time it generates on while the weights are on their way)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="tools.bench --continuous", description=__doc__.splitlines()[0])
    p.add_argument("--continuous", action="store_true")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--engine", choices=("vllm", "hf"), default="vllm")
    p.add_argument("--out", default="outputs/bench_continuous")
    p.add_argument("overrides", nargs="*", help="key=value train overrides for every mode")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    return run_and_write(args.out, "bench_continuous", run, render_markdown, args)
