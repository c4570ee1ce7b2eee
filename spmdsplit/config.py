"""The job's configuration: a typed schema, YAML presets and `key=value` overrides (OmegaConf).

Keys follow verl's names where verl has one (`data.train_batch_size`, `actor.ppo_mini_batch_size`,
`algorithm.kl_ctrl.kl_coef`, ...), so a verl recipe maps over key by key. Each key is checked
alone here, when the config loads (its type, its declared choices or range); the checks of keys
together, of names the runtime registers, and against the launch shape and the machine are
spmdsplit/preflight.py's. This module imports nothing of spmdsplit's but its errors, so that
anything may read the config without pulling in the runtime.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from spmdsplit.errors import ConfigError


# A key's allowed values are declared on its field, once: `check_declared` walks the schema and
# applies each field's `check` (metadata), so a new field with choices or a range needs nothing
# else. A check takes the full key and the value and returns the error, or None when the value is fine.
# Keys whose values name what the runtime registers (estimators, losses, tasks) are plain strings
# here and checked by spmdsplit/preflight.py (REGISTERED), with not_one_of's message.

def not_one_of(key, value, allowed, why_not: dict | None = None) -> str | None:
    """The error for a value that is not one of `allowed`, or None; `why_not` maps a wrong value to
    a better explanation than the list (`{key}` names the key)."""
    if value in allowed:
        return None
    if value in (why_not or {}):
        return f"{key}={value!r}: " + why_not[value].format(key=key)
    return f"{key}={value!r}: expected one of {list(allowed)}"


def choice(*allowed, default=None, why_not: dict | None = None):
    """A field whose value must be one of `allowed` (the first unless `default` says otherwise);
    `why_not` maps a wrong value to a better explanation than the list (`{key}` names the key)."""
    default = allowed[0] if default is None else default
    assert default in allowed, (default, allowed)

    def check(key, value):
        return not_one_of(key, value, allowed, why_not)
    return field(default=default, metadata={"choices": allowed, "check": check})


def each_of(*allowed, default: list):
    """A list whose every item must be one of `allowed` (trainer.logger)."""
    assert all(item in allowed for item in default), (default, allowed)

    def check(key, value):
        wrong = [item for item in value if item not in allowed]
        return f"{key}={list(value)}: {wrong[0]!r} is not one of {list(allowed)}" if wrong else None
    return field(default_factory=lambda: list(default), metadata={"choices": allowed, "check": check})


def bounded(default, ok: Callable[[Any], bool], expected: str):
    """A value that `ok` accepts; otherwise the error says `expected` (e.g. "expected >= 0")."""
    assert ok(default), default

    def check(key, value):
        return None if ok(value) else f"{key}={value!r}: {expected}"
    return field(default=default, metadata={"check": check})


def paths(default):
    """A path or a list of paths (typed Any, as OmegaConf has no union of the two)."""
    def ok(v):
        return isinstance(v, str) or (OmegaConf.is_list(v) or isinstance(v, list)) and all(isinstance(x, str) for x in v)
    return bounded(default, ok, "expected a path or a list of paths")


def consecutive_steps():
    """A list of consecutive step numbers from 1 up, or [] (trainer.profile_steps)."""
    def check(key, value):
        steps = list(value)
        if not steps or (steps[0] > 0 and steps == list(range(steps[0], steps[0] + len(steps)))):
            return None
        return f"{key}={steps}: expected consecutive steps from 1 up, e.g. [3] or [2, 3] ([] = off)"
    return field(default_factory=list, metadata={"check": check})


def _is_number(value) -> bool:
    try:
        return float(value) == float(value)  # not NaN
    except (TypeError, ValueError):
        return False


def positive(default):
    return bounded(default, lambda v: v > 0, "expected a positive number")


# Choices several keys share.
ENGINES = ("fsdp", "deepspeed")  # spmdsplit/engines/
# data.truncation: a prompt still too long stops the job (error) or is cut, keeping its end (left) or
# its start (right); spmdsplit/data/prompts.py cuts by it and checks a value that skipped load_config.
TRUNCATIONS = ("error", "left", "right")
# rollout.multi_turn.tool_response_truncate_side: the side of a long tool or environment response
# KEPT, as verl (middle: both ends); spmdsplit/agent/tools.py truncate cuts by it.
TRUNCATE_SIDES = ("middle", "left", "right")
# The KL(pi || pi_ref) estimators of the KL penalty in the reward and the actor's KL loss, each with
# verl's other name for it (None: none). The keys take the first names; spmdsplit/algo.py kl_penalty,
# the math, takes both and reads them from here.
KL_ESTIMATORS = {"kl": "k1", "abs": None, "mse": "k2", "low_var_kl": "k3"}
# Declared in spmdsplit/algo.py, beside the math that implements them, and checked at start-up
# (spmdsplit/preflight.py REGISTERED): LOSS_AGG_MODES (agg_loss), ROLLOUT_IS_LEVELS
# (compute_rollout_is_weights), and the registries of advantage estimators and policy losses,
# whose names are algorithm.adv_estimator's and actor.policy_loss.loss_mode's values.


def inference_zero_stage(trained: str):
    """DeepSpeed for a model that only infers can shard its weights (3) or hold them whole (0);
    -1 follows the model `trained` alongside it in the same pool."""
    no_optimizer = ("ZeRO stages 1 and 2 shard optimizer state (and gradients), and this model only infers and "
                    "has none; use {key}=3 (weights sharded over the pool), 0 (whole on every rank) or -1 (3 if "
                    + trained + ".zero_stage is 3, else 0)")
    return choice(-1, 0, 3, why_not={1: no_optimizer, 2: no_optimizer})


@dataclass
class TrainerConfig:
    total_steps: int = positive(100)
    # End the run early once it has learned: when the mean training score (critic/score/mean) of the
    # last stop_at_score_window steps reaches this, the job stops after the next step as after its
    # last one (exported; a checkpoint only if save_freq asks for one after the last step; no final
    # validation beyond val_freq's) and exits 0. null = run every step (spmdsplit/stop_at_score.py).
    stop_at_score: Optional[float] = None
    stop_at_score_window: int = positive(5)
    seed: int = 1
    log_dir: str = "outputs/tensorboard"  # TensorBoard event files, written by world rank 0
    # Where world rank 0 sends the metrics: console | tensorboard | wandb | mlflow (the last two are
    # extras: pip install -e ".[wandb]" / ".[mlflow]"). wandb follows its environment (WANDB_MODE=offline,
    # WANDB_DIR; default dir: trainer.log_dir's parent); MLflow follows MLFLOW_TRACKING_URI (default: a
    # file store, mlruns/ beside trainer.log_dir). Names as verl's trainer.logger.
    logger: list[str] = each_of("console", "tensorboard", "wandb", "mlflow", default=["console", "tensorboard"])
    project_name: str = "spmdsplit"  # the wandb project, the MLflow experiment
    experiment_name: str = "default"  # the wandb / MLflow run's name
    timeline: str = "outputs/timeline.json"  # Chrome-trace JSON of every rank's phases; "" = off
    # torch.profiler over these consecutive steps (e.g. [3] or [2, 3]) on every rank, the phases as
    # ranges, each rank's trace written to <profile_dir>/rank<r>.json.gz (spmdsplit/timing.py
    # StepProfiler; tools.device.gpu_check reads it); [] = off. verl 0.4's trainer.profile_steps.
    profile_steps: list[int] = consecutive_steps()
    profile_dir: str = "outputs/profile"
    output_dir: str = "outputs/actor_hf"  # the trained actor in Hugging Face format; "" = don't save
    # verl's dumps: each step's responses as <dir>/<step>.jsonl (input, output, gts, score, step, and
    # ours: data_source, uid, row_index, weights_version, agent turns; spmdsplit/dumps.py); "" = off.
    rollout_data_dir: str = ""  # the training rows, as trained
    validation_data_dir: str = ""  # the validation responses
    device: str = choice("auto", "cpu", "cuda")  # auto: cuda when available
    num_threads: int = 1  # torch threads per rank on CPU (1 avoids oversubscribing cores); 0 = torch's default
    dist_timeout_s: int = positive(600)  # a collective inside a pool that waits longer than this fails instead of hanging
    # A wait for the other pool (its rollout, its advantages, a validation set it generates): a
    # busy pool is not a dead one, so this is long. Dead ranks end the job at once anyway
    # (spmdsplit/failure.py and the launcher), whatever this says.
    pool_wait_timeout_s: int = positive(10800)
    progress_bar: bool = True
    val_freq: int = -1  # validate every this many steps (and after the last); -1 = never
    val_before_train: bool = False
    critic_warmup: int = 0  # the first this many steps train only the critic
    # verl's balance_batch: each chunk's prompt groups are reordered so that every rank of each
    # pool holds an even share of the tokens (attention_mask sums), not just an even row count
    # (spmdsplit/balanced_order.py; the move among the actor pool's ranks: spmdsplit/messages.py).
    balance_batch: bool = True
    # Checkpoints (see spmdsplit/checkpoint_files.py). A stop request (SIGUSR2, SIGTERM) always checkpoints.
    # save_freq: checkpoint every this many steps and after the last; -1 = only when stopped.
    save_freq: int = bounded(-1, lambda v: v > 0 or v == -1, "expected a positive number of steps, or -1 (off)")
    default_local_dir: str = "checkpoints"  # on a filesystem every node sees, to resume after a requeue
    max_ckpt_to_keep: int = bounded(0, lambda v: v >= 0, "expected >= 0 (0 = keep all)")  # keep the newest this many
    resume: str = "auto"  # auto (the latest complete checkpoint, if any) | disable | a global_step_* folder


def pool_sizes():
    """placement.pools: a list of sizes [actor, critic], or a mapping pool name -> size (typed
    Any, as OmegaConf has no union of the two)."""
    def is_size(v):
        return isinstance(v, int) and not isinstance(v, bool)

    def check(key, value):
        if OmegaConf.is_dict(value) or isinstance(value, dict):
            bad = [(k, v) for k, v in value.items() if not is_size(v)]
            return f"{key}.{bad[0][0]}={bad[0][1]!r}: expected a whole number (a pool's size)" if bad else None
        if (OmegaConf.is_list(value) or isinstance(value, list)) and all(is_size(v) for v in value):
            return None
        return (f"{key}={value!r}: expected a list of sizes [actor, critic], e.g. {key}=[6,2], or a mapping "
                f"pool name -> size, e.g. {key}='{{gen: 1, train: 1}}'")
    return field(default_factory=list, metadata={"check": check})


@dataclass
class PlacementConfig:
    mode: str = choice("split", "colocate", "custom")
    # custom: [actor, critic] sizes, or named pools {gen: 2, train: 6} for placement.roles
    pools: Any = pool_sizes()
    # custom with named pools: the pool of each role group, rollout (the engines) | actor (policy +
    # reference) | critic (value model, advantages) | reward (reward model, rule reward); a group
    # placed nowhere sits with its host (rollout and critic with the actor, reward with the critic),
    # e.g. {rollout: gen, actor: train}. docs/placement.md lists the maps that work.
    roles: dict[str, str] = field(default_factory=dict)
    pool_unit: str = choice("ranks_per_node", "nodes")  # what custom sizes count
    overlap: bool = True  # false: the pools wait for each other at each phase (verl's blocking calls)


def module_names(default):
    """PEFT's target_modules / exclude_modules: a name, a list of names, or null (typed Any, as
    OmegaConf has no union of a string and a list)."""
    def ok(v):
        return v is None or isinstance(v, str) or ((OmegaConf.is_list(v) or isinstance(v, list))
                                                  and all(isinstance(x, str) for x in v))
    return bounded(default, ok, "expected a module name (a suffix or a regex, as PEFT's), a list of them, or null")


@dataclass
class LoraKeys:
    """LoRA on a trained model (spmdsplit/lora.py, docs/lora.md), under verl's names: PEFT adapters
    of rank lora_rank on the layers target_modules names, the base frozen. The policy's are model.*,
    the value model's critic.model.*."""
    lora_rank: int = bounded(0, lambda v: v >= 0, "expected >= 0 (0 = off: full fine-tuning)")
    lora_alpha: float = positive(16.0)  # the adapter's output is scaled by lora_alpha / lora_rank
    # PEFT's names: "all-linear" (every linear layer but the output head), or module name suffixes
    # (e.g. [q_proj, v_proj]), or a regex matched against the whole name.
    target_modules: Any = module_names("all-linear")
    exclude_modules: Any = module_names(None)  # layers left out of target_modules, in the same form
    lora_adapter_path: str = ""  # a saved PEFT adapter folder to start from (its own config says its layers and scale)


