"""Every preset in configs/ is valid for the launch it documents: schema, placement, batch math."""

import pathlib

import pytest

from spmdsplit.config import check_against_pools, load_config
from spmdsplit.placement import plan_placement

CONFIGS = pathlib.Path(__file__).parent.parent / "configs"
# preset -> (world_size, ranks per node, nodes) it is written for, and the pools expected there
LAUNCHES = {
    "default.yaml": ((4, 4, 1), [0, 1], [2, 3]),
    "colocate.yaml": ((4, 4, 1), [0, 1, 2, 3], [0, 1, 2, 3]),
    "split_blocking.yaml": ((4, 4, 1), [0, 1], [2, 3]),
    "custom_6+2_per_node.yaml": ((16, 8, 2), [0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13], [6, 7, 14, 15]),
    "custom_3+5_per_node.yaml": ((16, 8, 2), [0, 1, 2, 8, 9, 10], [3, 4, 5, 6, 7, 11, 12, 13, 14, 15]),
    "nodes_8+8.yaml": ((16, 8, 2), list(range(8)), list(range(8, 16))),
    "gpu_qwen2.5_0.5b.yaml": ((8, 8, 1), [0, 1, 2, 3], [4, 5, 6, 7]),
}


def test_every_preset_is_listed():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == sorted(LAUNCHES)


@pytest.mark.parametrize("name", sorted(LAUNCHES))
def test_preset_fits_its_launch(name):
    (world, local, nnodes), actor, critic = LAUNCHES[name]
    cfg = load_config(str(CONFIGS / name))
    p = cfg.placement
    placement = plan_placement(p.mode, list(p.pools) or None, p.pool_unit, world, local, nnodes)
    assert list(placement.actor_ranks) == actor and list(placement.critic_ranks) == critic
    check_against_pools(cfg, len(placement.actor_ranks), len(placement.critic_ranks))


def test_default_preset_is_the_schema_default():
    """configs/default.yaml documents the no-flag run: it must not drift from the schema."""
    from omegaconf import OmegaConf

    assert OmegaConf.to_container(load_config(str(CONFIGS / "default.yaml"))) == OmegaConf.to_container(load_config())
