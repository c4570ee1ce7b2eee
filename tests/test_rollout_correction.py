"""Rollout correction (verl's algorithm.rollout_correction) in spmdsplit/algo.py, against verl's
formulas written out here on their own, on random inputs.

The reference follows verl/trainer/ppo/rollout_corr_helper.py (compute_rollout_correction_weights,
compute_is_metrics, compute_offpolicy_metrics) and verl/trainer/ppo/core_algos.py
(compute_policy_loss_vanilla, which multiplies the clipped per-token loss by rollout_is_weights
before aggregating), at verl b178a3c. Rows here all have a valid token (verl averages its per-row
statistics over every row; this repo over rows with a response, the same on such batches).
"""

import math

import pytest
import torch

from spmdsplit import algo

B, L = 6, 9


def random_batch(seed: int, spread: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(B, L, generator=g, dtype=torch.float64) * 3 - 0.05
    old = rollout + torch.randn(B, L, generator=g, dtype=torch.float64) * spread  # the mismatch
    lengths = torch.randint(1, L + 1, (B,), generator=g)
    lengths[0] = L
    mask = (torch.arange(L) < lengths[:, None]).long()
    # Padding holds garbage that must not count (the engine zeroes it, but nothing may rely on that).
    old = torch.where(mask.bool(), old, torch.full_like(old, 7.0))
    return old.float(), rollout.float(), mask


def mmean(x, m, axis=None):
    m = m.to(x.dtype)
    return (x * m).sum() / m.sum() if axis is None else (x * m).sum(axis) / m.sum(axis)


def verl_weights(old, rollout, mask, level, threshold):
    """compute_rollout_correction_weights: exp of the (row-summed) log-ratio, clamped to +-20,
    masked, truncated at the threshold."""
    log_ratio = old - rollout
    if level == "token":
        w = torch.exp(log_ratio.clamp(-20, 20))
    else:
        w = torch.exp((log_ratio * mask).sum(-1, keepdim=True).clamp(-20, 20)).expand_as(log_ratio)
    return (w * mask).clamp(max=threshold)


def verl_metrics(old, rollout, mask, level, threshold):
    old, rollout = old.double(), rollout.double()
    old = torch.where(mask.bool(), old, torch.zeros_like(old))
    log_ratio = old - rollout
    m = {}
    if level == "token":
        w = torch.exp(log_ratio.clamp(-20, 20)) * mask
        m["rollout_is_mean"] = mmean(w, mask)
        m["rollout_is_ratio_fraction_high"] = mmean((w > threshold).double(), mask)
        m["rollout_is_ratio_fraction_low"] = mmean((w < 1 / threshold).double(), mask)
        m["rollout_is_max"] = w[mask.bool()].max()
        m["rollout_is_min"] = w[mask.bool()].min()
    else:
        s = (log_ratio * mask).sum(-1, keepdim=True)
        w = torch.exp(s.clamp(-20, 20)).expand_as(log_ratio) * mask
        m["rollout_is_max"] = torch.exp(s.max().clamp(max=20))
        m["rollout_is_min"] = torch.exp(s.min())
        m["rollout_is_mean"] = mmean(w, mask)
        m["rollout_is_ratio_fraction_high"] = (s > math.log(threshold)).double().mean()
        m["rollout_is_ratio_fraction_low"] = (s < math.log(1 / threshold)).double().mean()
    wc = w.clamp(1 / threshold, threshold)
    m["rollout_is_std"] = torch.sqrt((mmean(wc.square(), mask) - mmean(wc, mask) ** 2).clamp(min=0))
    m["rollout_is_eff_sample_size"] = 1 / mmean((wc / (mmean(wc, mask) + 1e-8)).square(), mask)
    lp_train, lp_roll = mmean(old, mask, -1), mmean(rollout, mask, -1)
    m["training_ppl"] = torch.exp(-lp_train).mean()
    m["training_log_ppl"] = (-lp_train).mean()
    m["kl"] = mmean(rollout - old, mask)
    m["k3_kl"] = mmean(torch.exp(log_ratio) - log_ratio - 1, mask)
    m["rollout_ppl"] = torch.exp(-lp_roll).mean()
    m["rollout_log_ppl"] = (-lp_roll).mean()
    diff = lp_roll - lp_train
    m["log_ppl_diff"], m["log_ppl_abs_diff"] = diff.mean(), diff.abs().mean()
    m["log_ppl_diff_max"], m["log_ppl_diff_min"] = diff.max(), diff.min()
    m["ppl_ratio"] = torch.exp(diff).mean()
    m["chi2_token"] = mmean(torch.exp(log_ratio.clamp(-20, 20)).square(), mask) - 1
    m["chi2_seq"] = torch.exp(2 * (log_ratio * mask).sum(-1).clamp(-20, 20)).mean() - 1
    return {f"rollout_corr/{k}": float(v) for k, v in m.items()}


def verl_vanilla_pg_losses(old, log_prob, adv, low=0.2, high=0.2, c=3.0):
    ratio = torch.exp((log_prob - old).clamp(-20, 20))
    l1, l2 = -adv * ratio, -adv * ratio.clamp(1 - low, 1 + high)
    clipped = torch.maximum(l1, l2)
    return torch.where(adv < 0, torch.min(-adv * c, clipped), clipped)


def finished(means, maxes, mins):
    return algo.finish_rollout_correction_metrics({k: s / w for k, (s, w) in means.items()}, maxes, mins)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, 1.2, 5.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_weights_are_verls(level, threshold, seed):
    old, rollout, mask = random_batch(seed)
    got = algo.compute_rollout_is_weights(old, rollout, mask, level, threshold)
    assert got.dtype == torch.float32 and not got.requires_grad
    torch.testing.assert_close(got, verl_weights(old, rollout, mask, level, threshold).float(), rtol=1e-5, atol=1e-6)


def test_token_and_sequence_weights_differ_and_the_sequence_one_is_the_rows_product():
    old, rollout, mask = random_batch(2, spread=0.05)
    token = algo.compute_rollout_is_weights(old, rollout, mask, "token", 1e9)
    seq = algo.compute_rollout_is_weights(old, rollout, mask, "sequence", 1e9)
    product = torch.where(mask.bool(), token, torch.ones_like(token)).double().prod(-1)
    for i in range(B):
        valid = mask[i].bool()
        assert torch.allclose(seq[i, valid].double(), product[i].expand(int(valid.sum())), rtol=1e-4)
        assert (seq[i, ~valid] == 0).all() and (token[i, ~valid] == 0).all()
    assert not torch.allclose(token, seq)


def test_truncation_caps_only_the_weights_above_the_threshold():
    old, rollout, mask = random_batch(3, spread=1.0)
    raw = algo.compute_rollout_is_weights(old, rollout, mask, "token", 1e9)
    cut = algo.compute_rollout_is_weights(old, rollout, mask, "token", 2.0)
    above = (raw > 2.0) & mask.bool()
    assert above.any() and (raw[mask.bool()] < 2.0).any()
    assert (cut[above] == 2.0).all() and torch.equal(cut[~above], raw[~above])


def test_weights_are_detached_and_safe_from_overflow():
    old, rollout, mask = random_batch(4)
    old = old.clone().requires_grad_(True)
    rollout = rollout - 100.0 * mask  # a ratio of e^100: clamped to e^20 before exp, then truncated
    for level in ("token", "sequence"):
        w = algo.compute_rollout_is_weights(old, rollout, mask, level, 2.0)
        assert not w.requires_grad and torch.isfinite(w).all() and w.max() == 2.0


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_weighted_policy_loss_is_verls(agg, level):
    old, rollout, mask = random_batch(5)
    g = torch.Generator().manual_seed(6)
    log_prob = (old + torch.randn(B, L, generator=g) * 0.3).requires_grad_(True)
    adv = torch.randn(B, L, generator=g)
    weights = algo.compute_rollout_is_weights(old, rollout, mask, level, 2.0)
    loss, *_ = algo.compute_policy_loss(old, log_prob, adv, mask, loss_agg_mode=agg, rollout_is_weights=weights)
    reference = algo.agg_loss(verl_vanilla_pg_losses(old, log_prob, adv) * weights, mask, agg)
    torch.testing.assert_close(loss, reference)
    unweighted, *_ = algo.compute_policy_loss(old, log_prob, adv, mask, loss_agg_mode=agg)
    assert not torch.allclose(loss, unweighted)  # the weights do change the loss
    # ... and its gradient, token by token, by exactly the weight (they are constants).
    grad, = torch.autograd.grad(loss, log_prob)
    per_token = verl_vanilla_pg_losses(old, log_prob, adv)
    plain_grad, = torch.autograd.grad(algo.agg_loss(per_token, mask, agg), log_prob)
    torch.testing.assert_close(grad, plain_grad * weights)


def test_weights_of_one_leave_the_loss_as_it_was():
    old, _, mask = random_batch(7)
    log_prob, adv = old + 0.1, torch.randn(B, L)
    a, *_ = algo.compute_policy_loss(old, log_prob, adv, mask)
    b, *_ = algo.compute_policy_loss(old, log_prob, adv, mask, rollout_is_weights=mask.float())
    torch.testing.assert_close(a, b)


def test_bypass_mode_is_plain_ppo_against_the_rollout_policy():
    """verl's bypass mode (loss_type=ppo_clip): old_log_prob := rollout_log_prob and no weights,
    so the PPO ratio pi_theta / pi_rollout carries the correction and its clip bounds it."""
    _, rollout, mask = random_batch(8)
    log_prob, adv = rollout + 0.4 * torch.randn(B, L), torch.randn(B, L)
    loss, *_ = algo.compute_policy_loss(rollout, log_prob, adv, mask)
    torch.testing.assert_close(loss, algo.agg_loss(verl_vanilla_pg_losses(rollout, log_prob, adv), mask, "token-mean"))


@pytest.mark.parametrize("level", ["token", "sequence", None])
@pytest.mark.parametrize("seed", [0, 9])
def test_metrics_are_verls(level, seed):
    old, rollout, mask = random_batch(seed, spread=0.4)
    got = finished(*algo.rollout_correction_stats(old, rollout, mask, level, 1.5))
    want = verl_metrics(old, rollout, mask, level or "token", 1.5)
    if level is None:  # no weights chosen: only the mismatch metrics, as verl
        want = {k: v for k, v in want.items() if "rollout_is" not in k}
    assert set(got) == set(want)
    for name in want:
        assert got[name] == pytest.approx(want[name], rel=1e-5, abs=1e-6), name
    if level:
        assert 0 < got["rollout_corr/rollout_is_ratio_fraction_high"] < 1


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_metrics_of_a_pool_are_those_of_its_whole_batch(level):
    """Each rank's local sums and extremes, reduced as the pool reduces them (batch_metrics.py:
    summed sums and weights, max of maxes, min of mins), give the whole batch's metrics."""
    old, rollout, mask = random_batch(10, spread=0.4)
    parts = [algo.rollout_correction_stats(old[rows], rollout[rows], mask[rows], level, 2.0)
             for rows in (slice(0, 2), slice(2, B))]
    means = {k: (sum(p[0][k][0] for p in parts), sum(p[0][k][1] for p in parts)) for k in parts[0][0]}
    maxes = {k: max(p[1][k] for p in parts) for k in parts[0][1]}
    mins = {k: min(p[2][k] for p in parts) for k in parts[0][2]}
    whole = finished(*algo.rollout_correction_stats(old, rollout, mask, level, 2.0))
    pooled = finished(means, maxes, mins)
    for name in whole:
        assert pooled[name] == pytest.approx(whole[name], rel=1e-9), name


def test_an_engine_that_agrees_with_the_actor_gives_weights_of_one_and_no_mismatch():
    old, _, mask = random_batch(11)
    w = algo.compute_rollout_is_weights(old, old, mask, "sequence", 2.0)
    assert torch.equal(w, mask.float())
    metrics = finished(*algo.rollout_correction_stats(old, old, mask, "token", 2.0))
    for name in ("kl", "k3_kl", "chi2_token", "chi2_seq", "log_ppl_diff", "rollout_is_std",
                 "rollout_is_ratio_fraction_high"):
        assert metrics[f"rollout_corr/{name}"] == pytest.approx(0, abs=1e-6), name
    assert metrics["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(1)
