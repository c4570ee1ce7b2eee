"""The LLM judge (reward.judge.*, spmdsplit/rewards/judge.py): its verdict parsers, its scores against
the rule's on the embedded task (the competent judge of tests/support/judge_model.py), the same scores
through its OpenAI-compatible endpoint from an async reward function with the real `openai` client,
its bad inputs, and a job whose only reward it is, on a reward pool of its own."""

from __future__ import annotations

import json
import math

import pytest
import torch
from omegaconf import OmegaConf

from spmdsplit.config import JudgeConfig, load_config
from spmdsplit.data.synthetic import make_dataset
from spmdsplit.errors import ConfigError
from spmdsplit.models import eos_token_ids, load_causal_lm, load_tokenizer
from spmdsplit.placement import plan_from_config
from spmdsplit.preflight import check_judge, check_judge_placement
from spmdsplit.rewards import verdicts
from spmdsplit.rewards.calls import RewardCalls, Sample
from spmdsplit.rewards.judge import Judge, JudgeContextError, JudgeSampling
from spmdsplit.rewards.rule import positional_match_score
from spmdsplit.inference.hf import HFEngine
from tests.support.judge_model import JUDGE_PROMPT, ensure_judge_model, verdict_for
from tests.support.engines import needs_vllm
from tests.support.launch import job
from tests.support.jobs import ROOT
from tests.support.outputs import first_and_best_scores, scalars, timeline_events

REPEAT = "synthetic/repeat"


# ---------------------------------------------------------------- the parsers (pure)

@pytest.mark.parametrize("text, low, high, expected", [
    ("The answer is right. 7", 0, 10, 0.7),
    ("scores: 3 then 8.5", 0, 10, 0.85),
    ("Grade: 10", 1, 10, 1.0),
    ("1e1", 0, 10, 1.0),
    ("-2", -5, 5, 0.3),
])
def test_last_number_reads_the_last_number_in_its_range(text, low, high, expected):
    assert verdicts.last_number(text, low, high) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["no grade at all", "Grade: 11", "", "-1"])
def test_last_number_refuses_a_text_without_a_number_in_range(text):
    with pytest.raises(verdicts.NoVerdict):
        verdicts.last_number(text, 0, 10)


def test_tagged_number_reads_the_last_tag_and_refuses_what_is_not_a_number():
    assert verdicts.tagged_number("<score>2</score> on second thought <score> 9 </score> 4", "score", 0, 10) == 0.9
    for text in ("<score>high</score>", "score: 9", "<grade>9</grade>", "<score>12</score>"):
        with pytest.raises(verdicts.NoVerdict):
            verdicts.tagged_number(text, "score", 0, 10)


def test_yes_probability_is_the_two_tokens_softmax():
    assert verdicts.yes_probability(math.log(0.3), math.log(0.1)) == pytest.approx(0.75)
    assert verdicts.yes_probability(-1e4, 0.0) == pytest.approx(0.0)
    with pytest.raises(verdicts.NoVerdict):
        verdicts.yes_probability(-math.inf, -math.inf)


# ---------------------------------------------------------------- the judge in a process

def judge_config(**overrides):
    cfg = OmegaConf.structured(JudgeConfig)
    cfg.path, cfg.prompt, cfg.max_tokens, cfg.range = ensure_judge_model(), JUDGE_PROMPT, 2, [0.0, 9.0]
    for key, value in overrides.items():
        cfg[key] = value
    return cfg


def start_judge(cfg, serve=False) -> Judge:
    tokenizer = load_tokenizer(cfg.path)
    model = load_causal_lm(cfg.path, torch.float32, torch.device("cpu"), 0)
    engine = HFEngine(model, tokenizer, JudgeSampling(cfg), cfg.max_tokens, eos_token_ids(cfg.path, tokenizer))
    return Judge(cfg, engine, tokenizer).start(serve=serve)


def held_out_samples(n: int, seed: int = 777) -> list[Sample]:
    """Responses of every quality to the embedded task's prompts: exact, near, half, wrong, short, long."""
    import random

    rng = random.Random(seed)
    out = []
    for row in make_dataset("repeat", n, seed):
        truth = row["reward_model"]["ground_truth"]
        p = rng.choice([0.0, 0.25, 0.5, 0.75, 1.0, 1.0])
        length = rng.choice([4, 4, 4, 3, 5, 6])
        response = "".join(truth[0] if rng.random() < p else rng.choice("0123456789") for _ in range(length))
        out.append(Sample(REPEAT, response, truth, {"index": len(out)}, row["prompt"]))
    return out


