"""Ordered point-to-point messages between ranks, and the rows of a global batch moved by them.

**NCCL's contract** (docs/design.md): tags are ignored; between two ranks of a group both
directions run on one stream, in posting order; a send completes only once the peer has posted the
matching receive. Every CPU test holds the code to it (tests/support/nccl_p2p.py), since gloo forgives all
three. So:

**Correct by order, never by tag.** NCCL ignores point-to-point tags: messages between two ranks
match in the order they were posted. So nothing here passes a tag (gloo then follows the same
rule, and every CPU test holds the code to it), and every message starts with a header the
receiver checks against what it expects: kind, step, chunk and a per-pair sequence number. A
message out of place fails at once with one line naming what was expected and what arrived,
instead of being read as something else. The order itself is the caller's to keep; the
conversation between the pools is written down in `spmdsplit/messages.py`.

Wire format, per message, on one `Link` (a process group):
  1. header: int64 tensor [kind, step, chunk, seq, meta_len, payload_len]
  2. meta: pickled (tensor column specs, non-tensor columns) or a pickled object, as uint8
  3. payload (only if payload_len > 0): every tensor column's bytes in one uint8 tensor
Raw bytes instead of pickled tensors because pickling is ~20x slower here, and because a uint8
view carries any dtype (bool, bfloat16) that gloo cannot send natively.

Rows: the global batch of `num_rows` rows is split contiguously over each rank list with
`row_ranges`; each source sends each destination exactly the overlap of their ranges, so no rank
ever holds rows it does not need and nothing is gathered on one rank. `reorder_rows` puts the
rows held by one pool into another global order (balancing, spmdsplit/balanced_order.py): each rank
sends each other rank only the rows of its new slice, but there any two ranks may send each other
in the same phase, so it is a collective over the pool's group (all_to_all, NCCL's grouped call),
never separate sends and receives.

Self-delivery: what a rank sends to itself (it is in both lists, e.g. colocate placement) never
goes through torch.distributed: the link parks it under its (kind, step, chunk) and the receive on
the same rank takes it out, so on such a rank the send must come first. Rows sent to self are
views of the sender's tensors, not copies: colocate moves nothing.

Between pools only point-to-point ops, each one way in its phase (the schedule in messages.py):
no collective, since the two pools run different code and would never meet in one.
"""

from __future__ import annotations

import pickle
import time
from typing import Any, NamedTuple, Sequence

import torch
import torch.distributed as dist

from spmdsplit.batch import Batch
from spmdsplit.distributed import world_rank

_ALIGN = 16  # column offsets in the payload, so every column is a zero-copy, aligned dtype view
_HEADER = 6


class ProtocolError(RuntimeError):
    """A message arrived that is not the one the schedule says comes next."""


class Message(NamedTuple):
    kind: str
    step: int
    chunk: int = 0

    def describe(self, seq: int | None = None) -> str:
        text = f"{self.kind} of step {self.step}" + (f" chunk {self.chunk}" if self.chunk else "")
        return text if seq is None else f"{text} (message #{seq})"


def row_ranges(num_rows: int, num_parts: int) -> list[tuple[int, int]]:
    """`num_parts` contiguous (start, end) ranges covering range(num_rows); earlier ones larger."""
    if num_parts <= 0 or num_rows < 0:
        raise ValueError(f"need num_parts > 0 and num_rows >= 0, got {num_parts=} {num_rows=}")
    base, extra = divmod(num_rows, num_parts)
    ranges, start = [], 0
    for i in range(num_parts):
        end = start + base + (i < extra)
        ranges.append((start, end))
        start = end
    return ranges


class PendingSend:
    """Non-blocking sends in flight. Holds the buffers too: freeing them before the isend
    completed would send garbage (or crash on CUDA)."""

    def __init__(self, works=(), buffers=()):
        self._works, self._buffers = list(works), list(buffers)

    def add(self, other: "PendingSend") -> "PendingSend":
        self._works += other._works
        self._buffers += other._buffers
        return self

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        self._works, self._buffers = [], []


