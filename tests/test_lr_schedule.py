"""The LR schedule of a trained role (engines/common.py): linear warmup over trainer steps, then
constant or a half cosine that ends with the job (verl's `lr_scheduler_type`, `min_lr_ratio`)."""

import math

import pytest
import torch

from spmdsplit.config import load_config
from spmdsplit.errors import ConfigError
from spmdsplit.engines.common import adamw_with_warmup, lr_factor


def test_warmup_then_constant():
    assert [lr_factor(s, warmup=4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_factor(0, warmup=0) == 1.0


def test_cosine_falls_from_the_peak_to_the_floor_at_the_last_step():
    factors = [lr_factor(s, warmup=2, kind="cosine", total=12, min_ratio=0.1) for s in range(14)]
    assert factors[:3] == [0.5, 1.0, 1.0]
    assert all(a > b for a, b in zip(factors[2:12], factors[3:12]))  # strictly falling after warmup
    assert factors[7] == pytest.approx(0.55)  # halfway: the mean of peak and floor
    assert factors[12] == pytest.approx(0.1) and factors[13] == pytest.approx(0.1)  # held at the floor


def test_the_optimizer_follows_the_schedule_once_per_trainer_step():
    cfg = load_config(None, ["trainer.total_steps=10", "actor.optim.lr=0.5", "actor.optim.lr_warmup_steps=0",
                             "actor.optim.lr_scheduler_type=cosine", "actor.optim.min_lr_ratio=0"])
    assert cfg.actor.optim.total_training_steps == 10  # filled from trainer.total_steps
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer, scheduler = adamw_with_warmup([weight], cfg.actor.optim)
    lrs = []
    for _ in range(10):  # one trainer step: the role's optimizer steps, then the schedule once
        lrs.append(optimizer.param_groups[0]["lr"])
        weight.sum().backward()
        optimizer.step()
        scheduler.step()
    assert lrs[0] == 0.5 and lrs[-1] == pytest.approx(0.5 * 0.5 * (1 + math.cos(math.pi * 0.9)))
    # A horizon the user sets stays.
    assert load_config(None, ["trainer.total_steps=10", "critic.optim.total_training_steps=40"]
                       ).critic.optim.total_training_steps == 40


def test_bad_schedule_keys_are_config_errors():
    with pytest.raises(ConfigError, match="actor.optim.lr_scheduler_type='linear': expected one of"):
        load_config(None, ["actor.optim.lr_scheduler_type=linear"])
    with pytest.raises(ConfigError, match=r"critic.optim.min_lr_ratio=1.5: expected 0 <= ratio <= 1"):
        load_config(None, ["critic.optim.min_lr_ratio=1.5"])
