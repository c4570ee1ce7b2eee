"""Every CPU preset run for a few steps, its logged scalars written down, to compare two checkouts
bit for bit (a refactor that should change no number).

    python -m tools.refactor.preset_fingerprint run OUT.json [--steps 4]     # in each checkout
    python -m tools.refactor.preset_fingerprint compare BEFORE.json AFTER.json

(A checkout from before tools/ was sorted into folders by job has it as tools.preset_fingerprint.)

Each job validates and checkpoints at step 2, so those paths are in the numbers too. Wall-clock
scalars (timing_s/*, perf/*) are left out; everything else must be equal, float for float.
Besides the presets, the layouts and paths no preset takes (EXTRA_JOBS): a balanced batch, the
critic pool generating its share (rollout.ranks=all, with and without dynamic sampling), a reward
pool of its own, a PPO rollout pool one step ahead, rollout chunks sent on as they come, the
blocking hand-offs with the KL penalty in the reward, and continuous generation on its fixed
schedule (free-running, which engine step takes a version depends on the machine's timing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from tools.jobs import run_job

# (preset, ranks): the presets a CPU runs, at the rank count their headers give.
PRESETS = [
    ("default.yaml", 4), ("colocate.yaml", 4), ("split_blocking.yaml", 4), ("rollout_actor+critic.yaml", 2),
    ("rollout_actor_critic.yaml", 3), ("grpo_rollout_actor.yaml", 2), ("dapo_rollout_actor.yaml", 2),
    ("agent_lookup.yaml", 4), ("lora_grpo_rollout_actor.yaml", 2),
]
# (name, preset, ranks, overrides): what no preset runs, each named by what it adds.
EXTRA_JOBS = [
    ("default+balance_batch", "default.yaml", 4, ["trainer.balance_batch=true"]),
    ("default+rollout.ranks=all", "default.yaml", 4, ["rollout.ranks=all"]),
    ("default+filter_groups+rollout.ranks=all", "default.yaml", 4,
     ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_reward", "rollout.n=4",
      "data.train_batch_size=32", "data.gen_batch_size=48", "rollout.ranks=all"]),
    ("default+reward_pool", "default.yaml", 3,
     ["placement.mode=custom", "placement.pools={train: 1, critic: 1, score: 1}",
      "placement.roles={actor: train, critic: critic, reward: score}"]),
    ("default+chunks+kl_in_reward", "split_blocking.yaml", 4,
     ["rollout.stream_chunks=2", "algorithm.use_kl_in_reward=true"]),
    ("grpo_rollout_actor+continuous+fixed_schedule", "grpo_rollout_actor.yaml", 2,
     ["rollout.continuous=true", "rollout.version_every_engine_steps=6", "rollout.hf_step_tokens=1",
      "data.max_response_length=24", "data.train_batch_size=16", "actor.ppo_mini_batch_size=8"]),
]
JOBS = [(preset, preset, nproc, []) for preset, nproc in PRESETS] + EXTRA_JOBS


def run(out: str, steps: int) -> None:
    prints = {}
    for name, preset, nproc, extra in JOBS:
        with tempfile.TemporaryDirectory() as job_dir:
            overrides = ["--config", f"configs/{preset}", *extra, f"trainer.total_steps={steps}", "trainer.val_freq=2",
                         "trainer.save_freq=2", f"trainer.default_local_dir={job_dir}/ckpt"]
            _, scalars = run_job(nproc, overrides, job_dir, timeout=900)
        prints[name] = {tag: {str(s): v for s, v in sorted(points.items())} for tag, points in scalars.items()
                        if not tag.startswith(("timing_s/", "perf/"))}
        print(f"{name}: {len(prints[name])} scalars", flush=True)
    with open(out, "w") as f:
        json.dump(prints, f, indent=1, sort_keys=True)


def compare(before_path: str, after_path: str) -> int:
    before, after = (json.load(open(p)) for p in (before_path, after_path))
    bad = 0
    for preset in before:
        b, a = before[preset], after.get(preset, {})
        diffs = sorted(set(b) ^ set(a)) + [t for t in sorted(set(b) & set(a)) if b[t] != a[t]]
        print(f"{preset}: {len(b)} scalars, " + ("bit for bit equal" if not diffs else f"{len(diffs)} differ: {diffs[:6]}"))
        bad += bool(diffs)
    return 1 if bad else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("out")
    r.add_argument("--steps", type=int, default=4)
    c = sub.add_parser("compare")
    c.add_argument("before")
    c.add_argument("after")
    args = parser.parse_args()
    if args.cmd == "run":
        run(os.path.abspath(args.out), args.steps)
    else:
        sys.exit(compare(args.before, args.after))


if __name__ == "__main__":
    main()