class Link:
    """Checked, ordered messages over one process group. `kinds` names every kind of message that
    may travel on it (its index is the kind's code in the header). The group's timeout is what a
    receive on this link may wait: between pools that is a long one (a busy pool is not dead)."""

    def __init__(self, kinds: Sequence[str], group=None, device="cpu", name: str = "link"):
        self.kinds = list(kinds)
        self.group, self.device, self.name = group, torch.device(device), name
        self._sent: dict[int, int] = {}  # peer -> messages sent to it
        self._received: dict[int, int] = {}  # peer -> messages received from it
        self._local: dict[tuple, Any] = {}  # self-delivery: (kind, step, chunk) -> rows or pickled object
        self.connected: set[tuple[int, int]] | None = None  # after `connect`: the pairs that may talk

    def connect(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Every pair of ranks that will exchange messages on this link does so once, now, while
        every rank is at the same point of start-up. NCCL creates the communicator of two ranks at
        their first point-to-point message, and the first of them to get there blocks until the
        other arrives; it sets up each direction's connection at that direction's first use. Left
        to the first step, either wait would eat the overlap of the pools. So each pair sends one
        token each way: the lower rank first, then the higher (the rows generated and the
        advantages flow from higher ranks to lower). `pairs` (any direction) are taken in one
        order on every rank, each pair once, which cannot deadlock: the earliest pair not yet done
        always has both its ranks waiting at it, and within a pair the two directions are posted
        in the same order on both sides. From here on a message to a pair not connected is an
        error (the schedule missed it)."""
        me = world_rank()
        token = torch.zeros(1, device=self.device)
        ordered = list(dict.fromkeys((min(a, b), max(a, b)) for a, b in pairs if a != b))
        for low, high in ordered:
            if me == low:
                dist.send(token, high, group=self.group)
                dist.recv(token, high, group=self.group)
            elif me == high:
                dist.recv(token, low, group=self.group)
                dist.send(token, low, group=self.group)
            if me in (low, high):
                token.sum().item()  # on NCCL: the host waits here, so pairs are done in this order
        self.connected = set(ordered)

    def _check_connected(self, peer: int) -> None:
        me = world_rank()
        if self.connected is not None and (min(me, peer), max(me, peer)) not in self.connected:
            raise ProtocolError(f"rank {me} talks to rank {peer} on the {self.name} link, a pair that was not "
                                "connected at start-up (Link.connect)")

    # ---- one message

    def isend(self, msg: Message, meta: bytes, payload: torch.Tensor | None, dst: int) -> PendingSend:
        self._check_connected(dst)
        seq = self._sent.get(dst, 0)
        self._sent[dst] = seq + 1
        meta_t = torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(self.device)
        n_payload = 0 if payload is None else payload.numel()
        header = torch.tensor([self.kinds.index(msg.kind), msg.step, msg.chunk, seq, meta_t.numel(), n_payload],
                              dtype=torch.int64, device=self.device)
        bufs = [header, meta_t] + ([payload] if n_payload else [])
        return PendingSend([dist.isend(b, dst, group=self.group) for b in bufs], bufs)

    def recv_headers(self, expect: Message, peers: Sequence[int]) -> dict[int, tuple[int, int]]:
        """Posts a header receive from every peer at once (so they stream in parallel), checks each;
        returns peer -> (meta_len, payload_len)."""
        for s in peers:
            self._check_connected(s)
        headers = {s: torch.empty(_HEADER, dtype=torch.int64, device=self.device) for s in peers}
        for w in [dist.irecv(h, s, group=self.group) for s, h in headers.items()]:
            w.wait()
        return {s: self._check(expect, s, h.tolist()) for s, h in headers.items()}

    def _check(self, expect: Message, src: int, header: list[int]) -> tuple[int, int]:
        kind, step, chunk, seq, meta_len, payload_len = header
        want_seq = self._received.get(src, 0)
        self._received[src] = want_seq + 1
        name = self.kinds[kind] if 0 <= kind < len(self.kinds) else f"<unknown kind {kind}>"
        got = Message(name, step, chunk)
        if got != expect or seq != want_seq:
            raise ProtocolError(
                f"rank {world_rank()} expected {expect.describe(want_seq)} from rank {src} on the {self.name} link, "
                f"got {got.describe(seq)}"
            )
        return meta_len, payload_len

    def recv_bodies(self, sizes: dict[int, tuple[int, int]]) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
        bodies, works = {}, []
        for s, (meta_len, payload_len) in sizes.items():
            meta = torch.empty(meta_len, dtype=torch.uint8, device=self.device)
            payload = torch.empty(payload_len, dtype=torch.uint8, device=self.device) if payload_len else None
            works += [dist.irecv(b, s, group=self.group) for b in (meta, payload) if b is not None]
            bodies[s] = (meta, payload)
        for w in works:
            w.wait()
        return bodies

    # ---- self-delivery

    def park(self, msg: Message, value: Any) -> None:
        if tuple(msg) in self._local:
            raise ProtocolError(f"rank {world_rank()} sent itself {msg.describe()} twice without receiving it")
        self._local[tuple(msg)] = value

    def unpark(self, msg: Message) -> Any:
        if tuple(msg) not in self._local:
            raise ProtocolError(f"rank {world_rank()} expected {msg.describe()} from itself, but it was never sent")
        return self._local.pop(tuple(msg))

    # ---- small objects (metrics, control)

    def send_object(self, obj: Any, dst: int, msg: Message) -> PendingSend:
        """Non-blocking send of a small picklable object to global rank `dst`."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if dst == world_rank():
            self.park(msg, data)  # pickled, so the receiver gets a copy as it would remotely
            return PendingSend()
        return self.isend(msg, data, None, dst)

    def recv_object(self, src: int, msg: Message) -> Any:
        """Blocks until the object `msg` from global rank `src` arrived."""
        if src == world_rank():
            return pickle.loads(self.unpark(msg))
        sizes = self.recv_headers(msg, [src])
        meta, _ = self.recv_bodies(sizes)[src]
        return pickle.loads(meta.cpu().numpy().tobytes())


# ------------------------------------------------------------------------------------ rows


def _check_ranks(src_ranks, dst_ranks, num_rows) -> tuple[list[int], list[int]]:
    src, dst = list(src_ranks), list(dst_ranks)
    world = dist.get_world_size() if dist.is_initialized() else 1
    for name, ranks in (("src_ranks", src), ("dst_ranks", dst)):
        if not ranks:
            raise ValueError(f"{name} is empty")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"{name} has duplicate ranks: {ranks}")
        if any(not 0 <= r < world for r in ranks):
            raise ValueError(f"{name} {ranks} has ranks outside the world of size {world}")
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    return src, dst


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return max(a[0], b[0]), min(a[1], b[1])