@pytest.fixture(scope="module")
def judge():
    j = start_judge(judge_config(), serve=True)
    yield j
    j.close()


def test_the_judges_scores_agree_with_the_rule_on_held_out_responses(judge):
    samples = held_out_samples(200)
    scored, texts = judge.score(samples)
    right = sum(round(s.score * 9) == verdict_for(positional_match_score(x.solution_str, x.ground_truth))
                for s, x in zip(scored, samples))
    assert right / len(samples) >= 0.9, (right, list(zip(texts, samples))[:5])
    metrics = judge.pop_metrics()
    assert metrics["verdict_tokens"] == (2 * len(samples), len(samples))  # a digit and the EOS
    assert metrics["latency_s"][1] == 1 and metrics["tokens_per_s"][0] > 0


ASYNC_JUDGE_FN = '''
import re
from openai import AsyncOpenAI

async def compute_score(data_source, solution_str, ground_truth, extra_info, reward_router_address, prompt_str):
    client = AsyncOpenAI(base_url=f"http://{reward_router_address}/v1", api_key="unused")
    reply = await client.chat.completions.create(
        model="judge", messages=[{"role": "user", "content": prompt_str + solution_str + "="}], max_tokens=2,
        temperature=0)
    return int(re.findall(r"\\d+", reply.choices[0].message.content)[-1]) / 9
'''


def test_an_async_function_calling_the_endpoint_with_openai_scores_as_the_built_in_parser(judge, tmp_path):
    """verl's genrm shape: an async custom function that posts to reward_router_address with the
    `openai` client, 64 calls at once (batched into the judge's engine steps with each other)."""
    path = tmp_path / "judge_fn.py"
    path.write_text(ASYNC_JUDGE_FN)
    cfg = load_config(None, [f"reward.custom_fn.path={path}"]).reward
    from spmdsplit.rewards.custom import load_custom_reward_fn

    calls = RewardCalls(cfg, load_custom_reward_fn(str(path)), judge=judge)
    samples = held_out_samples(64, seed=5)
    through_endpoint = [s.score for s in calls.score(samples)]
    built_in = [s.score for s in judge.score(samples)[0]]
    assert through_endpoint == pytest.approx(built_in)
    assert len(set(built_in)) > 3  # the scores say something


def test_yes_no_reads_one_forward_pass_and_truncation_cuts_the_response(judge):
    samples = held_out_samples(4)
    yes_no = Judge(judge_config(verdict="yes_no", yes="9", no="0"), judge.engine, judge.tokenizer)
    yes_no.driver = judge.driver  # the same engine: pausing its driver is what the forward needs
    scored, texts = yes_no.score(samples)
    assert all(0 <= s.score <= 1 for s in scored) and all(t for t in texts)

    long = Sample(REPEAT, "5" * 200, "5555", {}, "15=")  # over the judge's 64 positions
    with pytest.raises(JudgeContextError, match="reward.judge.truncation"):
        judge.score([long])
    for side in ("left", "right"):
        cut = Judge(judge_config(truncation=side), judge.engine, judge.tokenizer)
        cut.driver = judge.driver
        [score], [text] = cut.score([long])
        assert text and cut.pop_metrics()["truncated"][0] == 1
        cut.score([long], measure=False)  # validation's: cut as well, not counted
        assert cut.pop_metrics()["truncated"][0] == 0


def test_a_verdict_function_that_raises_hangs_or_returns_garbage_is_contained_and_counted(judge):
    import time as clock

    def verdict_fn(text, data_source, ground_truth, extra_info):
        kind = extra_info["index"] % 4
        if kind == 1:
            raise RuntimeError("broken parser")
        if kind == 2:
            clock.sleep(5)
        return "garbage" if kind == 3 else int(text) / 9

    custom = Judge(judge_config(verdict="custom"), judge.engine, judge.tokenizer, verdict_fn, timeout_s=0.5)
    custom.driver = judge.driver
    samples = held_out_samples(8)
    scored, texts = custom.score(samples)
    good = [i for i in range(8) if i % 4 == 0]
    assert [scored[i].score for i in good] == [int(texts[i]) / 9 for i in good]
    assert all(scored[i].score == 0.0 for i in range(8) if i % 4)  # on_parse_error
    assert custom.pop_metrics()["parse_failures"][0] == 6


