r"""Writes tests/data/verl_core_algos.pt: verl 0.9.1's own advantage estimators and policy losses
(`verl.trainer.ppo.core_algos`) on seeded random fp64 inputs, for tests/test_algo_registry.py to
hold spmdsplit/algo.py against (CI has no verl; the test reads only the file).

The inputs are two batches with ragged response masks: rows of different lengths, a row with a
hole inside its mask (a multi-turn tool span), a fully masked row, a group of one, rows with a
zero score, tokens where the dual clip bites, and finite garbage on the masked positions (which
no result on a valid token may depend on). For every estimator we have the fixture holds verl's (advantages, returns);
for every policy loss, per hyper-parameter setting x loss_agg_mode, once plain and once with both
rollout IS weights and explicit global counts: verl's loss, its metrics and d loss / d log_prob.

verl's functions are called the way its trainer and actor call them: estimators with `config=AlgoConfig(...)` (and
gae's gamma/lam, grpo's norm_adv_by_std_in_grpo as arguments), losses with
`config=ActorConfig(...)` whose `global_batch_info` is {} (local counts) or {dp_size: 1,
batch_num_tokens, global_batch_size, loss_scale_factor} (explicit counts, which is where verl's
dp-size scaling and our summed global normalisation coincide). clip_cov draws at random: each
case records the seed set with torch.manual_seed right before the call.

To regenerate (after changing the cases below, or for another verl release). Nothing is
installed into .venv: verl and the few modules its package __init__ imports go to a throwaway
folder, --no-deps so that torch, numpy and omegaconf stay .venv's:

    .venv/bin/pip download --no-deps -d /tmp/verlwheel verl==0.9.1 ray==2.60.0 tensordict==0.15.3 \
        pyvers==0.2.3 codetiming==1.4.0 orjson==3.13.0
    .venv/bin/pip install --no-deps --target /tmp/verl_algos_site /tmp/verlwheel/*.whl
    PYTHONPATH=/tmp/verl_algos_site .venv/bin/python tools/verl_algo_fixtures.py
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import torch

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "verl_core_algos.pt"

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# (name, verl ActorConfig keys, verl PolicyLossConfig keys): settings per loss
LOSS_SETTINGS = [
    ("vanilla", {}, {}),
    ("vanilla", {"clip_ratio_low": 0.1, "clip_ratio_high": 0.28, "clip_ratio_c": 2.0}, {}),
    ("gspo", {"clip_ratio_low": 0.0003, "clip_ratio_high": 0.0004}, {}),  # the GSPO paper's
    ("gspo", {}, {}),
    ("sapo", {}, {}),
    ("sapo", {"tau_pos": 2.0, "tau_neg": 3.0}, {}),
    ("gpg", {}, {}),
    ("clip_cov", {}, {}),
    ("clip_cov", {"clip_ratio_low": 0.1, "clip_ratio_high": 0.3}, {"clip_cov_ratio": 0.1, "clip_cov_lb": 0.2,
                                                                   "clip_cov_ub": 3.0}),
    ("clip_cov", {}, {"clip_cov_ratio": 0.5, "clip_cov_lb": -1.0, "clip_cov_ub": 1.0}),
    ("kl_cov", {}, {}),
    ("kl_cov", {}, {"kl_cov_ratio": 0.2, "ppo_kl_coef": 1.0}),
    ("geo_mean", {}, {}),
    ("geo_mean", {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4}, {}),  # GMPO's (e^-0.4, e^0.4)
    ("cispo", {}, {}),
    ("cispo", {"clip_ratio_low": 10.0, "clip_ratio_high": 0.28}, {}),  # CISPO's: no lower bound
]

# (name, estimator keyword arguments; AlgoConfig keys go under "config")
ESTIMATOR_SETTINGS = [
    ("gae", {"gamma": 1.0, "lam": 1.0}),
    ("gae", {"gamma": 0.99, "lam": 0.95}),
    ("grpo", {"norm_adv_by_std_in_grpo": True}),
    ("grpo", {"norm_adv_by_std_in_grpo": False}),
    ("rloo", {}),
    ("reinforce_plus_plus", {"config": {"gamma": 1.0}}),
    ("reinforce_plus_plus", {"config": {"gamma": 0.9}}),
    ("reinforce_plus_plus_baseline", {}),
    ("remax", {}),
    ("grpo_passk", {"config": {"norm_adv_by_std_in_grpo": True}}),
    ("grpo_passk", {"config": {"norm_adv_by_std_in_grpo": False}}),
    ("opo", {}),
    ("gpg", {}),
]


def make_batch(seed: int, lengths: list, index: list, passk_index: list, zero_score_rows: list) -> dict:
    """One batch of fp64 inputs. `lengths`: a row's valid length, or a 0/1 list (a mask with holes)."""
    g = torch.Generator().manual_seed(seed)
    width = max(len(x) if isinstance(x, list) else x for x in lengths) + 1  # one padded column at least
    rows = len(lengths)
    mask = torch.zeros(rows, width, dtype=torch.float64)
    for i, x in enumerate(lengths):
        if isinstance(x, list):
            mask[i, :len(x)] = torch.tensor(x, dtype=torch.float64)
        else:
            mask[i, :x] = 1.0

    def randn():
        return torch.randn(rows, width, generator=g, dtype=torch.float64)

    garbage = 3.0 * randn()  # what masked positions hold: finite, and must not matter
    valid = mask.bool()
    # rewards: dense noise on valid tokens plus an outcome at each row's last valid token
    rewards = torch.where(valid, 0.1 * randn(), torch.zeros(()))
    for i in range(rows):
        where = valid[i].nonzero()
        if len(where):
            rewards[i, where[-1]] += float(torch.randint(0, 3, (), generator=g))  # 0, 1 or 2: ties
    for i in zero_score_rows:  # GPG's alpha counts the rows with a non-zero score
        rewards[i] = 0.0
    old_log_prob = -3.0 * torch.rand(rows, width, generator=g, dtype=torch.float64)
    # ratios mostly near 1, some well outside any clip range (dual clip, clip_cov, GSPO's tiny range)
    step = 0.3 * randn() + torch.where(torch.rand(rows, width, generator=g) < 0.15, 1.5 * randn(), torch.zeros(()))
    log_prob = old_log_prob + step
    advantages = randn() + torch.randn(rows, 1, generator=g, dtype=torch.float64)  # a row's part + token noise
    # two tokens where the dual clip bites: a negative advantage and a ratio e^1.5 > clip_ratio_c
    for i in (0, 3):
        log_prob[i, 0], advantages[i, 0] = old_log_prob[i, 0] + 1.5, -abs(advantages[i, 0]) - 0.5
    is_weights = torch.where(valid, 2.0 * torch.rand(rows, width, generator=g, dtype=torch.float64) + 1e-3,
                             torch.zeros(()))
    return {
        "response_mask": mask,
        "token_level_rewards": rewards,
        "values": torch.where(valid, randn(), garbage),
        "reward_baselines": torch.randn(rows, generator=g, dtype=torch.float64),
        "index": list(index),
        "passk_index": list(passk_index),  # grpo_passk: verl refuses groups of one
        "old_log_prob": torch.where(valid, old_log_prob, garbage),
        "log_prob": torch.where(valid, log_prob, garbage - 1.0),
        "advantages": torch.where(valid, advantages, garbage),
        "rollout_is_weights": is_weights,
    }


