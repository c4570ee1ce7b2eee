"""Moves the rows of a global batch between two ordered lists of global ranks (pools) by P2P.

The global batch of `num_rows` rows is split contiguously over each list with `row_ranges`:
source i holds row_ranges(num_rows, len(src_ranks))[i], destination j ends with
row_ranges(num_rows, len(dst_ranks))[j]. Each source sends each destination exactly the overlap
of their ranges, so no rank ever holds rows it does not need and nothing is gathered on one rank.

Wire format, per (source, destination) pair with a non-empty overlap, all with the same `tag`:
  1. header: int64 tensor [meta_len, payload_len]
  2. meta: pickled (tensor column specs, non-tensor columns) as a uint8 tensor
  3. payload (only if payload_len > 0): every tensor column's bytes in one uint8 tensor
Raw bytes instead of pickled tensors because pickling is ~20x slower here, and because a uint8
view carries any dtype (bool, bfloat16) that gloo cannot send natively.

Self-delivery: rows a rank sends to itself (it is in both lists, e.g. colocate placement) never
go through torch.distributed. `send_rows` parks them in a module-level dict keyed by tag and
`recv_rows` on the same rank takes them out, so on such a rank send_rows must run first (which
`exchange_rows` does). They are views of the sender's tensors, not copies: colocate is a no-op.

Only point-to-point ops on the default group with GLOBAL ranks: no collective may be used, since
the two pools run different code and would never meet in one.
"""

from __future__ import annotations

import pickle
import time
from typing import Any, Sequence

import torch
import torch.distributed as dist

from spmdsplit.batch import Batch

_ALIGN = 16  # column offsets in the payload, so every column is a zero-copy, aligned dtype view
_local: dict[tuple[str, int], Any] = {}  # self-delivery, keyed by (kind, tag)


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

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        self._works, self._buffers = [], []


def _rank() -> int:
    # Lets a single process (colocate, one rank) exchange with itself without a process group.
    return dist.get_rank() if dist.is_initialized() else 0


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


