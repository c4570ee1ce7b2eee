"""NCCL's point-to-point contract on gloo, for tests: loaded into every rank of the multi-rank tests
(tests/support/launch.py's forked ranks, and every torchrun job through tests/support/nccl_site/sitecustomize.py).

gloo sends eagerly and matches messages by tag, so code that would hang on NCCL passes on gloo.
`install()` replaces torch.distributed's point-to-point calls (isend, irecv, send, recv,
batch_isend_irecv) with ones that keep NCCL's rules (torch 2.13's ProcessGroupNCCL without
`device_id`, and NCCL's documented semantics):

- **Tags are ignored**: messages between two ranks match in the order they were posted.
- **One ordered stream per pair of ranks and group**, both directions on it: NCCL creates one
  communicator for the pair (key "low:high") at its first message, with one stream, and runs the
  pair's operations on it in posting order. Here every (group, peer) has a thread that runs this
  rank's operations with that peer one after another.
- **A send completes only once the peer has started the matching receive** (NCCL's rendezvous):
  the n-th send to a peer waits until the peer's stream has reached its n-th receive from us. A
  receive announces itself in the store when it reaches the head of its stream; the send's thread
  waits for that in the store (its own client, without the GIL), so it goes at once, as NCCL's
  would, even while the rank's main thread is busy generating.
- **A grouped call's operations progress together** (`batch_isend_irecv`, ncclGroupStart/End):
  its operations with one peer form one unit on that pair's stream, receives announced at once.

Two ranks that each send the other before receiving therefore wait for each other forever, as on
NCCL. Instead of hanging, the waiting send sees that the peer's stream is itself stuck on a send to
us that our stream cannot receive before ours completes, and fails both sides with one message
naming the ranks, the group and where the sends were posted. Any other send waits at most
SPMDSPLIT_P2P_WAIT_S (300 s) for its receive, then fails saying what the peer's stream is doing.

Collectives are left as they are: they are the grouped form already.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_ORIG = {}
_STATE = None  # the layer's state on this rank, once installed
_HERE = os.path.abspath(__file__)


class ContractError(RuntimeError):
    """What NCCL would have done silently: hang."""


class _Work:
    def __init__(self):
        self._done = threading.Event()
        self._error: BaseException | None = None

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout=None) -> bool:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return True


class _Op:
    """One send or receive of this rank with `peer`, its number in its direction, where posted."""

    def __init__(self, kind: str, tensor, peer: int, where: str):
        self.kind, self.tensor, self.peer, self.where = kind, tensor, peer, where
        self.n = -1
        self.work = _Work()


def _call_site() -> str:
    """The two innermost frames outside this file and torch: the project's lines that posted the op."""
    frame, sites = sys._getframe(2), []
    while frame is not None and len(sites) < 2:
        name = frame.f_code.co_filename
        if (os.path.abspath(name) != _HERE and f"{os.sep}torch{os.sep}" not in name
                and not frame.f_code.co_name.startswith("<")):  # <listcomp>, <genexpr>: their function says it
            sites.append(f"{os.path.relpath(name)}:{frame.f_lineno} in {frame.f_code.co_name}")
        frame = frame.f_back
    return " < ".join(sites) or "?"


