"""rollout.ranks=all: the critic pool's rollout engines get the policy's weights from the actor pool.

The actor pool streams its weights into its own rollout engines every step (one tensor at a time,
gathered from the shards: `engine.iter_full_weights`). Its first rank also packs what it streams
into buckets of `rollout.weight_bucket_mb` and broadcasts each over a group of itself and the
critic pool, made at start-up by every rank; the critic ranks unpack each bucket into their own
engine as it arrives. So no rank ever holds more than one bucket beyond its engine, and the
broadcast runs while the actor pool's own engines load.

Each bucket is two broadcasts: a small pickled list of (name, dtype, shape, offset, nbytes), then
the bytes. An empty list ends the stream.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
import torch.distributed as dist

_ALIGN = 16


class WeightBroadcast:
    def __init__(self, actor_ranks, critic_ranks, device: torch.device, bucket_mb: float, timeout=None):
        self.src = actor_ranks[0]
        self.ranks = sorted({self.src, *critic_ranks})
        self.group = dist.new_group(self.ranks, timeout=timeout)  # every rank of the world calls this
        self.device = device
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))

    def send(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """On the actor pool's first rank: passes `weights` through (to its own engine) and
        broadcasts them, bucket by bucket, on the way."""
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, tensor in weights:
            yield name, tensor
            bucket.append((name, tensor))
            size += _padded(tensor)
            if size >= self.bucket_bytes:
                self._broadcast(bucket)
                bucket, size = [], 0
        if bucket:
            self._broadcast(bucket)
        self._broadcast_specs([])  # the end

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """On a critic rank: the weights, as they arrive (views into the current bucket)."""
        while True:
            specs = self._broadcast_specs(None)
            if not specs:
                return
            buffer = torch.empty(sum(nbytes_padded for *_, nbytes_padded in specs), dtype=torch.uint8,
                                 device=self.device)
            dist.broadcast(buffer, src=self.src, group=self.group)
            for name, dtype, shape, offset, nbytes, _ in specs:
                yield name, buffer[offset: offset + nbytes].view(dtype).view(shape)

    def _broadcast(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        specs, offset = [], 0
        for name, tensor in bucket:
            nbytes = tensor.numel() * tensor.element_size()
            specs.append((name, tensor.dtype, tuple(tensor.shape), offset, nbytes, _padded(tensor)))
            offset += _padded(tensor)
        buffer = torch.empty(offset, dtype=torch.uint8, device=self.device)
        for (_, _, _, off, nbytes, _), (_, tensor) in zip(specs, bucket):
            buffer[off: off + nbytes].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
        self._broadcast_specs(specs)
        dist.broadcast(buffer, src=self.src, group=self.group)

    def _broadcast_specs(self, specs):
        box = [specs]
        dist.broadcast_object_list(box, src=self.src, group=self.group,
                                   device=self.device if self.device.type == "cuda" else None)
        return box[0]


def _padded(tensor: torch.Tensor) -> int:
    return -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
