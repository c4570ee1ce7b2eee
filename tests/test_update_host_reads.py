"""Issue 36: the actor's and the critic's passes read nothing back from the device per micro-batch.
Each read of a device value (`.item()`, `float(t)`, `bool(t)`, ...) makes the host wait for all the
work queued on the GPU, so a read per micro-batch stalls the pipeline as often as there are
micro-batches. The metrics are summed on the device and read once a step, and what a
micro-batch's forward needs of its shape comes from its plan, read once for the whole batch."""

from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from tests.support.launch import run_ranks
from tests.support.helpers import ROWS, make_batch

# Plans of few and of many micro-batches, by (rows per micro-batch, token budget or None): one
# micro-batch of the 8 rows or 8 of one row; a budget of 30 tokens (2 micro-batches) or of 8, the
# longest row's (8, one row each).
PLANS = {"rows": [(ROWS, None), (1, None)], "tokens": [(None, 30), (None, 8)]}


def _reads_per_pass(rank, world_size, model_dir, role, packed):
    """{(kind, rows, budget): (host reads during the update, during the rollout pass)} on one rank,
    for each plan of PLANS: the actor's update and log-probs, or the critic's update and values;
    each a Counter of (read, the project's line that made it)."""
    from spmdsplit.config import ActorConfig, CriticConfig, OptimConfig
    from spmdsplit.engines.fsdp import FSDPEngine
    from spmdsplit.models import load_causal_lm
    from spmdsplit.roles.actor import Actor
    from spmdsplit.roles.critic import Critic
    from tests.support.helpers import load_value_model
    from tests.support.host_reads import counting_host_reads

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    device = torch.device("cpu")
    reads = {}
    for kind, plans in PLANS.items():
        for rows, budget in plans:
            sizes = dict(ppo_mini_batch_size=ROWS, ppo_micro_batch_size_per_gpu=rows or 1, shuffle=False,
                         use_dynamic_bsz=budget is not None, ppo_max_token_len_per_gpu=budget or 1,
                         optim=OptimConfig(lr=1e-2, lr_warmup_steps=0, grad_clip=1e9))
            if role == "actor":
                cfg = ActorConfig(entropy_coeff=0.01, log_prob_micro_batch_size_per_gpu=rows or 1,
                                  log_prob_max_token_len_per_gpu=budget or 1, **sizes)
                model = load_causal_lm(model_dir, torch.float32, device, seed=3)
            else:
                cfg = CriticConfig(forward_micro_batch_size_per_gpu=rows or 1, forward_max_token_len_per_gpu=budget or 1,
                                   **sizes)
                model = load_value_model(model_dir, torch.float32, device, seed=3)
            # transformers' sdpa mask reads one bool per padded forward (masking_utils.fast_all, its
            # check for a mask it may skip); eager attention reads none, so what is counted is ours.
            model.set_attn_implementation("eager")
            engine = FSDPEngine(model, mesh, cfg.optim)
            if role == "actor":
                worker = Actor(engine, cfg, temperature=1.0, device=device, remove_padding=packed)
                update, rollout_pass = worker.update_policy, worker.compute_log_prob
            else:
                worker = Critic(engine, cfg, device, remove_padding=packed)
                update, rollout_pass = worker.update_critic, worker.compute_values
            batch = make_batch(model.config.vocab_size)
            with counting_host_reads(where=True) as in_update:
                update(batch, seed=1)
            with counting_host_reads(where=True) as in_pass:
                rollout_pass(batch)
            reads[(kind, rows, budget)] = (Counter(in_update), Counter(in_pass))
    return reads


def test_the_plans_are_of_few_and_of_many_micro_batches():
    from spmdsplit.roles.micro_batches import token_budget_bins

    tokens = make_batch(32)["attention_mask"].sum(-1).tolist()
    assert [len(token_budget_bins(tokens, budget)) for _, budget in PLANS["tokens"]] == [2, ROWS]


def _check_constant(reads):
    """For each kind of plan, the same reads with few micro-batches as with many (on failure: the
    lines whose reads grew)."""
    for kind in PLANS:
        (few_update, few_pass), (many_update, many_pass) = [n for (k, *_), n in reads.items() if k == kind]
        assert many_update.total() == few_update.total(), (kind, "update", dict(many_update - few_update))
        assert many_pass.total() == few_pass.total(), (kind, "pass", dict(many_pass - few_pass))


def test_the_actor_reads_the_device_a_fixed_number_of_times_whatever_the_micro_batches(embedded_model_dir):
    for packed in (False, True):
        (reads,) = run_ranks(_reads_per_pass, 1, embedded_model_dir, "actor", packed)
        _check_constant(reads)


def test_the_critic_reads_the_device_a_fixed_number_of_times_whatever_the_micro_batches(embedded_model_dir):
    for packed in (False, True):
        (reads,) = run_ranks(_reads_per_pass, 1, embedded_model_dir, "critic", packed)
        _check_constant(reads)
