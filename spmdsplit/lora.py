"""LoRA on the trained models (model.lora_rank for the policy, critic.model.lora_rank for the value
model), with Hugging Face PEFT: the adapter put on a model before it is sharded, the names of its
tensors, what the rollout engines take of it, and its files.

    which layers   model.target_modules (PEFT's: "all-linear" = every linear layer but the output
                   head), minus model.exclude_modules; rank model.lora_rank, scale lora_alpha / rank
    where          ModelSource applies it to the model it reads or builds (models.py), so every
                   rank of a pool holds the same module tree before FSDP2 shards it; the base stays
                   frozen in the compute dtype, the adapter trains in fp32
    the reference  the policy's own model with the adapter disabled (roles/build.py): no second model
    engines        take the adapter alone, each sync (`is_adapter`, `saved_name`), and keep the base
                   they loaded once; with model.lora_merge the merged weights instead (`merged`),
                   the whole model under the base's names, as a full sync
    files          a PEFT adapter folder (`write_adapter`): the HF export, and what vLLM reads

Names: PEFT's model holds `base_model.model.<HF name of the layer>.lora_A.default.weight` (the
adapter's name, "default", in the middle) and the base layer's own weight as
`....<layer>.base_layer.weight`. An adapter folder and vLLM name the adapter's tensors without the
adapter's name (`saved_name`), as `peft.get_peft_model_state_dict` writes them.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

ADAPTER = "default"  # the one adapter each model holds, under PEFT's default name
PEFT_PREFIX = "base_model.model."  # where PeftModel puts the wrapped model's names
# PEFT's task types of the models a role holds (models.AUTO_CLASSES): the value model's score head
# is then trained whole beside the adapter (PEFT adds "score" and "classifier" to modules_to_save for
# TOKEN_CLS), so it takes no adapter of its own: "all-linear" would put one on it (a token classifier
# has no output embedding for PEFT to leave out), which PEFT refuses beside modules_to_save.
TASK_TYPES = {"causal_lm": "CAUSAL_LM", "value": "TOKEN_CLS"}
HEADS = ("score", "classifier")


@dataclass(frozen=True)
class LoraSpec:
    """One model's adapter, as the config asks for it. `adapter_path`: start from a saved PEFT
    adapter (its own adapter_config.json then says which layers and the scale); `merge`: the rollout
    engines take merged weights instead of the adapter (the policy only)."""

    rank: int
    alpha: float
    target_modules: str | tuple[str, ...] = "all-linear"
    exclude_modules: str | tuple[str, ...] | None = None
    adapter_path: str = ""
    merge: bool = False

    def peft_config(self, kind: str):
        """The `peft.LoraConfig` of the adapter (dropout 0: PPO compares log-probs of the same tokens
        across passes, as models._no_dropout says)."""
        from peft import LoraConfig

        if self.adapter_path:
            config = LoraConfig.from_pretrained(self.adapter_path)
            config.inference_mode = False
            config.lora_dropout = 0.0
            return config
        as_list = lambda v: v if v is None or isinstance(v, str) else list(v)  # noqa: E731
        exclude = as_list(self.exclude_modules)
        if kind == "value":  # the head trains whole (TASK_TYPES above)
            if isinstance(exclude, str):  # a regex matched against each whole module name, as PEFT does
                exclude = rf"(?:{exclude})|(?:.*\.)?(?:{'|'.join(HEADS)})"
            else:
                exclude = [*(exclude or []), *HEADS]
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=as_list(self.target_modules),
                          exclude_modules=exclude, lora_dropout=0.0, bias="none", task_type=TASK_TYPES[kind])


def spec_of(section, merge: bool = False) -> LoraSpec | None:
    """The LoraSpec of a config section holding LoRA keys (cfg.model, cfg.critic.model); None when
    its lora_rank is 0 (full fine-tuning)."""
    if not section.lora_rank:
        return None

    def modules(value):
        if value is None or isinstance(value, str):
            return value
        return tuple(value)
    return LoraSpec(section.lora_rank, float(section.lora_alpha), modules(section.target_modules),
                    modules(section.exclude_modules), section.lora_adapter_path, merge)


def policy_spec(cfg) -> LoraSpec | None:
    return spec_of(cfg.model, merge=cfg.model.lora_merge)


def critic_spec(cfg) -> LoraSpec | None:
    return spec_of(cfg.critic.model)


def engines_take_adapter(cfg) -> LoraSpec | None:
    """The policy's LoraSpec where the rollout engines hold the base and take only the adapter at
    each sync; None where they take whole weights (no LoRA, or model.lora_merge). Decided here
    once: the actor's stream (weight_sync.PolicyWeights) and the engines (rollout/) both ask."""
    spec = policy_spec(cfg)
    return spec if spec is not None and not spec.merge else None


