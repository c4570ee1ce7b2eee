"""`python -m tools.bench.judge [--steps S] [--warmup W] [--modes ...] [--out DIR]`

Also `python -m tools.bench --judge [...]`. Where an LLM judge (reward.judge, spmdsplit/rewards/judge.py)
costs a step: PPO on the embedded task with a policy of some weight (POLICY: a random ~3.6M-parameter
Qwen2 answering 32 tokens, 64 samples a step) and a judge model as its only reward, each mode a real
`torchrun -m spmdsplit.train` job:

- `rule reward`: no judge (split 1+1 on 2 ranks): the step without one;
- `judge on the critic pool`: split 1+1, the judge with the critic group (it scores on the critic's
  rank while the actor's rank computes log-probs);
- `judge on a pool of its own`: 3 ranks, one each for the actor, critic and reward groups;
- `judge through the endpoint`: as on the critic pool, but an async custom function calls the judge
  with the `openai` client at reward_router_address (verl's genrm shape), 64 calls at once.

The judge: a random Qwen2 (BENCH_JUDGE, ~1.6M parameters) on the embedded tokenizer, whose head never
picks its EOS, so that every verdict is `--verdict-tokens` long (it writes no number: every verdict
scores on_parse_error, which the timing does not mind). Per mode: the reward group's `reward` phase
per step (median after the warmup), the actor pool's log-prob passes (`old_log_prob` + `ref`), the
critic pool's `values`, the step time, the judge engine's tokens per second of scoring, and the share of the judge's time the step hid: 1 - (step -
the rule reward's step) / scoring. On this 2-core machine the 3-rank mode oversubscribes the cores.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

from tools.bench import analysis
from tools.jobs import run_job
from tools.models import build_random_qwen2
from tools.report import fmt, run_and_write

BENCH_JUDGE = dict(hidden=256, layers=2, heads=4, kv_heads=2, mlp=512)
# The policy: a random Qwen2 of tools.bench's --gen-heavy shape (~3.6M parameters) answering 32 tokens,
# so that the actor pool's log-prob passes weigh what the judge's scoring does (on the embedded toy,
# 0.04 s against 0.3 s, nothing could hide behind them).
POLICY = dict(hidden=256, layers=4, heads=8, kv_heads=2, mlp=768)
POLICY_WORKLOAD = ["data.max_response_length=32", "data.train_batch_size=64", "actor.ppo_mini_batch_size=32",
                   "critic.ppo_mini_batch_size=32", "actor.ppo_micro_batch_size_per_gpu=16",
                   "critic.ppo_micro_batch_size_per_gpu=16"]
PROMPT = "[{role: user, content: '{prompt}{response}='}]"
ENDPOINT_FN = '''"""bench_judge's async reward function: the judge through its endpoint, with the openai client."""
from openai import AsyncOpenAI

CLIENTS = {{}}


async def judged(data_source, solution_str, ground_truth, extra_info, reward_router_address, prompt_str):
    client = CLIENTS.get(reward_router_address)
    if client is None:
        client = CLIENTS[reward_router_address] = AsyncOpenAI(base_url=f"http://{{reward_router_address}}/v1",
                                                              api_key="unused", max_retries=0)
    reply = await client.chat.completions.create(
        model="judge", messages=[{{"role": "user", "content": prompt_str + solution_str + "="}}],
        max_tokens={tokens}, temperature=0)
    return len(reply.choices[0].message.content) / 1000.0