BATCHES = [
    # 8 rows: groups of 4, 3 and 1; row 2 has a hole (a tool span), row 5 is fully masked
    make_batch(0, [7, 3, [1, 1, 0, 0, 1, 1, 1], 5, 1, 0, 6, 4], index=[0, 0, 0, 0, 1, 1, 1, 2],
               passk_index=[0, 0, 0, 0, 1, 1, 2, 2], zero_score_rows=[3, 6]),
    # 6 rows, wider: two holes in one row, no empty row
    make_batch(1, [9, [1, 0, 1, 1, 0, 0, 1, 1, 1], 2, 8, 5, 9], index=["a", "a", "b", "b", "b", "c"],
               passk_index=["a", "a", "b", "b", "b", "b"], zero_score_rows=[4]),
]


def run_estimators(core_algos, AlgoConfig, batch: dict) -> list[dict]:
    out = []
    for name, kwargs in ESTIMATOR_SETTINGS:
        kwargs = dict(kwargs)
        config = AlgoConfig(**kwargs.pop("config", {}))
        args = {"token_level_rewards": batch["token_level_rewards"].clone(), "response_mask": batch["response_mask"]}
        if name == "gae":
            args["values"] = batch["values"]
        else:
            args["config"] = config
        if name == "remax":
            args["reward_baselines"] = batch["reward_baselines"]
        if name not in ("gae", "reinforce_plus_plus", "remax"):
            args["index"] = np.array(batch["passk_index" if name == "grpo_passk" else "index"], dtype=object)
        advantages, returns = core_algos.get_adv_estimator_fn(name)(**args, **kwargs)
        # the hyper-parameters in effect, whether verl took them as arguments or from its config
        hyper = {key: kwargs.get(key, getattr(config, key)) for key in ("gamma", "lam", "norm_adv_by_std_in_grpo")}
        out.append({"name": name, "hyper": hyper, "advantages": advantages.detach().clone(),
                    "returns": returns.detach().clone()})
    return out