class _PairStream:
    """This rank's operations with one peer on one group, run in posting order by one thread."""

    def __init__(self, state: "_State", group, gname: str, peer: int):
        self.state, self.group, self.gname, self.peer = state, group, gname, peer
        self.me = state.rank
        self.sent = self.received = 0  # ops posted so far in each direction
        self.finished = 0  # ops of both directions done
        self.announced = 0  # receives from the peer whose start this stream announced
        self.units: queue.Queue = queue.Queue()
        self.failed: BaseException | None = None
        self.store = None  # a store client of this stream's own, made by its thread
        threading.Thread(target=self._run, name=f"nccl-p2p {gname}:{peer}", daemon=True).start()

    def post(self, ops: list[_Op]) -> None:
        """One unit: a single op, or a grouped call's ops with this peer."""
        for op in ops:
            if op.kind == "send":
                op.n, self.sent = self.sent, self.sent + 1
            else:
                op.n, self.received = self.received, self.received + 1
        self.units.put(ops)

    def _key(self, src: int, dst: int, n: int) -> str:
        return f"recv:{self.gname}:{src}>{dst}:{n}"

    def _head_key(self, src: int, dst: int) -> str:
        return f"head:{self.gname}:{src}>{dst}"

    def _run(self) -> None:
        # Its own client: a blocking wait on a shared one would hold the client's lock, and the
        # rank's main thread uses the default store's client in new_group and barriers (which
        # may themselves wait on a peer that waits for this stream).
        self.store = self.state.new_store()
        while True:
            ops = self.units.get()
            if self.failed is not None:
                for op in ops:
                    op.work._finish(self.failed)
                continue
            try:
                self._run_unit(ops)
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on these ops
                self.failed = e
                for op in ops:
                    if not op.work.is_completed():
                        op.work._finish(e)

    def _run_unit(self, ops: list[_Op]) -> None:
        store, works = self.store, []
        for op in ops:  # every receive of the unit has started: announce it, post it
            if op.kind == "recv":
                works.append((op, _ORIG["irecv"](op.tensor, self.peer, group=self.group)))
                store.set(self._key(self.peer, self.me, op.n), "1")
                self.announced = op.n + 1
        grouped = any(op.kind == "recv" for op in ops)
        for op in ops:
            if op.kind == "send":
                self._wait_for_receive(op, grouped)
                works.append((op, _ORIG["isend"](op.tensor, self.peer, group=self.group)))
        for op, work in works:
            work.wait()
            op.work._finish()
            self.finished += 1

    def _wait_for_receive(self, op: _Op, grouped: bool) -> None:
        """Blocks in the store (without the GIL) until the peer announces the receive: the send
        then goes at once, as NCCL's would, even while this rank's main thread is busy."""
        store, key = self.store, self._key(self.me, self.peer, op.n)
        start, published = time.monotonic(), False
        while True:
            try:
                store.wait([key], timedelta(seconds=0.5))
                break
            except Exception:  # noqa: BLE001 - the store's timeout (DistStoreError): check, then wait on
                pass
            waited = time.monotonic() - start
            if not published:
                # Say what this stream waits on, for the peer's deadlock check and for errors.
                store.set(self._head_key(self.me, self.peer),
                          f"send #{op.n}{' grouped with a receive' if grouped else ''} posted at {op.where}")
                published = True
            self._check_deadlock(op, grouped)
            if waited > self.state.max_wait_s:
                raise ContractError(
                    f"NCCL point-to-point contract: rank {self.me}'s send #{op.n} to rank {self.peer} on "
                    f"{self.state.describe(self.group, self.gname)} (posted at {op.where}) found no matching receive "
                    f"posted in {self.state.max_wait_s:.0f}s; rank {self.peer}'s stream to rank {self.me}: "
                    f"{self._peer_head()}")
        store.delete_key(key)
        if published:
            store.set(self._head_key(self.me, self.peer), "moving")

    def _peer_head(self) -> str:
        key = self._head_key(self.peer, self.me)
        return self.store.get(key).decode() if self.store.check([key]) else "no send waiting"

    def _check_deadlock(self, op: _Op, grouped: bool) -> None:
        """This stream's head is a send the peer has not started to receive. If the peer's stream
        is stuck on a send to us whose receive this stream has not announced (it is queued behind
        ours), neither can ever move: NCCL would hang here, forever."""
        if grouped:
            return  # our receives of this unit are posted: the peer's sends can go
        head = self._peer_head()
        if not head.startswith("send #") or " grouped" in head:
            return
        peer_n = int(head.split()[1].lstrip("#"))
        if peer_n < self.announced:
            return  # we did post that receive: the peer's send will complete
        raise ContractError(
            f"NCCL point-to-point contract: ranks {self.me} and {self.peer} each wait to send to the other on "
            f"{self.state.describe(self.group, self.gname)} before posting the receive (rank {self.me}: send #{op.n} "
            f"posted at {op.where}; rank {self.peer}: {head}). Under NCCL both directions between two ranks run "
            "on one stream in posting order and a send completes only when the peer has posted its receive, "
            "so this hangs; post such sends and receives in one dist.batch_isend_irecv, or use a collective.")


