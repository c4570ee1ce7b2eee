"""Bad input ends every rank with a clear message and a non-zero exit, before any collective:
never a hang, never one rank failing while the others wait."""

import re
import subprocess
import time

import pytest

from tests.support.judge_model import ensure_judge_model
from tests.support.launch import ranks_apart, torchrun

CASES = [
    (3, ["placement.mode=split"], "placement"),
    (2, ["placement.mode=custom", "placement.pools=[2,1]"], "placement.pools"),
    (2, ["placement.mode=colocate", "data.train_batch_size=15", "actor.ppo_mini_batch_size=5",
         "critic.ppo_mini_batch_size=5"], "data.train_batch_size=15 is not divisible"),
    (2, ["trainer.totl_steps=3"], "trainer.totl_steps"),
    (2, ["trainer.total_steps=many"], "trainer.total_steps"),
    (2, ["model.path=/no/such/model"], "model.path"),
    (2, ["algorithm.adv_estimator=grpo", "rollout.n=4"], "the critic pool would only compute advantages"),
    (2, ["placement.pools={actor:[1],critic:[2]}"], "placement.pools='{actor:[1],critic:[2]}': cannot be parsed"),
    # A value of the wrong shape (placement.pools takes a list or a mapping now, so the example is roles).
    (2, ["placement.roles=[gen,train]"], "placement.roles: expected a mapping, got a list"),
    # A role group that is not one (the four are rollout, actor, critic, reward).
    (2, ["placement.mode=custom", "placement.pools={train: 1, judge: 1}", "placement.roles={actor: train, judge: judge}"],
     "placement.roles.judge=judge: unknown role group; the role groups are rollout, actor, critic, reward"),
    # LoRA: an engine it does not run on, and layers the model does not have (found once the model's path is known)
    (2, ["model.lora_rank=8", "actor.engine=deepspeed"], "model.lora_rank=8 with actor.engine=deepspeed"),
    (2, ["model.lora_rank=8", "model.target_modules=[qkv_proj]"], "model.target_modules=['qkv_proj'] (exclude_modules=None) "
     "names no layer of"),
    # A judge whose KV cache cannot fit (found once the device is known); JUDGE: the test judge's folder.
    (2, ["reward.judge.path=JUDGE", "reward.judge.max_num_seqs=100000000"], "reward.judge does not fit"),
]
IDS = ["odd-split", "pools-dont-add-up", "batch-not-divisible", "unknown-key", "wrong-type", "missing-model",
       "critic-free-split-with-nothing-to-do",
       "override-yaml-cannot-parse", "list-where-a-mapping-is", "role-group-not-in-the-map", "lora-on-deepspeed",
       "lora-on-layers-the-model-lacks", "judge-too-big"]


@pytest.fixture(scope="module")
def bad_input_runs():
    """Every case's ranks started at once, each rank with torchrun's environment but no launcher to
    stop the others when one fails: each rank must reach the check, say why and exit on its own.
    A rank that went on to init_process_group would wait there for the ones that left, and time
    out. Case id -> each rank's CompletedProcess, or the rank that did not exit."""
    judge = ensure_judge_model()
    started = {case_id: ranks_apart(nproc, ["trainer.dist_timeout_s=30", *(o.replace("=JUDGE", f"={judge}") for o in overrides)])
               for case_id, (nproc, overrides, _) in zip(IDS, CASES)}
    deadline, results = time.monotonic() + 180, {}
    for case_id, ranks in started.items():
        try:
            ranks.wait(timeout=max(1.0, deadline - time.monotonic()))
            results[case_id] = ranks.ranks()
        except subprocess.TimeoutExpired:
            results[case_id] = "a rank did not exit: it went past the checks and waited"
    return results


@pytest.mark.parametrize("nproc, overrides, expected", CASES, ids=IDS)
def test_every_rank_fails_on_its_own_naming_the_key(bad_input_runs, request, nproc, overrides, expected):
    results = bad_input_runs[request.node.callspec.id]
    assert not isinstance(results, str), results
    assert len(results) == nproc
    for rank, result in enumerate(results):
        assert result.returncode == 2, (rank, result.stderr[-3000:])
        assert f"spmdsplit [rank {rank}]: error:" in result.stderr and expected in result.stderr, result.stderr[-3000:]
        # A message, not a crash: no traceback through our code.
        assert "Traceback" not in result.stderr, result.stderr[-3000:]


@pytest.mark.e2e
def test_under_torchrun_the_job_fails_fast_with_the_message():
    start = time.monotonic()
    result = torchrun(2, "trainer.totl_steps=3", timeout=120)
    assert result.returncode != 0
    assert re.search(r"spmdsplit \[rank \d\]: error: config key 'trainer.totl_steps'", result.stderr), result.stderr[-3000:]
    assert not re.search(r'File ".*spmdsplit/', result.stderr), result.stderr[-3000:]
    assert time.monotonic() - start < 90
