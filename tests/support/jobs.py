"""The jobs several test files run: the short job of the end-to-end tests and its runner, the metrics
verl's users read from it, a preset's learning run (ended once it has learned), the embedded agent
job and its rollout pool."""

from __future__ import annotations

import os

from tests.support.launch import job
from tests.support.outputs import first_and_best_scores

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VERL_METRICS = [
    "critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "critic/returns/mean",
    "critic/values/mean", "critic/vf_explained_var", "critic/vf_loss", "critic/vf_clipfrac",
    "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "actor/lr",
    "response_length/mean", "prompt_length/mean", "timing_s/gen", "timing_s/old_log_prob", "timing_s/ref",
    "timing_s/values", "timing_s/reward", "timing_s/adv", "timing_s/update_actor", "timing_s/update_critic",
    "timing_s/step", "perf/throughput", "perf/time_per_step",
]

SHORT = ["trainer.total_steps=4", "data.train_batch_size=16", "actor.ppo_mini_batch_size=8",
         "critic.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=4"]


def run_short(tmp_path, nproc, *overrides, launcher=job):
    """SHORT's job (warm, or under `launcher`) with TensorBoard, a timeline and the HF export in
    `tmp_path`/run; (that folder, the job's CompletedProcess)."""
    out = tmp_path / "run"
    result = launcher(
        nproc, *SHORT, f"trainer.log_dir={out}/tb", f"trainer.timeline={out}/timeline.json",
        f"trainer.output_dir={out}/actor_hf", *overrides, timeout=400,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return out, result


def learning_run(out, config: str, threshold: float, *overrides) -> tuple[str, float, float]:
    """A preset's learning run on 2 ranks, as a user starts it, ended as soon as the mean score of
    its last 5 steps reaches `threshold` (trainer.stop_at_score) or at the preset's last step: (its
    output, the mean score of its first 5 steps, the best mean of 5 steps in a row)."""
    result = job(2, "--config", config, *overrides, f"trainer.stop_at_score={threshold}", f"trainer.log_dir={out}/tb",
                 "trainer.timeline=", "trainer.output_dir=", timeout=1500, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-5000:]
    return (result.stdout, *first_and_best_scores(str(out / "tb")))

# The embedded lookup agent (configs/agent_lookup.yaml), short; POOL: on a rollout pool one batch ahead.
AGENT = ["--config", os.path.join(ROOT, "configs", "agent_lookup.yaml"), "data.train_batch_size=16", "actor.ppo_mini_batch_size=8",
         "critic.ppo_mini_batch_size=8", "trainer.timeline=", "trainer.output_dir=", "trainer.val_freq=2",
         "actor.optim.lr_scheduler_type=constant", "critic.optim.lr_scheduler_type=constant"]

POOL = ["placement.mode=custom", "placement.pool_unit=ranks_per_node", "placement.pools={gen: 1, train: 1}",
        "placement.roles={rollout: gen, actor: train}", "rollout.staleness=1", "algorithm.rollout_correction.rollout_is=token"]