def _nonempty(r: tuple[int, int]) -> bool:
    return r[0] < r[1]


def _pack(batch: Batch, device) -> tuple[bytes, torch.Tensor | None]:
    specs, offset = [], 0
    for name, t in batch.tensors.items():
        nbytes = t.numel() * t.element_size()
        specs.append((name, t.dtype, tuple(t.shape), offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    payload = torch.empty(offset, dtype=torch.uint8, device=device) if offset else None
    for (name, _, _, off, nbytes), t in zip(specs, batch.tensors.values()):
        if nbytes:
            payload[off : off + nbytes].copy_(t.detach().reshape(-1).view(torch.uint8))
    return pickle.dumps((specs, batch.non_tensors), protocol=pickle.HIGHEST_PROTOCOL), payload


def _unpack(meta: torch.Tensor, payload: torch.Tensor | None) -> Batch:
    specs, non_tensors = pickle.loads(meta.cpu().numpy().tobytes())
    tensors = {}
    for name, dtype, shape, off, nbytes in specs:
        if nbytes:
            tensors[name] = payload[off : off + nbytes].view(dtype).view(shape)
        else:
            tensors[name] = torch.empty(shape, dtype=dtype, device=meta.device)
    return Batch(tensors, non_tensors)


def row_pairs(src_ranks: Sequence[int], dst_ranks: Sequence[int], num_rows: int) -> list[tuple[int, int]]:
    """(source, destination) of every message `send_rows` sends for one exchange, in the order it
    sends them; what a rank keeps for itself is left out."""
    src, dst = list(src_ranks), list(dst_ranks)
    return [(s, d) for s, mine in zip(src, row_ranges(num_rows, len(src)))
            for d, theirs in zip(dst, row_ranges(num_rows, len(dst))) if s != d and _nonempty(_overlap(mine, theirs))]


def send_rows(link: Link, msg: Message, batch: Batch, src_ranks, dst_ranks, num_rows: int) -> PendingSend:
    """On a source rank: non-blocking send of its rows to every destination that needs some.
    Rows for other ranks are copied at call time, so `batch` may be changed right after; rows
    for itself are kept as views (see the module doc)."""
    src, dst = _check_ranks(src_ranks, dst_ranks, num_rows)
    me = world_rank()
    if me not in src:
        raise ValueError(f"send_rows called on rank {me}, which is not in src_ranks {src}")
    mine = row_ranges(num_rows, len(src))[src.index(me)]
    if len(batch) != mine[1] - mine[0]:
        raise ValueError(
            f"rank {me} holds rows {mine} of {num_rows} ({mine[1] - mine[0]} rows) but got a batch of {len(batch)}"
        )
    pending = PendingSend()
    for d, theirs in zip(dst, row_ranges(num_rows, len(dst))):
        lo, hi = _overlap(mine, theirs)
        if not _nonempty((lo, hi)):
            continue
        piece = batch.slice(lo - mine[0], hi - mine[0])
        if d == me:
            link.park(msg, piece.to(link.device))
        else:
            pending.add(link.isend(msg, *_pack(piece, link.device), d))
    return pending


def recv_rows(link: Link, msg: Message, src_ranks, dst_ranks, num_rows: int, stats: dict | None = None) -> Batch:
    """On a destination rank: blocks until its rows arrived; returns them in global row order.
    A destination with no rows gets an empty Batch (no columns: nobody sent it any).

    `stats`, if given, receives `bytes` (received over the wire) and `transfer_us` (from all
    headers in to all bodies in): the transfer itself, without the wait for the senders."""
    src, dst = _check_ranks(src_ranks, dst_ranks, num_rows)
    me = world_rank()
    if me not in dst:
        raise ValueError(f"recv_rows called on rank {me}, which is not in dst_ranks {dst}")
    mine = row_ranges(num_rows, len(dst))[dst.index(me)]
    peers = [s for s, theirs in zip(src, row_ranges(num_rows, len(src))) if _nonempty(_overlap(mine, theirs))]
    sizes = link.recv_headers(msg, [s for s in peers if s != me])
    headers_in = time.perf_counter_ns()
    bodies = link.recv_bodies(sizes)
    if stats is not None:
        stats["bytes"] = sum(m.numel() + (p.numel() if p is not None else 0) for m, p in bodies.values())
        stats["transfer_us"] = (time.perf_counter_ns() - headers_in) // 1000
    pieces = [link.unpark(msg) if s == me else _unpack(*bodies[s]) for s in peers]
    # One piece: hand back its views as they are (torch.cat would copy every column once more).
    # Pieces from several senders are rollout rows of different response widths: padded to one.
    return pieces[0] if len(pieces) == 1 else Batch.concat(pieces, pad_to_widest=True)


def reorder_rows(msg: Message, batch: Batch, ranks: Sequence[int], order: Sequence[int], group, device) -> Batch:
    """For every rank of `ranks` (one pool, whose process group is `group`): the global batch,
    held in contiguous `row_ranges` by `ranks`, put into a new global order. `order[p]` is the row
    (its old place) that goes to place p; afterwards each rank holds its `row_ranges` slice of the
    new order. Every rank must pass the same `order`.

    A collective, not point-to-point messages: here every rank may send every other rank and
    receive from it in the same phase, which NCCL cannot run as separate sends and receives (both
    directions of a pair share one stream, and a send completes only once the peer has posted its
    receive, so two ranks sending each other first wait forever: docs/design.md). So one
    all_to_all of sizes, checked (the message's step and chunk, and the order's fingerprint, must
    agree on every rank), then one all_to_all of the pieces' bytes, each NCCL's grouped call. Rows
    a rank keeps never leave it (views, as with self-delivery)."""
    ranks, me = list(ranks), world_rank()
    if sorted(order) != list(range(len(order))):
        raise ValueError(f"order must be a permutation of range({len(order)})")
    ranges = row_ranges(len(order), len(ranks))
    holder = [r for r, (lo, hi) in enumerate(ranges) for _ in range(lo, hi)]  # old place -> index in ranks
    mine = ranks.index(me)
    old_lo, old_hi = ranges[mine]
    if len(batch) != old_hi - old_lo:
        raise ValueError(f"rank {me} holds rows {(old_lo, old_hi)} of {len(order)} but got a batch of {len(batch)}")
    if len(ranks) == 1:
        return batch.index(list(order))
    pieces = []
    for lo, hi in ranges:
        theirs = [order[p] - old_lo for p in range(lo, hi) if old_lo <= order[p] < old_hi]
        pieces.append(batch.index(theirs) if theirs else None)
    fingerprint = hash(tuple(order)) & (2**62 - 1)
    arrived_from = exchange_pieces(msg, pieces, ranks, group, device, fingerprint, "balances")
    new_lo, new_hi = ranges[mine]
    sources = sorted({holder[order[p]] for p in range(new_lo, new_hi)})
    arrived = Batch.concat([arrived_from[s] for s in sources], pad_to_widest=True)
    # `arrived` holds the rows source by source, each source's in new order: put them in new order.
    arrival = sorted(range(new_lo, new_hi), key=lambda p: (holder[order[p]], p))
    place_in_arrived = {p: i for i, p in enumerate(arrival)}
    return arrived.index([place_in_arrived[p] for p in range(new_lo, new_hi)])


def exchange_pieces(msg: Message, pieces: Sequence[Batch | None], ranks: Sequence[int], group, device,
                    fingerprint: int, doing: str) -> list[Batch | None]:
    """The collective under `reorder_rows` and `regroup_rows`: `pieces[i]` (rows or None) goes to
    `ranks[i]`; returns what each rank of `ranks` sent this one (this rank's own piece stays here,
    as a view). One all_to_all of sizes, checked (the message's step and chunk and the caller's
    `fingerprint` of the plan must agree on every rank, else a ProtocolError naming both), then one
    all_to_all of the pieces' bytes: each is NCCL's grouped call, since any two ranks may send each
    other here."""
    ranks, me = list(ranks), world_rank()
    mine = ranks.index(me)
    if len(ranks) == 1:
        return [pieces[0]]
    device = torch.device(device)
    blobs = [_blob(None if i == mine else piece, device) for i, piece in enumerate(pieces)]
    sizes_out = torch.tensor([[msg.step, msg.chunk, fingerprint, b.numel()] for b in blobs], dtype=torch.int64,
                             device=device)
    sizes_in = torch.empty_like(sizes_out)
    dist.all_to_all_single(sizes_in, sizes_out, group=group)
    sizes_in = sizes_in.tolist()
    for i, (step, chunk, theirs, _) in enumerate(sizes_in):
        if (step, chunk) != (msg.step, msg.chunk) or theirs != fingerprint:
            raise ProtocolError(
                f"rank {me} {doing} {msg.describe()} while rank {ranks[i]} of its pool {doing} "
                f"{Message(msg.kind, step, chunk).describe()}" + ("" if (step, chunk) != (msg.step, msg.chunk)
                                                                   else " in another order"))
    received = torch.empty(sum(n for *_, n in sizes_in), dtype=torch.uint8, device=device)
    dist.all_to_all_single(received, torch.cat(blobs), output_split_sizes=[n for *_, n in sizes_in],
                           input_split_sizes=[b.numel() for b in blobs], group=group)
    offsets = [0]
    for *_, n in sizes_in:
        offsets.append(offsets[-1] + n)
    return [pieces[i] if i == mine else (_unblob(received[offsets[i]:offsets[i + 1]]) if sizes_in[i][3] else None)
            for i in range(len(ranks))]


def regroup_rows(msg: Message, rows: Batch, destination: Sequence[int], ranks: Sequence[int], group, device,
                 fingerprint: int = 0) -> list[Batch]:
    """For every rank of `ranks` (one group): row i of this rank's `rows` goes to
    `ranks[destination[i]]` (-1: dropped). Unlike `reorder_rows`, ranks may hold and receive any
    number of rows. Returns the pieces that arrived, one per source rank in `ranks` order (empty
    ones left out), each in its sender's order; the caller puts them in its own order."""
    pieces = []
    for d in range(len(ranks)):
        idx = [i for i, dst in enumerate(destination) if dst == d]
        pieces.append(rows.index(idx) if idx else None)
    arrived = exchange_pieces(msg, pieces, ranks, group, device, fingerprint, "regroups")
    return [piece for piece in arrived if piece is not None and len(piece)]


def _blob(piece: Batch | None, device) -> torch.Tensor:
    """A piece of rows as one uint8 tensor: [meta length as 8 bytes, meta, padding, payload];
    nothing for no piece."""
    if piece is None:
        return torch.empty(0, dtype=torch.uint8, device=device)
    meta, payload = _pack(piece, device)
    head = -(-(8 + len(meta)) // _ALIGN) * _ALIGN
    blob = torch.zeros(head + (0 if payload is None else payload.numel()), dtype=torch.uint8, device=device)
    blob[:8].copy_(torch.tensor([len(meta)], dtype=torch.int64).view(torch.uint8))
    blob[8:8 + len(meta)].copy_(torch.frombuffer(bytearray(meta), dtype=torch.uint8))
    if payload is not None:
        blob[head:].copy_(payload)
    return blob


def _unblob(blob: torch.Tensor) -> Batch:
    meta_len = int(blob[:8].cpu().view(torch.int64).item())
    head = -(-(8 + meta_len) // _ALIGN) * _ALIGN
    return _unpack(blob[8:8 + meta_len], blob[head:] if blob.numel() > head else None)
