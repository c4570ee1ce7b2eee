"""What every rollout engine shares: the contract the trainer calls and the columns of a rollout
(the per-row sampling seeds: spmdsplit/seeds.py).

An engine (transformers `generate` in hf.py, vLLM in vllm_engine.py) takes left-padded prompts and
returns the rollout with verl's columns; the trainer never knows which one runs.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Iterable, NamedTuple, Protocol

import torch

from spmdsplit.batch import Batch


class Engine(Protocol):
    dtype: torch.dtype  # what the actor streams its weights in (the engine's compute dtype)

    def generate(self, prompts: Batch, validate: bool = False, greedy: bool = False) -> Batch:
        """`prompts`: left-padded `input_ids`/`attention_mask` [B, P] (+ non-tensor columns, and an
        optional int64 `sample_seed` [B]); returns `prompts`, `responses` [B, R] (right-padded; R = the
        longest response of this call, see `rollout_batch`), `response_mask`, `input_ids`,
        `attention_mask`, `position_ids` [B, P+R], the prompt batch's non-tensor columns, and engine
        extras [B, R] (both engines: `rollout_log_probs`, the sampled tokens' log-probs under the
        distribution sampled from). Sampled as rollout.* says; `validate`: as rollout.val_kwargs;
        `greedy`: greedy (ReMax's baseline, whatever either says)."""

    def wake_up(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The start of a step's generation: the policy's new weights, as a stream of (Hugging Face
        name, full tensor), and whatever the engine needs on the device to generate."""

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """New weights into an awake engine that keeps its device memory: an engine on a device of
        its own (a rollout pool apart) wakes once and takes every later version of the policy so."""

    def sleep(self) -> None:
        """The end of a step's generation (every chunk, every validation batch) where the engine
        shares its device with training: it gives the device memory it can back to the trainer."""


class Delta(NamedTuple):
    """What one engine step gave one request (continuous generation, `Engine.step`): the tokens
    sampled in that step (a few, or none while it waits), their log-probs under the distribution
    sampled from, and whether the request is done (an EOS, kept, or its budget spent)."""

    request_id: str
    token_ids: list[int]
    log_probs: list[float]
    finished: bool


class StepwiseEngine(Engine, Protocol):
    """An engine driven one step at a time (rollout.continuous, spmdsplit/generation/continuous.py): requests
    go in whenever there is room, each step advances all of them, and new weights may be loaded
    between two steps (`update_weights`) while the requests held go on: their next tokens are
    sampled with the new weights."""

    eos_token_ids: list[int]  # what ends a request unless `submit` names other stop tokens
    max_model_len: int  # the longest context + response a request may reach

    def submit(self, request_id: str, context: list[int], budget: int, seed: int | None = None,
               validate: bool = False, stop_ids: list[int] | None = None) -> None:
        """A request: `context` (prompt and any tokens already generated, no padding) continued by
        at most `budget` tokens, up to an EOS (kept; `stop_ids`: these tokens instead, an agent's
        turn); `seed` seeds its sampling (vLLM); `validate`: sampled as rollout.val_kwargs says."""

    def step(self) -> list[Delta]:
        """One engine step over the requests held (vLLM: one scheduler step; HF: a few tokens)."""

    def abort(self, request_ids: list[str]) -> None:
        """Drops requests (no Delta comes for them after this)."""


# The sampling settings of a greedy generation (the engines read these fields of rollout.*).
GREEDY = SimpleNamespace(do_sample=False, temperature=1.0, top_p=1.0, top_k=-1)


def engine_index(tensor_parallel_size: int, rank: int) -> int:
    """Which of the job's engines `rank` runs in, counted from 0 in rank order (its seeds, its
    caches are the engine's)."""
    return rank // tensor_parallel_size


def engine_peers(tensor_parallel_size: int, rank: int) -> list[int]:
    """The ranks that run one engine together, `rank` among them: consecutive ranks, as vLLM cuts
    its tensor-parallel groups out of the world (preflight.check_rollout_placement keeps each
    inside one pool). Every engine of the job is engine_peers(tp, first) for first in range(0, world, tp)."""
    first = engine_index(tensor_parallel_size, rank) * tensor_parallel_size
    return list(range(first, first + tensor_parallel_size))


def response_mask_until_eos(responses: torch.Tensor, eos_token_id: int | list[int]) -> torch.Tensor:
    """1 up to and including the first EOS of each row, 0 after it (all 1 if no EOS)."""
    eos_ids = torch.as_tensor(eos_token_id if isinstance(eos_token_id, list) else [eos_token_id], device=responses.device)
    is_eos = torch.isin(responses, eos_ids).int()
    eos_seen_before = torch.cumsum(is_eos, dim=1) - is_eos  # EOS tokens strictly before each position
    return (eos_seen_before == 0).long()


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    # Left padding shifts where real tokens start; positions must count real tokens only.
    return (torch.cumsum(attention_mask, dim=1) - 1).clamp(min=0)


def rollout_batch(prompts: Batch, responses: torch.Tensor, pad_token_id: int, eos_token_ids: list[int],
                  extras: dict[str, torch.Tensor] | None = None) -> Batch:
    """The rollout's columns from the prompts and the generated tokens [B, R']: everything after a
    row's first EOS becomes padding, and positions count the real tokens of prompt + response.
    `extras`: the engine's own [B, R'] columns (`rollout_log_probs`), zeroed past each
    response like the rest.

    The responses are cut to R = the longest response of the batch (at least one column): the
    columns past it are padding in every row, and every exchange and every forward after this
    would carry them for nothing. Rows of different calls then have different R, and the places
    where rollout parts meet pad them to the widest (Batch.concat's `pad_to_widest`). Nothing
    downstream reads the width as a length: Dr. GRPO's horizon is data.max_response_length (roles)."""
    response_mask = response_mask_until_eos(responses, eos_token_ids)
    responses = responses.masked_fill(response_mask == 0, pad_token_id)
    width = max(int(response_mask.sum(1).max().item()) if len(responses) else 0, 1)
    columns = {"responses": responses, "response_mask": response_mask,
               **{name: extra * response_mask for name, extra in (extras or {}).items()}}
    for name, column in columns.items():
        pad = width - column.shape[1]
        value = pad_token_id if name == "responses" else 0
        columns[name] = torch.nn.functional.pad(column, (0, pad), value=value) if pad > 0 else column[:, :width]
    return with_prompts(prompts, columns, response_attention=columns["response_mask"])


def with_prompts(prompts: Batch, columns: dict[str, torch.Tensor], response_attention: torch.Tensor) -> Batch:
    """The rollout: the prompts' rows and non-tensor columns, the response `columns` ([B, R], with
    `responses`), and the whole sequence's `input_ids`, `attention_mask` (the prompt's, then
    `response_attention`: the response's real tokens) and `position_ids`."""
    prompt_ids, prompt_mask = prompts["input_ids"], prompts["attention_mask"]
    attention_mask = torch.cat([prompt_mask, response_attention], dim=1)
    return Batch(
        {
            "prompts": prompt_ids,
            **columns,
            "input_ids": torch.cat([prompt_ids, columns["responses"]], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids_from_mask(attention_mask),
        },
        dict(prompts.non_tensors),
    )


class AroundEngine:
    """What generates by driving an engine (`self.engine`: the agent loop, a harness's server): the
    engine's weights and sleep are the engine's own."""

    engine: Engine

    @property
    def dtype(self) -> torch.dtype:
        return self.engine.dtype

    def wake_up(self, weights) -> None:
        self.engine.wake_up(weights)

    def update_weights(self, weights) -> None:
        self.engine.update_weights(weights)

    def sleep(self) -> None:
        self.engine.sleep()

    def close(self) -> None:
        """At the job's end: what it runs besides the engine (a server, its loops)."""


def episodes_batch(prompts: Batch, episodes: list, pad_token_id: int) -> Batch:
    """The rollout's columns from multi-turn episodes (spmdsplit/agent/loop.py), one per prompt row,
    each with `response_ids`, `response_mask` (1: the policy's tokens, 0: tool responses and
    template glue) and `log_probs` (0 on masked tokens). Unlike `rollout_batch` a response may
    hold EOS tokens and masked tokens inside it: `attention_mask` covers every real token (the
    policy is conditioned on the tool's), `response_mask` only those the policy chose, which is
    what every loss, entropy, KL and advantage reads."""
    width = max([len(e.response_ids) for e in episodes] + [1])
    B = len(episodes)
    responses = torch.full((B, width), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((B, width), dtype=torch.long)
    response_attention = torch.zeros((B, width), dtype=torch.long)
    log_probs = torch.zeros((B, width), dtype=torch.float32)
    for i, e in enumerate(episodes):
        n = len(e.response_ids)
        responses[i, :n] = torch.tensor(e.response_ids, dtype=torch.long)
        response_mask[i, :n] = torch.tensor(e.response_mask, dtype=torch.long)
        response_attention[i, :n] = 1
        log_probs[i, :n] = torch.tensor(e.log_probs, dtype=torch.float32)
    device = prompts["input_ids"].device
    columns = {"responses": responses, "response_mask": response_mask, "rollout_log_probs": log_probs}
    return with_prompts(prompts, {k: v.to(device) for k, v in columns.items()}, response_attention.to(device))


def rollout_probs_diff(rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                       response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """verl's check of the engine against the actor: |p_rollout - p_actor| of every response token.
    Returns (sum, count, max) over this rank's tokens, to reduce over the pool; mean = sum / count
    gives training/rollout_probs_diff_mean, max training/rollout_probs_diff_max. A stale engine, a
    missed prefix-cache reset, a wrong temperature or wrong positions all show here."""
    mask = response_mask.bool()
    diff = (rollout_log_probs.float().exp() - old_log_probs.float().exp()).abs()[mask]
    zero = diff.new_zeros(())
    return diff.sum(), diff.new_tensor(float(diff.numel())), diff.max() if diff.numel() else zero
