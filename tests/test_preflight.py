"""The start-up checks (spmdsplit/preflight.py): a part the job does not build is not checked,
the one it builds still is; and the configuration (spmdsplit/config.py) imports nothing of the
runtime."""

import os
import subprocess
import sys

import pytest

from spmdsplit.config import load_config
from spmdsplit.errors import ConfigError
from spmdsplit.placement import plan_from_config
from spmdsplit.preflight import check_against_placement, check_config, packed_token_budgets
from spmdsplit.roles.build import trains_critic

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRPO_ROLLOUT_ACTOR = os.path.join(REPO, "configs", "grpo_rollout_actor.yaml")
# What a new user tries: the GRPO preset on a model of their own, with a smaller batch. The
# critic's keys keep the schema's defaults (critic.ppo_mini_batch_size=32, which does not divide
# 16; the embedded toy's preset, applied only without a model.path, has 16), and no critic is
# built. load_config does not look at the path; the real job below gives a real folder.
SMALLER_BATCH = ["data.train_batch_size=16", "actor.ppo_mini_batch_size=16"]
OWN_MODEL = ["model.path=/models/a-pretrained-model"]


def checked(config_file, overrides, shape=(2, 2, 1)):
    """check_config, then the checks against the planned placement, as preflight runs them."""
    cfg = load_config(config_file, overrides)
    check_config(cfg)
    check_against_placement(cfg, plan_from_config(cfg, *shape))
    return cfg


def test_grpo_on_rollout_actor_is_not_refused_for_the_critic_it_does_not_build():
    cfg = checked(GRPO_ROLLOUT_ACTOR, OWN_MODEL + SMALLER_BATCH)
    assert not trains_critic(cfg) and cfg.critic.ppo_mini_batch_size == 32


def test_ppo_with_a_critic_is_still_refused_for_its_mini_batch():
    with pytest.raises(ConfigError) as e:
        checked(None, ["placement.mode=colocate", *OWN_MODEL, *SMALLER_BATCH])
    assert str(e.value) == "critic.ppo_mini_batch_size=32 must divide data.train_batch_size=16"
    # ... and for one that does not divide over its pool (split: one critic rank here of 2+1).
    with pytest.raises(ConfigError, match=r"^critic\.ppo_micro_batch_size_per_gpu=3 must divide"):
        checked(None, ["critic.ppo_micro_batch_size_per_gpu=3"], shape=(2, 2, 1))
    checked(GRPO_ROLLOUT_ACTOR, ["critic.ppo_micro_batch_size_per_gpu=3"])


@pytest.mark.parametrize("overrides", [
    ["critic.engine=deepspeed", "critic.no_sync_accumulation=true"],  # an FSDP2 option on DeepSpeed
    ["model.use_remove_padding=true", "model.attn_implementation=sdpa", "trainer.device=cuda",
     "critic.ppo_micro_batch_size_per_gpu=4096"],  # a packed [T, T] mask of 57k tokens on a GPU
])
def test_critic_keys_are_checked_only_where_a_critic_is_built(overrides):
    with pytest.raises(ConfigError, match=r"critic\.(no_sync_accumulation|ppo_micro_batch_size_per_gpu)"):
        check_config(load_config(None, ["placement.mode=colocate", *overrides]))
    check_config(load_config(None, ["placement.mode=colocate", "algorithm.adv_estimator=grpo", "rollout.n=2",
                                    *overrides]))


def test_packed_budgets_leave_out_the_passes_of_a_critic_not_built():
    ppo = packed_token_budgets(load_config())
    grpo = packed_token_budgets(load_config(None, ["algorithm.adv_estimator=grpo", "rollout.n=2"]))
    assert {k for k in ppo if k.startswith("critic.")} == {"critic.ppo_micro_batch_size_per_gpu",
                                                          "critic.forward_micro_batch_size_per_gpu"}
    assert set(grpo) == {k for k in ppo if not k.startswith("critic.")}


@pytest.mark.e2e
def test_grpo_on_rollout_actor_with_a_smaller_batch_runs():
    """The user's command line, on 2 ranks, for one step: refused at start-up before preflight
    gated the critic's keys on a critic being built."""
    from spmdsplit.embedded import ensure_embedded_model
    from tests.support.launch import job

    own_model = f"model.path={ensure_embedded_model()}"  # a real Hugging Face folder: the schema's batch sizes
    result = job(2, "--config", GRPO_ROLLOUT_ACTOR, own_model, *SMALLER_BATCH, "trainer.total_steps=1", "trainer.timeline=",
                 "trainer.output_dir=", "trainer.logger=[console]", timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "critic.ppo_mini_batch_size" not in result.stderr


def test_the_configuration_imports_nothing_of_the_runtime():
    """A fresh interpreter: `spmdsplit.config` brings in spmdsplit.errors and nothing else of ours."""
    code = "import spmdsplit.config, sys; print(sorted(m for m in sys.modules if m.startswith('spmdsplit')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": REPO}).stdout
    assert out.strip() == "['spmdsplit', 'spmdsplit.config', 'spmdsplit.errors']"


def test_deepspeed_is_required_only_by_the_models_built(monkeypatch):
    """critic.engine=deepspeed under GRPO builds nothing on DeepSpeed, unless a reward model follows
    the critic's engine (reward.model.engine="")."""
    import importlib.util

    from spmdsplit.preflight import check_engines

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    grpo = ["algorithm.adv_estimator=grpo", "rollout.n=2", "critic.engine=deepspeed"]
    check_engines(load_config(None, grpo))
    with pytest.raises(ConfigError, match=r"^critic\.engine=deepspeed: DeepSpeed is not installed"):
        check_engines(load_config(None, grpo + ["reward.model.path=/models/a-reward-model"]))
    with pytest.raises(ConfigError, match=r"^critic\.engine=deepspeed: DeepSpeed is not installed"):
        check_engines(load_config(None, ["critic.engine=deepspeed"]))  # PPO: the value model runs on it
