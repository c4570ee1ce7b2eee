"""The policy's weights from the actor pool to rollout engines on other ranks, bucket by bucket.

Two users: a rollout pool of its own (placement.roles) and `rollout.ranks=all` (the critic pool's
engines generate too). The stream of weights, in the model's order, is cut into buckets of
`rollout.weight_bucket_mb`, and each bucket is broadcast by one of the S sources (the one that
owns the fewest bytes so far: `owner`) over that source's group with the receiving ranks (spmdsplit/groups.py makes one group per source, at start-up, on every
rank). The receivers unpack each bucket into their engine as it arrives, so no rank holds more
than a few buckets beyond its engine (how many: below).

With a rollout pool apart every actor rank is a source and none holds an engine (`push`): each
bucket is brought whole to the one rank that broadcasts it, from the shards every actor rank
holds (one `gather` over the actor pool per bucket, `engine.iter_weight_shards`), so the bytes an
actor rank receives, and the whole buckets it holds, are 1/S of the model's: about 15 GB per sync
at 7B became ~15/S GB per rank (across InfiniBand where the pool spans nodes). With
rollout.ranks=all every actor rank has an engine that needs the whole model anyway
(`engine.iter_full_weights`, every tensor gathered on every rank), and the actor pool's first rank,
the only source, broadcasts the stream on as it feeds its own engine (`send`).

Several buckets are in flight at once: a source broadcasts without waiting (up to `in_flight` of
its buckets pending), and a receiver posts the next buckets' broadcasts before it hands the
current one to its engine. Consecutive buckets come from different sources over different groups,
so with a rollout pool apart every actor rank's link carries a bucket at the same time instead of
one after another. Each group still sees its buckets in one order on every member (NCCL's rule for
collectives), and the actor pool gathers the buckets in the stream's order on every rank. A
gathered bucket is broadcast as it arrives, rank by rank (each rank's chunks of the bucket's
tensors, then the tensors that are whole on every rank): no copy to reassemble it on the owner,
and each receiver cuts every tensor out of its S pieces as it hands it to its engine. Memory: a
receiver holds up to `in_flight` + 1 buckets (and one tensor being put together); a source up to
`in_flight` of its buckets, the one it gathers among them; every other actor rank its 1/S part
of the bucket being gathered.

Before a sync streams, `ready` has every source meet the receivers (a one-number all_reduce on its
group, long timeout): the receivers may be busy (generating ahead, updating the critic) for longer
than a pool's collective may wait, and the actor pool's ranks gather from their shards with
collectives between the broadcasts: they must start the stream only once the receivers take it.

The bucket layout (which tensors, their dtype and shape, and where each one's bytes lie in the
bucket) is the same every sync, so it travels once: at the first sync each bucket's owner
broadcasts it (a small pickled `Bucket`) before its bytes, and None from the next bucket's owner
ends the stream; every source computes the same layout from the same stream (the tensors'
names, dtypes and whole shapes, which every actor rank knows without communication), and every
later sync is the buckets' bytes alone, each source checking that its stream still fits the layout.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from typing import Iterable, Iterator, NamedTuple

import torch
import torch.distributed as dist

from spmdsplit import lora
from spmdsplit.distributed import meet_on

_ALIGN = 16


class WeightShard(NamedTuple):
    """One weight as an actor rank holds it (engine.iter_weight_shards): its HF name, this rank's
    part (cast to the stream's dtype), and the whole tensor's shape. `sharded`: the part is this
    rank's chunk along dim 0 (torch.chunk over the pool: ceil(rows / pool) rows each, the last
    ones shorter or empty, as FSDP2 cuts); else it is the whole tensor, the same on every rank."""
    name: str
    part: torch.Tensor
    shape: tuple
    sharded: bool


class TensorSpec(NamedTuple):
    """Where a tensor lies in its bucket: its bytes are the `pieces` ((offset, nbytes) in the
    bucket) one after another: one piece when packed whole, one per rank holding rows of it when
    gathered from the actor pool's chunks."""
    name: str
    dtype: torch.dtype
    shape: tuple
    pieces: tuple