@dataclass
class CriticModelConfig(LoraKeys):
    """critic.model.*: the value model's LoRA (its path is critic.model_path)."""


@dataclass
class ModelConfig(LoraKeys):
    # The rollout engines take the merged weights (the whole model, as without LoRA) instead of the
    # adapter alone, and the HF export is a merged model instead of an adapter folder: for engines or
    # architectures without LoRA kernels. model.lora_rank > 0 only.
    lora_merge: bool = False
    path: str = ""  # local dir or hub id; "" = the embedded tiny model, built locally on first use
    embedded_dir: str = ""  # where the embedded model is built; "" = $SPMDSPLIT_CACHE or ~/.cache/spmdsplit
    dtype: str = choice("auto", "float32", "bfloat16")  # auto: bf16 on cuda, fp32 on cpu
    trust_remote_code: bool = False
    # Recompute each decoder block's activations in the backward instead of keeping them: about one
    # more forward per update (~1/3 more compute) for activation memory that no longer grows with
    # the layer count (tools/plan/memory.py models both). Off for the CPU toy; on in every GPU preset.
    gradient_checkpointing: bool = False
    # Padding-free forward passes (verl's name) for the actor, reference, critic and reward model:
    # each micro-batch's real tokens packed into one sequence, so no compute goes to padding.
    # varlen and flash_attention_2 are given the rows' boundaries and attend each row on its own;
    # with sdpa/eager an explicit [T, T] block-causal mask keeps rows apart (memory and compute grow
    # with the micro-batch's tokens squared; on cuda a mask past 1 GiB is refused,
    # check_packed_attention).
    use_remove_padding: bool = False
    # The attention kernel of every trained and frozen model (not the rollout engines'), chosen in
    # models.attention_implementation: auto (flash_attention_2 on cuda where transformers takes
    # flash-attn: the flash-attn distribution >= 2.3.3, importable; else varlen) | varlen (spmdsplit/attention.py: packed rows one by one, torch's varlen kernel
    # on cuda; sdpa otherwise) | sdpa | eager | flash_attention_2 (GPU only; needs flash-attn).
    attn_implementation: str = choice("auto", "varlen", "sdpa", "eager", "flash_attention_2")


