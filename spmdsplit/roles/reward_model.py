"""A reward model (`reward.model.path`): an `AutoModelForSequenceClassification` with one output,
frozen and sharded by FSDP2 over the critic pool, scoring each (prompt, response) as a whole.

Each rank of the critic pool scores its own rows:

1. the prompt (the left part of `input_ids`, without its left padding) and the response (its
   valid tokens, without the EOS that ends it) are decoded with the *policy's* tokenizer, and
   `prompt + response` is tokenised again with the *reward model's* tokenizer (the two may
   differ), right-padded;
2. the texts run through the model in micro-batches of `micro_batch_size` rows, or of at most
   `max_tokens` tokens (reward.model.use_dynamic_bsz), without grad; padded, or with
   `remove_padding` packed into one sequence per micro-batch;
3. the score is the model's output at the last real token of each text, and it is placed on the
   last valid token of the response, as the rule reward places its score.

FSDP runs collectives over the pool inside every forward, so every rank of the pool must run the
same number of forwards. With equal shards and a fixed micro-batch size they do; so that unequal
shards or token budgets cannot hang the pool, the ranks agree on the largest count first (one
small all-reduce over the pool, roles/micro_batches.py) and a rank with fewer micro-batches splits
its own, or runs one-token dummy forwards for the rest.
"""

from __future__ import annotations

import torch
from torch import nn

from spmdsplit.batch import Batch
from spmdsplit.roles.forward import packed_attention_kwargs
from spmdsplit.roles.micro_batches import in_row_order, plan_bins
from spmdsplit.roles.reward import (RewardError, decoded_prompts, describe_sample, on_last_token, per_flag,
                                    response_lengths, response_texts)


def default_max_length(prompt_len: int, response_len: int) -> int:
    """Room for `prompt + response` in the reward model's tokens: the policy's lengths plus a
    slack, since another tokenizer may cut the same text into more tokens (and may add a BOS)."""
    return prompt_len + response_len + (prompt_len + response_len) // 4 + 16