class Bucket(NamedTuple):
    nbytes: int
    tensors: tuple  # TensorSpec, in the stream's order


class WeightBroadcast:
    def __init__(self, sources: list[int], groups: list, device: torch.device, bucket_mb: float):
        """`groups[j]`: source `sources[j]` and the receiving ranks (None where this rank is not in it)."""
        self.sources, self.groups = list(sources), list(groups)
        self.device = device
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.layout: list[Bucket] | None = None  # known to every side after the first sync
        self.owners: list[int] = []  # each bucket's source (an index of `sources`), fixed by the first sync
        self._loads = [0] * len(self.sources)  # the bytes of the buckets each source owns
        self.in_flight = min(4, max(2, len(self.sources)))  # buckets pending at once (module doc)
        self._pending: deque = deque()  # a source's broadcasts not yet complete: (work, buffer)

    def ready(self) -> None:
        """Every source and every receiver, before a sync: the source's group (or, on a receiver,
        each source's group in turn) meets once, so a source starts streaming only when the
        receivers take the stream."""
        for group in self.groups:
            if group is not None:
                meet_on(group, self.device)

    def owner(self, index: int) -> tuple[int, object]:
        """The source that broadcasts bucket `index`, and its group: the one that owns the fewest
        bytes of the buckets before it (the lowest on a tie), so that buckets of one size go round
        the sources and a few large tensors (embeddings, the head) do not pile up on one. Sources
        and receivers work it out alike, each bucket's size known to both when it is owned
        (`_own`); the first sync fixes it."""
        j = self.owners[index] if index < len(self.owners) else self._loads.index(min(self._loads))
        return self.sources[j], self.groups[j]

    def _own(self, index: int, bucket: "Bucket") -> None:
        """The first sync: bucket `index`, now laid out, goes to its owner's account."""
        assert index == len(self.owners), (index, len(self.owners))
        j = self._loads.index(min(self._loads))
        self.owners.append(j)
        self._loads[j] += bucket.nbytes

    # ---------------------------------------------------------------- sources

    def push(self, shards: Iterable[WeightShard], pool_group) -> None:
        """On every actor rank, each a source with no engine of its own (a rollout pool apart): the
        pool's shards, each bucket gathered to its owner alone (`pool_group`: the actor pool's,
        whose ranks are the sources in order), which broadcasts it."""
        pool = dist.get_world_size(pool_group)
        buckets = _Buckets(self.bucket_bytes, self.layout, lambda metas: _gathered(metas, pool))
        as_bytes = lambda index, layout, items: self._gathered_to_owner(index, layout, items, pool_group)  # noqa: E731
        for shard in shards:
            self._post_closed(buckets, buckets.add(shard, (shard.name, shard.part.dtype, shard.shape, shard.sharded)),
                              as_bytes)
        self._post_closed(buckets, buckets.finish(), as_bytes)
        self._end_stream(buckets)

    def send(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """On a source rank that holds the whole stream (rollout.ranks=all: the actor pool's first
        rank): passes `weights` through (to its own engine) and broadcasts its buckets on the way."""
        buckets = _Buckets(self.bucket_bytes, self.layout, _packed)
        for name, tensor in weights:
            yield name, tensor
            self._post_closed(buckets, buckets.add(tensor, (name, tensor.dtype, tuple(tensor.shape), False)),
                              self._packed_bytes)
        self._post_closed(buckets, buckets.finish(), self._packed_bytes)
        self._end_stream(buckets)

    # ---------------------------------------------------------------- receivers

    def pull(self) -> Iterator[tuple[str, torch.Tensor]]:
        """On a receiver: meet the sources, then the stream, bucket by bucket (an engine's source)."""
        self.ready()
        return self.receive()

    def _mine(self, index: int) -> bool:
        return dist.get_rank() == self.owner(index)[0]

    def _packed_bytes(self, index: int, layout: "Bucket", tensors: list[torch.Tensor]) -> torch.Tensor | None:
        """Bucket `index` as the bytes its owner broadcasts (None on the other sources)."""
        if not self._mine(index):
            return None
        buffer = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device)
        for spec, tensor in zip(layout.tensors, tensors):
            for offset, nbytes in spec.pieces:  # one piece: packed whole
                buffer[offset: offset + nbytes].copy_(_bytes(tensor))
        return buffer

    def _gathered_to_owner(self, index: int, layout: "Bucket", shards: list[WeightShard],
                           pool_group) -> torch.Tensor | None:
        """Bucket `index` brought whole to its owner alone from the pool's shards, as the bytes it
        broadcasts (None elsewhere): one `gather` over the actor pool, which every rank of it runs
        for every bucket, in order. Each rank sends its chunks of the bucket's sharded tensors,
        each at its full ceil(rows / pool) rows so that every rank's part is alike; the owner
        gathers the parts straight into the bucket, rank after rank, and adds the tensors that
        are whole on every rank from its own copy (the layout: `_gathered`)."""
        pool = dist.get_world_size(pool_group)
        sharded = [s for s in shards if s.sharded]
        offsets, part_bytes = _chunk_offsets([s.shape for s in sharded], [s.part.dtype for s in sharded], pool)
        part = torch.zeros(part_bytes, dtype=torch.uint8, device=self.device)
        for s, offset in zip(sharded, offsets):
            mine = _bytes(s.part)
            part[offset: offset + len(mine)].copy_(mine)
        src = self.owner(index)[0]
        buffer = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device) if self._mine(index) else None
        parts = None if buffer is None else [buffer[r * part_bytes: (r + 1) * part_bytes] for r in range(pool)]
        if pool > 1 and part_bytes:
            dist.gather(part, parts, dst=src, group=pool_group)
        elif parts is not None:
            parts[0].copy_(part)
        if buffer is not None:
            for spec, s in zip(layout.tensors, shards):
                if not s.sharded:
                    (offset, nbytes), = spec.pieces
                    buffer[offset: offset + nbytes].copy_(_bytes(s.part))
        return buffer

    def _post_closed(self, buckets: "_Buckets", closed: list[tuple[int, list]], as_bytes) -> None:
        """The buckets the walk just closed, each made into the bytes its owner broadcasts
        (`as_bytes(index, layout, items)`: None on the other sources) and posted."""
        for index, items in closed:
            self._post_bucket(index, buckets, as_bytes(index, buckets.layout[index], items))

    def _post_bucket(self, index: int, buckets: "_Buckets", buffer: torch.Tensor | None) -> None:
        """Bucket `index`'s layout goes out first at the first sync (from its owner), then its owner
        broadcasts its bytes without waiting (at most `in_flight` of its broadcasts pending)."""
        src, group = self.owner(index)
        if buckets.first:
            if self._mine(index):
                self._broadcast_layout(index, buckets.layout[index])
            self._own(index, buckets.layout[index])
        if buffer is None:
            return
        self._drain(self.in_flight - 1)
        self._pending.append((dist.broadcast(buffer, src=src, group=group, async_op=True), buffer))

    def _end_stream(self, buckets: "_Buckets") -> None:
        if buckets.first:
            if self._mine(len(buckets.layout)):
                self._broadcast_layout(len(buckets.layout), None)  # the end of the first stream
            self.layout = buckets.layout
        self._drain(0)

    def _drain(self, keep: int) -> None:
        """On a source: wait until at most `keep` of its broadcasts are pending."""
        while len(self._pending) > keep:
            work, _ = self._pending.popleft()
            work.wait()

    # ---------------------------------------------------------------- receivers

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        """On a receiving rank: the weights, as they arrive (views into the current bucket, or a
        tensor put together from its pieces). The first sync learns the layout bucket by bucket;
        later ones keep `in_flight` buckets posted."""
        if self.layout is None:
            self.layout = []
            for index in itertools.count():
                layout = self._broadcast_layout(index, None)
                if layout is None:
                    break
                self.layout.append(layout)
                self._own(index, layout)
                yield from _unpacked(layout, self._post(index).wait_for())
            return
        posted: deque = deque(self._post(i) for i in range(min(self.in_flight, len(self.layout))))
        for index, layout in enumerate(self.layout):
            buffer = posted.popleft().wait_for()
            if index + len(posted) + 1 < len(self.layout):
                posted.append(self._post(index + len(posted) + 1))
            yield from _unpacked(layout, buffer)

    def _post(self, index: int) -> "_Posted":
        buffer = torch.empty(self.layout[index].nbytes, dtype=torch.uint8, device=self.device)
        src, group = self.owner(index)
        return _Posted(dist.broadcast(buffer, src=src, group=group, async_op=True), buffer)

    def _broadcast_layout(self, index: int, layout):
        src, group = self.owner(index)
        box = [layout]
        dist.broadcast_object_list(box, src=src, group=group,
                                   device=self.device if self.device.type == "cuda" else None)
        return box[0]


