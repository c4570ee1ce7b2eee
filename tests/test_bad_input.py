"""Bad input ends every rank with a clear message and a non-zero exit, before any collective:
never a hang, never one rank failing while the others wait."""

import re
import time

import pytest

from tests.runjob import torchrun


@pytest.mark.parametrize(
    "nproc, overrides, expected",
    [
        (3, ["placement.mode=split"], "placement"),
        (2, ["placement.mode=custom", "placement.pools=[2,1]"], "placement.pools"),
        (2, ["placement.mode=colocate", "data.train_batch_size=15", "actor.ppo_mini_batch_size=5", "critic.ppo_mini_batch_size=5"], "data.train_batch_size=15 is not divisible"),
        (2, ["trainer.totl_steps=3"], "trainer.totl_steps"),
        (2, ["trainer.total_steps=many"], "trainer.total_steps"),
        (2, ["model.path=/no/such/model"], "model.path"),
        (2, ["algorithm.adv_estimator=grpo", "rollout.n=4"], "the critic pool would only run a rule reward"),
    ],
    ids=["odd-split", "pools-dont-add-up", "batch-not-divisible", "unknown-key", "wrong-type", "missing-model",
         "critic-free-split-with-nothing-to-do"],
)
def test_every_rank_fails_fast_naming_the_key(nproc, overrides, expected):
    start = time.monotonic()
    result = torchrun(nproc, *overrides, timeout=120)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    for rank in range(nproc):
        assert f"spmdsplit [rank {rank}]: error:" in result.stderr, result.stderr[-3000:]
    assert expected in result.stderr
    # A message, not a crash: no traceback through our code (torchrun prints its own summary).
    assert not re.search(r'File ".*spmdsplit/', result.stderr), result.stderr[-3000:]
    assert elapsed < 90, f"took {elapsed:.0f}s: something waited"
