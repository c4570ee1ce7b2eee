"""`python -m tools.bench.agent [--steps S] [--warmup W] [--batch B] [--repeats R] [--engine hf|vllm] [--skip-turn] [--out DIR]`

Also `python -m tools.bench --agent [...]`. What multi-turn tool calls cost (spmdsplit/agent/),
against the issue's targets, with a tool that sleeps 0.2 s per call (a plain function in a
verl-format tool YAML, written under --out):

1. One tool turn of 32 episodes, in this process: `Tools.run` of 32 calls, and the whole
   `AgentLoop.generate` of 32 prompts (HF engine, embedded agent model, compact format,
   max_assistant_turns=2, so an episode calls at most once) with the sleeping tool and with one that
   answers at once. A random model seldom writes the call "@", so a logit bias of AT_BOOST on "@"
   makes nearly every first turn a call; the calls and tool rounds that happened are counted.
   Target: the turn adds <= 0.4 s to generation (gen sleeping - gen instant, per tool round).
2. Three real `torchrun -m spmdsplit.train` jobs on 2 ranks, a rollout pool of its own at
   staleness 1 (tools/bench/async_rollout.py's analysis), data.task=lookup with configs/agent_lookup.yaml:
   multi-turn with the sleeping tool vs rollout.multi_turn.enable=false, the same workload; and
   multi-turn with the instant tool, which tells the tool's latency from multi-turn's other costs
   (more engine calls per batch, tool tokens in the rows).
   Also the embedded echo environment's episodes (3 one-token turns, each step sleeping as the
   tool does), batch and continuous: modes "environment" and "environment, continuous"; and the
   same episodes driven by an agent harness through the OpenAI endpoint, "environment, harness"
   and "environment, harness, continuous" (target: its gen per batch, continuous its step period,
   <= 1.3x the agent loop's).
   Targets: the train pool's step period grows <= 10 %, and the rollout pool's gen per batch stays
   shorter than the train pool's work per step (its busy time, waits left out).

The analysis functions are pure (numbers in, rows and Markdown out): tests/test_bench_agent.py.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

from tools.bench import analysis, async_rollout
from tools.jobs import run_job
from tools.report import fmt, run_and_write

SLEEP_S, EPISODES, AT_BOOST = 0.2, 32, 10.0  # SLEEP_S: the tool latency (--tool-s changes it)
PRESET = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs",
                      "agent_lookup.yaml")
TARGETS = {"turn_added_s": 0.4, "step_growth": 0.10, "harness_gen": 1.3}
TOOL_FILE = '''"""bench_agent's tools: one that waits {sleep_s} s per call, one that answers at once; and an environment."""
import time

from spmdsplit.agent.echo import EchoDigits


def sleepy() -> str:
    """Waits {sleep_s} s, then answers a code."""
    time.sleep({sleep_s})
    return "0000"


def instant() -> str:
    """Answers a code at once."""
    return "0000"


class SleepyEcho(EchoDigits):
    """The embedded echo environment, each step waiting {sleep_s} s as the sleeping tool does."""

    def step(self, action):
        time.sleep({sleep_s})
        return super().step(action)


async def echo_harness(client, row):
    """The same episodes driven through the OpenAI endpoint (rollout.agent.harness): SleepyEcho's
    digit shown as a user message, a one-token answer, the step (in a thread: it sleeps) shown next."""
    import asyncio
    import hashlib

    env = SleepyEcho(turns=3)
    shown = env.reset(seed=int.from_bytes(hashlib.sha256(str(row["uid"]).encode()).digest()[:4], "big"))
    messages, reward = [{{"role": "user", "content": shown.text}}], 0.0
    for _ in range(3):
        answer = await client.chat.completions.create(model="policy", messages=messages, max_tokens=1)
        text = answer.choices[0].message.content or ""
        shown = await asyncio.to_thread(env.step, text)
        reward += shown.reward
        if shown.done:
            break
        messages += [{{"role": "assistant", "content": text}}, {{"role": "user", "content": shown.text}}]
    return reward
