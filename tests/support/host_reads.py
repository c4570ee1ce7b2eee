"""Counting host reads: each time Python reads a tensor's values (`tolist`, `item`, `int(t)`,
`float(t)`, `bool(t)`, `t.__index__`), a GPU would make the host wait for the device. A test
wraps the code it checks in `counting_host_reads()` and asserts how the count grows (or doesn't)
with the rows or micro-batches; on CPU the reads cost nothing, but their number is the same."""

from __future__ import annotations

import contextlib
import traceback

import torch

READS = ("tolist", "item", "__int__", "__index__", "__float__", "__bool__")


@contextlib.contextmanager
def counting_host_reads(where: bool = False):
    """Yields a list that gets one entry per host read made inside the block: the read's name, or
    with `where`, (name, the innermost frame of the project's own code that made it), to say
    which line a new read comes from. The patches are undone on leaving the block."""
    reads: list = []
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counting(name, real):
        def counted(self, *args, **kwargs):
            reads.append((name, _caller()) if where else name)
            return real(self, *args, **kwargs)
        return counted

    for name, real in originals.items():
        setattr(torch.Tensor, name, counting(name, real))
    try:
        yield reads
    finally:
        for name, real in originals.items():
            setattr(torch.Tensor, name, real)


def _caller() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if "/spmdsplit/" in f.filename]
    return f"{frames[-1].filename.split('/spmdsplit/')[-1]}:{frames[-1].lineno}" if frames else "elsewhere"
