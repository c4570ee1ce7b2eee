"""Loads the Hugging Face models each role trains or runs, the same way for the embedded tiny
model and for a real checkpoint: `from_pretrained` on a folder or hub id."""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from torch import nn

from spmdsplit import attention, lora


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def compute_dtypes(cfg, device: torch.device) -> tuple[torch.dtype, torch.dtype | None]:
    """(dtype, mixed): trained models keep fp32 master weights and compute in `dtype` (FSDP mixed
    precision, `mixed` is None in plain fp32); models that only infer are held in `dtype` outright."""
    dtype = resolve_dtype(cfg.model.dtype, device)
    return dtype, (dtype if dtype != torch.float32 else None)


def attention_implementation(requested: str, device: torch.device | str) -> str:
    """transformers' attention kernel for every trained and frozen model (model.attn_implementation),
    the one place it is chosen. "auto" (the default): flash_attention_2 on cuda where transformers
    itself would take flash-attn (`flash_attn_unavailable`); else "varlen" (spmdsplit/attention.py):
    packed passes attend each row on its own, with torch's varlen kernel on cuda or one sdpa call per
    row elsewhere, no [T, T] mask; other passes are sdpa's. Any other value is taken as it is."""
    if requested != "auto":
        return requested
    if torch.device(device).type != "cuda":
        return attention.VARLEN
    why_not = flash_attn_unavailable()
    if why_not is None:
        return "flash_attention_2"
    if why_not != NOT_INSTALLED:
        _warn_once(f"model.attn_implementation=auto: {why_not}; using {attention.VARLEN}")
    return attention.VARLEN


NOT_INSTALLED = "flash_attn is not installed"
# transformers 5.19 (utils/import_utils.py is_flash_attn_2_available) takes flash_attention_2 only
# from this distribution at this version or later.
FLASH_ATTN_DISTRIBUTION, FLASH_ATTN_MIN_VERSION = "flash-attn", "2.3.3"


@functools.lru_cache(maxsize=None)
def flash_attn_unavailable() -> str | None:
    """Why transformers would refuse flash_attention_2 here, or None. It asks what transformers asks
    (is_flash_attn_2_available), then one thing more:
    * the `flash_attn` package must come from the `flash-attn` distribution: flash-attn-4 (FA4) also
      installs a package named `flash_attn`, which transformers does not take for flash_attention_2;
    * that distribution at FLASH_ATTN_MIN_VERSION or later;
    * and it must import: a wheel built for another torch (or CUDA) is found but its compiled
      extension fails to load (an undefined symbol), and transformers then refuses the model.
      `flash_attn`'s own import loads that extension (flash_attn_interface imports flash_attn_2_cuda),
      so importing it is the check."""
    import importlib.metadata as md
    import importlib.util

    from packaging.version import InvalidVersion, Version

    if importlib.util.find_spec("flash_attn") is None:
        return NOT_INSTALLED
    # Which installed distributions provide the top-level package (their RECORD / top_level.txt),
    # with names normalised as transformers normalises them.
    providers = sorted({d.replace("_", "-").lower() for d in md.packages_distributions().get("flash_attn", [])})
    if FLASH_ATTN_DISTRIBUTION not in providers:
        found = f"the {', '.join(providers)} distribution" if providers else "no installed distribution"
        return (f"the flash_attn package comes from {found}, not from {FLASH_ATTN_DISTRIBUTION}, "
                "which transformers requires for flash_attention_2")
    installed = md.version(FLASH_ATTN_DISTRIBUTION)
    try:
        too_old = Version(installed) < Version(FLASH_ATTN_MIN_VERSION)
    except InvalidVersion:
        too_old = True
    if too_old:
        return (f"{FLASH_ATTN_DISTRIBUTION} {installed} is installed; transformers takes flash_attention_2 from "
                f">= {FLASH_ATTN_MIN_VERSION} only")
    try:
        import flash_attn  # noqa: F401
    except Exception as e:  # ImportError, OSError from the loader, or anything its __init__ raises
        return f"flash_attn is installed but does not load ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return None


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    """One line per node (its first local rank), however many models the rank builds."""
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        print(f"spmdsplit: warning: {message}", file=sys.stderr, flush=True)


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


# The Auto class of each kind of model a role holds. "value": the policy's backbone with a
# one-output token-classification head (verl's critic); "reward": a one-output sequence classifier.
AUTO_CLASSES = {"causal_lm": "AutoModelForCausalLM", "value": "AutoModelForTokenClassification",
                "reward": "AutoModelForSequenceClassification"}


