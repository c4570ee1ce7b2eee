"""Builds each role group's parts from the config: the models, their engines over the mesh of the
group's pool, and the objects the programs call. Kept out of the trainer so that the loop reads as
the algorithm.

    actor  : Actor (policy, trained) + reference (frozen Actor; with LoRA the policy's model, adapter off)
    rollout: the engine (HF or vLLM), whose weights come from the actor, and the agent loop around it
    critic : Critic (value model, trained; GAE only) + the KL controller
    reward : rule reward (custom fn or built-in scorers) with an LLM judge, or a reward model
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from omegaconf import OmegaConf

from spmdsplit import algo, lora
from spmdsplit.config import rows_per_prompt
from spmdsplit.engines import build_engine
from spmdsplit.models import ModelSource, attention_implementation, compute_dtypes, load_causal_lm, load_tokenizer
from spmdsplit.groups import Pools
from spmdsplit.rewards.calls import RewardCalls, waiting_scorers
from spmdsplit.rewards.custom import load_custom_reward_fn
from spmdsplit.rewards.judge import Judge, JudgeSampling
from spmdsplit.rewards.remote import RemoteReward
from spmdsplit.roles.actor import Actor
from spmdsplit.roles.critic import Critic
from spmdsplit.roles.reward import RuleReward
from spmdsplit.roles.reward_model import RewardModel
from spmdsplit.agent import build_agent
from spmdsplit.inference import Engine
from spmdsplit.inference import build_engine as build_inference_engine

if TYPE_CHECKING:
    from spmdsplit.agent.harness import HarnessRunner
    from spmdsplit.agent.loop import AgentLoop


@dataclass
class ActorRoles:
    actor: Actor
    ref: Actor


@dataclass
class RolloutRoles:
    engine: Engine  # takes the policy's weights, and generates (stepwise for continuous generation)
    # rollout.multi_turn: the agent loop around the engine; rollout.agent.harness: the engine served to
    # the harness (agent/harness.py). What generates a batch.
    agent: AgentLoop | HarnessRunner | None

    @property
    def generates(self) -> Engine:
        """What generates a batch: the agent loop or the harness, else the engine."""
        return self.agent or self.engine


@dataclass
class CriticRoles:
    critic: Critic | None  # None for critic-free estimators (GRPO, RLOO, REINFORCE++)
    kl_ctrl: algo.FixedKLController


def trains_critic(cfg) -> bool:
    """Whether the job builds a value model (the estimator's declaration, spmdsplit/algo.py), so
    that critic.*'s model, engine and batch keys apply; preflight asks this too. Without one the
    critic group still takes every step's rows and computes the advantages."""
    return algo.get_adv_estimator(cfg.algorithm.adv_estimator).needs_critic


def passes(cfg, device: torch.device) -> tuple[str, bool]:
    """How every trained and frozen model runs its forward passes: (its attention kernel, chosen
    in models.attention_implementation; whether micro-batches are packed, model.use_remove_padding)."""
    return attention_implementation(cfg.model.attn_implementation, device), cfg.model.use_remove_padding


def build_actor_roles(cfg, pools: Pools, tokenizer, eos_ids: list[int]) -> ActorRoles:
    device, seed, remote, path = pools.device, cfg.trainer.seed, cfg.model.trust_remote_code, cfg.model.path
    dtype, mixed = compute_dtypes(cfg, device)
    temperature = cfg.rollout.temperature
    mesh = pools.mesh("actor")
    # Trained: fp32 masters, computing in `mixed`; with LoRA the base is frozen and held in the
    # compute dtype, only the adapter has fp32 masters. Frozen: held in the compute dtype outright.
    attention, packed = passes(cfg, device)
    adapter = lora.policy_spec(cfg)
    policy = ModelSource("causal_lm", path, dtype if adapter else torch.float32, seed, remote, attention, adapter)
    actor = Actor(build_engine(cfg, "actor", policy, mesh, device, mixed), cfg.actor, temperature, device,
                  rollout_n=rows_per_prompt(cfg), remove_padding=packed, loss_horizon=cfg.data.max_response_length)
    if adapter:  # the reference is the base: the policy's own model with its adapter off, no second model
        ref = Actor(actor.engine, ref_config(cfg), temperature, device, remove_padding=packed, base_only=True)
    else:
        reference = ModelSource("causal_lm", path, dtype, seed, remote, attention)
        ref = Actor(build_engine(cfg, "ref", reference, mesh, device), ref_config(cfg), temperature, device,
                    remove_padding=packed)
    return ActorRoles(actor, ref)


def ref_config(cfg):
    """The reference reads the actor's settings but its own micro-batches (verl's
    ref.log_prob_micro_batch_size_per_gpu, ref.log_prob_use_dynamic_bsz and
    ref.log_prob_max_token_len_per_gpu; the last two follow the actor's when null)."""
    ref, actor = cfg.ref, cfg.actor
    own = {"log_prob_micro_batch_size_per_gpu": ref.log_prob_micro_batch_size_per_gpu}
    if ref.log_prob_use_dynamic_bsz is not None:
        own["use_dynamic_bsz"] = ref.log_prob_use_dynamic_bsz
    if ref.log_prob_max_token_len_per_gpu is not None:
        own["log_prob_max_token_len_per_gpu"] = ref.log_prob_max_token_len_per_gpu
    return OmegaConf.merge(actor, own)


def build_rollout_roles(cfg, pools: Pools, tokenizer, eos_ids: list[int]) -> RolloutRoles:
    """This rank's rollout engine (rollout.name) and, with rollout.multi_turn, the agent loop
    around it (with rollout.agent.harness, the harness's episodes over it). Its weights come from the actor. vLLM: every rank must have run
    rollout.vllm_engine.init_vllm_distributed before."""
    dtype, _ = compute_dtypes(cfg, pools.device)
    engine = build_inference_engine(cfg, cfg.model.path, tokenizer, eos_ids, pools.device, dtype, cfg.trainer.seed,
                                    sleeps=pools.placement.engines_share_device)
    return RolloutRoles(engine, build_agent(cfg, engine, tokenizer, eos_ids))


def build_critic_roles(cfg, pools: Pools) -> CriticRoles:
    device, seed, remote = pools.device, cfg.trainer.seed, cfg.model.trust_remote_code
    dtype, mixed = compute_dtypes(cfg, device)
    attention, packed = passes(cfg, device)
    critic = None
    if trains_critic(cfg):
        adapter = lora.critic_spec(cfg)  # as the actor's: the base frozen in the compute dtype, its score head trained
        value_model = ModelSource("value", cfg.critic.model_path or cfg.model.path, dtype if adapter else torch.float32,
                                  seed, remote, attention, adapter)
        critic = Critic(build_engine(cfg, "critic", value_model, pools.mesh("critic"), device, mixed), cfg.critic,
                        device, rollout_n=rows_per_prompt(cfg), remove_padding=packed,
                        loss_horizon=cfg.data.max_response_length)
    kl = cfg.algorithm.kl_ctrl
    return CriticRoles(critic, algo.get_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon))


