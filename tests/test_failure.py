"""A rank that fails in the middle of a step ends the whole job quickly, its error shown: the
other pool, blocked in a receive from it, must not wait forever."""

import os
import subprocess
import sys
import time

from tests.multiproc import free_port


def test_a_failing_critic_rank_ends_the_job_with_its_error(tmp_path):
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", f"--master-port={free_port()}",
        os.path.join(os.path.dirname(__file__), "fault_job.py"),
        "trainer.total_steps=50", "trainer.seed=1", "trainer.progress_bar=false", "data.train_batch_size=16",
        "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=4",
        "critic.ppo_micro_batch_size_per_gpu=4", f"trainer.log_dir={tmp_path}/tb", "trainer.timeline=",
        "trainer.output_dir=",
    ]
    env = {**os.environ, "FAIL_RANK": "3", "FAIL_STEP": "2", "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    start = time.monotonic()
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert "injected failure on rank 3 at step 2" in result.stderr
    assert "step 3:" not in result.stdout  # nobody went on as if nothing happened
    assert elapsed < 90, f"the job took {elapsed:.0f}s to end after a rank failed"