@dataclass
class ReasoningGymConfig:
    """reasoning-gym's tasks as data: a data.train_files / data.val_files entry
    `reasoning_gym:<task>[,<task>...]` (spmdsplit/data/reasoning_gym.py; the `reasoning-gym` extra)."""
    size: int = positive(1000)  # entries per task in the training set
    val_size: int = positive(100)  # entries per task in the validation set
    seed: int = 1  # the training set's; the validation set's is this + 1_000_003, so the two never share an entry
    # the system message before each question: a name in reasoning_gym.utils.SYSTEM_PROMPTS (the scorer
    # reads the answer between <answer> tags, which they all ask for), or "" for the question alone
    system_prompt: str = "default"
    # false: each prompt is one plain string (system prompt, blank line, question), for a model
    # without a chat template (the embedded one)
    chat: bool = True


@dataclass
class DataConfig:
    task: str = "repeat"  # the built-in synthetic task (spmdsplit/data/synthetic.py TASKS), when no train_files
    num_train_samples: int = positive(20000)  # size of the synthetic training set
    # verl's parquet files (a path or a list of paths), or reasoning_gym:<task>[,<task>...] for
    # reasoning-gym's tasks (data.reasoning_gym); "" = the synthetic task
    train_files: Any = paths("")
    val_files: Any = paths("")
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)
    prompt_key: str = "prompt"
    train_batch_size: int = positive(128)  # prompts per step, over the whole world
    # prompts per generation batch with algorithm.filter_groups (verl's name; null = train_batch_size):
    # batches are generated until their kept groups fill train_batch_size
    gen_batch_size: Optional[int] = bounded(None, lambda v: v is None or v > 0, "expected a positive number, or null")
    max_prompt_length: int = positive(8)
    max_response_length: int = positive(6)  # the synthetic tasks' answers are 4 digits: room for the EOS and to overrun
    filter_overlong_prompts: bool = False  # drop (and count) prompts longer than max_prompt_length
    truncation: str = choice(*TRUNCATIONS)  # a prompt still too long: fail, or cut on that side
    skip_malformed_rows: bool = False  # false: malformed rows stop the job, with their row numbers
    shuffle: bool = True
    seed: int = 1


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    lr_warmup_steps: int = 0  # linear warmup over this many trainer steps (as verl), then the schedule
    lr_scheduler_type: str = choice("constant", "cosine")  # cosine: down to min_lr_ratio * lr at the last trainer step
    min_lr_ratio: float = bounded(0.0, lambda v: 0 <= v <= 1, "expected 0 <= ratio <= 1")  # cosine only
    total_training_steps: int = -1  # where the cosine ends; -1: trainer.total_steps (filled by load_config, as verl's trainer does)
    grad_clip: float = 1.0


@dataclass
class PolicyLossConfig:
    """verl's actor.policy_loss: the registered loss (spmdsplit/algo.py) and its hyper-parameters
    (docs/algorithms.md); the losses also read actor.clip_ratio* and actor.tau_*."""
    loss_mode: str = "vanilla"  # a name in spmdsplit/algo.py's policy-loss registry
    clip_cov_ratio: float = positive(0.0002)  # clip_cov: share of a micro-batch's tokens whose gradient is cut
    clip_cov_lb: float = 1.0  # clip_cov: the candidates' covariance lies in (clip_cov_lb, clip_cov_ub)
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = positive(0.0002)  # kl_cov: share of tokens (largest covariance) given the KL penalty
    ppo_kl_coef: float = 0.1  # kl_cov: the penalty's coefficient, on |log(pi / pi_old)|


@dataclass
class ActorConfig:
    # verl's learning rates: right for a pretrained model; the embedded toy's live in its preset
    # (EMBEDDED_PRESET below), applied when model.path is empty.
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))
    ppo_mini_batch_size: int = positive(32)  # prompts per optimizer step, over the whole pool
    ppo_micro_batch_size_per_gpu: int = positive(16)  # rows per forward/backward on one rank
    ppo_epochs: int = positive(1)
    shuffle: bool = True
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: float = bounded(3.0, lambda v: v > 1, "the dual-clip bound must be > 1")  # for negative advantages
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = choice(*KL_ESTIMATORS, default="low_var_kl")
    loss_agg_mode: str = "token-mean"  # one of spmdsplit/algo.py LOSS_AGG_MODES
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    tau_pos: float = positive(1.0)  # policy_loss.loss_mode=sapo: the gate's temperature where the advantage > 0
    tau_neg: float = positive(1.05)  # ... and where it is <= 0 (larger: negative updates fade faster)
    log_prob_micro_batch_size_per_gpu: int = positive(32)
    # Where the update is one pass (one epoch, one mini-batch: ppo_mini_batch_size =
    # data.train_batch_size), its own forward, detached, gives the old log-probs instead of a
    # separate old_log_prob pass (as TRL's GRPO); false keeps the separate pass always
    # (docs/algorithms.md, "Old log-probs from the update's own forward").
    old_log_prob_from_update: bool = True
    # Response tokens whose logits exist at once, in the log-prob pass and the update (the reference
    # too): the LM head, log-softmax and entropy run this many tokens at a time, each chunk's head
    # recomputed in the backward (roles/lm_head.py; verl's use_fused_kernels, whose torch backend
    # chunks 512 tokens, and entropy_from_logits_with_chunking in one key). At Qwen's 152k vocabulary
    # 512 tokens are ~0.16 GB of bf16 logits, a 16k-token micro-batch's whole logits ~5 GB. At most
    # 32M logits a chunk whatever this says (roles/lm_head.py CHUNK_LOGITS: 220 tokens at 152k).
    # 0: the whole micro-batch's logits at once (only the fp32 softmax chunked).
    logits_chunk_size: int = bounded(512, lambda v: v >= 0, "expected >= 0 tokens (0 = not chunked)")
    engine: str = choice(*ENGINES)  # fsdp (FSDP2) | deepspeed (ZeRO, over the actor pool's group)
    # deepspeed: 1 (optimizer state), 2 (+ gradients), 3 (+ weights) sharded over the pool
    zero_stage: int = choice(1, 2, 3, default=3)
    # FSDP2: reduce-scatter gradients once per mini-batch instead of after every micro-batch. Saves
    # one reduce-scatter per micro-batch; costs one whole *unsharded* fp32 gradient (4 B/param, the
    # reduce dtype) on every rank while a mini-batch accumulates, whatever the pool size (7B: ~30 GB).
    # Only with engine=fsdp: ZeRO-2/3 partition gradients in every backward, ZeRO-1 holds them whole anyway.
    no_sync_accumulation: bool = False
    # Token-budget micro-batches (verl's names): instead of a fixed number of rows, a rank's rows
    # (of a mini-batch; of its whole batch for the log-prob pass) are binned so no micro-batch holds
    # more than this many tokens (prompt + response, padding not counted). A row longer than the
    # budget still runs, in a micro-batch of its own, so a budget below data.max_prompt_length +
    # data.max_response_length is allowed. The ranks of the pool agree on one micro-batch count (an
    # all-reduce per pass); a rank short of rows runs a dummy one. Cost: activation memory scales
    # with the budget, not with the row count; the update itself does not change.
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = positive(16384)  # per micro-batch of the update
    log_prob_max_token_len_per_gpu: int = positive(16384)  # per micro-batch of the old-log-prob pass


