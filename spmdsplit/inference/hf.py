"""An inference engine: transformers `generate` on a plain (unsharded) copy of the policy.

Why a copy and not the FSDP actor itself: `generate` on an FSDP-managed model turns
`synced_gpus` on and all-reduces over the *world* every token (it would hang the other pool),
and each rank's prompts stop at different lengths, so per-token FSDP all-gathers inside the pool
would not line up either. The copy is refreshed from the actor before each rollout by `load_weights`,
which takes the weights as a stream of (name, tensor), as a vLLM engine's will. With a LoRA policy
(spmdsplit/lora.py) the copy is the base with the same adapter on (PEFT): it keeps the base it
loaded and takes only the adapter at each sync.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from spmdsplit import lora
from spmdsplit.batch import Batch
from spmdsplit.inference.base import (GREEDY, Delta, position_ids_from_mask, response_mask_until_eos,  # noqa: F401
                                      rollout_batch)


class HFEngine:
    def __init__(self, model, tokenizer, cfg, max_response_length: int, eos_token_ids: list[int] | None = None,
                 val_cfg=None, adapter: lora.LoraSpec | None = None):
        """`adapter`: the policy's LoRA, when each sync brings the adapter alone (lora.engines_take_adapter)."""
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_response_length = max_response_length
        self.pad_token_id = tokenizer.pad_token_id
        self.eos_token_ids = eos_token_ids or [tokenizer.eos_token_id]
        # Replace the checkpoint's generation defaults, which transformers would otherwise fill
        # into every field left unset (an instruct model's repetition_penalty, min_new_tokens,
        # ...): the rollout must sample from exactly the distribution the actor's log-probs score.
        self.model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id, eos_token_id=self.eos_token_ids, pad_token_id=self.pad_token_id
        )
        self.sampling = self._generation_config(cfg)
        self.val_sampling = self._generation_config(val_cfg or cfg)
        self.greedy_sampling = self._generation_config(GREEDY)  # ReMax's baseline
        self.adapter = adapter is not None
        # Continuous generation (rollout.continuous): the requests held, each its context so far
        # and its budget left; a step decodes `step_tokens` more of each.
        self.requests: dict[str, tuple[list[int], int, bool]] = {}  # id -> (context, budget left, validate)
        self.step_tokens = cfg.hf_step_tokens
        self.max_num_seqs = cfg.max_num_seqs
        if adapter is not None:  # its weights come with the first sync
            self.model = lora.apply(self.model, adapter, "causal_lm", load_adapter=False, trained=False).eval()

    def _generation_config(self, cfg) -> tuple[GenerationConfig, list]:
        """The generation config and the sampling warpers. The warpers are given to `generate` as
        logits processors rather than set in the config: transformers would then append its own
        after every given processor, and `SampledLogProbs` must see the distribution that is
        finally sampled from. Same warpers, same order (temperature, top-k, top-p)."""
        warpers = []
        if cfg.do_sample:
            if cfg.temperature != 1.0:
                warpers.append(TemperatureLogitsWarper(cfg.temperature))
            if cfg.top_k > 0:
                warpers.append(TopKLogitsWarper(top_k=cfg.top_k))
            if cfg.top_p < 1.0:
                warpers.append(TopPLogitsWarper(top_p=cfg.top_p))
        config = GenerationConfig(
            do_sample=cfg.do_sample,
            **(dict(temperature=1.0, top_p=1.0, top_k=0) if cfg.do_sample else {}),
            max_new_tokens=self.max_response_length,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
        )
        return config, warpers

    @property
    def max_model_len(self) -> int:
        """The longest context (prompt and response) the model was made for."""
        return self.model.config.get_text_config().max_position_embeddings

    @property
    def dtype(self) -> torch.dtype:
        """The dtype weights are best streamed in (`load_weights` casts anything else)."""
        return self.model.dtype

    def wake_up(self, weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> None:
        self.load_weights(weights)  # the copy stays on the device: nothing else to do

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> None:
        self.load_weights(weights)

    def sleep(self) -> None:
        pass

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> None:
        """Copies each (HF name, whole tensor) of the stream into the copy as it arrives, keeping
        none of them: the stream may be a pool collective (`engine.iter_full_weights`) that gathers
        one tensor per item. Strict: an unknown name, a wrong shape, or a parameter the stream
        never gave raises (a tied head needs only its first name). With a LoRA adapter the stream
        is the adapter, under its saved names (lora.saved_name), and every adapter tensor must come."""
        if isinstance(weights, Mapping):
            weights = weights.items()
        if self.adapter:
            targets = {lora.saved_name(n): (p, n) for n, p in self.model.named_parameters() if lora.is_adapter(n)}
            missing = {n for _, n in targets.values()}
        else:
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
    def generate(self, prompts: Batch, validate: bool = False, greedy: bool = False) -> Batch:
        """`prompts` holds left-padded `input_ids`/`attention_mask` [B, P]; returns the rollout with
        right-padded `responses` [B, R] (R = the longest response) and verl's column names.
        `validate`: rollout.val_kwargs' sampling; `greedy`: greedy whatever the config says."""
        prompt_ids, prompt_mask = prompts["input_ids"], prompts["attention_mask"]
        config, warpers = self.greedy_sampling if greedy else self.val_sampling if validate else self.sampling
        log_probs = SampledLogProbs()
        out = self.model.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            generation_config=config,
            logits_processor=LogitsProcessorList([*warpers, log_probs]),
            synced_gpus=False,  # never the world all-reduce; this copy is not sharded
            use_cache=True,
        )
        responses = out[:, prompt_ids.shape[1] :]
        return rollout_batch(prompts, responses, self.pad_token_id, self.eos_token_ids,
                             extras={"rollout_log_probs": log_probs.finish(responses)})

    @torch.no_grad()
    def continue_ids(self, contexts: list[list[int]], budgets: list[int], stop_ids: list[int],
                     seeds: list[int] | None = None, validate: bool = False) -> list[tuple[list[int], list[float]]]:
        """One turn of multi-turn episodes (spmdsplit/agent/loop.py), token ids in and out: each
        context (prompt and the episode so far, no padding) continued until one of `stop_ids` (kept)
        or its own budget of new tokens. Returns per row the new tokens and their sampled log-probs.
        `seeds` are vLLM's; `generate` here draws from the rank's generator (as in `generate`)."""
        width = max(len(c) for c in contexts)
        ids = torch.full((len(contexts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, context in enumerate(contexts):  # left padding, as the prompts come
            ids[i, width - len(context):] = torch.tensor(context)
            mask[i, width - len(context):] = 1
        device = self.model.device
        config, warpers = self.val_sampling if validate else self.sampling
        config = copy.deepcopy(config)
        config.max_new_tokens, config.eos_token_id = max(budgets), list(stop_ids)
        log_probs = SampledLogProbs()
        out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config,
                                  logits_processor=LogitsProcessorList([*warpers, log_probs]), synced_gpus=False,
                                  use_cache=True)
        new = out[:, width:]
        scores = log_probs.finish(new).cpu().tolist()
        turns = []
        for row, row_scores, budget in zip(new.cpu().tolist(), scores, budgets):
            end = next((j + 1 for j, t in enumerate(row) if t in stop_ids), len(row))
            end = min(end, budget)
            turns.append((row[:end], row_scores[:end]))
        return turns


    # ---- continuous generation (spmdsplit/generation/continuous.py; inference/base.py StepwiseEngine)
    #
    # transformers has no engine that takes requests while it decodes, so a step here is one
    # `generate` of `step_tokens` tokens over the requests held (up to max_num_seqs, oldest first),
    # each from its whole context: the KV cache is computed again at every step (a prefill per
    # step_tokens tokens; vLLM keeps it). What that buys: a request that finishes frees its row at
    # the next step, and weights loaded between two steps are the ones every later token is
    # sampled with, the context included, as on vLLM (VLLMEngine.update_weights).

    def submit(self, request_id: str, context: list[int], budget: int, seed: int | None = None,
               validate: bool = False, stop_ids: list[int] | None = None) -> None:
        if request_id in self.requests:
            raise RuntimeError(f"HFEngine.submit: request {request_id!r} is already held")
        self.requests[request_id] = (list(context), budget, (validate, tuple(stop_ids or self.eos_token_ids)))

    def step(self) -> list[Delta]:
        held = list(self.requests.items())[: self.max_num_seqs]
        deltas = []
        # One `generate` per sampling (rollout.* or val_kwargs) and set of stop tokens (an EOS, or an agent's turn's).
        for kind in sorted(dict.fromkeys(request[2] for _, request in held), key=lambda kind: kind[0]):
            rows = [(request_id, request) for request_id, request in held if request[2] == kind]
            validate, stop_ids = kind
            budgets = [min(self.step_tokens, left) for _, (_, left, _) in rows]
            turns = self.continue_ids([context for _, (context, _, _) in rows], budgets, list(stop_ids),
                                      validate=validate)
            for (request_id, (context, left, _)), (tokens, log_probs) in zip(rows, turns):
                left -= len(tokens)
                finished = left <= 0 or tokens[-1] in stop_ids
                if finished:
                    del self.requests[request_id]
                else:
                    self.requests[request_id] = (context + tokens, left, kind)
                deltas.append(Delta(request_id, tokens, log_probs, finished))
        return deltas

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.requests.pop(request_id, None)


class SampledLogProbs(LogitsProcessor):
    """The last logits processor of a `generate`: it sees each step's final scores, the
    distribution the step samples from (after temperature, top-k, top-p), and keeps the log-prob of
    the token drawn from it, as vLLM's `processed_logprobs` do. The token is known only at the next
    step (the last column of `input_ids`), so one step's log-softmax [B, V] is held until then and
    `finish` takes the last token's from the generated responses."""

    def __init__(self):
        self.held: torch.Tensor | None = None  # the previous step's log-softmax
        self.columns: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.held is not None:
            self._take(input_ids[:, -1])
        self.held = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        self.columns.append(self.held.gather(-1, tokens.unsqueeze(-1)).squeeze(-1))

    def finish(self, responses: torch.Tensor) -> torch.Tensor:
        """[B, R] float32, one column per generated token (rows that ended early: whatever their
        padding scored, which `rollout_batch` zeroes)."""
        if self.held is not None:
            self._take(responses[:, len(self.columns)])
            self.held = None
        if not self.columns:
            return responses.new_zeros(responses.shape, dtype=torch.float32)
        return torch.stack(self.columns, dim=1)
