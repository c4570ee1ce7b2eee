"""rollout.ranks=all: the critic pool's rollout engines get the policy's weights from the actor pool.

The actor pool streams its weights into its own rollout engines every step (one tensor at a time,
gathered from the shards: `engine.iter_full_weights`). Its first rank also packs what it streams
into buckets of `rollout.weight_bucket_mb` and broadcasts each over a group of itself and the
critic pool (`weights` in spmdsplit/groups.py); the critic ranks unpack each bucket into their own
engine as it arrives. So no rank ever holds more than one bucket beyond its engine, and the
broadcast runs while the actor pool's own engines load.

The bucket layout (which tensors, their dtype, shape and offset) is the same every step, so it
travels once: at the first sync each bucket is preceded by a small pickled list of (name, dtype,
shape, offset, nbytes), an empty list ends the stream, and both sides keep the layout. Every later
sync is the buckets' bytes alone; the sender checks that its stream still fits the layout.
"""

from __future__ import annotations

import itertools
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

_ALIGN = 16


class WeightBroadcast:
    def __init__(self, src: int, group, device: torch.device, bucket_mb: float):
        """`group`: the actor pool's first rank `src` and the critic pool (spmdsplit/groups.py)."""
        self.src, self.group = src, group
        self.device = device
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.layout: list[list[tuple]] | None = None  # each bucket's specs, known to both sides after the first sync

    def send(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """On the actor pool's first rank: passes `weights` through (to its own engine) and
        broadcasts them, bucket by bucket, on the way."""
        first = self.layout is None
        layout = [] if first else self.layout
        bucket: list[tuple[str, torch.Tensor]] = []
        size = index = 0
        for name, tensor in weights:
            yield name, tensor
            bucket.append((name, tensor))
            size += _padded(tensor)
            if (size >= self.bucket_bytes) if first else (index < len(layout) and len(bucket) == len(layout[index])):
                self._send_bucket(bucket, layout, None if first else index)
                bucket, size, index = [], 0, index + 1
        if first:
            if bucket:
                self._send_bucket(bucket, layout, None)
            self._broadcast_specs([])  # the end of the first stream
            self.layout = layout
        elif bucket or index != len(layout):
            raise RuntimeError(f"weight broadcast: the policy streamed {index} whole buckets and {len(bucket)} more "
                               f"tensors, where the layout of the first sync has {len(layout)} buckets")

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """On a critic rank: the weights, as they arrive (views into the current bucket)."""
        first = self.layout is None
        layout = [] if first else self.layout
        for index in itertools.count():
            if first:
                specs = self._broadcast_specs(None)
                if not specs:
                    break
                layout.append(specs)
            elif index == len(layout):
                break
            specs = layout[index]
            buffer = torch.empty(sum(nbytes_padded for *_, nbytes_padded in specs), dtype=torch.uint8,
                                 device=self.device)
            dist.broadcast(buffer, src=self.src, group=self.group)
            for name, dtype, shape, offset, nbytes, _ in specs:
                yield name, buffer[offset: offset + nbytes].view(dtype).view(shape)
        self.layout = layout

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], layout: list, index: int | None) -> None:
        """Broadcasts one bucket's bytes; at the first sync (`index` None) its specs go first and
        join `layout`, later they must equal `layout[index]`."""
        specs, offset = [], 0
        for name, tensor in bucket:
            nbytes = tensor.numel() * tensor.element_size()
            specs.append((name, tensor.dtype, tuple(tensor.shape), offset, nbytes, _padded(tensor)))
            offset += _padded(tensor)
        if index is None:
            self._broadcast_specs(specs)
            layout.append(specs)
        elif specs != layout[index]:
            raise RuntimeError(f"weight broadcast: bucket {index} holds {[s[:3] for s in specs][:3]}..., the layout "
                               f"of the first sync {[s[:3] for s in layout[index]][:3]}...")
        buffer = torch.empty(offset, dtype=torch.uint8, device=self.device)
        for (_, _, _, off, nbytes, _), (_, tensor) in zip(specs, bucket):
            buffer[off: off + nbytes].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
        dist.broadcast(buffer, src=self.src, group=self.group)

    def _broadcast_specs(self, specs):
        box = [specs]
        dist.broadcast_object_list(box, src=self.src, group=self.group,
                                   device=self.device if self.device.type == "cuda" else None)
        return box[0]


def _padded(tensor: torch.Tensor) -> int:
    return -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
