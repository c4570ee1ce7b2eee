"""What both engines share: the optimizer and LR schedule of a trained role, activation
checkpointing, the HF names of a model's weights and the HF export."""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from spmdsplit import lora
from spmdsplit.models import save_hf_folder


def adamw_with_warmup(params, optim) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW, and a schedule that ramps the LR linearly over `optim.lr_warmup_steps` trainer
    steps (the role steps it once per update, after all its mini-batches, as verl), then holds it
    (`lr_scheduler_type=constant`) or follows a half cosine down to `min_lr_ratio` of it at
    `total_training_steps` (`cosine`). A torch optimizer on purpose: DeepSpeed's config-named ones JIT-compile."""
    # foreach=True: torch picks the multi-tensor update only where every parameter is on a CUDA-like
    # device (optim/optimizer.py _default_to_fused_or_foreach), so a CPU run took the one-tensor-at-a-
    # time loop, each op a DTensor dispatch under FSDP2: a third of a CPU train rank's step on the
    # embedded model. Now CPU runs the GPU's code path; the update is the same, float for float.
    optimizer = torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay,
                                  foreach=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
        lr_factor, warmup=max(0, optim.lr_warmup_steps), kind=optim.lr_scheduler_type,
        total=optim.total_training_steps, min_ratio=optim.min_lr_ratio))
    return optimizer, scheduler


def lr_factor(step: int, warmup: int, kind: str = "constant", total: int = -1, min_ratio: float = 0.0) -> float:
    """The LR multiplier of update `step` (0-based, one per trainer step)."""
    if step < warmup:
        return (step + 1) / warmup
    if kind == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / (total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def apply_ac(model: nn.Module) -> None:
    """Activation checkpointing of every transformer block, non-reentrant (the variant that works
    under FSDP2 and ZeRO-3, and with inputs that need no grad), by HF's own switch: parameter names stay HF's."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


class HFExport:
    """`save_hf` for an engine that has `model`, `compute_dtype` and a pool-collective
    `iter_full_weights(dtype, only)`."""

    def save_hf(self, output_dir: str, tokenizer, is_writer: bool, merge: bool = False) -> None:
        """Writes a folder `AutoModel*.from_pretrained` loads, in the model's compute dtype (bf16
        when it computes in bf16, not its fp32 masters), one weight gathered at a time. A LoRA model
        (spmdsplit/lora.py) writes its adapter folder instead (`peft.PeftModel.from_pretrained`
        loads it onto the base; the adapter in fp32, as it trained), or with `merge` the merged
        model. Every pool rank must call it (the gathers are pool collectives); `is_writer` (the
        pool's first rank) writes."""
        peft = lora.is_peft(self.model)
        if peft and not merge:
            adapter = ((lora.saved_name(n), t) for n, t in self.iter_full_weights(only=lora.is_adapter))
            if is_writer:
                config = self.model.peft_config[lora.ADAPTER]
                lora.write_adapter(output_dir, adapter, config, config.base_model_name_or_path)
                tokenizer.save_pretrained(output_dir)
            else:
                for _ in adapter:  # take part in each gather, keep nothing
                    pass
            return
        model, weights = self.model, self.iter_full_weights(None if peft else self.compute_dtype)
        if peft:
            weights = lora.merged(weights, lora.scalings(self.model), self.compute_dtype)
            model = self.model.get_base_model()
        if is_writer:
            save_hf_folder(model, weights, output_dir, tokenizer, dtype=self.compute_dtype)
        else:
            for _ in weights:  # take part in each gather, keep nothing
                pass
