"""Execute one device's part of a switch Program over torch state stores, with real communication.

A switch Program (``parashift.vps.transition.lower``) names per-tensor buffers
``old:<kind>:<tensor>`` / ``new:<kind>:<tensor>`` and packs/unpacks *pieces* (global boxes) listed
in ``meta["pieces"]``. The runtime's :class:`~parashift.exec.state.StateStore` keeps a rank's
states in flat buffers; :func:`piece_view` maps a piece onto a strided view of the right flat
buffer (no copy), so ``keep`` copies, packs and unpacks are strided tensor copies.

:class:`SwitchExecutor` runs the streams of one device (``pack``, ``send<l>``, ``recv<l>``,
``coll<l>``, ``unpack``) honoring ``deps``. How it keeps close to the bare cost of moving bytes:

- *no needless packing*: in a point-to-point transfer or a broadcast every piece of at least
  ``BIG`` bytes travels as a message of its own (a broadcast as a series of broadcasts), sent
  straight from the old state buffer and received straight into the new one wherever its box is
  contiguous there; only small pieces (and boxes strided at one end) go through a staging buffer,
  one per transfer (the planner coalesces per peer); scatter and gather pack their root's chunks;
- *pooled staging*: staging buffers come from a :class:`BufferPool` and go back as soon as
  their transfer is sent or unpacked, so later stages (and later switches) reuse them;
- *overlap*: point-to-point messages are all issued as soon as their deps allow (tags keep
  them apart), in parts of at most ``CHUNK`` bytes; while they are on the wire the driver copies
  the kept pieces (in slices of ``SLICE`` bytes) and checksums each part as soon as it has been
  sent or has landed;
- *cheap checks*: a checksum is one vectorized 64-bit sum per part (memory speed), folded per
  transfer, so verification publishes one value per transfer; the caller compares them (see
  :mod:`parashift.exec.switch`).

:func:`state_alloc` allocates the destination store huge-page backed (first-touch faults of
4 KiB pages cost about a tenth of a second per GB).
"""
from __future__ import annotations

import collections
import ctypes
import queue
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from ..errors import SwitchAborted
from ..ir.program import Instr, Program
from .state import StateStore

#: Pieces of at least this many bytes travel as messages of their own (p2p transfers and broadcasts).
BIG = 1 << 16
#: Messages travel in parts of at most this many bytes (checksummed as they land). 16 MiB: a part
#: is a wait, a queue hand-off and a gloo rendezvous; against 4 MiB parts the switch's CPU was
#: lower in 5 of 6 interleaved pairs (by 2-6%; one pair 3% higher). Smaller parts did not make
#: the checksums cache-hot.
CHUNK = 1 << 24
#: Kept pieces are copied in slices of about this many bytes, so landed parts wait at most one slice.
SLICE = 1 << 22
#: Parts per transfer (gloo tags are ``transfer * MAX_MSGS + part``).
MAX_MSGS = 1 << 24

#: Transparent huge pages: buffers of at least this many bytes are advised to use them.
HUGE = 1 << 21

__all__ = ["piece_view", "kind_tensor", "SwitchExecutor", "BufferPool", "PieceTable", "crc", "checksum",
           "state_alloc", "ExecStats", "reserve_waiters"]


class _Waiters:
    """Daemon threads that wait on issued work (gloo completes p2p work only inside ``wait()``),
    kept across switches: issuing a message hands it to an idle thread instead of starting one
    (``Thread.start`` blocks until the new thread runs, which costs a scheduling round on a busy
    host). :meth:`reserve` starts threads ahead of a switch."""

    def __init__(self) -> None:
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.idle = 0
        self.lock = threading.Lock()

    def _loop(self) -> None:
        while True:
            fn, args = self.q.get()
            fn(*args)
            with self.lock:
                self.idle += 1

    def _spawn(self, n: int) -> None:
        for _ in range(n):
            threading.Thread(target=self._loop, name="parashift-switch-wait", daemon=True).start()

    def reserve(self, n: int) -> None:
        """Make sure at least ``n`` threads are idle."""
        with self.lock:
            need = max(0, n - self.idle)
            self.idle += need
        self._spawn(need)

    def submit(self, fn: Callable, *args: Any) -> None:
        with self.lock:
            spawn = self.idle == 0
            if not spawn:
                self.idle -= 1
        self.q.put((fn, args))
        if spawn:
            self._spawn(1)


_WAITERS = _Waiters()


def reserve_waiters(program: Program, device: int) -> None:
    """Start the threads ``device``'s part of ``program`` waits on (call it before the switch)."""
    rp = program.ranks.get(device)
    _WAITERS.reserve(sum(ins.op != "copy" for v in (rp.streams.values() if rp is not None else ()) for ins in v))