def test_an_unreadable_verdict_scores_on_parse_error_and_is_counted(judge):
    off = Judge(judge_config(range=[10.0, 20.0], on_parse_error=-1.0), judge.engine, judge.tokenizer)
    off.driver = judge.driver
    scored, _ = off.score(held_out_samples(6))
    assert [s.score for s in scored] == [-1.0] * 6
    assert off.pop_metrics()["parse_failures"][0] == 6


# ---------------------------------------------------------------- bad config, before the first collective

@pytest.mark.parametrize("overrides, message", [
    (["reward.judge.path=/nowhere"], "reward.judge.path"),
    (["reward.judge.prompt=[{role: user, content: '{question}'}]"], "unknown placeholder {question}"),
    (["reward.judge.range=[5,5]"], "reward.judge.range"),
    (["reward.judge.verdict=yes_no", "reward.judge.yes=yes"], "read yes, no, on and off as booleans"),
    (["reward.judge.verdict=yes_no", "reward.judge.yes='12'"], "reward.judge.yes='12' is 2 tokens"),
    (["reward.judge.verdict=custom"], "reward.judge.verdict_fn.path"),
    (["algorithm.filter_groups.enable=true"], "dynamic sampling"),
    (["reward.remote_url=http://127.0.0.1:1/score"], "reward.judge.data_sources"),
    (["reward.judge.engine=vllm", "reward.judge.verdict=yes_no", "reward.judge.yes='9'", "reward.judge.no='0'"],
     "forward pass, which the HF engine gives"),
    (["reward.judge.engine=vllm", "rollout.name=vllm", "rollout.ranks=all"], "would hold two vLLM engines"),
    (["reward.judge.tensor_model_parallel_size=2"], "the HF engine runs a whole model per rank"),
    (["reward.judge.engine=vllm", "reward.judge.tensor_model_parallel_size=4"], "straddles"),
])
def test_bad_judge_settings_fail_naming_the_key(overrides, message):
    cfg = load_config(None, [f"reward.judge.path={ensure_judge_model()}", *overrides])
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("{", r"\{").replace("}", r"\}")):
        check_judge(cfg, None)
        check_judge_placement(cfg, plan_from_config(cfg, 4, 4, 1))  # split 2+2: the judge on ranks 2-3


def test_a_custom_function_that_cannot_reach_the_judge_is_refused(tmp_path):
    from spmdsplit.rewards.custom import load_custom_reward_fn

    path = tmp_path / "fn.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info):\n    return 0.0\n")
    cfg = load_config(None, [f"reward.judge.path={ensure_judge_model()}", f"reward.custom_fn.path={path}"])
    with pytest.raises(ConfigError, match="reward_router_address"):
        check_judge(cfg, load_custom_reward_fn(str(path)))


# ---------------------------------------------------------------- a job

JUDGE_ONLY = [f"reward.judge.prompt=[{{role: user, content: '{JUDGE_PROMPT[0]['content']}'}}]",
              "reward.judge.max_tokens=2", "reward.judge.range=[0,9]", "reward.judge.log_rule_score=true"]


ON_ITS_OWN_POOL = ["placement.mode=custom", "placement.pools={train: 1, rm: 1}", "placement.roles={actor: train, reward: rm}",
                   "algorithm.adv_estimator=grpo", "rollout.n=4", "trainer.total_steps=3", "data.train_batch_size=16",
                   "actor.ppo_mini_batch_size=16", "trainer.output_dir="]


def judge_job(out, engine: str):
    """GRPO on 2 ranks, 3 steps, the judge (on `engine`) its only reward on the reward group's own pool."""
    result = job(2, *ON_ITS_OWN_POOL, f"reward.judge.path={ensure_judge_model()}", f"reward.judge.engine={engine}",
                 *JUDGE_ONLY, f"trainer.log_dir={out}/tb", f"trainer.rollout_data_dir={out}/dump",
                 f"trainer.timeline={out}/timeline.json", timeout=400)
    assert result.returncode == 0, result.stderr[-5000:]
    return out


@pytest.fixture(scope="module")
def hf_judge_job(tmp_path_factory):
    return judge_job(tmp_path_factory.mktemp("hf_judge"), "hf")