def build_reward(cfg, pools: Pools, tokenizer, eos_ids: list[int]) -> RuleReward | RewardModel:
    """The reward group's reward: the rule reward, or a reward model on the mesh of its pool."""
    device, seed, remote = pools.device, cfg.trainer.seed, cfg.model.trust_remote_code
    dtype, _ = compute_dtypes(cfg, device)
    attention, packed = passes(cfg, device)
    reward = build_rule_reward(cfg, tokenizer, eos_ids, build_judge(cfg, pools))
    if cfg.reward.model.path:  # a reward model replaces the rule scores, as in verl
        rm = cfg.reward.model
        rm_engine = build_engine(cfg, "reward_model", ModelSource("reward", rm.path, dtype, seed, remote, attention),
                                 pools.mesh("reward"), device)
        reward = RewardModel(rm_engine, load_tokenizer(rm.path, remote), tokenizer, rm.micro_batch_size_per_gpu,
                             device, eos_ids, max_tokens=rm.forward_max_token_len_per_gpu if rm.use_dynamic_bsz else None,
                             remove_padding=packed)
    return reward


def build_judge(cfg, pools: Pools) -> Judge | None:
    """This rank's LLM judge (reward.judge.path; None without), started: its model in the compute
    dtype, its engine (the HF rollout engine, sampling as reward.judge says), and, with a custom
    reward function to call it, its endpoint on 127.0.0.1 (reward.judge.port + the rank's place in
    the reward group, or any free port)."""
    j = cfg.reward.judge
    if not j.path:
        return None
    import torch.distributed as dist

    from spmdsplit.models import eos_token_ids
    from spmdsplit.inference.hf import HFEngine

    device, remote = pools.device, cfg.model.trust_remote_code
    dtype, _ = compute_dtypes(cfg, device)
    tokenizer = load_tokenizer(j.path, remote)  # checked by preflight.check_judge on every rank
    sleeps, peers = judge_sleeps(cfg, pools.placement), None
    if j.engine == "vllm":  # vllm_engine.init_vllm_distributed ran on every rank (groups.py)
        from vllm.distributed.parallel_state import get_tp_group

        from spmdsplit.rewards.judge import checkpoint_tensors, vllm_view
        from spmdsplit.inference.vllm_engine import VLLMEngine

        engine = VLLMEngine(vllm_view(cfg), j.path, tokenizer, eos_token_ids(j.path, tokenizer), device, dtype,
                            sleeps=sleeps)
        engine.wake_up(checkpoint_tensors(j.path))  # awake from here on, its own weights (asleep: offload)
        # The engine's ranks trade their requests over vLLM's gloo group of them (its tensor-parallel
        # group's cpu_group, one rank at tensor parallel 1): only the judge's driver threads use it
        # once the engine is built, one trade at a time.
        peers = get_tp_group().cpu_group
    else:
        model = load_causal_lm(j.path, dtype, device, cfg.trainer.seed, remote)
        engine = HFEngine(model, tokenizer, JudgeSampling(j), j.max_tokens, eos_token_ids(j.path, tokenizer))
    verdict_fn = load_custom_reward_fn(j.verdict_fn.path, j.verdict_fn.name, key="reward.judge.verdict_fn") if j.verdict == "custom" else None
    place = pools.placement.ranks("reward").index(dist.get_rank()) if dist.is_initialized() else 0
    judge = Judge(j, engine, tokenizer, verdict_fn, cfg.reward.timeout_s, sleeps)
    return judge.start(serve=bool(cfg.reward.custom_fn.path), port=j.port + place if j.port else 0, peers=peers)