def _advise_huge(t: torch.Tensor) -> None:
    """Ask Linux to back the 2 MiB-aligned interior of ``t`` (not yet touched) with huge pages:
    first-touch page faults then cost ~1/10 (a 4 KiB-page fault per 4 KiB runs at ~1.3 GB/s)."""
    n = t.numel() * t.element_size()
    if n < 2 * HUGE or not sys.platform.startswith("linux"):
        return
    a = -(-t.data_ptr() // HUGE) * HUGE
    e = (t.data_ptr() + n) // HUGE * HUGE
    if e > a and _libc() is not None:
        _libc().madvise(ctypes.c_void_p(a), ctypes.c_size_t(e - a), 14)  # MADV_HUGEPAGE; advice only


_LIBC: list = []


def _libc():
    if not _LIBC:
        try:
            lib = ctypes.CDLL(None, use_errno=True)
            lib.madvise  # noqa: B018 - raises AttributeError where libc has none
        except (OSError, AttributeError):  # pragma: no cover - no madvise: small pages, same bytes
            lib = None
        _LIBC.append(lib)
    return _LIBC[0]


def state_alloc(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed state buffer for a switch's destination store, huge-page backed on Linux CPUs
    (the allocator for ``StateStore(..., alloc=state_alloc)``)."""
    if device.type != "cpu":
        return torch.zeros(numel, dtype=dtype, device=device)
    t = torch.empty(numel, dtype=dtype)
    _advise_huge(t)
    return t.zero_()


def crc(t: torch.Tensor) -> int:
    """CRC32 of a contiguous CPU tensor's bytes."""
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy())


def checksum(t: torch.Tensor) -> int:
    """A transfer checksum of a contiguous tensor's bytes: the 64-bit wrapping sum of its 8-byte words
    (any corrupted word changes it; it runs at memory speed) plus a CRC32 of the tail. The value
    depends only on the bytes, not on their alignment: numpy sums misaligned words in place
    (about half the aligned speed) instead of copying them."""
    b = t.contiguous().view(-1).view(torch.uint8)
    a = b.numpy()
    n8 = a.size // 8 * 8
    if n8 == 0:
        return zlib.crc32(a)
    if b.data_ptr() % 8 == 0:        # aligned: torch's reduction is the faster one (same wrapping sum)
        head = int(b[:n8].view(torch.int64).sum()) & 0xFFFFFFFFFFFFFFFF
    else:
        head = int(a[:n8].view(np.uint64).sum(dtype=np.uint64))
    return (head * 0x100000001B3 + zlib.crc32(a[n8:]) + n8) & 0xFFFFFFFFFFFFFFFF


def kind_tensor(store: StateStore, family: str, kind: str) -> tuple[torch.Tensor, int]:
    """(flat tensor holding ``kind`` of ``family``, buffer coordinate of its element 0)."""
    b = store.buffers[family]
    if kind == "param":
        return b.param, (b.lo if b.zero >= 3 else 0)
    t = getattr(b, kind)
    if t is None:
        raise SwitchAborted(f"rank {store.rank} keeps no {kind!r} state ({store.spec.dtype} training); "
                            f"plan the switch with the model's state kinds")
    return t, (b.lo if b.zero >= 1 else 0)


def piece_view(store: StateStore, tensor: str, kind: str, lo: tuple[int, ...], hi: tuple[int, ...]) -> torch.Tensor:
    """A strided view of global box ``[lo, hi)`` of ``tensor``'s ``kind`` inside ``store`` (no copy).

    Raises SwitchAborted when the store does not hold the whole box (the plan and the store disagree).
    """
    p = store.pieces.get(tensor)
    if p is None:
        raise SwitchAborted(f"rank {store.rank} holds no part of {tensor}, but the switch plan reads or writes it")
    flat, base = kind_tensor(store, p.group, kind)
    nd = len(p.sizes)
    strides = [1] * nd
    for i in range(nd - 2, -1, -1):
        strides[i] = strides[i + 1] * p.sizes[i + 1]
    loc = [a - o for a, o in zip(lo[:nd], p.offsets)]
    size = [b - a for a, b in zip(lo[:nd], hi[:nd])]
    if any(x < 0 for x in loc) or any(x + s > n for x, s, n in zip(loc, size, p.sizes)):
        raise SwitchAborted(f"box {tuple(lo[:nd])}-{tuple(hi[:nd])} of {tensor} lies outside rank "
                            f"{store.rank}'s shard {p.offsets}+{p.sizes}")
    first = p.start + sum(x * s for x, s in zip(loc, strides)) - base
    last = first + sum((s - 1) * st for s, st in zip(size, strides))
    if first < 0 or last >= flat.numel():
        raise SwitchAborted(f"rank {store.rank} does not hold {kind} of {tensor} box {tuple(lo[:nd])}-"
                            f"{tuple(hi[:nd])} in its shard; the switch plan and the state store disagree")
    return flat.as_strided(size, strides, flat.storage_offset() + first)


class BufferPool:
    """Reusable uint8 staging buffers, by size (sizes are 16-byte aligned by the planner).

    ``in_use``: bytes handed out and not yet returned; ``peak``: the most ``in_use`` ever was
    (reset by :meth:`reset_peak`); ``held``: bytes the pool owns (in use or idle)."""

    def __init__(self) -> None:
        self.free: dict[int, list[torch.Tensor]] = {}
        self.allocated = 0
        self.held = 0
        self.in_use = 0
        self.peak = 0

    def get(self, nbytes: int) -> torch.Tensor:
        self.in_use += nbytes
        self.peak = max(self.peak, self.in_use)
        lst = self.free.get(nbytes)
        if lst:
            return lst.pop()
        self.allocated += nbytes
        self.held += nbytes
        t = torch.empty(nbytes, dtype=torch.uint8)
        _advise_huge(t)
        return t

    def put(self, t: torch.Tensor) -> None:
        self.in_use -= t.numel()
        self.free.setdefault(t.numel(), []).append(t)

    def reset_peak(self) -> None:
        self.peak = self.in_use

    def clear(self) -> None:
        """Release the idle buffers (buffers in use stay with their holders)."""
        self.held -= sum(t.numel() for lst in self.free.values() for t in lst)
        self.free.clear()


@dataclass(frozen=True)
class PieceTable:
    """``meta["pieces"]`` of a switch Program as numpy columns, indexed by transfer."""

    tensor: np.ndarray
    kind: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    nbytes: np.ndarray
    stage: np.ndarray
    transfer: np.ndarray
    offset: np.ndarray

    @classmethod
    def of(cls, program: Program) -> "PieceTable":
        m = program.meta
        P = {k: np.asarray(v, dtype=np.int64) for k, v in m["pieces"].items()}
        d = int(m["dims"])
        P["lo"], P["hi"] = P["lo"].reshape(-1, d), P["hi"].reshape(-1, d)
        return cls(**P)


@dataclass
class _Flight:
    ins: Instr
    stream: str
    works: list
    t0: float
    then: Callable[[], None] | None = None
    on_part: Callable[[int], None] | None = None     # called as each of ``works`` completes, in order
    done: bool = False


@dataclass
class ExecStats:
    """What one device did: bytes packed/sent/received, pieces sent unpacked, checksums, and the
    driver thread's seconds per kind of work (``keep``, ``pack``, ``unpack``, ``checksum``,
    ``issue``, ``idle``: waiting on the wire with nothing else to do)."""

    sent_crc: dict[str, int] = field(default_factory=dict)       # checksum key -> crc of what was sent
    recv_crc: dict[str, int] = field(default_factory=dict)       # checksum key -> crc of what arrived
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_copied: int = 0
    zero_copy: int = 0
    staging_peak: int = 0                                       # most staging bytes in use at once
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("keep", "pack", "unpack", "checksum", "issue", "idle"), 0.0))
    rows: list[tuple[str, str, float, float, int]] = field(default_factory=list)  # stream, op, t0, t1, bytes

    def add(self, what: str, t0: float) -> float:
        """Charge the time since ``t0`` to ``what``; returns now."""
        t1 = time.perf_counter()
        self.seconds[what] += t1 - t0
        return t1


