"""The registries of advantage estimators and policy losses (spmdsplit/algo.py), and every one of
them against verl 0.9.1's own function: tests/data/verl_core_algos.pt holds verl's outputs (and
the losses' gradients) on the inputs it also holds, written by tools/fixtures/verl_algo_fixtures.py
(its docstring says how to regenerate it). CI has no verl: these tests read only the file.

Everything is fp64 and compared to 1e-6. Where our semantics deliberately differ from verl's, the
comparison is made in the setting where the two coincide, and the test says so:
- global normalisation: verl scales by dp_size and averages gradients over ranks, we divide by
  global counts and sum; with verl's dp_size 1 the counts mean the same (num_tokens =
  batch_num_tokens, num_seqs = global_batch_size, horizon = loss_scale_factor).
- geo_mean divides by num_seqs (rows with a valid token, global); verl by its micro-batch's rows,
  empty ones included: compared with num_seqs = the fixture's row count.
- gae: ours is 0 outside the response mask, verl's is not: compared on the mask.
- reinforce_plus_plus_baseline: our `returns` are the unwhitened centred scores, verl returns the
  advantages twice: only the advantages are compared.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from spmdsplit import algo
from spmdsplit.batch import Batch
from spmdsplit.config import ActorConfig, load_config
from spmdsplit.errors import ConfigError
from spmdsplit.preflight import REGISTERED, check_config
from tests.support.helpers import as_ranks

FIXTURE = torch.load(Path(__file__).parent / "data" / "verl_core_algos.pt", weights_only=True)
BATCHES = FIXTURE["batches"]


def close(actual, expected, tol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64),
                               torch.as_tensor(expected, dtype=torch.float64), atol=tol, rtol=tol)


def actor_config(name: str, actor: dict, policy_loss: dict, loss_agg_mode: str):
    """Our actor section with the case's keys (verl's names are ours)."""
    return OmegaConf.merge(OmegaConf.structured(ActorConfig), {
        **actor, "loss_agg_mode": loss_agg_mode, "policy_loss": {"loss_mode": name, **policy_loss}})


# ----------------------------------------------------------------------------- against verl

ESTIMATOR_CASES = [(b, i, case["name"]) for b, batch in enumerate(BATCHES) for i, case in enumerate(batch["estimators"])]
LOSS_CASES = [(b, i, case["name"], case["loss_agg_mode"])
              for b, batch in enumerate(BATCHES) for i, case in enumerate(batch["losses"]["cases"])]


def test_the_fixture_covers_every_registered_estimator_and_loss():
    assert FIXTURE["verl_version"] == "0.9.1"
    assert {name for _, _, name in ESTIMATOR_CASES} == set(algo.ADV_ESTIMATOR_REGISTRY)
    assert {name for _, _, name, _ in LOSS_CASES} == set(algo.POLICY_LOSS_REGISTRY)
    mask = BATCHES[0]["inputs"]["response_mask"]
    assert (mask.sum(-1) == 0).any()  # a fully masked row
    assert any(row.nonzero().max() + 1 > row.sum() for row in mask if row.any())  # a hole inside a mask


@pytest.mark.parametrize("b, i, name", ESTIMATOR_CASES, ids=[f"batch{b}-{n}-{i}" for b, i, n in ESTIMATOR_CASES])
def test_estimator_matches_verl(b, i, name):
    inputs, case = BATCHES[b]["inputs"], BATCHES[b]["estimators"][i]
    estimator = algo.get_adv_estimator(name)
    mask = inputs["response_mask"]
    # called as algo.compute_advantage calls it: the same keywords for every estimator
    advantages, returns = estimator.fn(
        token_level_rewards=inputs["token_level_rewards"], response_mask=mask,
        index=inputs["passk_index" if name == "grpo_passk" else "index"], reduce_sum=None, **case["hyper"],
        **{column: inputs[column] for column in estimator.inputs})
    if name == "gae":  # verl's are non-zero outside the mask (whitened / advantages + values there)
        valid = mask.bool()
        close(advantages[valid], case["advantages"][valid])
        close(returns[valid], case["returns"][valid])
        assert not advantages[~valid].any() and not returns[~valid].any()
        return
    close(advantages, case["advantages"])
    if name != "reinforce_plus_plus_baseline":  # ours: the centred scores (see the module docstring)
        close(returns, case["returns"])


@pytest.mark.parametrize("b, i, name, agg", LOSS_CASES, ids=[f"batch{b}-{n}-{a}-{i}" for b, i, n, a in LOSS_CASES])
def test_policy_loss_matches_verl(b, i, name, agg):
    inputs, losses = BATCHES[b]["inputs"], BATCHES[b]["losses"]
    case = losses["cases"][i]
    config = actor_config(name, case["actor"], case["policy_loss"], agg)
    info = case["global_batch_info"]
    counts = {"num_tokens": info["batch_num_tokens"], "num_seqs": info["global_batch_size"],
              "horizon": info["loss_scale_factor"]} if info else {}
    if name == "geo_mean":  # verl: the mean over its micro-batch's rows, empty rows included
        counts = {"num_seqs": inputs["response_mask"].shape[0]}
    log_prob = inputs["log_prob"].clone().requires_grad_()
    torch.manual_seed(case["seed"])  # clip_cov's draw, as verl's
    loss, metrics = algo.get_policy_loss_fn(name)(
        inputs["old_log_prob"], log_prob, inputs["advantages"], inputs["response_mask"], agg, config,
        rollout_is_weights=inputs["rollout_is_weights"] if case["weighted"] else None, **counts)
    (grad,) = torch.autograd.grad(loss, log_prob)
    close(loss, losses["loss"][i])
    close(grad, losses["grad"][i])
    assert metrics.keys() == case["metrics"].keys()
    for key, value in case["metrics"].items():
        close(metrics[key], value)


# ----------------------------------------------------------------------------- global normalisation

def ragged_batch(seed=0, rows=6, width=7):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(width)[None, :] < torch.tensor([7, 2, 0, 5, 4, 3])[:, None]).double()
    mask[0, 2:4] = 0  # a tool span inside the response
    old = -2 * torch.rand(rows, width, generator=g, dtype=torch.float64)
    log_prob = (old + 0.3 * torch.randn(rows, width, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(rows, 1, generator=g, dtype=torch.float64).expand(rows, width)
    return old, log_prob, adv, mask


# clip_cov and kl_cov pick tokens by statistics of the tensors they are given, i.e. per micro-batch
# (as verl): their sum over micro-batches is not the full batch's loss, by design.
@pytest.mark.parametrize("name", [n for n in algo.POLICY_LOSS_REGISTRY if n not in ("clip_cov", "kl_cov")])
@pytest.mark.parametrize("agg", algo.LOSS_AGG_MODES)
def test_policy_loss_summed_over_micro_batches_with_global_counts_is_the_full_batch_loss(name, agg):
    old, log_prob, adv, mask = ragged_batch()
    config = actor_config(name, {}, {}, agg)
    fn = algo.get_policy_loss_fn(name)
    full, _ = fn(old, log_prob, adv, mask, agg, config)
    (full_grad,) = torch.autograd.grad(full, log_prob)
    counts = {"num_tokens": mask.sum(), "num_seqs": (mask.sum(-1) > 0).sum(), "horizon": mask.shape[1]}
    total = sum(fn(old[rows], log_prob[rows], adv[rows], mask[rows], agg, config, **counts)[0]
                for rows in ([0, 3], [1, 2, 5], [4]))
    (grad,) = torch.autograd.grad(total, log_prob)
    close(total, full)
    close(grad, full_grad)


def test_gpg_estimator_alpha_counts_the_global_batch():
    """alpha = B / M over the whole batch: two ranks holding whole groups get the one-rank result."""
    scores = torch.tensor([1.0, 0.0, 2.0, 0.0, 0.0, 3.0, 1.0, 0.0], dtype=torch.float64)
    rewards = torch.zeros(8, 3, dtype=torch.float64)
    rewards[:, -1] = scores
    mask, index = torch.ones(8, 3), [0, 0, 1, 1, 2, 2, 3, 3]
    full, _ = algo.compute_gpg_outcome_advantage(rewards, mask, index)
    # group means 0.5, 1, 1.5, 0.5; alpha = 8 / 4 nonzero scores
    close(full[:, 0], 2.0 * (scores - torch.tensor([0.5, 0.5, 1, 1, 1.5, 1.5, 0.5, 0.5], dtype=torch.float64)))
    shards = [(rewards[:4], mask[:4], index[:4]), (rewards[4:], mask[4:], index[4:])]
    parts = as_ranks(lambda shard, reduce_sum: algo.compute_gpg_outcome_advantage(*shard, reduce_sum=reduce_sum)[0],
                     shards)
    close(torch.cat(parts), full)


# ----------------------------------------------------------------------------- the registries

def test_unknown_names_are_refused_with_the_registered_ones():
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'; registered: gae, grpo"):
        algo.get_adv_estimator_fn("ppo")
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo'; registered: vanilla, gspo"):
        algo.get_policy_loss_fn("ppo")


def test_registering_a_name_twice_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        algo.register_policy_loss("vanilla")(lambda *a, **k: None)
    with pytest.raises(ValueError, match="already registered"):
        algo.register_adv_est("grpo")(lambda **k: None)


def test_config_choices_are_the_registries():
    assert REGISTERED["algorithm.adv_estimator"] == tuple(algo.ADV_ESTIMATOR_REGISTRY)
    assert REGISTERED["actor.policy_loss.loss_mode"] == tuple(algo.POLICY_LOSS_REGISTRY)
    cfg = load_config()
    check_config(cfg)  # the schema's defaults are registered names
    assert cfg.algorithm.adv_estimator == "gae" and cfg.actor.policy_loss.loss_mode == "vanilla"


def test_estimators_declare_what_they_need():
    assert [n for n, e in algo.ADV_ESTIMATOR_REGISTRY.items() if e.needs_critic] == ["gae"]
    assert {n for n, e in algo.ADV_ESTIMATOR_REGISTRY.items() if e.groups} == {
        "grpo", "rloo", "reinforce_plus_plus_baseline", "grpo_passk", "opo", "gpg"}
    assert algo.get_adv_estimator("remax").inputs == ("reward_baselines",)


@pytest.mark.parametrize("overrides, message", [
    (["actor.policy_loss.loss_mode=ppo"], "actor.policy_loss.loss_mode='ppo': expected one of ['vanilla', 'gspo'"),
    (["actor.policy_loss.clip_cov_ratio=0"], "actor.policy_loss.clip_cov_ratio=0.0: expected a positive number"),
    (["actor.tau_neg=-1"], "actor.tau_neg=-1.0: expected a positive number"),
    (["algorithm.adv_estimator=ppo"], "algorithm.adv_estimator='ppo': expected one of ['gae', 'grpo'"),
])
def test_bad_values_are_refused_in_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        check_config(load_config(None, overrides))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize("name", [n for n, e in algo.ADV_ESTIMATOR_REGISTRY.items() if e.groups])
def test_group_estimators_need_two_responses_per_prompt(name):
    overrides = [f"algorithm.adv_estimator={name}", "placement.mode=colocate"]
    with pytest.raises(ConfigError) as e:
        check_config(load_config(None, overrides + ["rollout.n=1"]))
    assert str(e.value) == (f"algorithm.adv_estimator={name} compares responses to the same prompt: "
                            "set rollout.n >= 2 (got 1)")
    check_config(load_config(None, overrides + ["rollout.n=2"]))


def test_every_loss_mode_and_its_keys_load():
    for name in algo.POLICY_LOSS_REGISTRY:
        cfg = load_config(None, [f"actor.policy_loss.loss_mode={name}", "actor.policy_loss.kl_cov_ratio=0.01",
                                 "actor.policy_loss.ppo_kl_coef=1", "actor.tau_pos=2"])
        assert cfg.actor.policy_loss.loss_mode == name and cfg.actor.tau_pos == 2


# ----------------------------------------------------------------------------- compute_advantage

def advantage_of(batch, *overrides):
    """algo.compute_advantage as the critic program calls it, on one process (no reduce_sum)."""
    cfg = load_config(None, ["placement.mode=colocate", "rollout.n=2", *overrides])
    return algo.compute_advantage(batch, cfg.algorithm, None)


def advantage_batch(**extra):
    g = torch.Generator().manual_seed(3)
    mask = torch.ones(4, 5)
    mask[1, 3:] = 0
    scores = torch.zeros(4, 5)
    scores[:, 2] = torch.tensor([1.0, 0.0, 2.0, 1.0])
    return Batch({"token_level_scores": scores, "response_mask": mask,
                  "values": torch.randn(4, 5, generator=g), **extra}, {"uid": ["a", "a", "b", "b"]})


def test_compute_advantage_calls_the_registered_estimator_with_its_inputs():
    batch = advantage_batch()
    advantage_of(batch, "algorithm.adv_estimator=gae", "algorithm.gamma=0.9", "algorithm.lam=0.8")
    adv, ret = algo.compute_gae_advantage_return(batch["token_level_scores"], batch["values"], batch["response_mask"],
                                                 0.9, 0.8)
    assert torch.equal(batch["advantages"], adv) and torch.equal(batch["returns"], ret)
    batch = advantage_batch()
    advantage_of(batch, "algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=false")
    adv, _ = algo.compute_grpo_outcome_advantage(batch["token_level_scores"], batch["response_mask"],
                                                 ["a", "a", "b", "b"], norm_adv_by_std_in_grpo=False)
    assert torch.equal(batch["advantages"], adv)


def test_an_episodes_rows_take_its_advantage_which_the_estimator_computes_over_episodes():
    """rollout.agent.rows_per_episode=2: each episode's first row, then its extra row (scored too:
    the scorer puts the episode's reward on each of its rows) or an empty one. GRPO's groups are
    the episodes, each once: counting episode 0's extra row would move group a's mean and std."""
    first = advantage_batch()  # 4 episodes, 2 per prompt: their first rows
    empty = first.index([0])
    empty["response_mask"], empty["token_level_scores"] = torch.zeros(1, 5), torch.zeros(1, 5)
    batch = Batch.concat([first.index([0]), first.index([0]), first.index([1]), empty, first.index([2]), empty,
                          first.index([3]), empty])
    batch["episode_row"] = torch.tensor([0, 1, 0, -1, 0, -1, 0, -1])
    advantage_of(batch, "algorithm.adv_estimator=grpo")
    advantage_of(first, "algorithm.adv_estimator=grpo")
    per_episode = algo.masked_mean(first["advantages"], first["response_mask"], axis=-1)
    expected = per_episode[[0, 0, 1, 1, 2, 2, 3, 3]].unsqueeze(-1) * batch["response_mask"]
    assert torch.equal(batch["advantages"], expected) and batch["advantages"][1].abs().sum() > 0


def test_remax_reads_reward_baselines_and_says_so_when_they_are_missing():
    with pytest.raises(ValueError, match=r"algorithm.adv_estimator=remax needs the batch column\(s\) "
                                         r"\['reward_baselines'\]"):
        advantage_of(advantage_batch(), "algorithm.adv_estimator=remax")
    batch = advantage_batch(reward_baselines=torch.tensor([0.5, 0.5, 1.0, 1.0]))
    advantage_of(batch, "algorithm.adv_estimator=remax")
    close(batch["advantages"][:, 0], [0.5, -0.5, 1.0, 0.0])  # score - the greedy response's


def test_passk_gives_the_gap_to_the_best_response_only():
    rewards = torch.tensor([[1.0], [3.0], [2.0], [0.0], [5.0], [5.0]], dtype=torch.float64)
    adv, _ = algo.compute_grpo_passk_outcome_advantage(rewards, torch.ones(6, 1), [0, 0, 0, 1, 1, 1],
                                                       norm_adv_by_std_in_grpo=False)
    close(adv[:, 0], [0.0, 1.0, 0.0, 0.0, 0.0, 0.0])  # a tie at the top: a gap of 0
    with pytest.raises(ValueError, match="at least 2 responses per prompt"):
        algo.compute_grpo_passk_outcome_advantage(rewards[:1], torch.ones(1, 1), [0])


def test_opo_baseline_is_the_length_weighted_mean():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 3.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])  # lengths 3 and 1
    adv, _ = algo.compute_opo_outcome_advantage(rewards, mask, [0, 0])
    baseline = (3 * 1.0 + 1 * 3.0) / 4
    close(adv, [[1 - baseline] * 3, [3 - baseline, 0.0, 0.0]])
    assert math.isclose(baseline, 1.5)


# ----------------------------------------------------------------------------- Actor.update_policy

@pytest.mark.parametrize("name", list(algo.POLICY_LOSS_REGISTRY))
def test_the_actor_update_uses_the_configured_loss_with_the_global_counts(monkeypatch, name):
    from spmdsplit.roles import actor as actor_module

    cfg = load_config(None, [f"actor.policy_loss.loss_mode={name}", "actor.loss_agg_mode=seq-mean-token-sum-norm",
                             "actor.use_kl_loss=false"])
    old, log_prob, adv, mask = ragged_batch()
    seen = {}

    def one_micro_batch(engine, batch, cfg, rollout_n, seed, device, micro_loss):  # the whole batch at once
        seen["loss"], _, seen["pieces"] = micro_loss(batch, torch.tensor(20.0), torch.tensor(5), None)
        return {"grad_norm": 0.0, "lr": 0.0}

    monkeypatch.setattr(actor_module, "run_ppo_updates", one_micro_batch)
    actor = actor_module.Actor(SimpleNamespace(model=SimpleNamespace(train=lambda: None)), cfg.actor, 1.0, "cpu",
                               loss_horizon=9)
    monkeypatch.setattr(actor, "_log_probs", lambda micro, entropy, extent: (log_prob, torch.zeros_like(log_prob)))
    torch.manual_seed(0)
    actor.update_policy(Batch({"old_log_probs": old, "advantages": adv.contiguous(), "response_mask": mask}), seed=0)
    torch.manual_seed(0)
    expected, metrics = algo.get_policy_loss_fn(name)(old, log_prob, adv, mask, "seq-mean-token-sum-norm", cfg.actor,
                                                      num_tokens=20.0, num_seqs=5, horizon=9)
    close(seen["loss"], expected)
    assert seen["pieces"].keys() == {*metrics, "actor/entropy"}