def apply(model: torch.nn.Module, spec: LoraSpec, kind: str, load_adapter: bool = True,
          trained: bool = True) -> torch.nn.Module:
    """`model` with the adapter on (a `peft.PeftModel`): the base's parameters frozen, the adapter's
    trainable and in fp32 whatever the base's dtype (PEFT's autocast_adapter_dtype; a head trained
    whole beside it, as the value model's, too). From
    spec.adapter_path its saved weights when `load_adapter` (a skeleton on the meta device takes
    none: the pool's reader hands them out). `trained=False` (a rollout engine's copy): the adapter
    in the base's dtype, as the trainer computes it under mixed precision (FSDP2 casts it to the
    compute dtype) and as vLLM holds it (lora_dtype "auto"), so that a bf16 engine samples from
    what the trainer scores rather than from an fp32 adapter path."""
    from peft import PeftModel, get_peft_model

    if spec.adapter_path and load_adapter:
        model = PeftModel.from_pretrained(model, spec.adapter_path, is_trainable=trained, autocast_adapter_dtype=trained)
    else:
        model = get_peft_model(model, spec.peft_config(kind), autocast_adapter_dtype=trained)
    if trained:
        # autocast_adapter_dtype upcasts the adapter's layers only: what PEFT trains whole beside
        # them (the value model's score head, any modules_to_save) is copied in the base's dtype,
        # where an update of 1e-5 x a weight near 0.02 rounds to nothing in bf16. Every trainable
        # tensor gets fp32 masters; FSDP2's mixed precision casts them for the compute.
        for param in model.parameters():
            if param.requires_grad and param.dtype != torch.float32:
                param.data = param.data.float()
    return model


def is_peft(model: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


@contextlib.contextmanager
def adapter_disabled(model: torch.nn.Module):
    """A context in which the PEFT `model` computes as its base (the reference policy). PEFT's
    switch also freezes the adapter while it is off (LoraLayer.enable_adapters), and FSDP2 sets a
    group's mixed-precision dtypes from the parameters that require grad when the model first runs
    (torch 2.13 _fsdp_param_group.py _init_mp_dtypes): were that first forward the reference's,
    a bf16 compute would then hand fp32 adapters bf16 gradients. So what trains stays trainable."""
    trained = [p for p in model.parameters() if p.requires_grad]
    with model.disable_adapter():
        for p in trained:
            p.requires_grad_(True)
        yield


def is_adapter(name: str) -> bool:
    """Whether the model's tensor `name` is the adapter's (what an engine takes at each sync)."""
    return f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name


def saved_name(name: str) -> str:
    """An adapter tensor's name in a PEFT folder and in vLLM: without the adapter's name."""
    return name.replace(f".{ADAPTER}.", ".")


def model_name(saved: str) -> str:
    """The inverse of saved_name, for an adapter tensor (`...lora_A.weight` -> `...lora_A.default.weight`)."""
    head, _, last = saved.rpartition(".")
    return f"{head}.{ADAPTER}.{last}"


def base_name(name: str) -> str:
    """A tensor of the PEFT model under the base model's own Hugging Face name."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def scalings(model: torch.nn.Module) -> dict[str, float]:
    """Each adapted layer's scale (lora_alpha / r, or a saved adapter's per-layer patterns), by the
    layer's name in the PEFT model."""
    from peft.tuners.lora import LoraLayer

    return {name: module.scaling[ADAPTER] for name, module in model.named_modules()
            if isinstance(module, LoraLayer) and ADAPTER in module.scaling}


def merged(weights: Iterable[tuple[str, torch.Tensor]], scaling: dict[str, float],
           dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The PEFT model's stream of (name, whole tensor) as the merged model's, under the base's names:
    each adapted layer's weight W + scale * B @ A, computed in fp32 once its A and B have come (PEFT
    lists a layer's base weight, its bias, then A, then B), cast to `dtype`; every other tensor
    as it is. At most one layer's base weight is held back at a time."""
    held: dict[str, torch.Tensor] = {}  # layer name -> its base weight, then its A
    for name, tensor in weights:
        layer, _, rest = name.rpartition(".lora_")
        if layer and rest.startswith(("A.", "B.")):
            if rest.startswith("A."):
                held[layer + ".A"] = tensor
                continue
            weight = held.pop(layer + ".W")
            delta = tensor.float() @ held.pop(layer + ".A").float()
            out = weight.float() + scaling[layer] * delta
            yield base_name(f"{layer}.weight"), out.to(dtype or weight.dtype)
        elif name.endswith(".base_layer.weight"):
            held[name.removesuffix(".base_layer.weight") + ".W"] = tensor
        else:
            yield base_name(name), tensor if dtype is None or not tensor.is_floating_point() else tensor.to(dtype)
    if held:
        raise RuntimeError(f"lora.merged: the stream ended with {sorted(held)} not merged")


def write_adapter(folder: str, tensors: Iterable[tuple[str, torch.Tensor]], config, base_model: str) -> int:
    """A PEFT adapter folder (`peft.PeftModel.from_pretrained` and vLLM load it): adapter_config.json
    and adapter_model.safetensors, the tensors (saved names) written as given. Returns the bytes
    of the tensors. The caller makes it appear whole (write elsewhere, then rename)."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    state = {name: t.detach().to("cpu").contiguous() for name, t in tensors}
    save_file(state, os.path.join(folder, "adapter_model.safetensors"), metadata={"format": "pt"})
    saved = config.to_dict()
    saved.update(base_model_name_or_path=base_model, inference_mode=True)
    for key, value in saved.items():  # sets (target_modules) are not JSON
        if isinstance(value, set):
            saved[key] = sorted(value)
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(saved, f, indent=2, sort_keys=True)
    return sum(t.nbytes for t in state.values())
