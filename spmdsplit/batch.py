"""The batch that flows through a PPO step: named tensors sharing a first (row) dim, plus
non-tensor columns (strings, ground truths, ...) kept as Python lists of the same length.

Rows are samples. Every operation here is by rows, so a batch can be cut into shards for
ranks, mini-batches and micro-batches, and glued back, without knowing what the columns mean.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensors: dict[str, list[Any]] = field(default_factory=dict)

    def __post_init__(self):
        lengths = {k: v.shape[0] for k, v in self.tensors.items()}
        lengths.update({k: len(v) for k, v in self.non_tensors.items()})
        if len(set(lengths.values())) > 1:
            raise ValueError(f"batch columns disagree on the number of rows: {lengths}")
        for k, v in self.non_tensors.items():
            if not isinstance(v, list):
                self.non_tensors[k] = list(v)

    def __len__(self) -> int:
        for v in self.tensors.values():
            return v.shape[0]
        for v in self.non_tensors.values():
            return len(v)
        return 0

    def __getitem__(self, key: str):
        if key in self.tensors:
            return self.tensors[key]
        return self.non_tensors[key]

    def __setitem__(self, key: str, value):
        if len(self) and len(value) != len(self):
            raise ValueError(f"column {key!r} has {len(value)} rows, batch has {len(self)}")
        if isinstance(value, torch.Tensor):
            self.tensors[key] = value
        else:
            self.non_tensors[key] = list(value)

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.non_tensors

    def keys(self) -> list[str]:
        return list(self.tensors) + list(self.non_tensors)

    def select(self, keys: Iterable[str]) -> "Batch":
        keys = list(keys)
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"batch has no column(s) {missing}; it has {self.keys()}")
        return Batch(
            {k: v for k, v in self.tensors.items() if k in keys},
            {k: v for k, v in self.non_tensors.items() if k in keys},
        )

    def update(self, other: "Batch") -> "Batch":
        """Adds (or replaces) the columns of `other`, which must have the same rows."""
        if len(self) and len(other) and len(other) != len(self):
            raise ValueError(f"cannot merge a batch of {len(other)} rows into one of {len(self)}")
        self.tensors.update(other.tensors)
        self.non_tensors.update(other.non_tensors)
        return self

    def slice(self, start: int, end: int) -> "Batch":
        return Batch(
            {k: v[start:end] for k, v in self.tensors.items()},
            {k: v[start:end] for k, v in self.non_tensors.items()},
        )

    def index(self, rows: torch.Tensor | Sequence[int]) -> "Batch":
        rows = torch.as_tensor(rows, dtype=torch.long)
        idx = rows.tolist()
        return Batch(
            {k: v[rows.to(v.device)] for k, v in self.tensors.items()},
            {k: [v[i] for i in idx] for k, v in self.non_tensors.items()},
        )

    def repeat_interleave(self, n: int) -> "Batch":
        """Each row n times in a row (rows 0,0,1,1,... for n=2): one group per row."""
        return self if n == 1 else self.index(torch.arange(len(self)).repeat_interleave(n))

    def split(self, size: int) -> list["Batch"]:
        """Consecutive chunks of `size` rows (the last may be shorter)."""
        if size <= 0:
            raise ValueError(f"split size must be positive, got {size}")
        return [self.slice(i, i + size) for i in range(0, len(self), size)]

    def to(self, device: torch.device | str) -> "Batch":
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, dict(self.non_tensors))

    @staticmethod
    def concat(batches: Sequence["Batch"]) -> "Batch":
        batches = [b for b in batches if len(b)]
        if not batches:
            return Batch()
        keys = set(batches[0].keys())
        for b in batches[1:]:
            if set(b.keys()) != keys:
                raise ValueError(f"cannot concat batches with different columns: {sorted(keys)} vs {sorted(b.keys())}")
        tensors = {}
        for k in batches[0].tensors:
            parts = [b.tensors[k] for b in batches]
            shapes = {tuple(p.shape[1:]) for p in parts}
            if len(shapes) > 1:
                raise ValueError(f"cannot concat column {k!r}: trailing shapes differ {sorted(shapes)}")
            tensors[k] = torch.cat(parts, dim=0)
        non_tensors = {k: [x for b in batches for x in b.non_tensors[k]] for k in batches[0].non_tensors}
        return Batch(tensors, non_tensors)