@dataclass(frozen=True)
class ModelSource:
    """One model a role holds: which checkpoint, as what kind of model, in which dtype. `read()`
    loads it whole on the CPU (the pool's reader does this once); `skeleton()` builds the same
    module tree on the meta device, with no storage, for the ranks that only receive shards.

    `seed` makes any freshly initialised weights (a value head, a reward model's missing score
    head) the same wherever `read()` runs; shards are filled from the one reader, so they are
    equal on every rank by construction."""

    kind: str  # a key of AUTO_CLASSES
    path: str
    dtype: torch.dtype
    seed: int = 0
    trust_remote_code: bool = False
    # transformers' attention kernel (`attention_implementation`'s choice); None = transformers' default.
    attn_implementation: str | None = None
    # A LoRA adapter on the model (spmdsplit/lora.py): the base in `dtype`, frozen; the adapter in fp32.
    lora: lora.LoraSpec | None = None

    def _auto(self):
        import transformers

        return getattr(transformers, AUTO_CLASSES[self.kind])

    def _head_kwargs(self) -> dict:
        return {} if self.kind == "causal_lm" else {"num_labels": 1}

    def _attention_kwargs(self) -> dict:
        if self.attn_implementation == attention.VARLEN:  # ours: transformers must know it before a model is built
            attention.register()
        return {"attn_implementation": self.attn_implementation} if self.attn_implementation else {}

    def read(self, device: torch.device | str = "cpu") -> nn.Module:
        torch.manual_seed(self.seed)
        model = self._auto().from_pretrained(self.path, dtype=self.dtype, trust_remote_code=self.trust_remote_code,
                                             **self._head_kwargs(), **self._attention_kwargs())
        model = _no_dropout(model)
        if self.lora is not None:
            model = lora.apply(model, self.lora, self.kind)
        return model.to(device)

    def skeleton(self, device: torch.device | str = "meta") -> nn.Module:
        """On "meta" (the default): no storage. Elsewhere: freshly initialised weights, for a
        builder that partitions them as they are made (DeepSpeed's `zero.Init`)."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(self.path, trust_remote_code=self.trust_remote_code, **self._head_kwargs())
        with torch.device(device), _no_init_weights():
            model = self._auto().from_config(config, dtype=self.dtype, trust_remote_code=self.trust_remote_code,
                                             **self._attention_kwargs())
            model.tie_weights()  # skipped with the initialisation; a tied head must stay one tensor
            model = _no_dropout(model)
            if self.lora is not None:  # the same tree as read()'s; its weights come from the reader
                model = lora.apply(model, self.lora, self.kind, load_adapter=False)
        return model


def _no_init_weights():
    """transformers' switch that skips weight initialisation: the weights are loaded over it, and
    initialisers fail on tensors that zero.Init has already partitioned to nothing."""
    try:
        from transformers.initialization import no_init_weights  # transformers 5
    except ImportError:
        from transformers.modeling_utils import no_init_weights  # transformers 4
    return no_init_weights()


def load_causal_lm(path: str, dtype: torch.dtype, device: torch.device, seed: int, trust_remote_code=False):
    """A whole causal LM on `device` (tests, the rollout copy)."""
    return ModelSource("causal_lm", path, dtype, seed, trust_remote_code).read(device)


def hf_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors an HF checkpoint holds, by their HF names: every parameter once (a tied head
    comes under its first name only; from_pretrained ties it back) and the persistent buffers."""
    yield from model.named_parameters()
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buffer


def save_hf_folder(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], output_dir: str, tokenizer,
                   dtype: torch.dtype | None = None, max_shard_bytes: int = 2 * 2**30) -> None:
    """Config + safetensors shards + tokenizer, written by whichever rank calls it. `weights` is a
    stream of (HF name, full tensor) such as `hf_tensors(model)` or an engine's `iter_full_weights`
    (a tied head given once), floating ones written in `dtype` (default: as given), shard by shard as it
    comes, so at most one shard is held here at a time.

    Not `model.save_pretrained`: transformers 5 writes there only on *global* rank 0 once
    torch.distributed is up, so a pool whose first rank is not rank 0 would silently save nothing.
    """
    from safetensors.torch import save_file

    if isinstance(weights, Mapping):  # a whole state dict works too
        weights = weights.items()
    os.makedirs(output_dir, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    shard_names: list[list[str]] = []
    shard_bytes = 0

    def flush():
        save_file(shard, os.path.join(output_dir, f".part-{len(shard_names)}.safetensors"), metadata={"format": "pt"})
        shard_names.append(list(shard))
        shard.clear()

    for name, tensor in weights:
        # A copy of its own: gathered weights can be views into one large communication buffer,
        # which safetensors refuses to write.
        cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        tensor = tensor.detach().to("cpu", dtype=cast, copy=True).contiguous()
        if shard and shard_bytes + tensor.nbytes > max_shard_bytes:
            flush()
            shard_bytes = 0
        shard[name] = tensor
        shard_bytes += tensor.nbytes
    if shard or not shard_names:
        flush()
    # HF's names: one file "model.safetensors", or numbered parts and an index of where each weight is.
    if len(shard_names) == 1:
        os.replace(os.path.join(output_dir, ".part-0.safetensors"), os.path.join(output_dir, "model.safetensors"))
    else:
        weight_map = {}
        for i, names in enumerate(shard_names):
            file = f"model-{i + 1:05d}-of-{len(shard_names):05d}.safetensors"
            os.replace(os.path.join(output_dir, f".part-{i}.safetensors"), os.path.join(output_dir, file))
            weight_map.update(dict.fromkeys(names, file))
        with open(os.path.join(output_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    config = model.config
    config.architectures = [type(model).__name__.removeprefix("FSDP")]  # fully_shard renames the class
    if dtype is not None:
        config.dtype = dtype  # what from_pretrained(dtype="auto") loads it as
    config.save_pretrained(output_dir)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
