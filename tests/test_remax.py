"""ReMax (algorithm.adv_estimator=remax): each prompt's greedy response is generated beside its
sampled ones, where they are generated, and scored by the critic group's reward as the rows'
`reward_baselines` (the estimator's math against verl's: tests/test_algo_registry.py)."""

import pytest
import torch

from spmdsplit.generation.shares import greedy_baselines
from spmdsplit.batch import Batch
from spmdsplit.config import RolloutConfig
from spmdsplit.scoring import score_baselines
from spmdsplit.data.prompts import collate_prompts
from spmdsplit.data.synthetic import make_dataset
from spmdsplit.embedded import ensure_embedded_model
from spmdsplit.models import load_causal_lm, load_tokenizer
from spmdsplit.roles.reward import RuleReward
from spmdsplit.inference.hf import HFEngine

N, WIDTH = 3, 6  # responses per prompt, data.max_response_length


@pytest.fixture(scope="module")
def engine_and_prompts():
    path = ensure_embedded_model()
    tokenizer = load_tokenizer(path)
    model = load_causal_lm(path, torch.float32, torch.device("cpu"), seed=0)
    prompts = collate_prompts(make_dataset("repeat", 4, seed=0), tokenizer, 8, step=1, first_row=0)
    return tokenizer, HFEngine(model, tokenizer, RolloutConfig(do_sample=True, temperature=1.5), WIDTH), prompts


def test_every_row_carries_its_prompts_greedy_response_whatever_the_sampling(engine_and_prompts):
    tokenizer, sampling_engine, prompts = engine_and_prompts
    rows = prompts.repeat_interleave(N)
    baselines = greedy_baselines(sampling_engine, rows, N, WIDTH)
    greedy = HFEngine(sampling_engine.model, tokenizer, RolloutConfig(do_sample=False), WIDTH).generate(prompts)
    R = greedy["responses"].shape[1]
    assert baselines["baseline_responses"].shape == (len(rows), WIDTH)  # one width, whatever the batch's
    for g in range(len(prompts)):
        for i in range(g * N, (g + 1) * N):
            assert torch.equal(baselines["baseline_responses"][i, :R], greedy["responses"][g])
            assert torch.equal(baselines["baseline_response_mask"][i, :R], greedy["response_mask"][g])
            assert not baselines["baseline_response_mask"][i, R:].any()


def test_the_baseline_is_the_reward_of_the_greedy_response_scored_once_per_group(engine_and_prompts):
    tokenizer, sampling_engine, prompts = engine_and_prompts
    rows = sampling_engine.generate(prompts.repeat_interleave(N))
    rows.update(greedy_baselines(sampling_engine, prompts.repeat_interleave(N), N, WIDTH))
    reward = RuleReward(tokenizer)
    baselines = score_baselines(reward, rows)
    # The same reward on a batch whose responses are the greedy ones, row by row.
    P = rows["input_ids"].shape[1] - rows["responses"].shape[1]
    greedy_rows = rows.select(["data_source", "ground_truth", "extra_info"])
    greedy_rows.update(Batch({"responses": rows["baseline_responses"],
                                   "response_mask": rows["baseline_response_mask"],
                                   "input_ids": torch.cat([rows["input_ids"][:, :P], rows["baseline_responses"]], 1),
                                   "attention_mask": torch.cat([rows["attention_mask"][:, :P],
                                                                rows["baseline_response_mask"]], 1)}))
    _, expected = reward.compute(greedy_rows)
    assert torch.equal(baselines, expected)
    assert all(len(set(group)) == 1 for group in baselines.view(-1, N).tolist())  # one per prompt group