class _Buckets:
    """A source's walk of the stream: cuts it into buckets, by size at the first sync (a bucket
    closes once its tensors hold `bucket_bytes`; the layout grows as they close, each bucket's
    laid out by `lay_out`), else as the first sync's layout did, checking that the stream still
    fits it. `add` and `finish` return the buckets they close (none or one), as (index, items)."""

    def __init__(self, bucket_bytes: int, layout: list | None, lay_out):
        self.first = layout is None
        self.bucket_bytes, self.layout, self.lay_out = bucket_bytes, [] if layout is None else layout, lay_out
        self.items, self.metas, self.size, self.closed = [], [], 0, 0

    def add(self, item, meta: tuple) -> list[tuple[int, list]]:
        """`meta`: the item's (name, dtype, whole shape, sharded)."""
        self.items.append(item)
        self.metas.append(meta)
        self.size += _aligned(math.prod(meta[2]) * meta[1].itemsize)
        if self.first:
            return self._close() if self.size >= self.bucket_bytes else []
        if self.closed < len(self.layout) and len(self.items) == len(self.layout[self.closed].tensors):
            return self._close()
        return []

    def finish(self) -> list[tuple[int, list]]:
        if self.first:
            return self._close() if self.items else []
        if self.items or self.closed != len(self.layout):
            raise RuntimeError(f"weight broadcast: the policy streamed {self.closed} whole buckets and "
                               f"{len(self.items)} more tensors, where the layout of the first sync has "
                               f"{len(self.layout)} buckets")
        return []

    def _close(self) -> list[tuple[int, list]]:
        bucket = self.lay_out(self.metas)
        if self.first:
            self.layout.append(bucket)
        elif bucket != self.layout[self.closed]:
            was = [t[:3] for t in self.layout[self.closed].tensors][:3]
            raise RuntimeError(f"weight broadcast: bucket {self.closed} holds {[t[:3] for t in bucket.tensors][:3]}..., "
                               f"the layout of the first sync {was}...")
        closed = [(self.closed, self.items)]
        self.items, self.metas, self.size, self.closed = [], [], 0, self.closed + 1
        return closed


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _packed(metas: list[tuple]) -> Bucket:
    """A bucket of whole tensors, one after another (`send`)."""
    tensors, offset = [], 0
    for name, dtype, shape, _ in metas:
        nbytes = math.prod(shape) * dtype.itemsize
        tensors.append(TensorSpec(name, dtype, tuple(shape), ((offset, nbytes),) if nbytes else ()))
        offset += _aligned(nbytes)
    return Bucket(offset, tuple(tensors))


