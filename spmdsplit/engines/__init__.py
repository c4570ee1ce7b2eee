"""Training engines over one pool's group: FSDP2 (`fsdp.py`) and DeepSpeed ZeRO (`deepspeed.py`).

Both offer the same small interface the roles use (`model`, `group`, `dp_size`, `compute_dtype`,
`__call__`, `backward`, `grad_sync`, `step`, `iter_full_weights`, `save_hf`,
`save_checkpoint`, `load_checkpoint`) and build themselves from a `ModelSource`
(`from_source`); `build_engine` picks one per role from the config. DeepSpeed is imported only
when chosen.
"""

from __future__ import annotations

from spmdsplit.engines.fsdp import FSDPEngine
from spmdsplit.models import ModelSource

# role -> (its config section, the trained role it follows when its own keys are unset, trains?)
ROLES = {
    "actor": ("actor", None, True),
    "ref": ("ref", "actor", False),
    "critic": ("critic", None, True),
    "reward_model": ("reward.model", "critic", False),
}


def engine_choice(cfg, role: str) -> tuple[str, int]:
    """(engine, zero_stage) of a role. The reference policy and the reward model follow the actor's
    and the critic's engine unless set; an inference-only model under DeepSpeed takes ZeRO-3 when
    the role it follows shards its weights (stage 3), else stage 0 (whole weights)."""
    section, follows, _ = ROLES[role]
    own = cfg
    for part in section.split("."):
        own = own[part]
    if follows is None:
        return own.engine, own.zero_stage
    leader = cfg[follows]
    engine = own.engine or leader.engine
    stage = own.zero_stage if own.zero_stage != -1 else (3 if leader.zero_stage == 3 else 0)
    return engine, stage


def build_engine(cfg, role: str, source: ModelSource, mesh, device, param_dtype=None):
    """The engine of `role` ("actor", "ref", "critic", "reward_model") over the pool `mesh`, its model
    loaded from `source` straight into the engine's layout: trained roles get their optimizer
    config and activation checkpointing when `model.gradient_checkpointing` is set, inference-only
    ones neither."""
    engine, stage = engine_choice(cfg, role)
    section, _, trains = ROLES[role]
    optim = cfg[section].optim if trains else None
    checkpointing = trains and cfg.model.gradient_checkpointing
    if engine == "fsdp":
        return FSDPEngine.from_source(source, mesh, device, optim, param_dtype, checkpointing)
    from spmdsplit.engines.deepspeed import DeepSpeedEngine

    return DeepSpeedEngine.from_source(source, mesh.get_group(), stage, device, optim, param_dtype, checkpointing)
