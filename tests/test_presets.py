"""Every preset in configs/ is valid for the launch it documents: schema, placement, batch math."""

import pathlib

import pytest

from spmdsplit.config import config_warnings, load_config
from spmdsplit.preflight import check_against_placement, check_config
from spmdsplit.placement import plan_from_config

CONFIGS = pathlib.Path(__file__).parent.parent / "configs"
# preset -> (world_size, ranks per node, nodes) it is written for, and the pools expected there:
# actor, critic and, when the rollout group has a pool of its own, rollout (else the actor's)
LAUNCHES = {
    "default.yaml": ((4, 4, 1), [0, 1], [2, 3]),
    "colocate.yaml": ((4, 4, 1), [0, 1, 2, 3], [0, 1, 2, 3]),
    "split_blocking.yaml": ((4, 4, 1), [0, 1], [2, 3]),
    "custom_6+2_per_node.yaml": ((16, 8, 2), [0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13], [6, 7, 14, 15]),
    "custom_3+5_per_node.yaml": ((16, 8, 2), [0, 1, 2, 8, 9, 10], [3, 4, 5, 6, 7, 11, 12, 13, 14, 15]),
    "nodes_8+8.yaml": ((16, 8, 2), list(range(8)), list(range(8, 16))),
    "gpu_qwen2.5_0.5b.yaml": ((8, 8, 1), [0, 1, 2, 3], [4, 5, 6, 7]),
    "gpu_qwen2.5_7b.yaml": ((8, 8, 1), [0, 1, 2, 3], [4, 5, 6, 7]),
    "rollout_actor+critic.yaml": ((2, 2, 1), [0], [0], [1]),
    "rollout_actor_critic.yaml": ((3, 3, 1), [0], [2], [1]),
    "grpo_rollout_actor.yaml": ((2, 2, 1), [0], [0], [1]),
    "dapo_rollout_actor.yaml": ((2, 2, 1), [0], [0], [1]),
    "lora_grpo_rollout_actor.yaml": ((2, 2, 1), [0], [0], [1]),
    "agent_lookup.yaml": ((4, 4, 1), [0, 1], [2, 3]),
    "environment_echo.yaml": ((4, 4, 1), [0, 1], [2, 3]),
    "code_apps.yaml": ((2, 2, 1), [0], [0]),  # the reward group on rank 1 (its score pool)
    "judge.yaml": ((2, 2, 1), [0], [1]),
}
# What a preset needs from the command line, as its header says.
GIVEN = {"judge.yaml": ["reward.judge.path=/the/judge"]}


def test_every_preset_is_listed():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(LAUNCHES)


@pytest.mark.parametrize("name", sorted(LAUNCHES))
def test_preset_fits_its_launch(name):
    (world, local, nnodes), actor, critic, *rollout = LAUNCHES[name]
    cfg = load_config(str(CONFIGS / name), GIVEN.get(name, []))
    check_config(cfg)
    placement = plan_from_config(cfg, world, local, nnodes)
    assert list(placement.ranks("actor")) == actor and list(placement.ranks("critic")) == critic
    assert list(placement.ranks("rollout")) == (rollout[0] if rollout else actor)
    check_against_placement(cfg, placement)
    assert config_warnings(cfg) == []  # e.g. staleness without a correction
    if rollout:  # the role-group presets' headers name the launch shape they are written for
        header = (CONFIGS / name).read_text()
        assert f"--nproc-per-node {local}" in header, f"{name}: its header does not name {local} ranks per node"


def test_default_preset_is_the_schema_default():
    """configs/default.yaml documents the no-flag run: it must not drift from the schema."""
    from omegaconf import OmegaConf

    assert OmegaConf.to_container(load_config(str(CONFIGS / "default.yaml"))) == OmegaConf.to_container(load_config())


GPU_PRESETS = ("gpu_qwen2.5_0.5b.yaml", "gpu_qwen2.5_7b.yaml", "nodes_8+8.yaml")


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_gpu_presets_carry_the_gpu_settings(name):
    """What a first 7B job needs: checkpointed activations, vLLM with CUDA graphs and a seed per row
    (free on CUDA's V2 sampler, the same rollout on any layout), and packing only on a
    variable-length kernel (no [T, T] mask)."""
    from spmdsplit.preflight import check_packed_attention

    cfg = load_config(str(CONFIGS / name))
    assert cfg.model.gradient_checkpointing
    assert cfg.rollout.per_row_seed and not cfg.rollout.enforce_eager
    if cfg.model.use_remove_padding:  # a variable-length kernel, flash-attn's or torch's: no [T, T] mask
        assert cfg.model.attn_implementation == "auto"
    check_packed_attention(cfg, "cuda")


@pytest.mark.parametrize("name", sorted(LAUNCHES))
def test_vllm_memory_share_follows_what_else_holds_the_gpu(name):
    """A rollout pool of its own holds only its engine, NCCL's buffers and the weight stream's
    buckets: a high share, but not so high that those no longer fit at 7B (tools.plan --memory
    --rollout-pool: 0.85 and 0.9 do not); engines beside training (split, colocate) share the
    device with the trainer's resident state: at most the default."""
    (world, local, nnodes), *_ = LAUNCHES[name]
    cfg = load_config(str(CONFIGS / name))
    placement = plan_from_config(cfg, world, local, nnodes)
    if placement.apart("rollout"):
        assert cfg.rollout.gpu_memory_utilization == 0.8
    else:
        assert cfg.rollout.gpu_memory_utilization <= 0.5