@dataclass
class CriticConfig:
    model_path: str = ""  # "" = model.path (a value head on the policy's backbone, as verl does)
    model: CriticModelConfig = field(default_factory=CriticModelConfig)  # the value model's LoRA keys
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: int = positive(32)
    ppo_micro_batch_size_per_gpu: int = positive(16)
    ppo_epochs: int = positive(1)
    shuffle: bool = True
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"  # the actor's modes but token-sum (spmdsplit/preflight.py REGISTERED)
    forward_micro_batch_size_per_gpu: int = positive(32)
    engine: str = choice(*ENGINES)  # over the critic pool's group
    zero_stage: int = choice(1, 2, 3, default=3)  # deepspeed
    no_sync_accumulation: bool = False  # as actor.no_sync_accumulation (critic of 7B: ~28 GB per rank)
    use_dynamic_bsz: bool = False  # token-budget micro-batches, as actor.use_dynamic_bsz
    ppo_max_token_len_per_gpu: int = positive(16384)  # per micro-batch of the update
    forward_max_token_len_per_gpu: int = positive(16384)  # per micro-batch of the values pass


@dataclass
class RefConfig:
    """The reference policy: evaluated only, on the actor pool."""

    engine: str = choice("", *ENGINES)  # "" = actor.engine
    # deepspeed: 3 (weights sharded over the pool) | 0 (whole on every rank); -1 = 3 if the
    # actor's stage is 3, else 0. Stages 1 and 2 shard optimizer state, which it has none of.
    zero_stage: int = inference_zero_stage("actor")
    log_prob_micro_batch_size_per_gpu: int = positive(32)  # rows per forward of the reference on one rank (verl's key)
    # Token-budget micro-batches for the reference's pass; null = actor.use_dynamic_bsz and
    # actor.log_prob_max_token_len_per_gpu (the two passes see the same rows).
    log_prob_use_dynamic_bsz: Optional[bool] = None
    log_prob_max_token_len_per_gpu: Optional[int] = bounded(None, lambda v: v is None or v > 0,
                                                            "expected a positive number, or null (the actor's)")


@dataclass
class ValKwargsConfig:
    n: int = positive(1)
    do_sample: bool = False  # greedy by default
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1


@dataclass
class MultiTurnConfig:
    """Multi-turn, tool-using episodes (spmdsplit/agent/, docs/agents.md), under verl's names."""
    enable: bool = False
    # verl's tool-config YAML (tools: [{class_name, config, tool_schema}]); "" with data.task=lookup:
    # the embedded task's lookup tool
    tool_config_path: str = ""
    max_assistant_turns: Optional[int] = None  # null: only the token budget ends an episode
    # Tokens of one policy turn at most (a tool agent's turn cut there ends its episode, an environment's is
    # stepped as its action); null: what is left of the response's budget
    max_turn_length: Optional[int] = None
    max_parallel_calls: int = positive(1)  # calls of one turn that run (verl's default: 1); the rest are dropped
    max_tool_response_length: int = positive(256)  # characters of a tool response the model sees
    tool_response_truncate_side: str = choice(*TRUNCATE_SIDES)
    tool_timeout_s: float = positive(30.0)  # a call that runs longer is answered with an error
    format: str = choice("hermes", "compact")  # how calls are written (spmdsplit/agent/parsers.py)
    # An environment (docs/environments.md): each row an episode of it, as pkg.mod.Name or
    # path/to/file.py:Name; gym-style (spmdsplit/agent/environments.py: its reset, then a step per policy
    # turn; OpenEnv Environment subclasses run as they are) or written for TRL's environment_factory
    # (spmdsplit/agent/trl_env.py: its methods the tools; environment_style). "" = none.
    environment: str = ""
    # The constructor's keyword arguments; `environment_kwargs={}` on the command line empties a preset's
    # (a TRL-style class takes none)
    environment_kwargs: dict[str, Any] = field(default_factory=dict)
    # How the environment is driven: gym (reset, then step(turn text) per policy turn) | trl (a class written
    # for TRL's environment_factory: no constructor arguments, reset(**row) -> str | None, its other public
    # methods the tools the policy calls, an optional get_reward(); spmdsplit/agent/trl_env.py) | auto (trl
    # for a class without a step method or with a get_reward, else gym)
    environment_style: str = choice("auto", "gym", "trl")
    environment_reward: str = choice("sum", "last")  # an episode's reward: its steps' sum, or the last step's
    # The field of step's action model (OpenEnv) the policy's text fills; "": its one required string field
    environment_action_field: str = ""


@dataclass
class AgentConfig:
    default_agent_loop: str = choice("single_turn_agent", "tool_agent")  # for rows without agent_name
    # An agent harness that drives the model itself over the OpenAI API (spmdsplit/agent/harness.py):
    # pkg.mod.fn or path/to/file.py:fn, `async def fn(client, row) -> reward` (or (base_url, row));
    # each prompt row one episode of it. "" = none.
    harness: str = ""
    # rollout.agent.harness=verifiers:<env>: a verifiers v1 environment plays each row
    # (spmdsplit/agent/verifiers_env.py); these are the rest of its EnvConfig (taskset, agent, ...).
    verifiers_env_kwargs: dict[str, Any] = field(default_factory=dict)
    harness_timeout_s: float = positive(300.0)  # an episode of the harness, start to end
    max_concurrency: int = positive(256)  # the harness's episodes running at once per generating rank
    # The harness's endpoint on 127.0.0.1: a node's rank of local rank k serves its episodes at
    # port + k (a port taken stops the job before it starts); 0: any free port (the harness is
    # given its URL either way).
    port: int = bounded(0, lambda v: 0 <= v <= 65535 - 256, "expected 0 (any free port) or a port up to 65279")
    # The rows a harness's episode trains: its first call's row and the rows its calls start that do
    # not extend the row before (a history the harness rewrote, a sub-agent), each taking the
    # episode's advantage; an episode with fewer fills the rest with empty rows (no tokens trained),
    # one with more trains the first this many (agent/harness/rows_dropped). A step trains
    # data.train_batch_size x rollout.n x this many rows (rows_per_prompt). Needs an outcome
    # estimator (one advantage per episode: grpo, rloo, ...).
    rows_per_episode: int = positive(1)


def rows_per_prompt(cfg) -> int:
    """The rows a step trains per prompt: rollout.n responses, each rollout.agent.rows_per_episode rows
    (more than one only where a harness plays them: preflight)."""
    return cfg.rollout.n * cfg.rollout.agent.rows_per_episode


