"""Continuous generation on a rollout pool (rollout.continuous; spmdsplit/generation/continuous.py and
generation.sources.ContinuousSource), as a user runs it: torchrun jobs of 2 ranks (rollout | actor)
under the NCCL-contract layer (tests/support/nccl_site), HF and vLLM.

What the jobs must show: weights land mid-answer (rows whose tokens span two versions), every
trained token within rollout.staleness, the tokens recorded as the current version's scored by
the engine exactly as the actor scores them (a token tagged with the wrong version would differ
by the policy's change in one update), and a checkpoint that keeps the answers in flight, which
the resumed run goes on from."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from spmdsplit.config import load_config
from spmdsplit.errors import ConfigError
from spmdsplit.preflight import check_against_placement, check_config
from spmdsplit.placement import plan_from_config
from tests.support.launch import job
from tests.support.outputs import scalars

GRPO = "configs/grpo_rollout_actor.yaml"
# One token per engine step on the HF engine, and answers of up to 24 tokens: generating a batch takes
# longer than training on one, so versions land while answers are half done.
CONTINUOUS = ("rollout.continuous=true", "rollout.hf_step_tokens=1", "data.max_response_length=24", "data.train_batch_size=16",
              "actor.ppo_mini_batch_size=8", "actor.optim.lr=3e-3")


def values(logged, key):
    return [v for _, v in logged[key]]


def check_continuous_run(logged, staleness: int = 1, mixed: bool = True):
    """`mixed`: some trained answer spans a load and some tokens are of the policy that trains them
    (at staleness 2 the stream runs far enough ahead that a short run may train on neither)."""
    steps = len(values(logged, "critic/score/mean"))
    assert max(values(logged, "rollout/token_staleness_max")) <= staleness
    assert not mixed or max(values(logged, "rollout/mixed_version_rows")) > 0  # weights landed mid-answer
    assert not mixed or sum(values(logged, "rollout/current_version_tokens")) > 0
    assert max(values(logged, "rollout/current_version_probs_diff_max")) < 1e-4, values(
        logged, "rollout/current_version_probs_diff_max")
    assert min(values(logged, "rollout/occupancy")[:-1]) > 0
    assert len(values(logged, "rollout/weights_version_min")) == steps


@pytest.mark.e2e
@pytest.mark.parametrize("pools,every", [("{gen: 1, train: 1}", 0), ("{gen: 2, train: 2}", 6)])
def test_hf_continuous_job_takes_weights_mid_answer_within_the_staleness(tmp_path, pools, every):
    """On 1 | 1 free-running, and on 2 | 2 (two actor ranks each sending a share of every version, two
    rollout ranks each taking it at its own engine step, each sending its share of a batch) on the
    fixed schedule. Free-running, weights land mid-answer only while generating a batch outlasts
    training on one, which on 2 | 2 is a matter of the machine: CI once trained faster than it
    generated there and no answer spanned a load. On the fixed schedule where versions land is a
    matter of engine steps, so the check holds on any machine."""
    ranks = 2 if "1" in pools else 4
    result = job(ranks, "--config", GRPO, *CONTINUOUS, f"placement.pools={pools}", "trainer.total_steps=5",
                 f"rollout.version_every_engine_steps={every}", f"trainer.log_dir={tmp_path}/tb", "trainer.timeline=",
                 "trainer.output_dir=", timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    check_continuous_run(scalars(str(tmp_path / "tb")))


@pytest.mark.e2e
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_vllm_continuous_job_takes_weights_mid_answer_and_resumes_with_the_answers_in_flight(tmp_path):
    """vLLM steps one token per request per engine step, so weights land mid-answer by themselves.
    Saved at step 2 of 4 and resumed: the run goes on from the tokens the checkpoint held."""
    ckpt = tmp_path / "ckpt"
    common = ("--config", GRPO, "rollout.name=vllm", *CONTINUOUS, "trainer.total_steps=4", "trainer.timeline=",
              "trainer.output_dir=", f"trainer.default_local_dir={ckpt}")
    first = job(2, *common, "trainer.save_freq=2", f"trainer.log_dir={tmp_path}/tb1", timeout=600, fresh_dir=False)
    assert first.returncode == 0, first.stderr[-5000:]
    check_continuous_run(scalars(str(tmp_path / "tb1")))
    resumed = job(2, *common, f"trainer.resume={ckpt}/global_step_2", f"trainer.log_dir={tmp_path}/tb2",
                  timeout=600, fresh_dir=False)
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    logged = scalars(str(tmp_path / "tb2"))
    assert [s for s, _ in logged["rollout/tokens_resumed"]] == [3, 4]
    assert values(logged, "rollout/tokens_resumed")[0] > 0  # the answers in flight went on, not drawn again


@pytest.mark.e2e
def test_three_pools_continuous_with_a_critic_pool_validation_and_a_checkpoint(tmp_path):
    """configs/rollout_actor_critic.yaml's layout (rollout | actor | critic, GAE): the critic pool
    takes each batch as in batch mode while the rollout pool streams at staleness 2."""
    result = job(3, "placement.mode=custom", "placement.pools={gen: 1, policy: 1, value: 1}",
                 "placement.roles={rollout: gen, actor: policy, critic: value}", "rollout.staleness=2", *CONTINUOUS,
                 "critic.ppo_mini_batch_size=8", "trainer.total_steps=4", "trainer.val_freq=2", "trainer.save_freq=2",
                 f"trainer.log_dir={tmp_path}/tb", f"trainer.default_local_dir={tmp_path}/ckpt", "trainer.timeline=",
                 "trainer.output_dir=", timeout=600, fresh_dir=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "rollout pool ranks [1] | actor pool ranks [0] | critic pool ranks [2]" in result.stdout
    logged = scalars(str(tmp_path / "tb"))
    check_continuous_run(logged, staleness=2, mixed=False)
    assert [s for s, _ in logged["critic/vf_loss"]] == [1, 2, 3, 4]
    assert [s for s, _ in logged["val-core/synthetic/repeat/reward/mean@1"]] == [2, 4]
    assert "continuous" in torch.load(tmp_path / "ckpt" / "global_step_2" / "rollout" / "rank_1.pt", weights_only=False)


def check_agent_run(logged, validations: int):
    """Episodes called the tool and went on, the engine stepped while calls were out, the trained
    tokens within staleness 1 and scored as the actor scores them, validation ran."""
    assert min(values(logged, "tool/calls")) > 0 and max(values(logged, "num_turns/max")) >= 3
    assert sum(values(logged, "rollout/engine_steps_during_tools")) > 0
    assert max(values(logged, "rollout/token_staleness_max")) <= 1
    assert max(values(logged, "rollout/current_version_probs_diff_max")) < 1e-4
    assert len(values(logged, "val-core/synthetic/lookup/reward/mean@1")) >= validations


@pytest.mark.e2e
def test_agent_episodes_flow_one_by_one_in_a_continuous_job_and_resume_with_their_turns(tmp_path):
    """The embedded lookup agent (configs/agent_lookup.yaml) on 1 | 1 under the NCCL-contract
    layer: tool calls answered while other episodes generate, validation's episodes beside the
    requests held, every trained token within the staleness; saved at step 2 of 4 and resumed
    from the episodes in flight (turns, tool tokens and all)."""
    from tests.support.jobs import AGENT, POOL

    ckpt = tmp_path / "ckpt"
    common = (*AGENT, *POOL, "rollout.continuous=true", "rollout.hf_step_tokens=1", "trainer.total_steps=4",
              f"trainer.default_local_dir={ckpt}")
    first = job(2, *common, "trainer.save_freq=2", f"trainer.log_dir={tmp_path}/tb1", timeout=600, fresh_dir=False)
    assert first.returncode == 0, first.stderr[-5000:]
    check_agent_run(scalars(str(tmp_path / "tb1")), validations=2)  # validation's episodes at steps 2 and 4
    resumed = job(2, *common, f"trainer.resume={ckpt}/global_step_2", f"trainer.log_dir={tmp_path}/tb2",
                  timeout=600, fresh_dir=False)
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert values(scalars(str(tmp_path / "tb2")), "rollout/tokens_resumed")[0] > 0


@pytest.mark.e2e
def test_agents_on_the_fixed_schedule_give_the_same_rows_whatever_the_tools_latency(tmp_path):
    """On the fixed schedule a call's answer lands at the next engine step, waited for: two runs of
    one seed log the same numbers although the calls return at other times."""
    from tests.support.jobs import AGENT, POOL

    def run(name):
        result = job(2, *AGENT, *POOL, "rollout.continuous=true", "rollout.hf_step_tokens=1",
                     "rollout.version_every_engine_steps=4", "trainer.total_steps=3", f"trainer.log_dir={tmp_path}/{name}",
                     timeout=600, fresh_dir=False)
        assert result.returncode == 0, result.stderr[-5000:]
        return {k: v for k, v in scalars(str(tmp_path / name)).items() if not k.startswith(("timing", "perf/", "memory"))}

    first, second = run("a"), run("b")
    assert min(values(first, "tool/calls")) > 0
    assert not [k for k in first if first[k] != second.get(k)], [k for k in first if first[k] != second.get(k)]


@pytest.mark.e2e
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_vllm_agent_episodes_flow_one_by_one_in_a_continuous_job(tmp_path):
    """The same agent job on vLLM: each turn a request with the format's stop token, the next turn
    submitted when its call returns, validation's episodes beside the requests held."""
    from tests.support.jobs import AGENT, POOL

    result = job(2, *AGENT, *POOL, "rollout.name=vllm", "rollout.continuous=true", "trainer.total_steps=3",
                 f"trainer.log_dir={tmp_path}/tb", timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    check_agent_run(scalars(str(tmp_path / "tb")), validations=1)


@pytest.mark.parametrize("config, overrides, message", [
    (None, ("placement.mode=colocate", "rollout.staleness=1"), "needs a rollout pool of its own"),
    (GRPO, ("rollout.staleness=0",), "needs rollout.staleness >= 1"),
    (GRPO, ("algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc"), "dynamic sampling"),
    (GRPO, ("algorithm.adv_estimator=remax", "rollout.n=1"), "greedy baselines"),
    (GRPO, ("rollout.continuous=false", "rollout.partial_rollout=true"), "set rollout.continuous=true too"),
    (GRPO, ("rollout.name=vllm", "rollout.kv_after_load=keep"), "rollout.enable_prefix_caching=false"),
])
def test_continuous_refuses_what_it_does_not_run_with_in_one_line(config, overrides, message):
    cfg = load_config(config, ["rollout.continuous=true", *overrides])
    with pytest.raises(ConfigError, match=message):
        check_config(cfg)
        check_against_placement(cfg, plan_from_config(cfg, world_size=2, local_world_size=2, nnodes=1))


@pytest.mark.e2e
def test_the_fixed_schedule_gives_the_same_rows_for_the_same_seed_and_an_exact_resume(tmp_path):
    """rollout.version_every_engine_steps: each version taken at a fixed engine step (waiting if
    late), so two runs of one seed train on the same rows and log the same numbers, whatever the
    two pools' timing (the free-running schedule takes each version whenever it comes: its runs
    differ), and a run resumed from a checkpoint (the answers in flight submitted again in the
    engine's order) logs what the uninterrupted one did (HF; vLLM restarts a resubmitted request's
    seeded generator)."""
    common = ("--config", GRPO, *CONTINUOUS, "rollout.version_every_engine_steps=6", "trainer.total_steps=4",
              "trainer.timeline=", "trainer.output_dir=", f"trainer.default_local_dir={tmp_path}/ckpt")

    def run(name, *overrides):
        result = job(2, *common, *overrides, f"trainer.log_dir={tmp_path}/{name}", timeout=600, fresh_dir=False)
        assert result.returncode == 0, result.stderr[-5000:]
        logged = scalars(str(tmp_path / name))
        return {k: v for k, v in logged.items() if not k.startswith(("timing", "perf/", "memory"))}

    saved, again = run("a", "trainer.save_freq=2"), run("b", "trainer.save_freq=-1", "trainer.resume=disable")
    assert saved.keys() == again.keys()
    assert not [k for k in saved if saved[k] != again[k]]
    assert max(values(saved, "rollout/mixed_version_rows")) > 0  # versions still land mid-answer
    resumed = run("c", f"trainer.resume={tmp_path}/ckpt/global_step_2")
    later = {k: [(s, v) for s, v in saved[k] if s > 2] for k in resumed if k != "rollout/tokens_resumed"}
    assert not [k for k in later if later[k] != resumed[k]], [k for k in later if later[k] != resumed[k]]
    assert values(resumed, "rollout/tokens_resumed")[0] > 0


@pytest.mark.e2e
def test_a_continuous_job_stopped_on_request_leaves_nothing_pending_and_resumes_exactly(tmp_path):
    """SIGUSR2 to the rollout rank alone (the others learn it by the vote): the job checkpoints after
    the step and stops, and started again it logs what a run that never stopped logs (the fixed
    schedule, HF): the answers in flight at the stop go on where they were."""
    from tests.support.launch import stop_on_request

    common = ("--config", GRPO, *CONTINUOUS, "rollout.version_every_engine_steps=6", "trainer.total_steps=8",
              "trainer.timeline=", "trainer.output_dir=", "trainer.progress_bar=false")
    straight = job(2, *common, f"trainer.default_local_dir={tmp_path}/a", f"trainer.log_dir={tmp_path}/a_tb",
                   timeout=600, fresh_dir=False)
    assert straight.returncode == 0, straight.stderr[-3000:]
    argv = (*common, f"trainer.default_local_dir={tmp_path}/b", f"trainer.log_dir={tmp_path}/b_tb")
    stopped_after = stop_on_request(2, argv, str(tmp_path / "b"), after="step 2:", rank=1)
    assert 2 <= stopped_after < 8  # the vote stops the job within two steps of the signal
    resumed = job(2, *argv, timeout=600, fresh_dir=False)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = scalars(str(tmp_path / "a_tb")), scalars(str(tmp_path / "b_tb"))
    skip = ("timing", "perf/", "memory", "rollout/tokens_resumed")
    differ = [k for k in a if not k.startswith(skip) and [p for p in a[k] if p[0] > stopped_after]
              != [p for p in b[k] if p[0] > stopped_after]]
    assert not differ, differ
