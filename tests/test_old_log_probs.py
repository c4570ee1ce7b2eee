"""Old log-probs from the update's own forward (roles/actor.py update_is_one_pass): where the update
is one pass over the batch, the separate old_log_prob pass is skipped and the update's forward,
detached, stands in for it. It must be that pass's numbers up to float rounding, the update the
same, and the jobs that take it must log what the others log."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from tests.support.helpers import full_weights
from tests.support.launch import job, run_ranks
from tests.support.outputs import scalars, timeline_events
from tests.support.helpers import ROWS, make_batch

THRESHOLD = 1.0  # rollout-correction truncation: low enough that some of the weights below hit it


def _both_ways(rank, world_size, model_dir):
    """One update of the pool's rows twice from the same start: after a separate log-prob pass
    (the old log-probs and the truncated importance weights from it), and with them from the
    update's own forward. Token budgets make the ranks bin unequally, so a rank runs a dummy."""
    from spmdsplit import algo
    from spmdsplit.config import ActorConfig, OptimConfig
    from spmdsplit.engines.fsdp import FSDPEngine
    from spmdsplit.exchange import row_ranges
    from spmdsplit.models import load_causal_lm
    from spmdsplit.roles.actor import Actor, OldFromForward

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    device = torch.device("cpu")
    cfg = ActorConfig(optim=OptimConfig(lr=1e-2, lr_warmup_steps=0, grad_clip=1e9), ppo_mini_batch_size=ROWS,
                      entropy_coeff=0.01, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=14,
                      log_prob_max_token_len_per_gpu=30)
    results = []
    for from_forward in (False, True):
        model = load_causal_lm(model_dir, torch.float32, device, seed=3)
        actor = Actor(FSDPEngine(model, mesh, cfg.optim), cfg, temperature=1.0, device=device)
        batch = make_batch(model.config.vocab_size)
        del batch.tensors["old_log_probs"]
        g = torch.Generator().manual_seed(5)
        batch["rollout_log_probs"] = -2.0 - torch.rand(batch["responses"].shape, generator=g)
        start, end = row_ranges(ROWS, world_size)[rank]
        mine = batch.slice(start, end)
        if from_forward:
            metrics = actor.update_policy(mine, seed=1, old_from_forward=OldFromForward("token", THRESHOLD))
        else:
            mine["old_log_probs"] = actor.compute_log_prob(mine)
            mine["rollout_is_weights"] = algo.compute_rollout_is_weights(
                mine["old_log_probs"], mine["rollout_log_probs"], mine["response_mask"], "token", THRESHOLD)
            metrics = actor.update_policy(mine, seed=1)
        weights = algo.compute_rollout_is_weights(mine["old_log_probs"], mine["rollout_log_probs"],
                                                  mine["response_mask"], "token", THRESHOLD)
        results.append((mine["old_log_probs"] * mine["response_mask"], weights, full_weights(actor.engine), metrics))
    return results


def test_the_updates_own_forward_gives_the_separate_passs_old_log_probs_and_the_same_update(embedded_model_dir):
    for rank, (separate, from_forward) in enumerate(run_ranks(_both_ways, 2, embedded_model_dir)):
        (old_a, weights_a, state_a, metrics_a), (old_b, weights_b, state_b, metrics_b) = separate, from_forward
        torch.testing.assert_close(old_b, old_a, rtol=0, atol=1e-5)  # every row's, in its place
        assert (weights_a == THRESHOLD).any() and (weights_a < THRESHOLD).any()
        torch.testing.assert_close(weights_b, weights_a, rtol=1e-5, atol=1e-6)
        for name in state_a:
            torch.testing.assert_close(state_b[name], state_a[name], rtol=0, atol=1e-5, msg=name)
        # PPO's ratio is 1 exactly: nothing clipped, no KL between old and new
        assert metrics_b["actor/ppo_kl"] == 0 and metrics_b["actor/pg_clipfrac"] == 0, metrics_b
        assert abs(metrics_a["actor/ppo_kl"]) < 1e-6, metrics_a
        for name in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
            assert metrics_b[name] == pytest.approx(metrics_a[name], rel=1e-5, abs=1e-7), (rank, name)


def _grpo_one_pass(tmp_path, name, *overrides):
    out = tmp_path / name
    result = job(2, "--config", "configs/grpo_rollout_actor.yaml", "actor.ppo_mini_batch_size=32",
                 "trainer.total_steps=3", f"trainer.log_dir={out}/tb", f"trainer.timeline={out}/timeline.json",
                 "trainer.output_dir=", *overrides)
    assert result.returncode == 0, result.stderr[-5000:]
    return scalars(str(out / "tb")), {e["name"] for e in timeline_events(str(out / "timeline.json"))}


def test_a_one_pass_grpo_job_skips_the_old_log_prob_pass_and_logs_the_same(tmp_path):
    """The GRPO preset (rollout | actor 1+1, one step off-policy, token importance weights) with
    one mini-batch: no old_log_prob phase, and the numbers of the job with the separate pass
    (actor.old_log_prob_from_update=false) to float precision, the ratio's to their rounding."""
    logged, phases = _grpo_one_pass(tmp_path, "from_update")
    separate, separate_phases = _grpo_one_pass(tmp_path, "separate", "actor.old_log_prob_from_update=false")
    assert "old_log_prob" in separate_phases and "old_log_prob" not in phases, phases
    assert {"update_actor", "ref"} <= phases
    assert set(logged) == set(separate) - {"timing_s/old_log_prob"}
    ratio_based = ("actor/ppo_kl", "actor/pg_clipfrac", "actor/pg_clipfrac_lower")
    for name, points in separate.items():
        if name.startswith(("timing", "perf")):
            continue
        for (step, expected), (step_b, value) in zip(points, logged[name]):
            assert step == step_b
            if name in ratio_based:
                assert abs(value - expected) < 1e-5, (name, step, value, expected)
            else:
                assert value == pytest.approx(expected, rel=1e-3, abs=1e-5), (name, step, value, expected)
