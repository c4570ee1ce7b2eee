"""The real job, with one rank made to fail (or stall) on entering a phase (for test_failure.py).

Run as a torchrun script: `FAULT=3:update_critic:2 torchrun ... tests/jobs/fault.py key=value ...`
makes rank 3 raise on entering its `update_critic` phase of step 2; `FAULT=0,1:val_gen:2:sleep=8`
makes ranks 0 and 1 sleep 8 s there instead (several faults: separated by ";"); `FAULT=1:update_actor:2:segv` makes rank 1 die of a
segmentation fault there (a crash in native code, where no Python handler runs). Phases are the timer's names (`timing_s/<phase>`),
so every phase of every pool can be hit the same way. The moment of the raise is written to
$FAULT_TIME_FILE, so a test can time the job's end from the error, not from the start.
"""

import os
import sys
import time
from contextlib import contextmanager

from spmdsplit.timing import PhaseTimer
from spmdsplit.train import main

def parse(spec: str) -> tuple[set[int], str, int, list[str]]:
    ranks, fault_phase, fault_step, *action = spec.split(":")
    return {int(r) for r in ranks.split(",")}, fault_phase, int(fault_step), action


faults = [parse(spec) for spec in os.environ["FAULT"].split(";")]
original_phase = PhaseTimer.phase


@contextmanager
def phase(self, name, step, **args):
    with original_phase(self, name, step, **args) as event_args:
        for ranks, fault_phase, fault_step, action in faults:
            if self.rank in ranks and name == fault_phase and step == fault_step and not args.get("chunk"):
                if action and action[0].startswith("sleep="):
                    time.sleep(float(action[0].removeprefix("sleep=")))
                    continue
                with open(os.environ["FAULT_TIME_FILE"], "w") as f:
                    f.write(str(time.time()))
                if action == ["segv"]:
                    import ctypes

                    ctypes.string_at(0)  # reads address 0: SIGSEGV
                raise RuntimeError(f"injected failure on rank {self.rank} in {name} at step {step}")
        yield event_args


PhaseTimer.phase = phase
sys.exit(main())