'''
ROLLOUT_TRAIN = ["placement.mode=custom", "placement.pool_unit=ranks_per_node", "placement.pools={gen: 1, train: 1}",
                 "placement.roles={rollout: gen, actor: train}", "rollout.staleness=1", "algorithm.adv_estimator=grpo",
                 "rollout.n=4", "algorithm.rollout_correction.rollout_is=token", "data.task=lookup"]
WORKLOAD = ["trainer.num_threads=1", "trainer.seed=1", "trainer.device=cpu"]
# mode -> (rollout.multi_turn.enable, tool, other overrides); the instant tool tells the tool's latency from
# multi-turn's other costs; continuous generation (rollout.continuous) runs each episode's turns as its calls return
CONTINUOUS = ["rollout.continuous=true"]
# The embedded echo environment's episodes (configs/environment_echo.yaml's keys; ENVIRONMENT is
# filled in with the sleeping environment's path): 3 one-token turns, each stepped in SLEEP_S.
ECHO = ["data.task=echo", "data.max_prompt_length=4", "data.max_response_length=8", "rollout.multi_turn.max_turn_length=1",
        "rollout.multi_turn.environment_kwargs={turns: 3}", "ENVIRONMENT"]
# The same episodes driven by an agent harness over the endpoint (HARNESS: the harness's path).
MODES = {"single-turn": (False, "sleepy", []), "multi-turn, instant tool": (True, "instant", []),
         "multi-turn": (True, "sleepy", []), "single-turn, continuous": (False, "sleepy", CONTINUOUS),
         "multi-turn, continuous": (True, "sleepy", CONTINUOUS),
         "environment": (True, "sleepy", ECHO), "environment, continuous": (True, "sleepy", [*ECHO, *CONTINUOUS]),
         "environment, harness": (False, "sleepy", [*ECHO[:-1], "HARNESS"]),
         "environment, harness, continuous": (False, "sleepy", [*ECHO[:-1], "HARNESS", *CONTINUOUS])}
PHASES = ("gen", "gen_ahead", "sync_weights", "old_log_prob", "ref", "reward", "adv", "update_actor")


# ------------------------------------------------------------------ pure analysis

def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def tool_turn(run_s: list[float], gen_sleepy_s: list[float], gen_instant_s: list[float], rounds: list[int],
              calls: int) -> dict:
    """Part 1's numbers from the repeated timings: `rounds` holds the calls of each tool round of
    one sleeping generate; the turn's cost is the median difference over the number of rounds."""
    added = analysis.ratio(median(gen_sleepy_s) - median(gen_instant_s), len(rounds)) \
        if gen_sleepy_s and gen_instant_s else None
    return {"run_s": median(run_s), "gen_sleepy_s": median(gen_sleepy_s), "gen_instant_s": median(gen_instant_s),
            "rounds": len(rounds), "calls_per_round": rounds, "calls": calls, "added_per_round_s": added}


def job_summary(analysis: dict, scalars: dict[str, dict[int, float]], steady: range) -> dict:
    """One job's row: phase medians per pool (async_rollout.analyze), the train pool's step period and
    busy time, and the tool counts per step (TensorBoard), medians over the steady steps."""
    phases, busy = analysis["phases"], analysis["busy_s"]
    gen_pool = next((p for p in phases if async_rollout.is_rollout_pool(p)), None)
    train_pool = next((p for p in phases if async_rollout.is_actor_pool(p)), None)
    scalar = {k: median(v for s, v in scalars.get(k, {}).items() if s in steady)
              for k in ("tool/calls", "num_turns/mean", "response_length/mean", "tool/errors")}
    return {"step_s": analysis["step_time_s"], "gen_s": phases.get(gen_pool, {}).get("gen"),
            "train_busy_s": busy.get(train_pool), "gen_pool": {k: phases.get(gen_pool, {}).get(k) for k in PHASES},
            "train_pool": {k: phases.get(train_pool, {}).get(k) for k in PHASES}, **scalar}


def targets(turn: dict, modes: dict[str, dict], sleep_s: float = SLEEP_S) -> list[dict]:
    """The issue's targets, each with its value, bound and met (None where a number is missing);
    `sleep_s` the tool's latency the run used (the bounds are set for the issue's SLEEP_S)."""
    single, multi = modes.get("single-turn", {}), modes.get("multi-turn", {})
    growth = analysis.ratio(multi.get("step_s"), single.get("step_s"))
    rows = []

    def row(name, value, bound, how, unit):
        rows.append({"target": name, "value": value, "bound": bound, "met": None if value is None else value <= bound,
                     "how": how, "unit": unit})

    row(f"one turn of {EPISODES} concurrent calls: added to generation", turn.get("added_per_round_s"),
        TARGETS["turn_added_s"], f"(gen with the {sleep_s:g} s tool - gen with an instant tool) / tool rounds", "s")
    row(f"Tools.run of {EPISODES} calls", turn.get("run_s"), TARGETS["turn_added_s"], "wall time of one run", "s")
    row("s=1: train pool's step period, multi-turn vs single-turn", None if growth is None else growth - 1,
        TARGETS["step_growth"], "step multi / step single - 1", "share")
    row("s=1 multi-turn: gen per batch / train pool's work per step",
        analysis.ratio(multi.get("gen_s"), multi.get("train_busy_s")), 1.0,
        "rollout pool's gen / train pool's busy time (must stay < 1)", "ratio")
    # Continuous generation: the rollout pool never stops (its gen_ahead fills the step), so whether
    # generation keeps up shows as the train pool's wait for rows, not as the rollout pool's gen.
    streamed = modes.get("multi-turn, continuous", {})
    growth = analysis.ratio(streamed.get("step_s"), single.get("step_s"))
    row("s=1 continuous: train pool's step period, multi-turn vs single-turn (batches)",
        None if growth is None else growth - 1, TARGETS["step_growth"], "step multi continuous / step single - 1", "share")
    waited = analysis.ratio(streamed.get("train_busy_s"), streamed.get("step_s"))
    row("s=1 multi-turn, continuous: train pool's wait for rows / its step period", None if waited is None else 1 - waited,
        TARGETS["step_growth"], "1 - train pool busy / step period", "share")
    row("the echo episodes through the endpoint (harness) vs the agent loop: gen per batch",
        analysis.ratio(modes.get("environment, harness", {}).get("gen_s"), modes.get("environment", {}).get("gen_s")),
        TARGETS["harness_gen"], "rollout pool's gen, harness / environment", "ratio")
    # Continuous: the rollout pool never stops, so the train pool's step period says what keeps up.
    row("continuous: the echo episodes through the endpoint (harness) vs the agent loop: step period",
        analysis.ratio(modes.get("environment, harness, continuous", {}).get("step_s"),
                       modes.get("environment, continuous", {}).get("step_s")),
        TARGETS["harness_gen"], "train pool's step period, harness / environment (continuous)", "ratio")
    return rows


def render_markdown(report: dict) -> str:
    meta, turn, modes = report["meta"], report["turn"], report["modes"]
    part1 = (f"Part 1, one process: {EPISODES} lookup prompts, embedded agent model, HF engine, compact format, "
             f"max_assistant_turns=2, logit bias +{AT_BOOST:g} on \"@\"; medians of {meta['repeats']} runs.")
    part2 = (f"Part 2, torchrun jobs on 2 ranks (rollout | train, staleness 1): `{' '.join(meta['workload'])}`; "
             f"{meta['steps']} steps, medians over steps {meta['warmup'] + 1}-{meta['steps'] - 1}.")
    head = ("| Tools.run, 32 calls (s) | generate, instant tool (s) | generate, sleeping tool (s) | tool rounds "
            "| calls per round | added per round (s) |")
    row = (f"| {fmt(turn['run_s'])} | {fmt(turn['gen_instant_s'])} | {fmt(turn['gen_sleepy_s'])} | "
           f"{turn['rounds']} | {turn['calls_per_round']} | {fmt(turn['added_per_round_s'])} |")
    lines = [f"# spmdsplit bench --agent: {meta['device']}, torch {meta['torch']}, {meta['date']}", "", part1, "",
             head, "|---" * 6 + "|", row, "", part2, "",
             "| seconds per step (median) | " + " | ".join(modes) + " |", "|---" * (len(modes) + 1) + "|"]
    cells = [("gen (rollout pool, per batch)", lambda m: m["gen_s"])]
    cells += [(f"{k} (rollout pool)", lambda m, k=k: m["gen_pool"][k]) for k in PHASES[1:]
              if any(m["gen_pool"][k] is not None for m in modes.values())]
    cells += [(f"{k} (train pool)", lambda m, k=k: m["train_pool"][k]) for k in PHASES
              if any(m["train_pool"][k] is not None for m in modes.values())]
    cells += [("train pool busy (waits left out)", lambda m: m["train_busy_s"]),
              ("**step period (train pool)**", lambda m: m["step_s"])]
    for name, get in cells:
        lines.append(f"| {name} | " + " | ".join(fmt(get(m)) for m in modes.values()) + " |")
    counts = (("tool/calls", "{:.1f}"), ("tool/errors", "{:.0f}"), ("num_turns/mean", "{:.2f}"),
              ("response_length/mean", "{:.1f}"))
    for key, spec in counts:
        lines.append(f"| {key} | " + " | ".join(fmt(m[key], spec) for m in modes.values()) + " |")
    lines += ["", "| target | value | bound | met? | how |", "|---|---|---|---|---|"]
    for t in report["targets"]:
        spec = {"s": "{:.3f} s", "share": "{:+.1%}", "ratio": "{:.2f}x"}[t["unit"]]
        met = "n/a" if t["met"] is None else "met" if t["met"] else "**missed**"
        lines.append(f"| {t['target']} | {fmt(t['value'], spec)} | <= {spec.format(t['bound'])} | {met} | {t['how']} |")
    return "\n".join(lines + [""])


# ------------------------------------------------------------------ measuring

def write_tools(folder: str, sleep_s: float = SLEEP_S) -> dict[str, str]:
    """name -> a verl-format tool YAML whose one tool is that function of TOOL_FILE."""
    os.makedirs(folder, exist_ok=True)
    code = os.path.join(os.path.abspath(folder), "bench_tools.py")
    with open(code, "w") as f:
        f.write(TOOL_FILE.format(sleep_s=sleep_s))
    paths = {}
    for name in ("sleepy", "instant"):
        paths[name] = os.path.join(os.path.abspath(folder), f"{name}.yaml")
        with open(paths[name], "w") as f:
            f.write(f'tools:\n  - class_name: "{code}:{name}"\n    config: {{type: native}}\n')
    paths["environment"] = f"{code}:SleepyEcho"
    paths["harness"] = f"{code}:echo_harness"
    return paths


def measure_turn(paths: dict[str, str], repeats: int) -> dict:
    import torch

    from spmdsplit.agent import build_agent_rollout, check_multi_turn
    from spmdsplit.agent.tools import Call
    from spmdsplit.config import load_config
    from spmdsplit.data.prompts import collate_prompts
    from spmdsplit.data.sources import build_rows
    from spmdsplit.embedded import ensure_embedded_model
    from spmdsplit.models import eos_token_ids, load_tokenizer
    from spmdsplit.inference import build_generator

    torch.set_num_threads(1)  # one rank's share of the machine
    cfgs = {n: load_config(PRESET, [f"rollout.multi_turn.tool_config_path={p}",
                                    "rollout.multi_turn.max_assistant_turns=2"]) for n, p in paths.items()}
    path = ensure_embedded_model(cfgs["sleepy"].model.embedded_dir, agent=True)
    tok = load_tokenizer(path)
    tools = check_multi_turn(cfgs["sleepy"], tok)
    calls = [Call("sleepy", {}) for _ in range(EPISODES)]
    tools.run(calls)  # starts its event loop
    run_s = []
    for _ in range(repeats):
        start = time.perf_counter()
        results = tools.run(calls)
        run_s.append(time.perf_counter() - start)
    assert not any(r.error for r in results), [r.text for r in results if r.error][:3]

    cfg = cfgs["sleepy"]
    rows, _ = build_rows(cfg.data, tok, "train", tools=tools.schemas,
                         default_agent=cfg.rollout.agent.default_agent_loop)
    prompts = collate_prompts(rows[:EPISODES], tok, cfg.data.max_prompt_length, 1, 0)
    eos = eos_token_ids(path, tok)
    agents = {"sleepy": build_generator(cfg, path, tok, eos, torch.device("cpu"), torch.float32, 1)}
    agents["instant"] = build_agent_rollout(cfgs["instant"], agents["sleepy"].engine, tok, eos)  # the same model
    at = tok.convert_tokens_to_ids("@")

    def boost(module, inputs, logits):  # a bias on "@": no edit of the lm_head row raises its logit in every context
        logits[..., at] += AT_BOOST
        return logits
    agents["sleepy"].engine.model.lm_head.register_forward_hook(boost)
    rounds: list[int] = []
    run = agents["sleepy"].tools.run
    agents["sleepy"].tools.run = lambda c: (rounds.append(len(c)) if c else None, run(c))[1]  # counts the rounds
    gen = {"sleepy": [], "instant": []}
    for i in range(repeats + 1):  # the first round warms up
        for name, agent in agents.items():
            torch.manual_seed(i)
            rounds.clear()
            start = time.perf_counter()
            out = agent.generate(prompts)
            gen[name] += [time.perf_counter() - start] if i else []
            if name == "sleepy":
                last_rounds, calls = list(rounds), int(out["tool_calls"].sum())
                assert not int(out["tool_errors"].sum()), out["tool_errors"].sum(0).tolist()
    return tool_turn(run_s, gen["sleepy"], gen["instant"], last_rounds, calls)


def run(args) -> dict:
    import torch

    os.makedirs(args.out, exist_ok=True)
    paths = write_tools(os.path.join(args.out, "tools"), args.tool_s)
    chosen = {name: MODES[name] for name in args.modes}
    print(f"tools.bench.agent: [1/{len(chosen) + 1}] one tool turn of {EPISODES} episodes, in this process",
          file=sys.stderr, flush=True)
    turn = tool_turn([], [], [], [], 0) if args.skip_turn else measure_turn(paths, args.repeats)
    workload = ["--config", PRESET] + ROLLOUT_TRAIN + WORKLOAD + [f"data.train_batch_size={args.batch}",
                                                                  f"trainer.total_steps={args.steps}",
                                                                  f"rollout.name={args.engine}"]
    steady = async_rollout.steady_steps(args.steps, args.warmup, 1)
    modes = {}
    for i, (name, (on, tool, other)) in enumerate(chosen.items(), 2):
        filled = {"ENVIRONMENT": f"rollout.multi_turn.environment={paths['environment']}",
                  "HARNESS": f"rollout.agent.harness={paths['harness']}"}
        extra = [f"rollout.multi_turn.enable={str(on).lower()}", f"rollout.multi_turn.tool_config_path={paths[tool]}",
                 *(filled.get(o, o) for o in other)]
        print(f"tools.bench.agent: [{i}/{len(chosen) + 1}] {name}: {' '.join(extra)}", file=sys.stderr, flush=True)
        start = time.time()
        trace, scalars = run_job(2, workload + extra, os.path.join(args.out, name.replace(",", "").replace(" ", "-")))
        analysis = async_rollout.analyze(trace, scalars, args.warmup, args.batch, staleness=1)
        modes[name] = {"overrides": extra, "wall_s": time.time() - start, "pools": analysis["pools"],
                       **job_summary(analysis, scalars, steady)}
    meta = {"device": "cpu", "torch": torch.__version__, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "workload": workload, "batch": args.batch, "steps": args.steps, "warmup": args.warmup,
            "repeats": args.repeats, "sleep_s": args.tool_s, "episodes": EPISODES, "engine": args.engine}
    return {"schema": "spmdsplit.bench_agent/1", "meta": meta, "turn": turn, "modes": modes,
            "targets": targets(turn, modes, args.tool_s)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tools.bench.agent", description=__doc__.splitlines()[0])
    p.add_argument("--agent", action="store_true", help=argparse.SUPPRESS)  # as passed on by tools.bench --agent
    p.add_argument("--steps", type=int, default=12, help="training steps per job (default 12)")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians (default 2)")
    p.add_argument("--batch", type=int, default=128, help="part 2: data.train_batch_size, prompts per step "
                   "(default 128, the preset's; x rollout.n=4 episodes)")
    p.add_argument("--repeats", type=int, default=3, help="part 1: timed runs of each measurement (default 3)")
    p.add_argument("--tool-s", type=float, default=SLEEP_S, help=f"the sleeping tool's seconds per call (default "
                   f"{SLEEP_S}, the issue's; the targets are set for it)")
    p.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="part 2's rollout.name (default hf; "
                   "part 1 always runs HF in this process)")
    p.add_argument("--skip-turn", action="store_true", help="leave part 1 out (its numbers: n/a)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES), metavar="MODE",
                   help="part 2's jobs (default all): " + "; ".join(MODES))
    p.add_argument("--out", default="outputs/bench_agent", help="where bench_agent.json/.md and the jobs' files go")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    return run_and_write(args.out, "bench_agent", run, render_markdown, args)


if __name__ == "__main__":
    sys.exit(main())