def judge_sleeps(cfg, placement) -> bool:
    """Whether the judge's engine sleeps while the critic trains: a vLLM judge on the critic's pool
    (reward.judge.free_cache_engine) where a critic trains. The HF judge stays on its device, as the
    HF rollout engine does."""
    j = cfg.reward.judge
    return (j.engine == "vllm" and j.free_cache_engine and not placement.apart("reward")
            and trains_critic(cfg))


def build_rule_reward(cfg, tokenizer, eos_ids: list[int], judge: Judge | None = None) -> RuleReward:
    """The rule reward (the custom function, or the built-in scorers by data_source), with DAPO's
    overlong shaping when reward.overlong_buffer says so: the reward group's (with its judge), and
    dynamic sampling's on the generating ranks."""
    custom = cfg.reward.custom_fn
    custom_fn = load_custom_reward_fn(custom.path, custom.name) if custom.path else None
    r = cfg.reward
    remote = RemoteReward(r.remote_url, r.remote_retries, r.max_concurrency, r.timeout_s) if r.remote_url else None
    calls = RewardCalls(r, custom_fn, remote, waiting_scorers(r), judge)
    return RuleReward(tokenizer, eos_ids, overlong_buffer=cfg.reward.overlong_buffer,
                      max_response_length=cfg.data.max_response_length, calls=calls)
