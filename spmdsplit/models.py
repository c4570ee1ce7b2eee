"""Loads the Hugging Face models each role trains or runs, the same way for the embedded tiny
model and for a real checkpoint: `from_pretrained` on a folder or hub id."""

from __future__ import annotations

import os

import torch
from torch import nn


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def _no_dropout(model: nn.Module) -> nn.Module:
    # PPO compares log-probs and values of the same tokens across passes; dropout would make
    # old and new log-probs differ with no policy change (and value heads have it on by default).
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    for key in ("attention_dropout", "hidden_dropout", "classifier_dropout", "resid_pdrop", "embd_pdrop"):
        if hasattr(model.config, key):
            setattr(model.config, key, 0.0)
    return model


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    tokenizer.padding_side = "left"  # prompts are left-padded so every response starts at one column
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def eos_token_ids(path: str, tokenizer) -> list[int]:
    """Every token that ends a response: the tokenizer's EOS and those the checkpoint's
    generation config lists (chat models end turns with a token other than the tokenizer's EOS)."""
    from transformers import GenerationConfig

    ids = [tokenizer.eos_token_id]
    try:
        listed = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json
        listed = None
    for i in listed if isinstance(listed, list) else [listed]:
        if i is not None and i not in ids:
            ids.append(i)
    return ids


def load_causal_lm(path: str, dtype: torch.dtype, device: torch.device, seed: int, trust_remote_code=False):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)  # any freshly initialised weights must be equal on every rank of a pool
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    return _no_dropout(model).to(device)


def load_value_model(path: str, dtype: torch.dtype, device: torch.device, seed: int, trust_remote_code=False):
    """A critic: the policy's backbone with a one-output token-classification head (verl's choice)."""
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(seed)  # the new value head must start equal on every rank of the pool
    model = AutoModelForTokenClassification.from_pretrained(
        path, num_labels=1, dtype=dtype, trust_remote_code=trust_remote_code
    )
    return _no_dropout(model).to(device)


def save_hf_folder(model: nn.Module, state: dict[str, torch.Tensor], output_dir: str, tokenizer) -> None:
    """Config + safetensors shards + tokenizer, written by whichever rank calls it.

    Not `model.save_pretrained`: transformers 5 writes there only on *global* rank 0 once
    torch.distributed is up, so a pool whose first rank is not rank 0 would silently save nothing.
    """
    from huggingface_hub import save_torch_state_dict

    os.makedirs(output_dir, exist_ok=True)
    config = model.config
    config.architectures = [type(model).__name__.removeprefix("FSDP")]  # fully_shard renames the class
    config.save_pretrained(output_dir)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(output_dir)
    tensors, seen = {}, set()
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            continue  # a tied weight (head = embeddings): stored once, from_pretrained ties it back
        seen.add(key)
        # A copy of its own: gathered weights can be views into one large communication buffer,
        # which safetensors refuses to write.
        tensors[name] = tensor.detach().to("cpu", copy=True).contiguous()
    save_torch_state_dict(tensors, output_dir)
    tokenizer.save_pretrained(output_dir)
