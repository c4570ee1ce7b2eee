"""The rule reward: decodes each response and scores it with the scorer of its data_source."""

from __future__ import annotations

import torch

from spmdsplit.batch import Batch
from spmdsplit.rewards.rule import compute_score


class RuleReward:
    def __init__(self, tokenizer, eos_token_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids or [tokenizer.eos_token_id])

    @torch.no_grad()
    def compute(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (token_level_scores [B, R] with the score on each response's last valid
        token and 0 elsewhere, scores [B])."""
        responses, mask = batch["responses"], batch["response_mask"]
        lengths = mask.sum(-1)
        scores = []
        for i in range(len(batch)):
            ids = responses[i, : lengths[i]].tolist()
            if ids and ids[-1] in self.eos_token_ids:
                ids = ids[:-1]
            # Other special tokens stay in the text: stripping them would let a policy pad its
            # answer with tokens the scorer never sees (a reward hack seen on the embedded task).
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            scores.append(compute_score(batch["data_source"][i], text, batch["ground_truth"][i]))
        scores = torch.tensor(scores, dtype=torch.float32, device=responses.device)
        token_level_scores = torch.zeros(mask.shape, dtype=torch.float32, device=responses.device)
        last = (lengths - 1).clamp(min=0)
        token_level_scores[torch.arange(len(batch), device=responses.device), last] = scores
        return token_level_scores * (lengths > 0).unsqueeze(-1), scores