class RewardModel:
    """`compute(batch) -> (token_level_scores [B, R], scores [B])`, on every rank of the pool at
    once (it runs FSDP collectives). `max_length` caps the reward model's input: a longer text
    loses its *start* (left truncation), since the score is read at the end of the response and
    the response must stay whole; None = `default_max_length(P, R)`, and never more than the
    model's `max_position_embeddings`. `max_tokens`: token-budget micro-batches (None = fixed
    `micro_batch_size` rows); `remove_padding`: each micro-batch packed into one sequence (only
    for models that score every token, see below; others run padded)."""

    judge = None  # no LLM judge beside a reward model (preflight)

    def __init__(self, engine, rm_tokenizer, policy_tokenizer, micro_batch_size: int, device,
                 eos_token_ids: list[int] | None = None, max_length: int | None = None,
                 max_tokens: int | None = None, remove_padding: bool = False):
        if micro_batch_size <= 0:
            raise ValueError(f"reward.model.micro_batch_size_per_gpu must be positive, got {micro_batch_size}")
        self.engine = engine
        self.rm_tokenizer = rm_tokenizer
        self.policy_tokenizer = policy_tokenizer
        self.micro_batch_size = micro_batch_size
        self.device = torch.device(device)
        self.eos_token_ids = set(eos_token_ids or [policy_tokenizer.eos_token_id])
        self.max_length = max_length
        self.max_tokens = max_tokens
        model = engine.model
        self.pad_token_id = self._ensure_pad_token(model, rm_tokenizer)
        # getattr: a Hugging Face config, not ours; not every architecture's declares a maximum.
        self.max_positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        # Decoder reward models (Llama, Qwen2, Mistral, ...) put a `score` head on every token and
        # keep the output at the last token that is not the pad id. We read the per-token output
        # ourselves at the last position the attention mask marks real, which is right even when
        # a text ends with a token equal to the pad id (e.g. pad = EOS); other architectures pool
        # their own way (e.g. a BERT's first token) and their pooled output is used as is.
        head = getattr(model, "score", None)
        self._per_token = None
        if isinstance(head, nn.Module):
            head.register_forward_hook(self._capture)
        # Packed rows are told apart only by reading each row's last token ourselves.
        self.remove_padding = remove_padding and isinstance(head, nn.Module)

    def close(self) -> None:
        """Nothing to let go of besides its model, which the job's end frees."""

    @staticmethod
    def _ensure_pad_token(model, rm_tokenizer) -> int:
        config = model.config.get_text_config()
        pad = config.pad_token_id
        if pad is None:
            pad = rm_tokenizer.pad_token_id if rm_tokenizer.pad_token_id is not None else rm_tokenizer.eos_token_id
            if pad is None:
                raise ValueError("the reward model's tokenizer has neither a pad nor an EOS token to pad with")
            # Without it, HF's sequence classifiers refuse batches of more than one row.
            config.pad_token_id = pad
            model.config.pad_token_id = pad
        return int(pad)

    def _capture(self, module, inputs, output):
        self._per_token = output

    # ------------------------------------------------------------------------------ texts

    def texts(self, batch: Batch) -> tuple[list[str], list[str]]:
        """(prompt texts, response texts), decoded with the policy's tokenizer."""
        prompts = decoded_prompts(self.policy_tokenizer, batch)
        answers = response_texts(self.policy_tokenizer, batch["responses"], response_lengths(batch), self.eos_token_ids)
        return prompts, answers

    def encode(self, texts: list[str], max_length: int) -> list[list[int]]:
        """Reward-model token ids of each text, cut to its last `max_length` tokens. The texts go
        to the tokenizer as lists, one call per value of add_special_tokens (a fast tokenizer
        encodes a list in one call into its Rust core, on all its threads), not one call per text."""
        bos = self.rm_tokenizer.bos_token
        # The decoded prompt may already open with the BOS (a chat template writes it): adding
        # the tokenizer's own would double it.
        add_special = [not (bos and text.startswith(bos)) for text in texts]
        encoded = per_flag(texts, add_special,
                           lambda some, flag: self.rm_tokenizer(some, add_special_tokens=flag)["input_ids"])
        cut = [ids[-max_length:] if len(ids) > max_length else ids for ids in encoded]
        return [ids or [self.pad_token_id] for ids in cut]

    def _pad(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            mask[i, : len(r)] = 1
        return ids.to(self.device), mask.to(self.device)

    # ------------------------------------------------------------------------------ forward

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self._per_token = None
        out = self.engine(input_ids=ids, attention_mask=mask, use_cache=False)
        per_token, self._per_token = self._per_token, None
        if per_token is not None and per_token.dim() == 3 and per_token.shape[:2] == ids.shape:
            last = mask.sum(-1) - 1
            return per_token[torch.arange(ids.shape[0], device=per_token.device), last.to(per_token.device), 0].float()
        return out.logits[:, 0].float()

    def _forward_packed(self, rows: list[list[int]]) -> torch.Tensor:
        """The rows as one sequence, position ids restarting at each (roles/forward.py
        `_packed_forward` says what keeps them apart); each row's score at its last token."""
        # Built on the host from the token lists, then moved: no device reads.
        lengths = torch.tensor([len(r) for r in rows]).to(self.device)
        ids = torch.tensor([t for r in rows for t in r], dtype=torch.long).to(self.device)[None]
        positions = torch.tensor([p for r in rows for p in range(len(r))], dtype=torch.long).to(self.device)[None]
        self._per_token = None
        self.engine(input_ids=ids, position_ids=positions, use_cache=False,
                    **packed_attention_kwargs(self.engine, lengths, [len(r) for r in rows]))
        per_token, self._per_token = self._per_token, None
        return per_token[0, lengths.cumsum(0) - 1, 0].float()

    def _score(self, rows: list[list[int]]) -> torch.Tensor:
        return self._forward_packed(rows) if self.remove_padding else self._forward(*self._pad(rows))

    @torch.no_grad()
    def compute(self, batch: Batch, keep_extras: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        responses, response_mask = batch["responses"], batch["response_mask"]
        B, R = responses.shape
        P = batch["input_ids"].shape[1] - R
        prompts, answers = self.texts(batch)
        max_length = self.max_length or default_max_length(P, R)
        if self.max_positions:
            max_length = min(max_length, int(self.max_positions))
        encoded = self.encode([p + a for p, a in zip(prompts, answers)], max_length)
        # Rows of each forward, as many forwards as on any rank of the pool.
        bins = plan_bins([len(ids) for ids in encoded], self.max_tokens is not None, self.micro_batch_size,
                         self.max_tokens or 0, getattr(self.engine, "group", None), self.device)
        # An empty bin: this rank has run out of rows, a dummy forward keeps the pool in lockstep.
        parts = [self._score([encoded[i] for i in rows] if rows else [[self.pad_token_id]]) for rows in bins]
        scores = in_row_order(parts, bins, B).to(device=responses.device, dtype=torch.float32)
        bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
        if bad:
            i = bad[0]
            raise RewardError(
                f"the reward model ({len(bad)} of {B} rows) gave a non-finite score ({scores[i].item()}); "
                f"the job stops here so that it does not train on a broken reward:\n"
                + describe_sample(
                    i, answers[i],
                    batch["data_source"][i] if "data_source" in batch else None,
                    batch["ground_truth"][i] if "ground_truth" in batch else None,
                    prompt=prompts[i],
                )
            )
        return on_last_token(scores, response_mask), scores

    def pop_extra_metrics(self, group, device) -> dict[str, float]:
        """A reward model returns scores only: no extra numbers to log (RuleReward's interface)."""
        return {}

    def text_columns(self) -> dict[str, list[str]]:
        return {}

    def pop_judge_spans(self) -> list[tuple[int, int]]:
        return []