'''
WORKLOAD = ["trainer.num_threads=1", "trainer.seed=1", "trainer.device=cpu", "trainer.val_freq=-1",
            "trainer.save_freq=-1", "trainer.output_dir="]
SPLIT = ["placement.mode=split"]
OWN_POOL = ["placement.mode=custom", "placement.pools={policy: 1, value: 1, rm: 1}",
            "placement.roles={actor: policy, critic: value, reward: rm}"]
JUDGE = ["reward.judge.path=JUDGE", f"reward.judge.prompt={PROMPT}", "reward.judge.max_tokens=TOKENS",
         "reward.judge.range=[0,9]"]
MODES = {  # mode -> (ranks, overrides): JUDGE, TOKENS and FUNCTIONS filled in
    "rule reward": (2, SPLIT),
    "judge on the critic pool": (2, SPLIT + JUDGE),
    "judge on a pool of its own": (3, OWN_POOL + JUDGE),
    "judge through the endpoint": (2, SPLIT + JUDGE + ["reward.custom_fn.path=FUNCTIONS", "reward.custom_fn.name=judged"]),
}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="tools.bench.judge", description=__doc__.splitlines()[0])
    p.add_argument("--judge", action="store_true", help=argparse.SUPPRESS)  # from python -m tools.bench --judge
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    p.add_argument("--verdict-tokens", type=int, default=16, help="every verdict's length (reward.judge.max_tokens)")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--out", default="outputs/bench_judge")
    p.add_argument("overrides", nargs="*", help="key=value train overrides for every mode")
    return p.parse_args(argv)


def build_judge(folder: str) -> str:
    """BENCH_JUDGE, random (tools/models.py, its head never picking its EOS: every verdict runs to
    max_tokens), with a chat template that writes the messages' contents end to end."""
    from transformers import AutoTokenizer

    if not os.path.isfile(os.path.join(folder, "config.json")):
        build_random_qwen2(folder, **BENCH_JUDGE, long_answers=True, max_positions=128)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        tokenizer.chat_template = "{%- for m in messages -%}{{ m['content'] }}{%- endfor -%}"
        tokenizer.save_pretrained(folder)
    return folder


def build_policy(folder: str) -> str:
    """POLICY, random, answering at length (every response runs to data.max_response_length)."""
    if not os.path.isfile(os.path.join(folder, "config.json")):
        build_random_qwen2(folder, **POLICY, long_answers=True)
    return folder


def run(args) -> dict:
    os.makedirs(args.out, exist_ok=True)
    judge = build_judge(os.path.join(args.out, "judge"))
    policy = build_policy(os.path.join(args.out, "policy"))
    functions = os.path.join(args.out, "judge_functions.py")
    with open(functions, "w") as f:
        f.write(ENDPOINT_FN.format(tokens=args.verdict_tokens))
    rows = {}
    for mode in args.modes:
        ranks, overrides = MODES[mode]
        overrides = [o.replace("=JUDGE", f"={judge}").replace("TOKENS", str(args.verdict_tokens))
                     .replace("FUNCTIONS", functions) for o in overrides]
        trace, scalars = run_job(ranks, [*WORKLOAD, *POLICY_WORKLOAD, f"model.path={os.path.abspath(policy)}",
                                         f"trainer.total_steps={args.steps}", *overrides, *args.overrides],
                                 os.path.join(args.out, mode.replace(" ", "_")))
        phases = analysis.pool_phase_medians(analysis.complete_events(trace), analysis.pools_by_rank(trace), args.warmup)
        reward_pool = "reward" if "reward" in phases and "reward" in phases["reward"] else "critic"
        actor = phases.get("actor", {})
        rows[mode] = {
            "ranks": ranks,
            "reward_s": phases.get(reward_pool, {}).get("reward"),
            "log_probs_s": (actor.get("old_log_prob") or 0.0) + (actor.get("ref") or 0.0) or None,
            "values_s": phases.get("critic", {}).get("values"),
            "step_s": analysis.median_after_warmup(scalars.get("timing_s/step", {}), args.warmup),
            "judge_tokens": analysis.median_after_warmup(scalars.get("reward/judge/engine_tokens", {}), args.warmup),
        }
        # The engine's tokens over the scoring phase: the endpoint's calls counted as the rows' own verdicts.
        tokens, seconds = rows[mode]["judge_tokens"], rows[mode]["reward_s"]
        rows[mode]["judge_tokens_per_s"] = tokens / seconds if tokens and seconds else None
        print(f"bench_judge: {mode}: reward {fmt(rows[mode]['reward_s'])} s, step {fmt(rows[mode]['step_s'])} s",
              file=sys.stderr, flush=True)
    return {"date": datetime.date.today().isoformat(), "steps": args.steps, "warmup": args.warmup,
            "verdict_tokens": args.verdict_tokens, "modes": rows}


def render_markdown(report: dict) -> str:
    lines = [f"# An LLM judge's cost ({report['date']})", "",
             f"PPO, a random ~3.6M-parameter policy answering 32 tokens, 64 samples a step, scored by a random judge "
             f"writing {report['verdict_tokens']}-token verdicts; {report['steps']} steps, medians after "
             f"{report['warmup']}. Phases in seconds per step.", "",
             "| mode | ranks | scoring (reward phase) | actor log-probs (old + ref) | critic values | step | "
             "judge's time hidden | judge tokens/s |", "|---|---|---|---|---|---|---|---|"]
    base = report["modes"].get("rule reward", {}).get("step_s")
    for mode, r in report["modes"].items():
        hidden = None
        if base and r["step_s"] and r["reward_s"] and mode != "rule reward":
            hidden = min(1.0, max(0.0, 1 - (r["step_s"] - base) / r["reward_s"]))  # within the steps' noise
        lines.append(f"| {mode} | {r['ranks']} | {fmt(r['reward_s'])} | {fmt(r['log_probs_s'])} | {fmt(r['values_s'])} | "
                     f"{fmt(r['step_s'])} | {fmt(hidden, '{:.0%}')} | {fmt(r['judge_tokens_per_s'], '{:.0f}')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return run_and_write(args.out, "bench_judge", run, render_markdown, args)


if __name__ == "__main__":
    sys.exit(main())
