"""The real job, each rank watched for tensors of logits' shape over its whole run (for
tests/test_logprobs.py's whole-step check).

Run as a torchrun script: `LOGITS_VOCAB=V LOGITS_HIDDEN=H LOGITS_OUT=dir torchrun ... tests/jobs/logits_watch.py key=value ...`.
Every op every rank runs (forward, backward, generation, validation, metrics, whatever the pass) goes
through a TorchDispatchMode that notes, per phase of the timer (`timing_s/<phase>`, the innermost
open one), the most positions a fresh tensor [..., V] held (its elements over V), and the most
positions such tensors held at once. Views allocate nothing and are left out, and so is the
head's weight gradient [hidden, V]. Each rank writes {"largest": {phase: positions}, "peak": {...}}
to LOGITS_OUT/rank<r>.json when its job ends.
"""

import json
import os
import sys
import weakref
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from spmdsplit.timing import PhaseTimer
from spmdsplit.train import main

VOCAB, HIDDEN = int(os.environ["LOGITS_VOCAB"]), int(os.environ["LOGITS_HIDDEN"])
open_phases: list[str] = []
largest: dict[str, int] = {}  # phase -> the most positions one tensor held
live = [0]  # positions held by the [..., V] tensors alive now
peak: dict[str, int] = {}  # phase -> the most positions alive at once (many [B, V] steps kept add up)


def released(rows: int) -> None:
    live[0] -= rows


class LogitsWatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if (isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == VOCAB and not t._is_view()
                    and tuple(t.shape) != (HIDDEN, VOCAB)):
                where, rows = open_phases[-1] if open_phases else "outside", t.numel() // VOCAB
                largest[where] = max(largest.get(where, 0), rows)
                live[0] += rows
                weakref.finalize(t, released, rows)
                peak[where] = max(peak.get(where, 0), live[0])
        return out


original_phase = PhaseTimer.phase


@contextmanager
def phase(self, name, step, **args):
    open_phases.append(name)
    try:
        with original_phase(self, name, step, **args) as event_args:
            yield event_args
    finally:
        open_phases.pop()


PhaseTimer.phase = phase
with LogitsWatch():
    code = main()
rank = int(os.environ.get("RANK", 0))
with open(os.path.join(os.environ["LOGITS_OUT"], f"rank{rank}.json"), "w") as f:
    json.dump({"largest": largest, "peak": peak}, f)
sys.exit(code)
