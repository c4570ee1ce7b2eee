"""What both engines share: the optimizer and LR schedule of a trained role, and the HF export."""

from __future__ import annotations

import torch

from spmdsplit.models import save_hf_folder


def adamw_with_warmup(params, optim) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW, and a schedule that ramps the LR linearly over `optim.lr_warmup_steps` trainer
    steps (the role steps it once per update, after all its mini-batches, as verl), then holds it. A torch optimizer on purpose: DeepSpeed's config-named ones JIT-compile."""
    optimizer = torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay)
    warmup = max(0, optim.lr_warmup_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
    )
    return optimizer, scheduler


class HFExport:
    """`save_hf` for an engine that has `model` and a pool-scoped `full_state_dict()`."""

    def save_hf(self, output_dir: str, tokenizer, is_writer: bool) -> None:
        """Writes a folder `AutoModel*.from_pretrained` loads; every pool rank must call it (the
        gather is a pool collective), and `is_writer` (the pool's first rank) writes."""
        state = self.full_state_dict()
        if is_writer:
            save_hf_folder(self.model, state, output_dir, tokenizer)
