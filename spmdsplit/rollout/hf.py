"""Rollout with transformers `generate` on a plain (unsharded) copy of the policy.

Why a copy and not the FSDP actor itself: `generate` on an FSDP-managed model turns
`synced_gpus` on and all-reduces over the *world* every token (it would hang the other pool),
and each rank's prompts stop at different lengths, so per-token FSDP all-gathers inside the pool
would not line up either. The copy is refreshed from the actor before each rollout by `load_weights`,
which takes the weights as a stream of (name, tensor), as a vLLM engine's will.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from transformers import GenerationConfig

from spmdsplit.batch import Batch
from spmdsplit.rollout.base import position_ids_from_mask, response_mask_until_eos, rollout_batch  # noqa: F401


class HFRollout:
    def __init__(self, model, tokenizer, cfg, max_response_length: int, eos_token_ids: list[int] | None = None,
                 val_cfg=None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_response_length = max_response_length
        self.pad_token_id = tokenizer.pad_token_id
        self.eos_token_id = eos_token_ids or [tokenizer.eos_token_id]
        # Replace the checkpoint's generation defaults, which transformers would otherwise fill
        # into every field left unset (an instruct model's repetition_penalty, min_new_tokens,
        # ...): the rollout must sample from exactly the distribution the actor's log-probs score.
        self.model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id, eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id
        )
        self.generation_config = self._generation_config(cfg)
        self.val_generation_config = self._generation_config(val_cfg or cfg)

    def _generation_config(self, cfg) -> GenerationConfig:
        sampling = dict(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k if cfg.top_k > 0 else 0)
        return GenerationConfig(
            do_sample=cfg.do_sample,
            **(sampling if cfg.do_sample else {}),
            max_new_tokens=self.max_response_length,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
        )

    @property
    def dtype(self) -> torch.dtype:
        """The dtype weights are best streamed in (`load_weights` casts anything else)."""
        return self.model.dtype

    def wake_up(self, weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> None:
        self.load_weights(weights)  # the copy stays on the device: nothing else to do

    def sleep(self) -> None:
        pass

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> None:
        """Copies each (HF name, whole tensor) of the stream into the copy as it arrives, keeping
        none of them: the stream may be a pool collective (`engine.iter_full_weights`) that gathers
        one tensor per item. Strict: an unknown name, a wrong shape, or a parameter the stream
        never gave raises (a tied head needs only its first name)."""
        if isinstance(weights, Mapping):
            weights = weights.items()
        first_name = {id(p): n for n, p in self.model.named_parameters()}  # a tied head -> its first name
        targets = {n: (p, first_name[id(p)]) for n, p in self.model.named_parameters(remove_duplicate=False)}
        targets.update((n, (b, n)) for n, b in self.model.named_buffers())
        missing = set(first_name.values())
        for name, tensor in weights:
            if name not in targets:
                raise RuntimeError(f"load_weights: the rollout model has no weight named {name!r}")
            target, first = targets[name]
            if target.shape != tensor.shape:
                raise RuntimeError(f"load_weights: {name} has shape {tuple(tensor.shape)}, "
                                   f"the rollout model's {tuple(target.shape)}")
            target.copy_(tensor)
            missing.discard(first)
        if missing:
            raise RuntimeError(f"load_weights: no weights given for {sorted(missing)}")

    @torch.no_grad()
    def generate(self, prompts: Batch, validate: bool = False) -> Batch:
        """`prompts` holds left-padded `input_ids`/`attention_mask` [B, P]; returns the rollout with
        right-padded `responses` [B, R] (R = the longest response) and verl's column names."""
        prompt_ids, prompt_mask = prompts["input_ids"], prompts["attention_mask"]
        out = self.model.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            generation_config=self.val_generation_config if validate else self.generation_config,
            synced_gpus=False,  # never the world all-reduce; this copy is not sharded
            use_cache=True,
        )
        responses = out[:, prompt_ids.shape[1] :]
        return rollout_batch(prompts, responses, self.pad_token_id, self.eos_token_id)
