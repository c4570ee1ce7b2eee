"""The real job, with one rank killed right after it wrote its half of a checkpoint, before the
checkpoint is published (for test_resume.py).

Run as a torchrun script: `CRASH_RANK=1 CRASH_STEP=4 torchrun ... tests/jobs/ckpt_crash.py key=value ...`.
"""

import os
import signal
import sys

from spmdsplit.engines.fsdp import FSDPEngine
from spmdsplit.train import main

crash_rank, crash_step = os.environ["CRASH_RANK"], int(os.environ["CRASH_STEP"])
original_save = FSDPEngine.save_checkpoint


def save_then_die(self, path, *args, **kwargs):
    original_save(self, path, *args, **kwargs)
    if os.environ["RANK"] == crash_rank and f"global_step_{crash_step}.partial" in path:
        os.kill(os.getpid(), signal.SIGKILL)


FSDPEngine.save_checkpoint = save_then_die
sys.exit(main())
