"""Every preset in configs/ is valid for the launch it documents: schema, placement, batch math."""

import pathlib

import pytest

from spmdsplit.config import check_against_placement, config_warnings, load_config
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
    "rollout_actor+critic.yaml": ((2, 2, 1), [0], [0], [1]),
    "rollout_actor_critic.yaml": ((3, 3, 1), [0], [2], [1]),
    "grpo_rollout_actor.yaml": ((2, 2, 1), [0], [0], [1]),
}


def test_every_preset_is_listed():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(LAUNCHES)


@pytest.mark.parametrize("name", sorted(LAUNCHES))
def test_preset_fits_its_launch(name):
    (world, local, nnodes), actor, critic, *rollout = LAUNCHES[name]
    cfg = load_config(str(CONFIGS / name))
    placement = plan_from_config(cfg.placement, world, local, nnodes)
    assert list(placement.actor_ranks) == actor and list(placement.critic_ranks) == critic
    assert list(placement.rollout_ranks) == (rollout[0] if rollout else actor)
    check_against_placement(cfg, placement)
    assert config_warnings(cfg) == []  # e.g. staleness without a correction
    if rollout:  # the role-group presets' headers name the launch shape they are written for
        header = (CONFIGS / name).read_text()
        assert f"--nproc-per-node {local}" in header, f"{name}: its header does not name {local} ranks per node"


def test_default_preset_is_the_schema_default():
    """configs/default.yaml documents the no-flag run: it must not drift from the schema."""
    from omegaconf import OmegaConf

    assert OmegaConf.to_container(load_config(str(CONFIGS / "default.yaml"))) == OmegaConf.to_container(load_config())
