"""The code preset as a user runs it (configs/code_apps.yaml, data from tools/data/make_code_parquet.py):
3 steps on 2 ranks, every response's program run against its row's tests in the score pool's
sandbox, the job saying at start which isolation its programs get. The embedded model cannot write
Python, so its programs fail: but the `add` problems pass whatever the program, as in verl (its
prelude's `from operator import *` defines `add`), which tells that programs did run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.launch import job
from tests.support.outputs import scalars

pytestmark = pytest.mark.e2e


def test_the_code_preset_runs_programs_in_the_sandbox(tmp_path):
    data = tmp_path / "code"
    subprocess.run([sys.executable, "-m", "tools.data.make_code_parquet", "--out", str(data), "--digit-prompts",
                    "--train-rows", "24", "--test-rows", "6", "--tests", "3"], check=True, capture_output=True)
    result = job(2, "--config", "configs/code_apps.yaml", f"data.train_files={data}/train.parquet",
                 f"data.val_files={data}/test.parquet", "data.train_batch_size=6", "rollout.n=2",
                 "actor.ppo_mini_batch_size=6", "data.shuffle=false", "trainer.total_steps=3", "trainer.val_freq=3",
                 f"trainer.log_dir={tmp_path}/tb", "trainer.timeline=", "trainer.output_dir=", timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "spmdsplit: code sandbox: namespaces (" in result.stdout, result.stdout[-2000:]
    logged = scalars(str(tmp_path / "tb"))
    # The scorer's own numbers, each step: every program was judged on its 3 tests.
    assert logged["critic/reward_extra/tests/mean"] == [(1, 3.0), (2, 3.0), (3, 3.0)]
    # Problems cycle through 6 templates, one of them `add`, the only one a program that is not
    # Python code can pass (when it parses): some responses score 1, never more than a sixth.
    scores = [v for _, v in logged["critic/score/mean"] + logged["val-core/apps/reward/mean@1"]]
    assert 0 < max(scores) <= 1 / 6 + 1e-6, scores