def _chunk_offsets(shapes: list[tuple], dtypes: list[torch.dtype], pool: int) -> tuple[list[int], int]:
    """Where each sharded tensor's chunk lies in one rank's part of a gathered bucket (each at its
    full ceil(rows / pool) rows), and the part's size."""
    offsets, offset = [], 0
    for shape, dtype in zip(shapes, dtypes):
        offsets.append(offset)
        offset += _aligned(_chunk_bytes(shape, dtype, pool))
    return offsets, offset


def _chunk_bytes(shape: tuple, dtype: torch.dtype, pool: int) -> int:
    """The bytes of a full chunk of a tensor cut along dim 0 into `pool` chunks (torch.chunk)."""
    rows = shape[0] if shape else 1
    return -(-rows // pool) * math.prod(shape[1:]) * dtype.itemsize


def _gathered(metas: list[tuple], pool: int) -> Bucket:
    """A bucket gathered from the actor pool (`push`): rank 0's part, rank 1's, ... (each its chunks
    of the sharded tensors, `_chunk_offsets`), then the tensors that are whole on every rank. A
    sharded tensor's pieces are its rows on each rank that holds any, in rank order."""
    sharded = [m for m in metas if m[3]]
    offsets, part_bytes = _chunk_offsets([m[2] for m in sharded], [m[1] for m in sharded], pool)
    chunk_offsets = iter(offsets)
    tensors, whole = [], pool * part_bytes
    for name, dtype, shape, is_sharded in metas:
        nbytes = math.prod(shape) * dtype.itemsize
        if is_sharded:
            at, chunk = next(chunk_offsets), _chunk_bytes(shape, dtype, pool)
            pieces = tuple((r * part_bytes + at, min(chunk, nbytes - r * chunk))
                           for r in range(pool) if nbytes - r * chunk > 0)
        else:
            pieces = ((whole, nbytes),) if nbytes else ()
            whole += _aligned(nbytes)
        tensors.append(TensorSpec(name, dtype, tuple(shape), pieces))
    return Bucket(whole, tuple(tensors))


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


class _Posted:
    """A receiver's bucket broadcast in flight, and its buffer."""

    def __init__(self, work, buffer: torch.Tensor):
        self.work, self.buffer = work, buffer

    def wait_for(self) -> torch.Tensor:
        self.work.wait()
        return self.buffer


def _unpacked(bucket: Bucket, buffer: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The bucket's tensors: a view of the buffer where a tensor lies in one piece, else its
    pieces put together (one tensor at a time, freed when the engine asks for the next)."""
    for spec in bucket.tensors:
        if len(spec.pieces) == 1:
            (offset, nbytes), = spec.pieces
            flat = buffer[offset: offset + nbytes]
        elif spec.pieces:
            flat = torch.cat([buffer[offset: offset + nbytes] for offset, nbytes in spec.pieces])
        else:
            flat = buffer[:0]
        yield spec.name, flat.view(spec.dtype).view(spec.shape)


class WeightsReady:
    """Continuous generation's signal, actor pool -> rollout pool: "the weights of update v are
    being sent now". A MAX all-reduce of v over a gloo group of the actor and rollout pools' ranks
    (spmdsplit/groups.py): the actor ranks join it, blocking, right before they push; each rollout
    rank posts it ahead (`expect`) and looks whether it completed between two engine steps
    (`arrived`), then joins the push (WeightBroadcast.pull). gloo on GPUs too: a posted NCCL
    collective would sit on the device, where a device-wide synchronize (vLLM's, a sleep's) would
    wait for it; this one lives on the host."""

    def __init__(self, group):
        self.group = group
        self.work, self.value = None, torch.zeros(1, dtype=torch.int64)

    def announce(self, version: int) -> None:
        """Actor ranks: the version they are about to push."""
        dist.all_reduce(torch.tensor([version], dtype=torch.int64), op=dist.ReduceOp.MAX, group=self.group)

    def expect(self) -> None:
        """Rollout ranks: wait for the next version, without blocking."""
        if self.work is None:
            self.value = torch.full((1,), -1, dtype=torch.int64)
            self.work = dist.all_reduce(self.value, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def arrived(self) -> bool:
        """Rollout ranks, between two engine steps, when a version is still to come: whether it is
        being sent. Posted at the first look, not when the last version was taken: a job that
        stops after a step (the stop vote) then leaves no collective posted that no peer will
        join, which train.py's destroy_process_group counts on ("nothing is pending now")."""
        self.expect()
        return self.work.is_completed()

    def wait(self) -> int:
        """Rollout ranks: the version being sent (waiting for the actor pool if it is not yet)."""
        self.expect()
        self.work.wait()
        self.work = None
        return int(self.value.item())


class PolicyWeights:
    """The actor pool's side of every weight sync: the policy's weights from its shards, into
    this rank's own engine (the rollout group on the actor pool; with rollout.ranks=all the first
    rank broadcasting them on to the critic pool's engines as it feeds its own), or pushed to a
    rollout pool of its own (`push`). `broadcast`: None where no engine sits outside the actor pool.

    What a sync moves (spmdsplit/lora.py): the whole policy; with LoRA its adapter alone, under the
    adapter's saved names (the engines keep the base they loaded); with model.lora_merge the merged
    weights under the base's names, the whole model as without LoRA."""

    def __init__(self, engine, dtype: torch.dtype, broadcast: WeightBroadcast | None, pools,
                 adapter: lora.LoraSpec | None = None, merge: bool = False, ready: WeightsReady | None = None):
        """`adapter`: lora.engines_take_adapter's answer; `merge`: model.lora_merge with a LoRA policy;
        `ready`: continuous generation's signal, announced before each push."""
        self.engine, self.dtype, self.broadcast, self.pools = engine, dtype, broadcast, pools
        self.adapter, self.merge, self.ready = adapter is not None, merge, ready

    def pull(self, broadcast: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights for this rank's engine, streamed from the shards; `broadcast=False`: for
        this pool's engines alone (validation, which only the actor pool generates)."""
        broadcast = broadcast and self.broadcast is not None
        if broadcast:
            self._wait_for_receivers()
        weights = self.stream()
        if broadcast and self.pools.rank in self.broadcast.sources:
            weights = self.broadcast.send(weights)
        return weights

    def stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What the engines take, whole tensor by whole tensor (a pool collective, as iter_full_weights)."""
        if self.adapter:
            return ((lora.saved_name(n), t) for n, t in self.engine.iter_full_weights(self.dtype, only=lora.is_adapter))
        if self.merge:  # merged in fp32 from the weights as they are held, then cast
            return lora.merged(self.engine.iter_full_weights(), lora.scalings(self.engine.model), self.dtype)
        return self.engine.iter_full_weights(self.dtype)

    def push(self, version: int) -> None:
        """A rollout pool of its own: each bucket of the stream gathered from the actor ranks'
        shards to the one that broadcasts it. The merged weights are whole on every actor rank
        (each layer's W + scale * B @ A needs its whole A), so each bucket comes from its owner's
        own copy, as rollout.ranks=all's stream does. `version`: the update they are (0: before any)."""
        if self.ready:
            self.ready.announce(version)
        self._wait_for_receivers()
        if self.adapter:
            shards = (s._replace(name=lora.saved_name(s.name))
                      for s in self.engine.iter_weight_shards(self.dtype, only=lora.is_adapter))
        elif self.merge:
            shards = (WeightShard(name, t, tuple(t.shape), sharded=False) for name, t in self.stream())
        else:
            shards = self.engine.iter_weight_shards(self.dtype)
        self.broadcast.push(shards, self.pools.group("actor"))

    def _wait_for_receivers(self) -> None:
        """The sources meet the engines they feed (busy generating or updating for as long as
        they are), then the pool meets, all under the long timeout: the stream's gathers from the
        shards are the pool's collectives, and none may wait for the receivers."""
        if self.pools.rank in self.broadcast.sources:
            self.broadcast.ready()
        self.pools.meet("actor")