@dataclass
class RolloutConfig:
    name: str = choice("hf", "vllm")  # hf (transformers generate on a copy of the policy) | vllm (spmdsplit/inference/vllm_engine.py)
    temperature: float = positive(1.0)
    top_p: float = bounded(1.0, lambda v: 0 < v <= 1, "expected 0 < top_p <= 1")
    top_k: int = -1  # -1 = off
    do_sample: bool = True
    n: int = positive(1)  # responses sampled per prompt (GRPO/RLOO group size)
    # >1: the actor pool sends its rollout in this many chunks, each as soon as it is generated,
    # so the critic pool computes values and rewards while generation goes on.
    stream_chunks: int = positive(1)
    # batch k is generated with the weights after update k-1-s; s >= 1 lets a rollout pool of its own
    # generate while the others train (needs placement.roles.rollout on a pool of its own). 0: on-policy.
    staleness: int = bounded(0, lambda v: v >= 0, "expected >= 0 (0 = on-policy)")
    # Continuous generation (spmdsplit/generation/continuous.py; a rollout pool of its own): the engine never
    # drains; each batch is handed over as soon as its groups are complete, in completion order; new
    # weights are loaded between two engine steps while requests go on (every token records its
    # version; staleness bounds how old a trained token may be).
    continuous: bool = False
    hf_step_tokens: int = positive(8)  # rollout.name=hf, continuous: tokens per engine step (a prefill each)
    # With rollout.continuous: once a batch is handed over, the answers still running wait (kept, with
    # their tokens) for the next weights and go on with them, rather than with the weights held:
    # fewer stale tokens, the engine idle meanwhile (slime's partial rollouts, in a continuous engine).
    partial_rollout: bool = False
    # With rollout.continuous and rollout.name=vllm, what the requests held keep when new weights load
    # between two engine steps: recompute (their KV is computed again with the new weights: every later
    # token is exactly the new version's; one prefill of them per load) | keep (the old KV stays, as
    # PipelineRL does: no prefill, later tokens see a context computed by older weights; the importance
    # correction still divides by the probability each token was drawn with; needs
    # rollout.enable_prefix_caching=false, else new prompts would reuse KV of older weights).
    kv_after_load: str = choice("recompute", "keep")
    # With rollout.continuous: 0 = free-running (each version taken at the first engine step after it
    # is sent); K > 0 = a fixed schedule, for tests and for repeating a run: version v is taken at
    # engine step max(v*K, the step at which batch v was handed over), waiting for it if late, so the
    # same seed gives the same rows whatever the timing.
    version_every_engine_steps: int = bounded(0, lambda v: v >= 0, "expected >= 0 (0 = free-running)")
    # Which ranks generate: actor (the actor pool's) | all (the critic pool's too, with engines
    # refreshed by a broadcast from the actor pool each step; spmdsplit/weight_sync.py).
    ranks: str = choice("actor", "all")
    weight_bucket_mb: float = positive(256.0)  # rollout.ranks=all: the broadcast's bucket size
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)  # sampling for validation
    # vLLM only (rollout.name=vllm), under verl's names.
    tensor_model_parallel_size: int = positive(1)  # ranks per engine, consecutive, inside one pool
    # Kept so that a verl config that sets it loads: 1 is the one layout here (nothing else reads
    # it), and its check (check_declared, when the config loads) refuses any other value.
    data_parallel_size: int = bounded(1, lambda v: v == 1, "expected 1; vLLM's own data parallel steps its engines "
                                      "in lockstep, and every generating rank (or tensor-parallel group) already runs "
                                      "its own engine")
    # The share of the WHOLE device vLLM reserves for itself (weights + KV cache + activations), on
    # top of what the trainer already holds there: resident state + this x device memory must fit.
    gpu_memory_utilization: float = bounded(0.5, lambda v: 0 < v <= 1, "expected 0 < value <= 1")
    kv_cache_memory_gb: float = bounded(0.0, lambda v: v >= 0, "expected >= 0 (0 = vLLM sizes it)")  # explicit KV-cache size per engine; 0 = from gpu_memory_utilization on GPU, 1 GiB on CPU
    # With LoRA (model.lora_rank > 0, not lora_merge): the largest adapter rank the engine takes, one
    # of vLLM's sizes (1, 8, 16, 32, 64, 128, 256, 320, 512); null = model.lora_rank rounded up to one.
    max_lora_rank: Optional[int] = bounded(None, lambda v: v is None or v > 0, "expected a positive rank, or null")
    # With LoRA engines: the folder each engine rank writes the adapter into for vLLM to read at each
    # sync; "" = /dev/shm where it exists. An adapter that does not fit (a container's small
    # /dev/shm) goes to the node's temp folder (TMPDIR), with a warning.
    lora_adapter_dir: str = ""
    max_num_seqs: int = positive(1024)
    max_num_batched_tokens: int = positive(8192)  # >= data.max_prompt_length + max_response_length
    enforce_eager: bool = True  # no CUDA graphs / no torch.compile: quicker start, slower decode
    enable_prefix_caching: bool = True
    # GPU: the engine sleeps between a step's rollouts (vLLM sleep level 2: weights and KV cache
    # freed, nothing copied to host, as the weights are reloaded at each wake); no-op on CPU.
    free_cache_engine: bool = True
    # vLLM: each row sampled with its own seed from (trainer seed, step, row), so its tokens do not
    # depend on its batch, rank or pool size: runs repeat across layouts. false: one seed per engine
    # per step (each row seeded by it and its place), the same on every rank of a tensor-parallel
    # engine; a row's tokens then depend on the layout. Either way every row has a seed, never one
    # from a global generator a tool could move (generation.shares.sample_seeds). No cost on GPU: vLLM 0.32
    # on CUDA (its V2 model runner) reads the seeds inside its one batched sampling kernel.
    per_row_seed: bool = True
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)


@dataclass
class CustomRewardFnConfig:
    path: str = ""  # a .py file defining the function; "" = the built-in scorers by data_source
    name: str = "compute_score"


@dataclass
class RewardModelConfig:
    path: str = ""  # an AutoModelForSequenceClassification checkpoint; "" = rule rewards only
    micro_batch_size_per_gpu: int = positive(16)
    engine: str = choice("", *ENGINES)  # "" = critic.engine
    zero_stage: int = inference_zero_stage("critic")  # as ref.zero_stage, following the critic
    # Token-budget micro-batches of the reward model's own tokens (its tokenizer's), as actor.use_dynamic_bsz.
    use_dynamic_bsz: bool = False
    forward_max_token_len_per_gpu: int = positive(16384)


@dataclass
class OverlongBufferConfig:
    """DAPO's overlong reward shaping on the rule reward (roles/reward.py overlong_reward), under the
    names of verl's DAPO reward manager: verl 0.9.1 reward.reward_kwargs.overlong_buffer_cfg.* (its
    reward_kwargs.max_resp_len is data.max_response_length here); DAPO's recipe yaml
    reward_model.overlong_buffer.*. A response longer than data.max_response_length - len tokens
    loses penalty_factor * (length - that) / len: penalty_factor at the limit."""
    enable: bool = False
    len: int = 0  # the buffer, in tokens; when enabled, > 0 and < data.max_response_length
    penalty_factor: float = bounded(1.0, lambda v: v >= 0, "expected >= 0")
    log: bool = False  # also log overlong_reward and overlong (1 if penalised) as critic/reward_extra/<key>/mean