class _State:
    def __init__(self):
        self.rank = dist.get_rank()
        self.max_wait_s = float(os.environ.get("SPMDSPLIT_P2P_WAIT_S", "300"))
        self.streams: dict[tuple[str, int], _PairStream] = {}
        self.lock = threading.Lock()

    def new_store(self):
        """A client of the job's store (torchrun's agent's, or rank 0's), under a prefix of ours."""
        client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                               wait_for_workers=False, timeout=timedelta(seconds=60))
        return dist.PrefixStore("nccl_p2p/", client)

    def describe(self, group, gname: str) -> str:
        ranks = dist.get_process_group_ranks(group)
        return f"group {gname} (ranks {ranks[:8]}{'...' if len(ranks) > 8 else ''})"

    def stream(self, group, peer: int) -> _PairStream:
        group = group or c10d._get_default_group()
        gname = c10d._get_process_group_name(group)
        with self.lock:
            key = (gname, peer)
            if key not in self.streams:
                self.streams[key] = _PairStream(self, group, gname, peer)
            return self.streams[key]


def _state() -> _State:
    global _STATE
    if _STATE is None:
        _STATE = _State()
    return _STATE


def _global(group, rank, group_rank):
    if group_rank is not None:
        return dist.get_global_rank(group or c10d._get_default_group(), group_rank)
    return rank


def _post(kind: str, tensor, peer: int, group, where: str) -> _Work:
    op = _Op(kind, tensor, peer, where)
    _state().stream(group, peer).post([op])
    return op.work


def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    return _post("send", tensor, _global(group, dst, group_dst), group, _call_site())


def irecv(tensor, src=None, group=None, tag=0, group_src=None):
    if src is None and group_src is None:
        raise ContractError("a receive from any source: NCCL has none (name the source rank)")
    return _post("recv", tensor, _global(group, src, group_src), group, _call_site())


def send(tensor, dst=None, group=None, tag=0, group_dst=None):
    isend(tensor, dst, group, tag, group_dst).wait()


def recv(tensor, src=None, group=None, tag=0, group_src=None):
    peer = _global(group, src, group_src)
    irecv(tensor, peer, group, tag).wait()
    return peer


def batch_isend_irecv(p2p_op_list):
    """One grouped call: per peer, its ops form one unit of that pair's stream."""
    where, by_peer = _call_site(), {}
    for p in p2p_op_list:
        kind = "send" if p.op in (isend, _ORIG["isend"]) else "recv"
        peer = p.peer  # P2POp holds the global rank
        by_peer.setdefault((id(p.group), peer), (p.group, peer, []))[2].append(_Op(kind, p.tensor, peer, where))
    for group, peer, ops in by_peer.values():
        _state().stream(group, peer).post(ops)
    return [op.work for _, _, ops in by_peer.values() for op in ops]


_PATCHES = {"isend": isend, "irecv": irecv, "send": send, "recv": recv, "batch_isend_irecv": batch_isend_irecv}


def install() -> None:
    """Patch torch.distributed's point-to-point calls in this process (idempotent)."""
    if _ORIG:
        return
    for name, fn in _PATCHES.items():
        _ORIG[name] = getattr(c10d, name)
        setattr(c10d, name, fn)  # what torch's own helpers (send_object_list, P2POp's check) call
        setattr(dist, name, fn)  # what `dist.isend(...)` calls


def installed() -> bool:
    return bool(_ORIG)


def unfinished() -> list[str]:
    """The streams of this process with operations posted and not done (a send nobody received):
    a process left so would hand them to the next receive on that pair."""
    if _STATE is None:
        return []
    return [f"{gname}:{peer}" for (gname, peer), s in list(_STATE.streams.items())
            if s.failed is None and s.finished < s.sent + s.received]