def global_info(batch: dict, explicit: bool) -> dict:
    """verl's config.global_batch_info: {} (the micro-batch's own counts), or dp_size 1 with
    counts of a larger batch (more tokens, more rows, a longer horizon than these tensors)."""
    if not explicit:
        return {}
    mask = batch["response_mask"]
    return {"dp_size": 1, "batch_num_tokens": int(mask.sum()) + 5,
            "global_batch_size": int((mask.sum(-1) > 0).sum()) + 3, "loss_scale_factor": mask.shape[1] + 2}


def run_losses(core_algos, ActorConfig, PolicyLossConfig, batch: dict, batch_number: int) -> list[dict]:
    out = []
    # (rollout IS weights, explicit global counts): plain, and both at once
    cases = itertools.product(enumerate(LOSS_SETTINGS), AGG_MODES, ((False, False), (True, True)))
    for (setting, (name, actor_keys, loss_keys)), agg, (weighted, explicit) in cases:
        seed = 1000 * batch_number + 10 * setting + 2 * weighted + explicit
        config = ActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=1, loss_agg_mode=agg,
                             **actor_keys, policy_loss=PolicyLossConfig(loss_mode=name, **loss_keys))
        config.global_batch_info.update(global_info(batch, explicit))
        log_prob = batch["log_prob"].clone().requires_grad_()
        torch.manual_seed(seed)  # clip_cov's draw
        loss, metrics = core_algos.get_policy_loss_fn(name)(
            batch["old_log_prob"], log_prob, batch["advantages"], batch["response_mask"], loss_agg_mode=agg,
            config=config, rollout_is_weights=batch["rollout_is_weights"] if weighted else None)
        (grad,) = torch.autograd.grad(loss, log_prob)
        out.append({"name": name, "actor": dict(actor_keys), "policy_loss": dict(loss_keys), "loss_agg_mode": agg,
                    "weighted": weighted, "global_batch_info": global_info(batch, explicit), "seed": seed,
                    "loss": loss.detach().clone(), "grad": grad.clone(), "metrics": dict(metrics)})
    # one tensor for all the cases' losses and one for their gradients: a file of a few hundred KiB
    # instead of one zip entry per small tensor
    return {"cases": [{k: v for k, v in case.items() if k not in ("loss", "grad")} for case in out],
            "loss": torch.stack([case["loss"] for case in out]), "grad": torch.stack([case["grad"] for case in out])}


def main() -> None:
    import verl
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import core_algos
    from verl.workers.config import ActorConfig, PolicyLossConfig

    fixture = {"verl_version": verl.__version__, "batches": []}
    for number, batch in enumerate(BATCHES):
        fixture["batches"].append({
            "inputs": batch,
            "estimators": run_estimators(core_algos, AlgoConfig, batch),
            "losses": run_losses(core_algos, ActorConfig, PolicyLossConfig, batch, number),
        })
    OUT.parent.mkdir(parents=True, exist_ok=True)
    torch.save(fixture, OUT)
    cases = sum(len(b["estimators"]) + len(b["losses"]["cases"]) for b in fixture["batches"])
    print(f"wrote {OUT} ({OUT.stat().st_size // 1024} KiB): verl {verl.__version__}, {cases} cases")


if __name__ == "__main__":
    main()
