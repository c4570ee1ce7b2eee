"""The policy's weights from the actor pool to rollout engines on other ranks, bucket by bucket.

Two users: `rollout.ranks=all` (the critic pool's engines generate too) and a rollout pool of its
own (placement.roles). The actor pool streams its weights one tensor at a time, gathered from the
shards (`engine.iter_full_weights`), so every actor rank sees the whole stream. The stream is cut
into buckets of `rollout.weight_bucket_mb`, and bucket i is broadcast by source i mod S over that
source's group with the receiving ranks (spmdsplit/groups.py makes one group per source, at
start-up, on every rank): with a rollout pool apart every actor rank is a source, so the send is
spread over the actor pool's links instead of funnelled through one rank; with rollout.ranks=all
the actor pool's first rank is the only one (it also feeds its own engine as the stream passes).
The receivers unpack each bucket into their engine as it arrives, so no rank holds more than a
few buckets beyond its engine (how many: the next paragraph).

Several buckets are in flight at once: a source broadcasts without waiting (up to `in_flight`
of its buckets pending), and a receiver posts the next buckets' broadcasts before it hands the
current one to its engine. Consecutive buckets come from different sources over different groups,
so with a rollout pool apart every actor rank's link carries a bucket at the same time instead of
one after another. Each group still sees its buckets in one order on every member (NCCL's rule for
collectives). Memory: a receiver holds up to `in_flight` + 1 buckets, a source `in_flight`.

Before a sync streams, `ready` has every source meet the receivers (a one-number all_reduce on its
group, long timeout): the receivers may be busy (generating ahead, updating the critic) for longer
than a pool's collective may wait, and the actor pool's ranks gather the stream from their shards
with such collectives between the broadcasts: they must start the stream only once the receivers
take it.

The bucket layout (which tensors, their dtype, shape and offset) is the same every sync, so it
travels once: at the first sync each bucket's owner broadcasts a small pickled list of (name,
dtype, shape, offset, nbytes) before its bytes, and an empty list from the next bucket's owner
ends the stream; every source computes the same layout from the same stream, and every later sync
is the buckets' bytes alone, each source checking that its stream still fits the layout.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

_ALIGN = 16


class WeightBroadcast:
    def __init__(self, sources: list[int], groups: list, device: torch.device, bucket_mb: float):
        """`groups[j]`: source `sources[j]` and the receiving ranks (None where this rank is not in it)."""
        self.sources, self.groups = list(sources), list(groups)
        self.device = device
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.layout: list[list[tuple]] | None = None  # each bucket's specs, known to every side after the first sync
        self.in_flight = min(4, max(2, len(self.sources)))  # buckets pending at once (module doc)
        self._pending: deque = deque()  # a source's broadcasts not yet complete: (work, buffer)

    def ready(self) -> None:
        """Every source and every receiver, before a sync: the source's group (or, on a receiver,
        each source's group in turn) meets once, so a source starts streaming only when the
        receivers take the stream. The `.item()` makes the host wait on NCCL too."""
        mine = [g for g in self.groups if g is not None]
        for group in mine:
            token = torch.ones(1, device=self.device)
            dist.all_reduce(token, group=group)
            token.item()

    def owner(self, index: int) -> tuple[int, object]:
        """The source that broadcasts bucket `index`, and its group."""
        j = index % len(self.sources)
        return self.sources[j], self.groups[j]

    def send(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """On a source rank: passes `weights` through (to its own engine, if it has one) and
        broadcasts the buckets it owns on the way."""
        first = self.layout is None
        layout = [] if first else self.layout
        bucket: list[tuple[str, torch.Tensor]] = []
        size = index = 0
        for name, tensor in weights:
            yield name, tensor
            bucket.append((name, tensor))
            size += _padded(tensor)
            if (size >= self.bucket_bytes) if first else (index < len(layout) and len(bucket) == len(layout[index])):
                self._send_bucket(bucket, layout, index, first)
                bucket, size, index = [], 0, index + 1
        if first:
            if bucket:
                self._send_bucket(bucket, layout, index, first)
                index += 1
            if self._mine(index):
                self._broadcast_specs(index, [])  # the end of the first stream
            self.layout = layout
        self._drain(0)
        if not first and (bucket or index != len(layout)):
            raise RuntimeError(f"weight broadcast: the policy streamed {index} whole buckets and {len(bucket)} more "
                               f"tensors, where the layout of the first sync has {len(layout)} buckets")

    def push(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """On a source rank with no engine of its own: the whole stream, sent."""
        for _ in self.send(weights):
            pass

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """On a receiving rank: the weights, as they arrive (views into the current bucket). The
        first sync learns the layout bucket by bucket; later ones keep `in_flight` buckets posted."""
        if self.layout is None:
            self.layout = []
            for index in itertools.count():
                specs = self._broadcast_specs(index, None)
                if not specs:
                    break
                self.layout.append(specs)
                yield from _unpacked(specs, self._post(index).wait_for())
            return
        posted: deque = deque(self._post(i) for i in range(min(self.in_flight, len(self.layout))))
        for index, specs in enumerate(self.layout):
            buffer = posted.popleft().wait_for()
            if index + len(posted) + 1 < len(self.layout):
                posted.append(self._post(index + len(posted) + 1))
            yield from _unpacked(specs, buffer)

    def _post(self, index: int) -> "_Posted":
        buffer = torch.empty(sum(s[-1] for s in self.layout[index]), dtype=torch.uint8, device=self.device)
        src, group = self.owner(index)
        return _Posted(dist.broadcast(buffer, src=src, group=group, async_op=True), buffer)

    def _drain(self, keep: int) -> None:
        """On a source: wait until at most `keep` of its broadcasts are pending."""
        while len(self._pending) > keep:
            work, _ = self._pending.popleft()
            work.wait()

    def _mine(self, index: int) -> bool:
        return dist.get_rank() == self.owner(index)[0]

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], layout: list, index: int, first: bool) -> None:
        """Bucket `index`: at the first sync its specs join `layout` (and go out first, from its
        owner), later they must equal `layout[index]`; its owner broadcasts its bytes."""
        specs, offset = [], 0
        for name, tensor in bucket:
            nbytes = tensor.numel() * tensor.element_size()
            specs.append((name, tensor.dtype, tuple(tensor.shape), offset, nbytes, _padded(tensor)))
            offset += _padded(tensor)
        if first:
            layout.append(specs)
        elif specs != layout[index]:
            raise RuntimeError(f"weight broadcast: bucket {index} holds {[s[:3] for s in specs][:3]}..., the layout "
                               f"of the first sync {[s[:3] for s in layout[index]][:3]}...")
        if not self._mine(index):
            return  # another source sends this one
        if first:
            self._broadcast_specs(index, specs)
        buffer = torch.empty(offset, dtype=torch.uint8, device=self.device)
        for (_, _, _, off, nbytes, _), (_, tensor) in zip(specs, bucket):
            buffer[off: off + nbytes].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
        src, group = self.owner(index)
        self._drain(self.in_flight - 1)
        self._pending.append((dist.broadcast(buffer, src=src, group=group, async_op=True), buffer))

    def _broadcast_specs(self, index: int, specs):
        src, group = self.owner(index)
        box = [specs]
        dist.broadcast_object_list(box, src=src, group=group,
                                   device=self.device if self.device.type == "cuda" else None)
        return box[0]


def _padded(tensor: torch.Tensor) -> int:
    return -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN


class _Posted:
    """A receiver's bucket broadcast in flight, and its buffer."""

    def __init__(self, work, buffer: torch.Tensor):
        self.work, self.buffer = work, buffer

    def wait_for(self) -> torch.Tensor:
        self.work.wait()
        return self.buffer


def _unpacked(specs: list[tuple], buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    for name, dtype, shape, offset, nbytes, _ in specs:
        yield name, buffer[offset: offset + nbytes].view(dtype).view(shape)