def _bytes_tensor(data: bytes, device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _isend_message(meta: bytes, payload: torch.Tensor | None, dst: int, tag: int, device) -> PendingSend:
    meta_t = _bytes_tensor(meta, device)
    n_payload = 0 if payload is None else payload.numel()
    header = torch.tensor([meta_t.numel(), n_payload], dtype=torch.int64, device=device)
    bufs = [header, meta_t] + ([payload] if n_payload else [])
    # Same peer and tag for all three, so they arrive in order; the tag keeps phases apart on gloo
    # (NCCL ignores tags: there, phases stay apart only because every rank posts them in order).
    return PendingSend([dist.isend(b, dst, tag=tag) for b in bufs], bufs)


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


def send_rows(batch: Batch, src_ranks, dst_ranks, num_rows: int, tag: int, device="cpu") -> PendingSend:
    """On a source rank: non-blocking send of its rows to every destination that needs some.
    Rows for other ranks are copied at call time, so `batch` may be changed right after; rows
    for itself are kept as views (see the module doc)."""
    src, dst = _check_ranks(src_ranks, dst_ranks, num_rows)
    me = _rank()
    if me not in src:
        raise ValueError(f"send_rows called on rank {me}, which is not in src_ranks {src}")
    mine = row_ranges(num_rows, len(src))[src.index(me)]
    if len(batch) != mine[1] - mine[0]:
        raise ValueError(
            f"rank {me} holds rows {mine} of {num_rows} ({mine[1] - mine[0]} rows) but got a batch of {len(batch)}"
        )
    if me in dst and ("rows", tag) in _local:
        raise RuntimeError(f"rows for tag {tag} sent to self were never received: reusing a tag?")
    pending = PendingSend()
    for d, theirs in zip(dst, row_ranges(num_rows, len(dst))):
        lo, hi = _overlap(mine, theirs)
        if not _nonempty((lo, hi)):
            continue
        piece = batch.slice(lo - mine[0], hi - mine[0])
        if d == me:
            _local[("rows", tag)] = piece.to(device)
            continue
        p = _isend_message(*_pack(piece, device), d, tag, device)
        pending._works += p._works
        pending._buffers += p._buffers
    return pending


def recv_rows(src_ranks, dst_ranks, num_rows: int, tag: int, device="cpu", stats: dict | None = None) -> Batch:
    """On a destination rank: blocks until its rows arrived; returns them in global row order.
    A destination with no rows gets an empty Batch (no columns: nobody sent it any).

    `stats`, if given, receives `bytes` (received over the wire) and `transfer_us` (from all
    headers in to all bodies in): the transfer itself, without the wait for the senders."""
    src, dst = _check_ranks(src_ranks, dst_ranks, num_rows)
    me = _rank()
    if me not in dst:
        raise ValueError(f"recv_rows called on rank {me}, which is not in dst_ranks {dst}")
    mine = row_ranges(num_rows, len(dst))[dst.index(me)]
    peers = [s for s, theirs in zip(src, row_ranges(num_rows, len(src))) if _nonempty(_overlap(mine, theirs))]
    # Post every header receive first, then all bodies: the sources then stream in parallel.
    headers = {s: torch.empty(2, dtype=torch.int64, device=device) for s in peers if s != me}
    for w in [dist.irecv(h, s, tag=tag) for s, h in headers.items()]:
        w.wait()
    headers_in = time.perf_counter_ns()
    bodies, works = {}, []
    for s, h in headers.items():
        meta_len, payload_len = h.tolist()
        meta = torch.empty(meta_len, dtype=torch.uint8, device=device)
        payload = torch.empty(payload_len, dtype=torch.uint8, device=device) if payload_len else None
        works += [dist.irecv(b, s, tag=tag) for b in (meta, payload) if b is not None]
        bodies[s] = (meta, payload)
    for w in works:
        w.wait()
    if stats is not None:
        stats["bytes"] = sum(m.numel() + (p.numel() if p is not None else 0) for m, p in bodies.values())
        stats["transfer_us"] = (time.perf_counter_ns() - headers_in) // 1000
    pieces = []
    for s in peers:
        if s == me:
            if ("rows", tag) not in _local:
                raise RuntimeError(f"rank {me} expects rows from itself for tag {tag}: call send_rows first")
            pieces.append(_local.pop(("rows", tag)))
        else:
            pieces.append(_unpack(*bodies[s]))
    # One piece: hand back its views as they are (torch.cat would copy every column once more).
    return pieces[0] if len(pieces) == 1 else Batch.concat(pieces)


def exchange_rows(
    batch: Batch | None, src_ranks: Sequence[int], dst_ranks: Sequence[int], num_rows: int, tag: int, device="cpu"
) -> Batch | None:
    """For code run on every rank: sends (if a source), receives (if a destination), waits for
    its own sends. Sending first, non-blocking, is what keeps a rank in both lists from deadlocking."""
    me, src_ranks, dst_ranks = _rank(), list(src_ranks), list(dst_ranks)
    pending = PendingSend()
    if me in src_ranks:
        if batch is None:
            raise ValueError(f"rank {me} is a source but was given no batch")
        pending = send_rows(batch, src_ranks, dst_ranks, num_rows, tag, device)
    result = recv_rows(src_ranks, dst_ranks, num_rows, tag, device) if me in dst_ranks else None
    pending.wait()
    return result


def send_object(obj: Any, dst: int, tag: int, device="cpu") -> PendingSend:
    """Non-blocking send of a small picklable object (e.g. a metrics dict) to global rank `dst`."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    if dst == _rank():
        if ("object", tag) in _local:
            raise RuntimeError(f"object for tag {tag} sent to self was never received: reusing a tag?")
        _local[("object", tag)] = data  # pickled, so the receiver gets a copy as it would remotely
        return PendingSend()
    return _isend_message(data, None, dst, tag, device)


def recv_object(src: int, tag: int, device="cpu") -> Any:
    """Blocks until the object `send_object` sent from global rank `src` with `tag` arrived."""
    if src == _rank():
        if ("object", tag) not in _local:
            raise RuntimeError(f"no object sent to self for tag {tag}: call send_object first")
        return pickle.loads(_local.pop(("object", tag)))
    header = torch.empty(2, dtype=torch.int64, device=device)
    dist.recv(header, src, tag=tag)
    meta = torch.empty(int(header[0]), dtype=torch.uint8, device=device)
    dist.recv(meta, src, tag=tag)
    return pickle.loads(meta.cpu().numpy().tobytes())