@pytest.mark.e2e
def test_a_job_whose_only_reward_is_the_judge_on_a_pool_of_its_own(hf_judge_job):
    """Every row's verdict in the dumps, reward/judge/* in TensorBoard, its time in the timeline, the
    rule's score beside the judge's."""
    out = hf_judge_job
    lines = [json.loads(line) for line in (out / "dump" / "3.jsonl").read_text().splitlines()]
    assert len(lines) == 64 and all(line["judge_verdict"].isdigit() for line in lines)
    assert all(line["score"] == pytest.approx(int(line["judge_verdict"]) / 9) for line in lines)
    logged = scalars(str(out / "tb"))
    for key in ("reward/judge/parse_failures", "reward/judge/verdict_tokens", "reward/judge/latency_s",
                "reward/judge/tokens_per_s", "reward/judge/engine_tokens", "timing_s/reward/judge",
                "critic/reward_extra/rule_score/mean"):
        assert len(logged[key]) == 3, key
    inside = [e for e in timeline_events(str(out / "timeline.json")) if e.get("name") == "reward/judge"]
    assert len(inside) == 3 and all(e["pid"] == 1 for e in inside)  # one span a step, on the reward pool's rank
    judged = [v for _, v in logged["critic/score/mean"]]
    rule = [v for _, v in logged["critic/reward_extra/rule_score/mean"]]
    assert all(abs(a - b) < 0.1 for a, b in zip(judged, rule)), (judged, rule)


@pytest.mark.e2e
@needs_vllm
def test_a_tensor_parallel_vllm_judge_beside_the_critic(tmp_path):
    """configs/judge.yaml on 4 ranks (split 2+2), the judge a vLLM-CPU engine of tensor parallel 2
    on the critic's pool: its two ranks score different rows and still step one engine together
    (serving/driver.py LockstepDriver; without it vLLM's collectives desynchronise), every row's
    verdict in the dumps and as right as the HF judge's; it sleeps around each critic update (on
    CPU the sleep itself is vLLM's no-op, the pause and its timing are not)."""
    result = job(4, "--config", "configs/judge.yaml", f"reward.judge.path={ensure_judge_model()}",
                 "reward.judge.engine=vllm", "reward.judge.tensor_model_parallel_size=2", "trainer.total_steps=3",
                 f"trainer.log_dir={tmp_path}/tb", f"trainer.rollout_data_dir={tmp_path}/dump", "trainer.timeline=",
                 "trainer.output_dir=", timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-5000:]
    lines = [json.loads(line) for step in (1, 2, 3) for line in (tmp_path / "dump" / f"{step}.jsonl").read_text().splitlines()]
    assert lines and all(line["score"] == pytest.approx(int(line["judge_verdict"]) / 9) for line in lines)
    logged = scalars(str(tmp_path / "tb"))
    judged = [v for _, v in logged["critic/score/mean"]]
    rule = [v for _, v in logged["critic/reward_extra/rule_score/mean"]]
    assert len(judged) == 3 and all(abs(a - b) < 0.1 for a, b in zip(judged, rule)), (judged, rule)
    assert len(logged["timing_s/reward/judge/sleep"]) == len(logged["timing_s/reward/judge/wake"]) == 3


@pytest.mark.e2e
def test_the_judge_preset_learns_the_embedded_task_by_its_verdicts_alone(tmp_path):
    """configs/judge.yaml as a user starts it (split on 2 ranks, the judge with the critic group):
    the policy learns from the judge's verdicts only, and the rule's score, logged beside them,
    rises as the issue asks (first 5 steps <= 0.15, best 5 in a row >= 0.8). The run ends once the
    judge's score of 5 steps in a row reaches 0.85. Its step-1 dump holds each row's verdict."""
    result = job(2, "--config", "configs/judge.yaml", f"reward.judge.path={ensure_judge_model()}",
                 "trainer.stop_at_score=0.85", f"trainer.log_dir={tmp_path}/tb", f"trainer.rollout_data_dir={tmp_path}/dump",
                 "trainer.timeline=", "trainer.output_dir=", timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-5000:]
    first, best = first_and_best_scores(str(tmp_path / "tb"), key="critic/reward_extra/rule_score/mean")
    assert first <= 0.15 and best >= 0.8, (first, best)
    lines = [json.loads(line) for line in (tmp_path / "dump" / "1.jsonl").read_text().splitlines()]
    assert all(line["score"] == pytest.approx(int(line["judge_verdict"]) / 9) for line in lines)
    assert max(v for _, v in scalars(str(tmp_path / "tb"))["reward/judge/parse_failures"]) == 0