@dataclass
class SandboxConfig:
    """Programs under test (verl's code data_sources: apps, codecontests, codeforces, taco), run on
    the scoring rank each in a process of its own (spmdsplit/sandbox/), in a fresh temporary folder
    with a scrubbed environment, under these limits."""
    workers: int = bounded(0, lambda v: v >= 0, "expected >= 0")  # programs at once per scoring rank; 0 = its CPU cores
    # namespaces: a user, PID, mount, network and IPC namespace per program, the file system read-only
    # but its folder (a tmpfs of max_output_mb); guard: limits and verl's reliability guard only;
    # auto: namespaces where the kernel allows them, else guard (one line at start says which).
    isolation: str = choice("auto", "namespaces", "guard")
    # One test's run (verl's per-test 10 s); the first run, of all tests together, gets half of it per
    # test (verl's 5 s); each process 1 s more (verl's global timeout).
    timeout_s: float = positive(10.0)
    memory_mb: int = positive(1024)  # address space of the program's process (RLIMIT_AS)
    max_processes: int = positive(8)  # processes and threads the program may start (RLIMIT_NPROC)
    max_open_files: int = positive(64)  # RLIMIT_NOFILE
    max_output_mb: int = positive(8)  # what one test prints; what it writes in its folder (guard: each file)


@dataclass
class SandboxFusionConfig:
    """verl's reward.sandbox_fusion: the code data_sources run by a SandboxFusion server instead."""
    url: str = ""  # its run_code address; "" = the local sandbox (reward.sandbox)
    max_concurrent: int = positive(64)  # requests in flight at once per scoring rank
    memory_limit_mb: int = positive(1024)


@dataclass
class RewardManagerConfig:
    """verl's reward.reward_manager.name: how a custom reward function is called. naive: one call per
    sample (an `async def` on the rank's event loop, a plain def on reward.num_workers threads);
    prime: one call per sample, a plain def on reward.num_workers processes (CPU-bound scorers); batch:
    one call per batch, with verl's batch signature (data_sources, solution_strs, ground_truths,
    extra_infos as lists)."""
    name: str = choice("naive", "prime", "batch", why_not={
        "dapo": "DAPO's shaping is reward.overlong_buffer here, with any manager; use {key}=naive",
        "remote": "verl's remote manager runs a plain function in processes: use {key}=prime"})


# The judge's default prompt: a rubric grade from 0 to 10, the grade last (reward.judge.verdict=last_number).
JUDGE_PROMPT = [
    {"role": "system", "content": "You grade answers. Reply with a short reason, then the grade alone on the last line."},
    {"role": "user", "content": "Question:\n{prompt}\n\nReference answer:\n{ground_truth}\n\nAnswer to grade:\n"
                                "{response}\n\nGrade the answer from 0 (wrong) to 10 (right and complete)."},
]


@dataclass
class JudgeConfig:
    """An LLM judge: a generative reward model on each rank of the reward group, scoring responses by
    the verdict it writes (spmdsplit/rewards/judge.py, docs/rewards.md "An LLM judge"); its
    OpenAI-compatible endpoint on the rank's 127.0.0.1 reaches a custom reward function as verl's
    `reward_router_address`."""
    path: str = ""  # a causal LM folder (with a chat template); "" = no judge
    # hf: transformers on the rank's device; vllm: an in-process vLLM engine, on ranks that hold no
    # vLLM rollout engine
    engine: str = choice("hf", "vllm")
    # vllm: each judge over this many consecutive ranks of the reward group's pool, which score
    # their rows together (beside a vLLM rollout: the rollout's tensor parallel size)
    tensor_model_parallel_size: int = positive(1)
    # vllm, hosted with a critic: its weights to host memory and its KV cache freed while the critic
    # trains (vLLM's level-1 sleep; GPU only), back for the next step's scoring
    free_cache_engine: bool = True
    gpu_memory_utilization: float = bounded(0.3, lambda v: 0 < v < 1, "expected in (0, 1)")  # vllm: its share of the GPU
    kv_cache_memory_gb: float = bounded(0.25, lambda v: v > 0, "expected > 0")  # vllm on CPU: its KV cache
    # The data_sources whose rows the judge scores; the others keep their scorer (built-in, custom
    # function, server). [] = every row, or, with reward.custom_fn, none directly: the function
    # scores every row and calls the judge through its endpoint.
    data_sources: list[str] = field(default_factory=list)
    # Chat messages, rendered with the judge's own chat template; placeholders {prompt}, {response},
    # {ground_truth}, {data_source} and {extra_info[<key>]} (a literal brace is written twice).
    prompt: list[dict[str, str]] = field(default_factory=lambda: [dict(m) for m in JUDGE_PROMPT])
    temperature: float = bounded(0.0, lambda v: v >= 0, "expected >= 0 (0 = greedy)")
    top_p: float = bounded(1.0, lambda v: 0 < v <= 1, "expected in (0, 1]")
    top_k: int = -1  # -1 = off
    max_tokens: int = positive(256)  # the verdict's length at most
    n: int = positive(1)  # verdicts per response; the response scores their mean
    # last_number: the last number of the text, in `range`; tag: the number in the last <tag>...</tag>,
    # in `range` (both scored (x - low) / (high - low)); yes_no: p(yes) / (p(yes) + p(no)) right
    # after the prompt, one forward pass, no generation; custom: verdict_fn given the text.
    verdict: str = choice("last_number", "tag", "yes_no", "custom")
    range: list[float] = field(default_factory=lambda: [0.0, 10.0])
    tag: str = "score"
    yes: str = "Yes"  # yes_no: each one token of the judge's tokenizer
    no: str = "No"
    # verdict=custom: fn(text, data_source, ground_truth, extra_info) -> a number or verl's dict with "score"
    verdict_fn: CustomRewardFnConfig = field(default_factory=lambda: CustomRewardFnConfig(name="parse_verdict"))
    on_parse_error: float = 0.0  # what a verdict that cannot be read scores (counted: reward/judge/parse_failures)
    # A judge prompt longer than the judge's context minus max_tokens: error (the job stops, one
    # line), or the response cut at its start (left) or end (right) until it fits (reward/judge/truncated).
    truncation: str = choice("error", "left", "right")
    port: int = bounded(0, lambda v: 0 <= v < 65536, "expected a port, or 0 for any free one")  # the endpoint's
    max_num_seqs: int = positive(256)  # verdicts the engine decodes at once
    # Also log the built-in scorer's score of each judged row, where its data_source has one
    # (critic/reward_extra/rule_score/mean): how far the judge is from the rule.
    log_rule_score: bool = False


