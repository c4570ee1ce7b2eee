"""Rollouts sampled at a temperature other than 1: the actor's and the reference's log-probs
must be those of the distribution the rollout sampled from, i.e. of logits / temperature.

The sampled distribution is read from transformers' own `generate` (its processed scores, after
the temperature warper), not recomputed by the code under test; the actor and the reference are
built by roles/build.py exactly as a job builds them. Deleting the division by the temperature in
roles/actor.py `_log_probs` (or building the reference without the rollout's temperature) fails.
"""

import torch

from tests.support.launch import run_ranks

TEMPERATURE = 0.6


def _log_probs_at_temperature(rank, world_size, model_dir):
    from spmdsplit.config import load_config
    from spmdsplit.data.prompts import collate_prompts
    from spmdsplit.data.synthetic import make_dataset
    from spmdsplit.models import load_tokenizer
    from spmdsplit.groups import build_pools
    from spmdsplit.placement import plan_placement
    from spmdsplit.roles.build import build_actor_roles, build_rollout_roles
    from transformers import LogitsProcessorList

    cfg = load_config(None, [f"model.path={model_dir}", "placement.mode=colocate", "data.max_response_length=6",
                             f"rollout.temperature={TEMPERATURE}", "trainer.device=cpu"])
    pools = build_pools(plan_placement("colocate", None, "ranks_per_node", 1, 1, 1), torch.device("cpu"))
    tokenizer = load_tokenizer(model_dir)
    roles = build_actor_roles(cfg, pools, tokenizer, [tokenizer.eos_token_id])
    engine = build_rollout_roles(cfg, pools, tokenizer, [tokenizer.eos_token_id]).engine
    prompts = collate_prompts(make_dataset("repeat", 24, seed=2), tokenizer, cfg.data.max_prompt_length,
                              step=1, first_row=0)

    torch.manual_seed(11)
    rollout = engine.generate(prompts)
    torch.manual_seed(11)  # the same draw again, now asking transformers for what it sampled from
    config, warpers = engine.sampling  # the warpers go in as processors, as the engine gives them
    out = engine.model.generate(
        input_ids=prompts["input_ids"], attention_mask=prompts["attention_mask"], generation_config=config,
        logits_processor=LogitsProcessorList(warpers), output_scores=True, return_dict_in_generate=True,
    )
    P, steps = prompts["input_ids"].shape[1], len(out.scores)
    mask = rollout["response_mask"][:, :steps].bool()
    assert torch.equal(out.sequences[:, P:][mask], rollout["responses"][:, :steps][mask])
    sampled = torch.log_softmax(torch.stack(out.scores, dim=1).float(), dim=-1)
    sampled = sampled.gather(-1, rollout["responses"][:, :steps, None]).squeeze(-1)
    actor = roles.actor.compute_log_prob(rollout)[:, :steps]
    ref = roles.ref.compute_log_prob(rollout)[:, :steps]
    # What a log-prob that ignored the temperature would give: the check below can tell them apart.
    with torch.no_grad():
        logits = engine.model(input_ids=rollout["input_ids"], attention_mask=rollout["attention_mask"],
                                     position_ids=rollout["position_ids"]).logits[:, P - 1: P - 1 + steps]
    untempered = torch.log_softmax(logits.float(), -1).gather(-1, rollout["responses"][:, :steps, None]).squeeze(-1)
    return sampled[mask], actor[mask], ref[mask], untempered[mask]


def test_actor_and_reference_log_probs_divide_by_the_rollout_temperature():
    from spmdsplit.embedded import ensure_embedded_model

    (sampled, actor, ref, untempered), = run_ranks(_log_probs_at_temperature, 1, ensure_embedded_model())
    assert sampled.numel() > 50
    assert (untempered - sampled).abs().max() > 0.1, "temperature made no difference: the test has no power"
    torch.testing.assert_close(actor, sampled, rtol=0, atol=1e-4)
    torch.testing.assert_close(ref, sampled, rtol=0, atol=1e-4)