class SwitchExecutor:
    """Runs device ``device``'s streams of a switch Program.

    ``old``: the device's store in the source layout (None for a joining device); ``new``: its
    store in the destination layout (None for a leaving device). ``world``: process group over
    the switch's participants, ``index``: device id -> rank in ``world``; ``group(members)``
    returns the cached process group of a collective's device tuple. ``extra_keep``: kept pieces
    the Program leaves out (buffers it reuses in place, which the flat stores still copy), as
    (tensor, kind, lo, hi). ``on_received(key, buffer)``: a test hook called on every received
    buffer before it is checksummed; ``on_issue(instr)``: called after each
    communication instruction is issued (fault tests). ``peer_gone()``: polled while
    waiting; a device id it returns (a participant known to be dead) aborts the switch at once.
    ``big``: pieces of at least this many bytes travel as messages of their own; ``chunk``:
    point-to-point messages travel in parts of at most this many bytes (every participant must
    use the same values). ``pool``: where staging buffers come from and go back to (its ``peak``
    becomes ``stats.staging_peak``).
    """

    def __init__(self, program: Program, device: int, old: StateStore | None, new: StateStore | None,
                 world: Any, index: dict[int, int], group: Callable[[tuple[int, ...]], Any], *,
                 extra_keep: list[tuple[str, str, tuple, tuple]] = (), timeout: float = 60.0,
                 pool: BufferPool | None = None,
                 on_received: Callable[[str, torch.Tensor], None] | None = None,
                 on_issue: Callable[[Instr], None] | None = None,
                 peer_gone: Callable[[], int | None] | None = None, big: int = BIG, chunk: int = CHUNK) -> None:
        self.program, self.device, self.old, self.new = program, device, old, new
        self.world, self.index, self.group = world, index, group
        self.meta = program.meta
        self.names, self.kinds = self.meta["tensors"], self.meta["kinds"]
        self.P = PieceTable.of(program)
        self.tag_id = {t: i for i, t in enumerate(self.meta["transfers"])}
        self.extra_keep = list(extra_keep)
        self.timeout = timeout
        self.pool = pool or BufferPool()
        self.on_received = on_received
        self.on_issue = on_issue
        self.peer_gone = peer_gone
        self.big = int(big)
        self.chunk = int(chunk)
        self.bufs: dict[str, torch.Tensor] = {}
        self.pooled: set[str] = set()
        self.stats = ExecStats()
        rows = np.flatnonzero((self.P.src == device) | (self.P.dst == device))
        self.by_xfer: dict[int, np.ndarray] = {}
        x = self.P.transfer[rows]
        order = np.argsort(x, kind="stable")
        rows, x = rows[order], x[order]
        cut = np.flatnonzero(np.r_[True, x[1:] != x[:-1]]) if len(x) else np.zeros(0, dtype=np.int64)
        for a, b in zip(cut.tolist(), np.append(cut[1:], len(x)).tolist()):
            self.by_xfer[int(x[a])] = rows[a:b]
        self.graveyard: list[Any] = []                    # buffers of works left in flight on abort
        self._splits: dict[str, tuple] = {}
        self.msgs: dict[str, list[torch.Tensor]] = {}       # p2p tag -> its messages
        self.temps: dict[str, list[torch.Tensor]] = {}      # p2p tag -> pooled buffers it uses
        self.later: collections.deque = collections.deque()  # deferred work, run while the wire is busy
        self._comm: dict[str, Instr] = {}
        self._done: set[int] = set()
        moved = self.P.transfer >= 0
        self._xstage = np.zeros(len(self.tag_id), dtype=np.int64)   # transfer id -> stage
        self._xstage[self.P.transfer[moved]] = self.P.stage[moved]

    def _sum(self, t: torch.Tensor) -> int:
        t0 = time.perf_counter()
        v = checksum(t)
        self.stats.add("checksum", t0)
        return v

    # ---- geometry ---------------------------------------------------------------------------------
    def _view(self, store: StateStore, i: int) -> torch.Tensor:
        return piece_view(store, self.names[int(self.P.tensor[i])], self.kinds[int(self.P.kind[i])],
                          tuple(self.P.lo[i].tolist()), tuple(self.P.hi[i].tolist()))

    def _rows(self, tag: str, end: str) -> np.ndarray:
        rows = self.by_xfer.get(self.tag_id[tag], np.zeros(0, dtype=np.int64))
        col = self.P.src if end == "src" else self.P.dst
        return rows[col[rows] == self.device]

    def _local_offset(self, ins: Instr, i: int) -> int:
        off = int(self.P.offset[i])
        if ins.op in ("scatter", "gather") and self.device != ins.root:
            off -= ins.group.index(self.device) * self._chunk(ins)
        return off

    @staticmethod
    def _chunk(ins: Instr) -> int:
        return ins.nbytes // len(ins.group) if ins.op in ("scatter", "gather") else 0

    # ---- instructions -------------------------------------------------------------------------------
    def _alloc(self, ins: Instr) -> None:
        for name, nb in ins.alloc:
            if name.startswith("buf:") and name not in self.bufs:
                self.bufs[name] = self.pool.get(nb)[:nb] if nb else torch.empty(0, dtype=torch.uint8)
                self.pooled.add(name)

    def _free(self, ins: Instr) -> None:
        for name in ins.free:
            t = self.bufs.pop(name, None)
            if t is not None and name in self.pooled:
                self.pooled.discard(name)
                self.pool.put(t._base if t._base is not None else t)

    def _copy(self, ins: Instr) -> None:
        kind, _, arg = ins.key.partition(":")
        if kind == "keep":
            # kept pieces read the old store and write regions of the new one that nothing else
            # touches, so their copies are deferred: the driver runs them while transfers are on the wire
            stage = int(arg)
            rows = np.flatnonzero((self.P.transfer == -1) & (self.P.dst == self.device) & (self.P.stage == stage))
            pairs = [(self._view(self.new, i), self._view(self.old, i)) for i in rows.tolist()]
            if stage == 0:
                pairs += [(piece_view(self.new, *x), piece_view(self.old, *x)) for x in self.extra_keep]
            for d, o in pairs:            # in slices, so that landing parts are checksummed between them
                self.later.extend(_slices(d, o, SLICE))
            self._alloc(ins)
            return
        tag = arg
        if self._comm_of(tag).op in _MESSAGES:
            (self._pack_p2p if kind == "pack" else self._unpack_p2p)(tag)
            return
        if kind == "pack":              # scatter and gather: their chunks at the root are one buffer
            rows = self._rows(tag, "src")
            t_ins = self._comm_of(tag)
            self._alloc(ins)
            buf = self.bufs[f"buf:{tag}"]
            for i in rows.tolist():
                n = int(self.P.nbytes[i])
                off = self._local_offset(t_ins, i)
                v = self._view(self.old, i)
                buf[off:off + n].view(v.dtype).view(v.shape).copy_(v)
            self._record_sent(t_ins, buf)
        elif kind == "unpack":
            t_ins = self._comm_of(tag)
            buf = self.bufs[f"buf:{tag}"]
            for i in self._rows(tag, "dst").tolist():
                n = int(self.P.nbytes[i])
                off = self._local_offset(t_ins, i)
                v = self._view(self.new, i)
                v.copy_(buf[off:off + n].view(v.dtype).view(v.shape))
            self._free(ins)

    # ---- p2p transfers and broadcasts: large pieces travel as messages of their own ----------------------
    def _split(self, tag: str) -> tuple[list[int], list[int], int, list[int]]:
        """Pieces of a p2p transfer or broadcast in buffer order: small ones (their offsets in a
        compact staging buffer, its size) and large ones (``BIG`` bytes or more), which travel as
        messages of their own, sent from and received into the state buffers when their boxes are
        contiguous there. Every member derives the same split from the piece table (a broadcast
        lists each piece once per receiver: one row per buffer offset is kept)."""
        hit = self._splits.get(tag)
        if hit is None:
            rows = self.by_xfer[self.tag_id[tag]]
            _, first = np.unique(self.P.offset[rows], return_index=True)
            rows = rows[first]
            nb = self.P.nbytes[rows]
            small, big = rows[nb < self.big], rows[nb >= self.big]
            size = -(-nb[nb < self.big] // 16) * 16
            offs = np.concatenate([[0], np.cumsum(size)[:-1]]) if len(size) else np.zeros(0, dtype=np.int64)
            hit = self._splits[tag] = (small.tolist(), offs.tolist(), int(size.sum()), big.tolist())
        return hit

    def _temp(self, tag: str, nbytes: int) -> torch.Tensor:
        t = self.pool.get(nbytes)
        self.temps.setdefault(tag, []).append(t)
        return t

    def _release(self, tag: str) -> None:
        for t in self.temps.pop(tag, []):
            self.pool.put(t)
        self.msgs.pop(tag, None)

    def _pack_p2p(self, tag: str) -> None:
        small, offs, size, big = self._split(tag)
        msgs = []
        if small:
            buf = self._temp(tag, size)
            for i, off in zip(small, offs):
                v = self._view(self.old, i)
                buf[off:off + int(self.P.nbytes[i])].view(v.dtype).view(v.shape).copy_(v)
            msgs.append(buf)
        for i in big:
            v = self._view(self.old, i)
            if v.is_contiguous():
                msgs.append(v.view(-1).view(torch.uint8))
                self.stats.zero_copy += 1
            else:
                t = self._temp(tag, int(self.P.nbytes[i]))
                t.view(v.dtype).view(v.shape).copy_(v)
                msgs.append(t)
        self.msgs[tag] = msgs

    def _run_later(self, item: tuple[torch.Tensor, torch.Tensor]) -> None:
        """One piece of deferred work: a slice of a kept piece's copy."""
        t0 = time.perf_counter()
        d, o = item
        d.copy_(o)
        self.stats.bytes_copied += d.numel() * d.element_size()
        self.stats.add("keep", t0)

    def _recv_p2p(self, ins: Instr) -> list[torch.Tensor]:
        small, offs, size, big = self._split(ins.tag)
        msgs = [self._temp(ins.tag, size)] if small else []
        for i in big:
            v = self._view(self.new, i)
            if v.is_contiguous():
                msgs.append(v.view(-1).view(torch.uint8))
                self.stats.zero_copy += 1
            else:
                msgs.append(self._temp(ins.tag, int(self.P.nbytes[i])))
        self.msgs[ins.tag] = msgs
        return msgs

    def _unpack_p2p(self, tag: str) -> None:
        small, offs, size, big = self._split(tag)
        msgs = self.msgs[tag]
        if small:
            buf = msgs[0]
            for i, off in zip(small, offs):
                v = self._view(self.new, i)
                v.copy_(buf[off:off + int(self.P.nbytes[i])].view(v.dtype).view(v.shape))
        for i, m in zip(big, msgs[1 if small else 0:]):
            v = self._view(self.new, i)
            if m.data_ptr() != v.data_ptr():
                v.copy_(m.view(v.dtype).view(v.shape))
        self._release(tag)

    def _ck(self, ins: Instr, member: int) -> str:
        """Checksum key of a scatter's or gather's chunk of ``member`` (p2p transfers and broadcasts,
        which travel as messages, are keyed by their tag)."""
        return f"{ins.tag}@{member}"

    def _record(self, ins: Instr, buf: torch.Tensor, per_member: str, into: dict[str, int]) -> None:
        """Checksums of ``buf`` into ``into``: one per non-root member's chunk when ``ins`` is a
        ``per_member`` collective (the root's scatter buffer, the root's gathered one), else one."""
        if ins.op == per_member:
            c = self._chunk(ins)
            for p, m in enumerate(ins.group):
                if m != ins.root:
                    into[self._ck(ins, m)] = self._sum(buf[p * c:(p + 1) * c])
        else:
            into[self._ck(ins, self.device)] = self._sum(buf)

    def _record_sent(self, ins: Instr, buf: torch.Tensor) -> None:
        self._record(ins, buf, "scatter", self.stats.sent_crc)

    def _record_received(self, ins: Instr, buf: torch.Tensor) -> None:
        if self.on_received is not None:
            self.on_received(ins.tag, buf)
        self._record(ins, buf, "gather", self.stats.recv_crc)

    def _comm_of(self, tag: str) -> Instr:
        return self._comm[tag]

    def _messages(self, ins: Instr, msgs: list[torch.Tensor], sending: bool, post: Callable, t0: float) -> _Flight:
        """A flight of ``msgs`` cut into parts, part ``j`` issued as ``post(j, part)``. Each part is
        checksummed once it has gone out or landed (while later parts are on the wire) and folded,
        in order, into the transfer's checksum; a sender's staging goes back to the pool when all
        are out."""
        parts = _parts(msgs, self.chunk)
        fold = [0]
        if sending:
            self.stats.bytes_sent += ins.nbytes
        else:
            self.stats.bytes_received += ins.nbytes

        def part(j: int) -> None:
            if not sending and self.on_received is not None:
                self.on_received(ins.tag, parts[j])
            fold[0] = _fold(fold[0], self._sum(parts[j]))

        def done() -> None:
            (self.stats.sent_crc if sending else self.stats.recv_crc)[ins.tag] = fold[0]
            if sending:
                self._release(ins.tag)
        return _Flight(ins, ins.stream, [post(j, m) for j, m in enumerate(parts)], t0, done, on_part=part)

    def _issue(self, ins: Instr) -> _Flight:
        tag = ins.tag
        t0 = time.perf_counter()
        if ins.op in ("send", "recv"):
            base, peer = self.tag_id[tag] * MAX_MSGS, self.index[ins.peer]
            if ins.op == "send":
                return self._messages(ins, self.msgs[tag], True,
                                      lambda j, m: self.world.send([m], peer, base + j), t0)
            return self._messages(ins, self._recv_p2p(ins), False,
                                  lambda j, m: self.world.recv([m], peer, base + j), t0)
        pg = self.group(tuple(ins.group))
        me = ins.group.index(self.device)
        root = ins.group.index(ins.root)
        if ins.op == "broadcast":          # message by message, as a p2p transfer travels
            o = dist.BroadcastOptions()
            o.rootRank = root
            mine = me == root
            return self._messages(ins, self.msgs[tag] if mine else self._recv_p2p(ins), mine,
                                  lambda j, m: pg.broadcast([m], o), t0)
        sender = self.device in (ins.group if ins.op == "gather" else (ins.root,)) and not (
            ins.op == "gather" and self.device == ins.root)
        if not sender:
            self._alloc(ins)
        buf = self.bufs[ins.key]
        c = self._chunk(ins)
        if ins.op == "scatter":
            o = dist.ScatterOptions()
            o.rootRank = root
            if me == root:
                chunks = [buf[p * c:(p + 1) * c] for p in range(len(ins.group))]
                work = pg.scatter([torch.empty(c, dtype=torch.uint8)], [chunks], o)
            else:
                work = pg.scatter([buf], [], o)
        else:  # gather
            o = dist.GatherOptions()
            o.rootRank = root
            if me == root:
                chunks = [buf[p * c:(p + 1) * c] for p in range(len(ins.group))]
                work = pg.gather([chunks], [torch.empty(c, dtype=torch.uint8)], o)
            else:
                work = pg.gather([], [buf], o)
        then = None
        if not sender:
            self.stats.bytes_received += ins.nbytes if ins.op != "scatter" else c
            then = lambda: self._record_received(ins, buf)  # noqa: E731
        else:
            self.stats.bytes_sent += ins.nbytes if ins.op != "gather" else c
        return _Flight(ins, ins.stream, [work], t0, then)

    # ---- driver ---------------------------------------------------------------------------------------
    def stage_of(self, ins: Instr) -> int:
        """The switch stage ``ins`` belongs to (``keep:<stage>``, else its transfer's stage)."""
        if ins.key is not None and ins.key.startswith("keep:"):
            return int(ins.key[5:])
        tag = ins.tag if ins.tag is not None else ins.key.partition(":")[2]
        return int(self._xstage[self.tag_id[tag]])

    def run(self, stage: int | None = None) -> ExecStats:
        """Execute every stream of this device (only stage ``stage``'s instructions when given:
        run the stages in order); raise SwitchAborted on a failed or stuck transfer.

        Gloo completes point-to-point work only inside ``wait()``, so every issued instruction is
        waited on by a daemon thread that reports to a queue; the driver thread runs copies and
        issues work as soon as its deps are done. Point-to-point streams (``send<l>``/``recv<l>``)
        do not wait for one message before issuing the next (tags keep messages apart): each
        instruction is issued once its deps are done and counts as done once it and every earlier
        instruction of its stream have completed, so a dependency on it still covers its stream's
        prefix. Collective streams issue one instruction at a time (one order per communicator).
        While everything issued is on the wire, the driver runs deferred work (kept pieces' copies,
        checksums of sent messages).
        """
        rp = self.program.ranks.get(self.device)
        streams = {s: list(v) for s, v in (rp.streams.items() if rp is not None else ())}
        for v in streams.values():
            for ins in v:
                if ins.tag is not None:
                    self._comm[ins.tag] = ins
        if stage is not None:
            streams = {s: [i for i in v if self.stage_of(i) == stage] for s, v in streams.items()}
            streams = {s: v for s, v in streams.items() if v}
        pos = {s: 0 for s in streams}
        busy: dict[str, _Flight] = {}                                   # collective streams: one at a time
        lanes: dict[str, collections.deque] = {s: collections.deque() for s in streams
                                                if s.startswith(("send", "recv"))}
        done = self._done                                               # earlier stages' too
        finished: queue.SimpleQueue = queue.SimpleQueue()
        timeout = _td(self.timeout)
        st = self.stats
        if self.pool is not None:
            self.pool.reset_peak()

        def waiter(fl: _Flight) -> None:
            try:
                for j, w in enumerate(fl.works):
                    w.wait(timeout)
                    if fl.on_part is not None:
                        finished.put((fl, j, None))
                finished.put((fl, None, None))
            except BaseException as e:  # noqa: BLE001 - handed to the driver
                finished.put((fl, None, e))

        def in_flight() -> int:
            return len(busy) + sum(len(q) for q in lanes.values())

        def complete(fl: _Flight) -> None:
            if fl.then is not None:
                fl.then()
            self._free(fl.ins)
            st.rows.append((fl.stream, fl.ins.op, fl.t0, time.perf_counter(), fl.ins.nbytes))
            fl.done = True
            q = lanes.get(fl.stream)
            if q is None:
                done.add(fl.ins.id)
                del busy[fl.stream]
                return
            while q and q[0].done:
                done.add(q.popleft().ins.id)

        def handle(fl: _Flight, j: int | None, err: BaseException | None) -> None:
            if err is not None:
                raise err
            if j is not None:
                fl.on_part(j)
            else:
                complete(fl)
        try:
            while True:
                ran = self._step(streams, pos, busy, lanes, done, waiter)
                while True:                        # whatever landed meanwhile, before more copies
                    try:
                        item = finished.get_nowait()
                    except queue.Empty:
                        break
                    handle(*item)
                    ran = True
                if ran:
                    continue
                if not in_flight():
                    if any(pos[s] < len(v) for s, v in streams.items()):
                        raise SwitchAborted(f"device {self.device}: the switch Program cannot proceed (a dependency "
                                            f"is never satisfied); the Program is invalid")
                    break
                if self.later:                     # the wire is busy: do deferred work meanwhile
                    self._run_later(self.later.popleft())
                    continue
                handle(*self._wait(finished, busy, lanes))
            while self.later:
                self._run_later(self.later.popleft())
        except SwitchAborted:
            self.graveyard.append((busy, lanes, self.bufs, self.msgs, self.temps))
            raise
        except Exception as e:  # noqa: BLE001 - a peer failure surfaces as a gloo error
            self.graveyard.append((busy, lanes, self.bufs, self.msgs, self.temps))
            raise SwitchAborted(f"device {self.device}: a transfer failed ({type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''}); a peer left or failed") from e
        if self.pool is not None:
            st.staging_peak = self.pool.peak
        return st

    def _step(self, streams: dict, pos: dict, busy: dict, lanes: dict, done: set, waiter: Callable) -> bool:
        """Issue every communication instruction whose deps are done, then run at most one ready
        copy (pack, unpack, keep); False when nothing could run. Receives are posted and sends go out
        before the next pack, so that packing overlaps the transfers already on the wire."""
        st = self.stats
        ran = False

        def ready(s: str, v: list) -> bool:
            return s not in busy and pos[s] < len(v) and all(d in done for d in v[pos[s]].deps)
        for s, v in streams.items():
            while ready(s, v) and v[pos[s]].op != "copy":
                ins = v[pos[s]]
                pos[s] += 1
                t0 = time.perf_counter()
                fl = self._issue(ins)
                if s in lanes:
                    lanes[s].append(fl)
                else:
                    busy[s] = fl
                _WAITERS.submit(waiter, fl)
                st.add("issue", t0)
                ran = True
                if self.on_issue is not None:
                    self.on_issue(ins)
        for s, v in streams.items():
            if ready(s, v):               # a copy (communication was all issued above)
                ins = v[pos[s]]
                pos[s] += 1
                t0 = time.perf_counter()
                ck = st.seconds["checksum"]
                self._copy(ins)
                t1 = time.perf_counter()
                what = ins.key.split(":")[0]
                st.seconds[what] += t1 - t0 - (st.seconds["checksum"] - ck)
                st.rows.append((s, what, t0, t1, ins.nbytes))
                done.add(ins.id)
                return True
        return ran

    def _wait(self, finished: queue.SimpleQueue, busy: dict, lanes: dict) -> tuple:
        """The next finished flight; raises SwitchAborted when a peer is gone or nothing moves."""
        t0 = time.perf_counter()
        end = time.monotonic() + self.timeout + 5.0
        while True:
            try:
                got = finished.get(timeout=0.05)
                self.stats.add("idle", t0)
                return got
            except queue.Empty:
                gone = self.peer_gone() if self.peer_gone is not None else None
                if gone is not None or time.monotonic() > end:
                    why = f"device {gone} is gone" if gone is not None else f"no progress for {self.timeout:.0f} s"
                    waiting = list(busy.values()) + [f for q in lanes.values() for f in q if not f.done]
                    raise SwitchAborted(f"device {self.device}: {why} (waiting on "
                                        f"{', '.join(f'{f.ins.op} {f.ins.tag}' for f in waiting)})") from None


#: Transfers that travel as a list of messages (see ``SwitchExecutor._split``).
_MESSAGES = ("send", "recv", "broadcast")


def _parts(msgs: list[torch.Tensor], chunk: int) -> list[torch.Tensor]:
    """Messages cut into consecutive parts of at most ``chunk`` bytes (views, no copy); both ends
    of a transfer cut alike, as their messages have the same sizes."""
    return [m[a:a + chunk] for m in msgs for a in range(0, max(m.numel(), 1), chunk)]


def _slices(dst: torch.Tensor, src: torch.Tensor, nbytes: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(dst, src) views of equal shape cut along the first dimension into copies of about
    ``nbytes`` bytes or less (a single row may be larger)."""
    if dst.dim() == 0 or dst.numel() * dst.element_size() <= nbytes:
        return [(dst, src)]
    row = max(1, dst[0].numel() * dst.element_size())
    step = max(1, nbytes // row)
    return [(dst[a:a + step], src[a:a + step]) for a in range(0, dst.shape[0], step)]


def _fold(h: int, c: int) -> int:
    """Order-dependent combination of part checksums into one per transfer."""
    return (h * 0x100000001B3 ^ c) & 0xFFFFFFFFFFFFFFFF


def _td(seconds: float):
    import datetime
    return datetime.timedelta(seconds=seconds)


def bytes_of(store: StateStore | None) -> int:
    """Bytes of a store's parameter and optimizer buffers."""
    if store is None:
        return 0
    total = 0
    for b in store.buffers.values():
        for k in ("param", "master", "exp_avg", "exp_avg_sq"):
            t = getattr(b, k)
            if t is not None:
                total += t.numel() * t.element_size()
    return total