@dataclass
class RewardConfig:
    custom_fn: CustomRewardFnConfig = field(default_factory=CustomRewardFnConfig)
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    reward_manager: RewardManagerConfig = field(default_factory=RewardManagerConfig)
    # Plain functions' threads (naive; 0 = 64) or processes (prime; 0 = the rank's CPU cores).
    num_workers: int = bounded(0, lambda v: v >= 0, "expected >= 0")
    max_concurrency: int = positive(64)  # async functions' calls and remote requests in flight at once
    timeout_s: float = positive(300.0)  # every call of a reward function (a batch function's: the batch's)
    # What a call that raises, overruns or returns garbage scores: fail (the job stops, the sample
    # shown) or a number (the sample scores it, counted in reward/errors/<kind>).
    on_error: str = bounded("fail", lambda v: v == "fail" or _is_number(v), "expected fail or a number")
    # A reward server: each sample POSTed as JSON (prompt, response, label, data_source, extra_info;
    # OpenRLHF's query/prompts/labels too), concurrently; "" = none.
    remote_url: str = ""
    remote_retries: int = bounded(3, lambda v: v >= 0, "expected >= 0")  # after the first try, with backoff
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    sandbox_fusion: SandboxFusionConfig = field(default_factory=SandboxFusionConfig)


@dataclass
class KLCtrlConfig:
    type: str = choice("fixed", "adaptive")
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass
class RolloutCorrectionConfig:
    """verl's algorithm.rollout_correction: the engine's `rollout_log_probs` against the actor's
    recomputed `old_log_probs` (docs/algorithms.md, "Rollout correction")."""
    # null: no weights (the rollout_corr/ mismatch metrics are still logged) | token | sequence
    rollout_is: Optional[str] = None  # spmdsplit/algo.py ROLLOUT_IS_LEVELS
    rollout_is_threshold: float = positive(2.0)  # weights are truncated at this (TIS)
    # true: the engine's log-probs stand in for old_log_probs (no recomputation; PPO's ratio is
    # then against the rollout policy itself, so no weights are applied under loss_type=ppo_clip)
    bypass_mode: bool = False
    # Kept so that a verl config that sets it loads: ppo_clip is the one loss here, and its check
    # (check_declared, when the config loads) refuses any other value.
    loss_type: str = choice("ppo_clip", why_not={"reinforce": "verl's bypass-mode REINFORCE loss is not implemented "
                                                 "here; use {key}=ppo_clip"})


@dataclass
class FilterGroupsConfig:
    """verl's algorithm.filter_groups: DAPO's dynamic sampling (spmdsplit/dynamic_sampling.py)."""
    enable: bool = False
    # What must differ between a prompt group's responses for the group to be kept: seq_reward or
    # seq_final_reward (the row's total reward), or a number the reward function returns in its dict
    # (DAPO's recipe: acc).
    metric: str = "seq_reward"
    max_num_gen_batches: int = 0  # a step that needs more generation batches stops the job; <= 0: no limit


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"  # a name in spmdsplit/algo.py's registry of advantage estimators
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = choice(*KL_ESTIMATORS)
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)


@dataclass
class Config:
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)


PATH_KEYS = ("trainer.log_dir", "trainer.timeline", "trainer.profile_dir", "trainer.output_dir", "trainer.default_local_dir",
             "trainer.rollout_data_dir", "trainer.validation_data_dir",
             "model.path", "model.embedded_dir", "model.lora_adapter_path", "critic.model_path",
             "critic.model.lora_adapter_path", "rollout.multi_turn.tool_config_path", "rollout.lora_adapter_dir",
             "reward.judge.path")


def _shape(value) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return repr(value)


def check_shapes(value, kind: Any = Config, key: str = "") -> None:
    """A mapping, list or scalar where the schema wants another shape, as one line naming the full
    key. OmegaConf's merge would say it with the key `?`, or not catch it at all (a mapping into a
    list is a TypeError). `value` is plain (OmegaConf.to_container, unresolved). Unknown keys and
    scalars of the wrong type are left to the merge, whose messages name them."""
    if value is None or (isinstance(value, str) and "${" in value):  # null or an interpolation: the merge decides
        return
    if kind is Any:
        return
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a section (a mapping of its keys), got {_shape(value)}")
        kinds = typing.get_type_hints(kind)
        for name, sub in value.items():
            if name in kinds:
                check_shapes(sub, kinds[name], f"{key}.{name}" if key else str(name))
        return
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is typing.Union:  # Optional[X]; None returned above
        check_shapes(value, next(a for a in args if a is not type(None)), key)
    elif origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {_shape(value)}")
        for name, item in value.items():
            check_shapes(item, args[1] if args else Any, f"{key}.{name}")
    elif origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {_shape(value)}")
        for i, item in enumerate(value):
            check_shapes(item, args[0] if args else Any, f"{key}[{i}]")
    elif isinstance(value, (dict, list)):
        expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(kind, "a value")
        raise ConfigError(f"{key}: expected {expected}, got {_shape(value)}")


# What a value of a schema key must look like, by the type of its default (for parse errors).
def _expected_form(schema: DictConfig, key: str) -> str:
    try:
        value = OmegaConf.select(schema, key, throw_on_missing=False)
    except OmegaConfBaseException:
        value = None
    if OmegaConf.is_list(value):
        return f"a YAML list, e.g. {key}=[6,2]"
    if OmegaConf.is_dict(value):
        return f"a YAML mapping with a space after each colon, e.g. {key}=\"{{lr: 1e-6}}\" (or set {key}.<sub-key>=...)"
    if isinstance(value, str):
        return f"a string; quote it if it holds YAML characters, e.g. {key}=\"'...'\""
    if value is not None:
        return f"a {type(value).__name__}"
    return "a YAML value"


def _parse_overrides(schema: DictConfig, overrides: list[str]) -> list[DictConfig]:
    """`key=value` overrides, one DictConfig each (an EmptyMapping for `key={}` on a mapping field),
    in order (merged by load_config after placement.pools, which may change shape, is taken out); a
    value YAML cannot parse names its key."""
    import yaml

    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"overrides must look like key=value, got {bad}")
    parsed = []
    for override in overrides:
        key, value = override.split("=", 1)
        # `key=` (what the shell leaves of `key=""`) means the empty string, not null.
        try:
            parsed.append(OmegaConf.from_dotlist([f"{key}={value if value else chr(39) * 2}"]))
        except yaml.YAMLError as e:
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(f"{key}={value!r}: cannot be parsed as YAML ({problem}); expected "
                              f"{_expected_form(schema, key)}") from None
        if _is_mapping_field(schema, key) and OmegaConf.select(parsed[-1], key) == {}:
            parsed[-1] = EmptyMapping(key)
            continue
        # Each on its own: merging two overrides of different shapes would fail first.
        check_shapes(OmegaConf.to_container(parsed[-1], resolve=False))
    return parsed


class EmptyMapping(str):
    """An override `key={}` of a mapping field (not a section of the schema): it empties the
    mapping, where OmegaConf's merge would keep what a preset put there."""


def _is_mapping_field(schema: DictConfig, key: str) -> bool:
    """Whether `key` is a field holding a plain mapping (environment_kwargs, ...), not a section."""
    try:
        node = OmegaConf.select(schema, key)
    except OmegaConfBaseException:  # a malformed key: the merge names it
        return False
    return OmegaConf.is_dict(node) and OmegaConf.get_type(node) is dict


