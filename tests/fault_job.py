"""The real job, with one rank made to fail in the middle of a step (for test_failure.py).

Run as a torchrun script: `FAIL_RANK=3 FAIL_STEP=2 torchrun ... tests/fault_job.py key=value ...`.
"""

import os
import sys

from spmdsplit.roles.critic import Critic
from spmdsplit.train import main

fail_rank, fail_step = int(os.environ["FAIL_RANK"]), int(os.environ["FAIL_STEP"])
original_update = Critic.update_critic


def failing_update(self, batch, seed):
    step = seed - 7919  # trainer passes seed = trainer.seed * 7919 + step, trainer.seed=1 here
    if int(os.environ["RANK"]) == fail_rank and step == fail_step:
        raise RuntimeError(f"injected failure on rank {fail_rank} at step {fail_step}")
    return original_update(self, batch, seed)


Critic.update_critic = failing_update
sys.exit(main())
