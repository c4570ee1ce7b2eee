"""The real job, with one rank's checkpoint write made slow (for test_checkpoint.py).

Run as a torchrun script: `SLOW_WRITE=1:8 torchrun ... tests/jobs/slow_write.py key=value ...` makes
world rank 1 sleep 8 s inside the first engine checkpoint write it makes, after the engine's first
wait for its pool (DCP's planning; DeepSpeed's first barrier) and before the wait for the
slowest writer: the stretch where a large shard's write to a busy filesystem takes its time.
"""

import os
import sys
import time

from spmdsplit.train import main

slow_rank, slow_s = (float(x) for x in os.environ["SLOW_WRITE"].split(":"))


slept = []  # the first write is slow, not every one: one wait past the timeout is the case, more only cost time


def slowed(write):
    def slow_write(self, *args, **kwargs):
        if int(os.environ["RANK"]) == slow_rank and not slept:
            slept.append(True)
            time.sleep(slow_s)
        return write(self, *args, **kwargs)

    return slow_write


from torch.distributed.checkpoint.filesystem import FileSystemWriter  # noqa: E402

FileSystemWriter.write_data = slowed(FileSystemWriter.write_data)  # FSDP's DCP: each rank its shards
if os.environ.get("SLOW_WRITE_DEEPSPEED") == "1":
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    TorchCheckpointEngine.save = slowed(TorchCheckpointEngine.save)  # each file DeepSpeed writes
sys.exit(main())