def _merge(schema: DictConfig, sources: list) -> DictConfig:
    """The schema with `sources` merged over it in order, an EmptyMapping emptying its key there
    (runs of other sources merged at once: a merge copies the whole config)."""
    cfg, run = schema, []
    for source in [*sources, None]:
        if source is None or isinstance(source, EmptyMapping):
            cfg = OmegaConf.merge(cfg, *run)  # a copy even when run is empty: the schema is read-only
            run = []
            if source is not None:
                OmegaConf.update(cfg, source, {}, merge=False)
        else:
            run.append(source)
    return cfg


def _read_config_file(config_file: str) -> DictConfig:
    import yaml

    if not os.path.isfile(config_file):
        raise ConfigError(f"--config {config_file!r}: no such file")
    try:
        loaded = OmegaConf.load(config_file)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"--config {config_file!r}: not valid YAML{where} ({problem}); expected a YAML "
                          "mapping of the schema's sections, as in configs/default.yaml") from None
    if not OmegaConf.is_dict(loaded):
        raise ConfigError(f"--config {config_file!r}: expected a YAML mapping of the schema's sections "
                          f"(trainer:, data:, ...), got a {type(loaded).__name__}")
    check_shapes(OmegaConf.to_container(loaded, resolve=False))
    return loaded


def _take_pools(sources: list[DictConfig]):
    """placement.pools is a list or a mapping, and OmegaConf cannot merge one into the other: take it
    out of every source and fold it here, a later list or a change of shape replacing the value
    whole, a later mapping adding to an earlier one (placement.pools.gen=2 on a preset's pools).
    None when no source sets it."""
    out = None
    for source in sources:
        section = source.get("placement")
        if not OmegaConf.is_dict(section) or "pools" not in section:
            continue
        value = section.pools
        value = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
        del section["pools"]
        out = {**out, **value} if isinstance(out, dict) and isinstance(value, dict) else value
    return out


# The embedded toy's hyper-parameters, layered over the schema when model.path is empty (see
# load_config; a --config file and key=value overrides still win). The schema holds verl's
# values for a pretrained model; a random 2-layer model (spmdsplit/embedded.py) needs learning rates ~1000x larger.
# configs/default.yaml spells out the same values. Why these: docs/embedded.md, "Why the default is what it is".
EMBEDDED_PRESET = {
    # No balancing: the toy's rows are all but equally long (611-615 tokens per rank of the 2+2
    # job as generated), so it has nothing to even out and would only change which rows share a
    # mini-batch, i.e. the run's trajectory, which the seed tables of docs/embedded.md were measured
    # without (one 200-step run of the default with it ended at 0.33 instead of 0.99).
    "trainer": {"total_steps": 200, "balance_batch": False},
    # A cosine decay to a tenth of the peak: at a constant 2e-3 a policy that had solved the task
    # could fall back (0.96 -> 0.81 over the last 60 steps of one seed).
    "actor": {"optim": {"lr": 2.0e-3, "lr_warmup_steps": 5, "lr_scheduler_type": "cosine", "min_lr_ratio": 0.1},
              "ppo_mini_batch_size": 16, "entropy_coeff": 0.02,
              # The KL loss keeps the EOS (and every digit) within reach of sampling while the
              # policy sharpens: without it the EOS dies out early and never comes back.
              "use_kl_loss": True, "kl_loss_coef": 0.1},
    "critic": {"optim": {"lr": 2.0e-3, "lr_warmup_steps": 5, "lr_scheduler_type": "cosine", "min_lr_ratio": 0.1},
               "ppo_mini_batch_size": 16},
}



def load_config(config_file: str | None = None, overrides: list[str] | None = None) -> DictConfig:
    """Schema <- embedded preset (only when model.path is empty) <- YAML file <- `key=value`
    overrides; unknown keys, wrong types and values YAML cannot parse raise ConfigError."""
    schema = _schema()
    try:
        user = [_read_config_file(config_file)] if config_file else []
        if overrides:
            user += _parse_overrides(schema, overrides)
        pools = _take_pools([u for u in user if not isinstance(u, EmptyMapping)])
        cfg = _merge(schema, user)
        if not cfg.model.path:  # the embedded toy: its learning rates, not those for a real model
            cfg = _merge(schema, [EMBEDDED_PRESET, *user])
        if pools is not None:
            cfg.placement.pools = pools
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        reason = str(e).splitlines()[0]
        raise ConfigError(f"config key {key!r}: {reason}") from None
    for role in ("actor", "critic"):  # the cosine schedule ends with the job unless told otherwise
        if cfg[role].optim.total_training_steps <= 0:
            cfg[role].optim.total_training_steps = cfg.trainer.total_steps
    for key in PATH_KEYS:
        # The shell expands ~ only at the start of a word, never in `key=~/x`: do it here.
        OmegaConf.update(cfg, key, os.path.expanduser(OmegaConf.select(cfg, key)))
    check_declared(cfg)
    return cfg


HIGH_LR_FOR_A_REAL_MODEL = 1e-4


def config_warnings(cfg: DictConfig) -> list[str]:
    """Values that run but are likely wrong: one line each, for rank 0 to print before training."""
    out = []
    if cfg.model.path:
        for role in ("actor", "critic"):
            lr = cfg[role].optim.lr
            if lr >= HIGH_LR_FOR_A_REAL_MODEL:
                out.append(f"{role}.optim.lr={lr:g} with model.path={cfg.model.path!r}: a learning rate >= "
                           f"{HIGH_LR_FOR_A_REAL_MODEL:g} destroys a pretrained model in a few steps "
                           "(verl uses 1e-6 for the actor, 1e-5 for the critic)")
    r = cfg.rollout
    corr = cfg.algorithm.rollout_correction
    if r.staleness > 0 and corr.rollout_is is None and not corr.bypass_mode:
        out.append(f"rollout.staleness={r.staleness} with algorithm.rollout_correction.rollout_is=null and "
                   "bypass_mode=false: batches come from weights up to "
                   f"{r.staleness} update{'s' if r.staleness > 1 else ''} old and the loss ignores it; set "
                   "algorithm.rollout_correction.rollout_is=token (or sequence), or bypass_mode=true")
    if r.do_sample and (r.top_p < 1 or r.top_k > 0):
        out.append(f"rollout.top_p={r.top_p}, rollout.top_k={r.top_k}: the rollout samples from a truncated "
                   "distribution, but the actor's log-probs are of the full one, so PPO's ratio is off-policy")
    return out


@functools.cache
def _schema() -> DictConfig:
    """The schema with every default, built once (a quarter of a load's time): read-only, as
    OmegaConf.merge copies it into each config it makes."""
    return OmegaConf.structured(Config)


@functools.cache
def declared_checks(cls: type = Config, prefix: str = "") -> tuple[tuple[str, Callable], ...]:
    """(full key, check) for every field that declares one, in the schema's order."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            out += declared_checks(kind, f"{prefix}{f.name}.")
        elif "check" in f.metadata:
            out.append((prefix + f.name, f.metadata["check"]))
    return tuple(out)


def check_declared(cfg: DictConfig) -> None:
    """Each key's declared choices or range, when the config loads; what needs keys together, the
    runtime's registries or the world is spmdsplit/preflight.py's."""
    for key, check in declared_checks():
        problem = check(key, OmegaConf.select(cfg, key))
        if problem:
            raise ConfigError(problem)


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)
