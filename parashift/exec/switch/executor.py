"""Execute one device's part of a switch Program over torch state stores, with real communication.

A switch Program (``parashift.vps.transition.lower``) is complete: its :class:`SwitchMeta` lists
every destination piece (kept ones included) and the op table (``vps.transition.OPS``) says what
each transfer means, so the executor needs nothing else. Pieces map onto strided views of the
flat state buffers (:func:`~.stores.piece_view`), so ``keep`` copies, packs and unpacks are strided
tensor copies.

:class:`SwitchExecutor` runs the streams of one device (``pack``, ``send<l>``, ``recv<l>``,
``coll<l>``, ``unpack``) honoring ``deps``. How it keeps close to the bare cost of moving bytes:

- *no needless packing*: in a point-to-point transfer or a broadcast every piece of at least
  ``BIG`` bytes travels as a message of its own (a broadcast as a series of broadcasts), sent
  straight from the old state buffer and received straight into the new one wherever its box is
  contiguous there; only small pieces (and boxes strided at one end) go through a staging buffer,
  one per transfer (the planner coalesces per peer); chunked ops pack their chunks;
- *pooled staging*: staging buffers come from a :class:`~.memory.BufferPool` and go back as soon
  as their transfer is sent or unpacked, so later stages (and later switches) reuse them;
- *overlap*: point-to-point messages are all issued as soon as their deps allow (tags keep
  them apart), in parts of at most ``CHUNK`` bytes; while they are on the wire the driver copies
  the kept pieces (in slices of ``SLICE`` bytes) and checksums each part as soon as it has been
  sent or has landed;
- *same-host messages by local reads* (:mod:`.local`): between processes of one host the gloo
  driver lends each part's address instead of sending its bytes; the receiver copies it out of
  the sender's memory (one kernel copy, no socket) and sums it a block at a time in cache, while
  the sender sums its part as it is read;
- *cheap checks*: a checksum is one vectorized 64-bit sum per part (memory speed), folded per
  transfer (or chunk), so verification publishes one value per transfer; the caller compares
  them (see :mod:`.protocol`). A part sent straight from the old state to several peers (a ZeRO
  shard going to every replica of its new cell) is summed once; host staging is summed block by
  block as it is packed (while in cache), and sends of the same content share one packing.

Each op has one handler (:attr:`SwitchExecutor.HANDLERS`); what differs between ops beyond the
call itself (who sends, bytes per member, offsets, checksummed chunks) comes from the op table.
"""
from __future__ import annotations

import collections
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from ...errors import SwitchAborted
from ...ir.program import Instr, Program
from ...vps.transition import SwitchMeta, parse_switch_name, switch_name
from ...collectives import op as op_of
from ..state import StateStore
from .local import LocalPeers, LocalRecv, LocalSend
from .memory import BufferPool
from .stores import piece_view
from .wire import (BIG, BLOCK, CHUNK, MAX_MSGS, SLICE, PartSums, checksum, checksum_device, fold, parts, resolve,
                   slices, submit, timedelta)

__all__ = ["SwitchExecutor", "ExecStats", "issue_order"]


def issue_order(program: Program) -> dict[tuple[int, int], int]:
    """One global order of every instruction of a switch Program, the same on every participant:
    (device, instruction id) -> position. The instructions of one transfer (its send and recv, or
    every member's part of a collective) share a position; a position comes after its deps and, on
    copy and collective streams, after the stream's previous instruction (point-to-point streams
    post without waiting, so their order is their deps'). Issuing in this order is what NCCL needs:
    each pair of devices and each communicator sees its operations in the same order on all
    members, so no member waits on an operation another has queued behind one it waits for.
    Raises SwitchAborted when the Program's dependencies form a cycle."""
    import heapq
    node_of: dict[tuple[int, int], tuple] = {}
    first: dict[tuple, tuple[int, int, int]] = {}
    meta = SwitchMeta.of(program)
    tag_id = {t: i for i, t in enumerate(meta.transfers)}
    xstage = meta.transfer_stage()
    for d, rp in program.ranks.items():
        for ins in rp.instrs():
            if ins.tag is not None:
                node, stage = ("x", ins.tag), int(xstage[tag_id[ins.tag]])
            else:
                what, (arg,) = parse_switch_name(ins.key)
                node = ("c", d, ins.id)
                stage = int(arg) if what == "keep" else int(xstage[tag_id[arg]])
            node_of[(d, ins.id)] = node
            key = (stage, d, ins.id)
            if node not in first or key < first[node]:
                first[node] = key
    preds: dict[tuple, set] = {n: set() for n in first}
    for d, rp in program.ranks.items():
        for name, instrs in rp.streams.items():
            ordered = not name.startswith(("send", "recv"))
            prev = None
            for ins in instrs:
                me = node_of[(d, ins.id)]
                for dep in ins.deps:
                    if node_of[(d, dep)] != me:
                        preds[me].add(node_of[(d, dep)])
                if ordered and prev is not None and prev != me:
                    preds[me].add(prev)
                prev = me
    succ: dict[tuple, list] = {n: [] for n in first}
    for n, ps in preds.items():
        for q in ps:
            succ[q].append(n)
    left = {n: len(ps) for n, ps in preds.items()}
    heap = [(first[n], n) for n, k in left.items() if k == 0]
    heapq.heapify(heap)
    pos: dict[tuple, int] = {}
    while heap:
        _, n = heapq.heappop(heap)
        pos[n] = len(pos)
        for m in succ[n]:
            left[m] -= 1
            if left[m] == 0:
                heapq.heappush(heap, (first[m], m))
    if len(pos) != len(first):
        raise SwitchAborted("the switch Program's dependencies form a cycle across devices; it cannot be issued "
                            "in one order (the Program is invalid)")
    return {k: pos[n] for k, n in node_of.items()}


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
class _Packed:
    """Messages packed for one point-to-point send, shared by the sends of the same content (a
    piece going to several peers); ``owner``'s staging holds them until ``users`` sends are done."""

    owner: str
    msgs: list
    direct: list
    sums: list
    users: int
    expected: bool                    # ``users`` counts every send of the content, packed or not yet


@dataclass
class _Run:
    """One run of the driver: streams and positions, what is on the wire, where waiters report."""

    streams: dict[str, list[Instr]]
    pos: dict[str, int]
    busy: dict[str, _Flight]                    # collective streams: one flight at a time
    lanes: dict[str, collections.deque]         # point-to-point streams: flights in issue order
    finished: queue.SimpleQueue
    timeout: Any

    def in_flight(self) -> int:
        return len(self.busy) + sum(len(q) for q in self.lanes.values())


@dataclass
class ExecStats:
    """What one device did: bytes packed/sent/received, pieces sent unpacked, checksums, and the
    driver thread's seconds per kind of work (``keep``, ``pack``, ``unpack``, ``checksum``,
    ``issue``, ``idle``: waiting on the wire with nothing else to do; ``<kind>_cpu``: the CPU seconds
    of each kind but ``idle``, which a busy host inflates less than wall time)."""

    sent_crc: dict[str, int] = field(default_factory=dict)       # checksum key -> crc of what was sent
    recv_crc: dict[str, int] = field(default_factory=dict)       # checksum key -> crc of what arrived
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_copied: int = 0
    bytes_local: int = 0                                        # received by reading a same-host sender's memory
    zero_copy: int = 0
    sums_reused: int = 0                                        # sent parts whose checksum an earlier send computed
    packs_shared: int = 0                                       # sends that reused another send's packed messages
    staging_peak: int = 0                                       # most staging bytes in use at once
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("keep", "pack", "unpack", "checksum", "issue", "idle", "keep_cpu", "pack_cpu", "unpack_cpu", "checksum_cpu",
         "issue_cpu"), 0.0))
    rows: list[tuple[str, str, float, float, int]] = field(default_factory=list)  # stream, op, t0, t1, bytes

    def add(self, what: str, t0: float, c0: float | None = None) -> float:
        """Charge the time since ``t0`` to ``what`` (and the thread's CPU time since ``c0`` to
        ``<what>_cpu``); returns now."""
        t1 = time.perf_counter()
        self.seconds[what] += t1 - t0
        if c0 is not None:
            self.seconds[f"{what}_cpu"] += time.thread_time() - c0
        return t1

    def start(self) -> tuple[float, float, float, float]:
        """The clocks and checksum totals before an instruction, for :meth:`add_copy`."""
        return time.perf_counter(), time.thread_time(), self.seconds["checksum"], self.seconds["checksum_cpu"]

    def add_copy(self, stream: str, key: str, nbytes: int, at: tuple[float, float, float, float]) -> None:
        """Charge a copy since ``at`` (:meth:`start`) to its kind, less the checksums it took, and row it."""
        t0, c0, ck, ckc = at
        t1 = time.perf_counter()
        what = parse_switch_name(key)[0]
        self.seconds[what] += t1 - t0 - (self.seconds["checksum"] - ck)
        self.seconds[f"{what}_cpu"] += time.thread_time() - c0 - (self.seconds["checksum_cpu"] - ckc)
        self.rows.append((stream, what, t0, t1, nbytes))


class SwitchExecutor:
    """Runs device ``device``'s streams of a switch Program.

    ``old``: the device's store in the source layout (None for a joining device); ``new``: its
    store in the destination layout (None for a leaving device). ``world``: process group over
    the switch's participants, ``index``: device id -> rank in ``world``; ``group(members)``
    returns the cached process group of a collective's device tuple. ``on_received(key, buffer)``:
    a test hook called on every received buffer before it is checksummed; ``on_issue(instr)``:
    called after each communication instruction is issued (fault tests). ``peer_gone()``: polled
    while waiting; a device id it returns (a participant known to be dead) aborts the switch at
    once. ``big``: pieces of at least this many bytes travel as messages of their own; ``chunk``:
    point-to-point messages travel in parts of at most this many bytes (every participant must
    use the same values). ``pool``: where staging buffers come from and go back to (its ``peak``
    becomes ``stats.staging_peak``).

    ``streams`` (:class:`~parashift.exec.streams.Streams`): issue in one global order
    (:func:`issue_order`) with every Program stream a stream of the device and deps as events, as
    NCCL needs (see :meth:`run`); None: the gloo driver. ``host_wire``: messages must be host
    memory (gloo moving device state): every piece of a device store travels through a staging
    buffer of the pool (pinned host memory there), none straight from or into the state.
    ``local`` (:func:`~.local.negotiate`): same-host peers whose point-to-point messages the
    gloo driver moves by local reads instead of through gloo's sockets.
    """

    def __init__(self, program: Program, device: int, old: StateStore | None, new: StateStore | None,
                 world: Any, index: dict[int, int], group: Callable[[tuple[int, ...]], Any], *,
                 timeout: float = 60.0, pool: BufferPool | None = None,
                 on_received: Callable[[str, torch.Tensor], None] | None = None,
                 on_issue: Callable[[Instr], None] | None = None,
                 peer_gone: Callable[[], int | None] | None = None, big: int = BIG, chunk: int = CHUNK,
                 streams: Any = None, host_wire: bool = False, local: LocalPeers | None = None) -> None:
        self.program, self.device, self.old, self.new = program, device, old, new
        self.local = local if local is not None and streams is None and not host_wire else LocalPeers()
        self.streams, self.host_wire = streams, bool(host_wire)
        self._order: dict[tuple[int, int], int] | None = None
        self._cur: Any = None             # (ordered driver) the key whose work a buffer handed back waits for
        self._on: str | None = None       # (ordered driver) the stream of the running instruction
        self.world, self.index, self.group = world, index, group
        self.meta = SwitchMeta.of(program)
        self.names, self.kinds = self.meta.tensors, self.meta.kinds
        self.P = self.meta.pieces
        self.tag_id = {t: i for i, t in enumerate(self.meta.transfers)}
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
        self.direct: dict[str, list[bool]] = {}             # p2p tag -> whether each message is a view of the old state
        self.sent_sums: dict[tuple[int, int], Any] = {}     # (address, bytes) of a sent part of the old state -> sum
        self.temps: dict[str, list[torch.Tensor]] = {}      # p2p tag -> pooled buffers it uses
        self.presums: dict[str, list] = {}                  # p2p tag -> per message, its parts' checksums (or None)
        self.packed: dict[bytes, _Packed] = {}              # content -> messages packed for a send still in flight
        self.pack_of: dict[str, bytes] = {}                 # p2p tag -> the content key of its packed messages
        self._sends: collections.Counter | None = None
        self.later: collections.deque = collections.deque()  # deferred work, run while the wire is busy
        self._comm: dict[str, Instr] = {}
        self._done: set[int] = set()
        self._xstage = self.meta.transfer_stage()

    def _sum(self, t: torch.Tensor) -> Any:
        """A checksum: an int for host memory, a device scalar (read at the end of the run) on a device."""
        t0, c0 = time.perf_counter(), time.thread_time()
        v = checksum(t) if t.device.type == "cpu" else checksum_device(t)
        self.stats.add("checksum", t0, c0)
        return v

    def _resolve_sums(self) -> None:
        """Turn pending checksums (lists of part checksums, device scalars) into ints, with one read."""
        todo = [(d, k, v) for d in (self.stats.sent_crc, self.stats.recv_crc) for k, v in d.items()
                if not isinstance(v, int)]
        flat = [x for _, _, v in todo for x in (v if isinstance(v, list) else [v])]
        got = iter(resolve(flat))
        for d, k, v in todo:
            if isinstance(v, list):
                h = 0
                for _ in v:
                    h = fold(h, next(got))
                d[k] = h
            else:
                d[k] = next(got)

    def _get(self, nbytes: int) -> torch.Tensor:
        """A staging buffer for the running instruction (its stream first waits for the buffer's last user)."""
        return self.pool.get(nbytes, self._on)

    def _put(self, t: torch.Tensor) -> None:
        """Hand a staging buffer back; with the ordered driver, its next user first waits for the work
        that used it last (the current instruction's)."""
        key, streams = self._cur, self.streams
        self.pool.put(t, None if streams is None or key is None else (lambda on: streams.wait(on or "pack", [key])))

    # ---- geometry ---------------------------------------------------------------------------------
    def _view(self, store: StateStore, i: int) -> torch.Tensor:
        return piece_view(store, self.names[int(self.P.tensor[i])], self.kinds[int(self.P.kind[i])],
                          tuple(self.P.lo[i].tolist()), tuple(self.P.hi[i].tolist()))

    def _rows(self, tag: str, end: str) -> np.ndarray:
        """This device's rows of transfer ``tag`` as its source (``end="src"``, one per buffer
        offset) or its destination."""
        rows = self.by_xfer.get(self.tag_id[tag], np.zeros(0, dtype=np.int64))
        rows = rows[(self.P.src if end == "src" else self.P.dst)[rows] == self.device]
        if end == "src":      # a piece sent to several receivers is packed once
            rows = rows[np.unique(self.P.offset[rows], return_index=True)[1]]
        return rows

    @staticmethod
    def _chunk(ins: Instr) -> int:
        return op_of(ins.op).chunk(ins.nbytes, len(ins.group or ()))

    def _local_offset(self, ins: Instr) -> int:
        """Where this device's buffer of ``ins`` starts in the transfer's full buffer."""
        return op_of(ins.op).local_offset(self.device, ins.root, tuple(ins.group), self._chunk(ins))

    # ---- copies: keep, pack, unpack ------------------------------------------------------------------
    def _alloc(self, ins: Instr) -> None:
        for name, nb in ins.alloc:
            if parse_switch_name(name)[0] == "buf" and name not in self.bufs:
                self.bufs[name] = self._get(nb)[:nb] if nb else torch.empty(0, dtype=torch.uint8,
                                                                                       device=self.pool.device)
                self.pooled.add(name)

    def _free(self, ins: Instr) -> None:
        for name in ins.free:
            t = self.bufs.pop(name, None)
            if t is not None and name in self.pooled:
                self.pooled.discard(name)
                self._put(t._base if t._base is not None else t)

    def _copy(self, ins: Instr) -> None:
        what, (arg,) = parse_switch_name(ins.key)
        if what == "keep":
            # kept pieces read the old store and write regions of the new one that nothing else
            # touches, so their copies are deferred: the driver runs them while transfers are on the wire
            stage = int(arg)
            rows = np.flatnonzero((self.P.transfer == -1) & (self.P.dst == self.device) & (self.P.stage == stage))
            for i in rows.tolist():       # in slices, so that landing parts are checksummed between them
                self.later.extend(slices(self._view(self.new, i), self._view(self.old, i), SLICE))
            self._alloc(ins)
            return
        t_ins = self._comm[arg]
        if not op_of(t_ins.op).chunked:
            (self._pack_p2p if what == "pack" else self._unpack_p2p)(arg)
            return
        buf_name = switch_name("buf", arg)
        base = self._local_offset(t_ins)
        if what == "pack":              # a chunked op: this device's chunks are one buffer
            self._alloc(ins)
            buf = self.bufs[buf_name]
            for i in self._rows(arg, "src").tolist():
                n, off = int(self.P.nbytes[i]), int(self.P.offset[i]) - base
                v = self._view(self.old, i)
                buf[off:off + n].view(v.dtype).view(v.shape).copy_(v)
            self._record(t_ins, buf, True)
        else:
            buf = self.bufs[buf_name]
            for i in self._rows(arg, "dst").tolist():
                n, off = int(self.P.nbytes[i]), int(self.P.offset[i]) - base
                v = self._view(self.new, i)
                v.copy_(buf[off:off + n].view(v.dtype).view(v.shape))
            self._free(ins)

    def _ck(self, ins: Instr, member: int) -> str:
        """Checksum key of ``member``'s chunk of a chunked op (p2p transfers and broadcasts, which
        travel as messages, are keyed by their tag)."""
        return f"{ins.tag}@{member}"

    def _record(self, ins: Instr, buf: torch.Tensor, sending: bool) -> None:
        """Checksums of the chunks of ``buf`` this device sends (``sending``) or receives, one per
        chunk owner (the op table says which)."""
        o, group = op_of(ins.op), tuple(ins.group)
        owners = (o.chunks_sent if sending else o.chunks_received)(self.device, ins.root, group)
        if not sending and self.on_received is not None:
            self.on_received(ins.tag, buf)
        c, base = self._chunk(ins), self._local_offset(ins)
        into = self.stats.sent_crc if sending else self.stats.recv_crc
        for m in owners:
            a = group.index(m) * c - base
            into[self._ck(ins, m)] = self._sum(buf[a:a + c])

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
            size = -(-nb[nb < self.big] // self.meta.align) * self.meta.align
            offs = np.concatenate([[0], np.cumsum(size)[:-1]]) if len(size) else np.zeros(0, dtype=np.int64)
            hit = self._splits[tag] = (small.tolist(), offs.tolist(), int(size.sum()), big.tolist())
        return hit

    def _temp(self, tag: str, nbytes: int) -> torch.Tensor:
        t = self._get(nbytes)
        self.temps.setdefault(tag, []).append(t)
        return t

    def _release(self, tag: str) -> None:
        self.msgs.pop(tag, None)
        self.direct.pop(tag, None)
        self.presums.pop(tag, None)
        key = self.pack_of.pop(tag, None)
        if key is not None:               # packed messages shared by sends of the same content: the last frees them
            p = self.packed[key]
            p.users -= 1
            if p.users:
                return
            del self.packed[key]
            tag = p.owner
        for t in self.temps.pop(tag, []):
            self._put(t)

    def _direct(self, v: torch.Tensor) -> bool:
        """Whether a piece's box travels straight from or into the state (contiguous, and in
        memory the wire reaches)."""
        return v.is_contiguous() and not (self.host_wire and v.device.type != "cpu")

    def _content(self, tag: str) -> bytes:
        """What this device's messages of p2p transfer ``tag`` hold (their pieces in order): two
        transfers with the same content send the same bytes."""
        small, _, _, big = self._split(tag)
        rows = np.asarray(small + [-1] + big, dtype=np.int64)
        ok = rows >= 0
        P = self.P
        return b"".join(np.ascontiguousarray(a[rows[ok]]).tobytes() for a in (P.tensor, P.kind, P.lo, P.hi)) + \
            rows.size.to_bytes(8, "little") + np.flatnonzero(~ok).tobytes()

    def _pack_p2p(self, tag: str) -> None:
        """Pack ``tag``'s messages: small pieces into one staging buffer, large ones straight from the
        old state where contiguous, else into a staging buffer each. Host staging is summed as it is
        written (:class:`~.wire.PartSums`, a block at a time while in cache), so sending it reads it
        no more. A send of the same content as one still in flight (on the gloo driver) reuses its
        messages and checksums instead of packing them again."""
        key = self._content(tag) if self.streams is None else None
        got = self.packed.get(key) if key is not None else None
        if got is not None:
            got.users += 0 if got.expected else 1
            self.pack_of[tag] = key
            self.msgs[tag], self.direct[tag], self.presums[tag] = got.msgs, got.direct, got.sums
            self.stats.packs_shared += 1
            self.stats.zero_copy += sum(got.direct)
            return
        small, offs, size, big = self._split(tag)
        msgs: list[torch.Tensor] = []
        sums: list = []
        if small:
            buf = self._temp(tag, size)
            hot = self._hot(buf)
            for i, off in zip(small, offs):
                v = self._view(self.old, i)
                n = int(self.P.nbytes[i])
                buf[off:off + n].view(v.dtype).view(v.shape).copy_(v)
                if hot is not None and off + n - hot.done >= BLOCK:
                    self._sum_upto(hot, off + n)
            msgs.append(buf)
            sums.append(self._sum_rest(hot))
        direct = [False] * len(msgs)
        for i in big:
            v = self._view(self.old, i)
            if self._direct(v):
                msgs.append(v.view(-1).view(torch.uint8))
                self.stats.zero_copy += 1
                direct.append(True)
                sums.append(None)
            else:
                t = self._temp(tag, int(self.P.nbytes[i]))
                tv = t.view(v.dtype).view(v.shape)
                hot = self._hot(t)
                for d, o in (slices(tv, v, BLOCK) if hot is not None else [(tv, v)]):
                    d.copy_(o)
                    if hot is not None:
                        self._sum_upto(hot, d.data_ptr() - t.data_ptr() + d.numel() * d.element_size())
                msgs.append(t)
                direct.append(False)
                sums.append(self._sum_rest(hot))
        self.msgs[tag], self.direct[tag], self.presums[tag] = msgs, direct, sums
        if key is not None:
            n = self._senders().get(key, 1)
            self.packed[key] = _Packed(tag, msgs, direct, sums, n, n > 1)
            self.pack_of[tag] = key

    def _senders(self) -> dict[bytes, int]:
        """Content -> how many of this device's sends carry it, when the switch runs in one stage (their
        packed messages then wait for every one of them; in a staged switch, under a memory budget, a
        send shares them only while they are still in flight, so staging never exceeds the Program's)."""
        if self._sends is None:
            self._sends = collections.Counter()
            rp = self.program.ranks.get(self.device)
            if self.meta.stages == 1 and rp is not None:
                self._sends.update(self._content(i.tag) for i in rp.instrs() if i.op == "send")
        return self._sends

    def _hot(self, buf: torch.Tensor) -> PartSums | None:
        """Part sums of a host staging buffer the gloo driver packs (None otherwise: summed on send)."""
        return PartSums(buf, self.chunk) if buf.device.type == "cpu" and self.streams is None else None

    def _sum_upto(self, hot: PartSums, end: int) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        hot.upto(end)
        self.stats.add("checksum", t0, c0)

    def _sum_rest(self, hot: PartSums | None) -> list[int] | None:
        if hot is None:
            return None
        t0, c0 = time.perf_counter(), time.thread_time()
        v = hot.values()
        self.stats.add("checksum", t0, c0)
        return v

    def _run_later(self, item: tuple[torch.Tensor, torch.Tensor]) -> None:
        """One piece of deferred work: a slice of a kept piece's copy."""
        t0, c0 = time.perf_counter(), time.thread_time()
        d, o = item
        d.copy_(o)
        self.stats.bytes_copied += d.numel() * d.element_size()
        self.stats.add("keep", t0, c0)

    def _recv_p2p(self, ins: Instr) -> list[torch.Tensor]:
        small, offs, size, big = self._split(ins.tag)
        msgs = [self._temp(ins.tag, size)] if small else []
        for i in big:
            v = self._view(self.new, i)
            if self._direct(v):
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

    def _messages(self, ins: Instr, msgs: list[torch.Tensor], sending: bool, post: Callable, t0: float) -> _Flight:
        """A flight of ``msgs`` cut into parts, part ``j`` issued as ``post(j, part)``. Each part is
        checksummed once it has gone out or landed (while later parts are on the wire) and folded,
        in order, into the transfer's checksum; a sender's staging goes back to the pool when all
        are out."""
        pieces = parts(msgs, self.chunk)
        works: list = []
        acc: list = []            # part checksums, folded in order when the run ends
        # parts whose checksums were taken while packing (None: summed here)
        sums = (self.presums.get(ins.tag) if sending else None) or [None] * len(msgs)
        pre = [c for m, s in zip(msgs, sums) for c in (s or [None] * len(range(0, max(m.numel(), 1), self.chunk)))]
        # parts sent straight from the old state (never written during the switch): a piece sent to several
        # peers is summed once
        shared = [d for m, d in zip(msgs, self.direct.get(ins.tag, ()))
                  for _ in range(0, max(m.numel(), 1), self.chunk)]

        def part(j: int) -> None:
            local = works[j] if j < len(works) and isinstance(works[j], (LocalRecv, LocalSend)) else None
            if not sending and self.on_received is not None:
                self.on_received(ins.tag, pieces[j])
            elif local is not None and not sending:                   # summed as it was read
                acc.append(local.sum)
                return
            if pre[j] is not None:
                acc.append(pre[j])
                return
            if sending and j < len(shared) and shared[j]:
                key = (pieces[j].data_ptr(), pieces[j].numel())
                v = self.sent_sums.get(key)
                if v is None and local is not None:                   # summed while the reader read it
                    v = self.sent_sums[key] = local.sum
                elif v is None:
                    v = self.sent_sums[key] = self._sum(pieces[j])
                else:
                    self.stats.sums_reused += 1
                acc.append(v)
                return
            acc.append(local.sum if sending and local is not None else self._sum(pieces[j]))   # a hook re-sums

        def done() -> None:
            (self.stats.sent_crc if sending else self.stats.recv_crc)[ins.tag] = acc
            if sending:
                self._release(ins.tag)
        if sending and self.streams is not None:     # ordered: summed as issued, staging handed back behind a fence
            for j in range(len(pieces)):
                part(j)
            works = [post(j, m) for j, m in enumerate(pieces)]
            self._cur = ins.id
            done()
            return _Flight(ins, ins.stream, works, t0)
        works.extend(post(j, m) for j, m in enumerate(pieces))
        for j, w in enumerate(works):
            if isinstance(w, LocalSend):
                w.summed = pre[j] is not None
        return _Flight(ins, ins.stream, works, t0, done, on_part=part)

    # ---- one handler per op --------------------------------------------------------------------------
    def _issue(self, ins: Instr) -> _Flight:
        t0 = time.perf_counter()
        o = op_of(ins.op)
        if not o.p2p:                     # a collective: the op table says who sends and receives
            group, root = tuple(ins.group), ins.root
            sending, receiving = self.device in o.senders(root, group), self.device in o.receivers(root, group)
        else:                             # point to point
            group, root = (), self.device
            sending, receiving = ins.op == "send", ins.op == "recv"
        c = self._chunk(ins)
        if sending:
            self.stats.bytes_sent += o.wire_bytes(self.device, root, group, ins.nbytes, c, True)
        if receiving:
            self.stats.bytes_received += o.wire_bytes(self.device, root, group, ins.nbytes, c, False)
        if not o.chunked:                 # messages, part by part
            msgs = self.msgs[ins.tag] if sending else self._recv_p2p(ins)
            return self._messages(ins, msgs, sending, self.HANDLERS[ins.op](self, ins), t0)
        if not sending:
            self._alloc(ins)
        buf = self.bufs[switch_name("buf", ins.tag)]
        work = self.HANDLERS[ins.op](self, ins, buf, c)
        then = (lambda: self._record(ins, buf, False)) if receiving else None  # noqa: E731
        return _Flight(ins, ins.stream, [work], t0, then)

    def _send(self, ins: Instr) -> Callable:
        base, peer = self.tag_id[ins.tag] * MAX_MSGS, self.index[ins.peer]
        if ins.peer in self.local.readers:            # the same-host receiver reads the part itself
            return lambda j, m: LocalSend(self.world, peer, base + j, m)
        return lambda j, m: self.world.send([m], peer, base + j)

    def _recv(self, ins: Instr) -> Callable:
        base, peer = self.tag_id[ins.tag] * MAX_MSGS, self.index[ins.peer]
        pid = self.local.sources.get(ins.peer)
        if pid is not None:
            self.stats.bytes_local += ins.nbytes
            return lambda j, m: LocalRecv(self.world, peer, base + j, m, pid, self.chunk)
        return lambda j, m: self.world.recv([m], peer, base + j)

    def _broadcast(self, ins: Instr) -> Callable:
        pg, o = self.group(tuple(ins.group)), dist.BroadcastOptions()
        o.rootRank = ins.group.index(ins.root)
        return lambda j, m: pg.broadcast([m], o)

    def _scatter(self, ins: Instr, buf: torch.Tensor, c: int) -> Any:
        pg, o = self.group(tuple(ins.group)), dist.ScatterOptions()
        o.rootRank = ins.group.index(ins.root)
        if self.device == ins.root:
            chunks = [buf[p * c:(p + 1) * c] for p in range(len(ins.group))]
            return pg.scatter([torch.empty(c, dtype=torch.uint8, device=buf.device)], [chunks], o)
        return pg.scatter([buf], [], o)

    def _gather(self, ins: Instr, buf: torch.Tensor, c: int) -> Any:
        pg, o = self.group(tuple(ins.group)), dist.GatherOptions()
        o.rootRank = ins.group.index(ins.root)
        if self.device == ins.root:
            chunks = [buf[p * c:(p + 1) * c] for p in range(len(ins.group))]
            return pg.gather([chunks], [torch.empty(c, dtype=torch.uint8, device=buf.device)], o)
        return pg.gather([], [buf], o)

    def _all_gather(self, ins: Instr, buf: torch.Tensor, c: int) -> Any:
        me = ins.group.index(self.device)
        chunks = [buf[p * c:(p + 1) * c] for p in range(len(ins.group))]
        return self.group(tuple(ins.group)).allgather([chunks], [chunks[me].clone()])

    #: op -> handler: for messages ``handler(self, ins)`` returns ``post(j, part)``; for chunked ops
    #: ``handler(self, ins, buffer, chunk)`` issues the collective and returns its work.
    HANDLERS: dict[str, Callable] = {"send": _send, "recv": _recv, "broadcast": _broadcast, "scatter": _scatter,
                                     "gather": _gather, "all_gather": _all_gather}

    # ---- driver ---------------------------------------------------------------------------------------
    def stage_of(self, ins: Instr) -> int:
        """The switch stage ``ins`` belongs to (``keep:<stage>``, else its transfer's stage)."""
        if ins.tag is not None:
            return int(self._xstage[self.tag_id[ins.tag]])
        what, (arg,) = parse_switch_name(ins.key)
        return int(arg) if what == "keep" else int(self._xstage[self.tag_id[arg]])

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
        if self.streams is not None:
            return self._run_ordered(stage)
        r = self._start(stage)
        try:
            self._drive(r)
            self._resolve_sums()
        except SwitchAborted:
            self.graveyard.append((r.busy, r.lanes, self.bufs, self.msgs, self.temps))
            raise
        except Exception as e:  # noqa: BLE001 - a peer failure surfaces as a gloo error
            self.graveyard.append((r.busy, r.lanes, self.bufs, self.msgs, self.temps))
            raise SwitchAborted(f"device {self.device}: a transfer failed ({type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''}); a peer left or failed") from e
        if self.pool is not None:
            self.stats.staging_peak = self.pool.peak
        return self.stats

    def _run_ordered(self, stage: int | None) -> ExecStats:
        """The driver for NCCL (and its CPU twin on gloo): this device's instructions (of ``stage``)
        in the switch's global order (:func:`issue_order`), each on its Program stream after the
        events (copies) and communication handles its deps stand for; a dependency on a
        point-to-point instruction covers its stream's earlier ones. Nothing waits per instruction
        on a GPU: copies are queued on the streams, sends and receives on NCCL's, and the run ends
        with one wait for everything (polling ``peer_gone``). On CPU the same calls run in issue
        order and a dependency on a transfer waits for it on the host."""
        S = self.streams
        rp = self.program.ranks.get(self.device)
        instrs = list(rp.instrs()) if rp is not None else []
        for ins in instrs:
            if ins.tag is not None:
                self._comm[ins.tag] = ins
        if self._order is None:
            self._order = issue_order(self.program)
        prefix: dict[int, list[int]] = {}
        for name, v in (rp.streams.items() if rp is not None else ()):
            if name.startswith(("send", "recv")):
                for k, ins in enumerate(v):
                    prefix[ins.id] = [i.id for i in v[:k + 1]]
        mine = sorted((i for i in instrs if stage is None or self.stage_of(i) == stage),
                      key=lambda i: (self._order[(self.device, i.id)], i.id))
        if self.pool is not None:
            self.pool.reset_peak()
        st = self.stats
        try:
            for ins in mine:
                deps = [k for d in ins.deps for k in prefix.get(d, (d,))]
                at = st.start()
                if ins.op == "copy":
                    with S.enter(ins.stream, deps):
                        self._cur, self._on = ins.id, ins.stream
                        self._copy(ins)
                        while self.later:
                            self._run_later(self.later.popleft())
                    S.mark(ins.stream, ins.id)
                    st.add_copy(ins.stream, ins.key, ins.nbytes, at)
                    continue
                with S.enter(ins.stream, deps):
                    self._cur, self._on = ins.id, ins.stream
                    fl = self._issue(ins)
                S.pending(ins.id, fl.works, then=lambda fl=fl: self._landed(fl))
                st.add("issue", at[0], at[1])
                if self.on_issue is not None:
                    self.on_issue(ins)
            t0 = time.perf_counter()
            S.finish(poll=self._check_peers)
            st.add("idle", t0)
            self._resolve_sums()
        except SwitchAborted:
            S.forget()
            self.graveyard.append((self.bufs, self.msgs, self.temps))
            raise
        except Exception as e:  # noqa: BLE001 - a peer failure surfaces as a backend error
            S.forget()
            self.graveyard.append((self.bufs, self.msgs, self.temps))
            raise SwitchAborted(f"device {self.device}: a transfer failed ({type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''}); a peer left or failed") from e
        if self.pool is not None:
            st.staging_peak = self.pool.peak
        return st

    def _landed(self, fl: _Flight) -> None:
        """(Ordered driver) a transfer's handles were waited on: its parts' checksums, then its
        completion (what the gloo driver does as each part lands)."""
        cur, self._cur = self._cur, fl.ins.id
        if fl.on_part is not None:
            for j in range(len(fl.works)):
                fl.on_part(j)
        if fl.then is not None:
            fl.then()
        self._free(fl.ins)
        self._cur = cur
        self.stats.rows.append((fl.stream, fl.ins.op, fl.t0, time.perf_counter(), fl.ins.nbytes))

    def _check_peers(self) -> None:
        """Raise SwitchAborted when a participant is known to be gone (polled while the run drains)."""
        gone = self.peer_gone() if self.peer_gone is not None else None
        if gone is not None:
            raise SwitchAborted(f"device {self.device}: device {gone} is gone (waiting for the switch's "
                                f"transfers to finish)")

    def _start(self, stage: int | None) -> "_Run":
        """This device's streams (of ``stage`` only, when given) and an empty wire."""
        rp = self.program.ranks.get(self.device)
        streams = {s: list(v) for s, v in (rp.streams.items() if rp is not None else ())}
        for v in streams.values():
            for ins in v:
                if ins.tag is not None:
                    self._comm[ins.tag] = ins
        if stage is not None:
            streams = {s: [i for i in v if self.stage_of(i) == stage] for s, v in streams.items()}
            streams = {s: v for s, v in streams.items() if v}
        if self.pool is not None:
            self.pool.reset_peak()
        return _Run(streams, {s: 0 for s in streams}, {},
                    {s: collections.deque() for s in streams if s.startswith(("send", "recv"))},
                    queue.SimpleQueue(), timedelta(self.timeout))

    def _drive(self, r: "_Run") -> None:
        """Issue, copy and complete until every stream is through (or raise)."""
        while True:
            ran = self._step(r)
            while True:                        # whatever landed meanwhile, before more copies
                try:
                    item = r.finished.get_nowait()
                except queue.Empty:
                    break
                self._handle(r, *item)
                ran = True
            if ran:
                continue
            if not r.in_flight():
                if any(r.pos[s] < len(v) for s, v in r.streams.items()):
                    raise SwitchAborted(f"device {self.device}: the switch Program cannot proceed (a dependency "
                                        f"is never satisfied); the Program is invalid")
                break
            if self.later:                     # the wire is busy: do deferred work meanwhile
                self._run_later(self.later.popleft())
                continue
            self._handle(r, *self._wait(r))
        while self.later:
            self._run_later(self.later.popleft())

    @staticmethod
    def _waiter(r: "_Run", fl: _Flight) -> None:
        """(On a waiter thread) wait on each of ``fl``'s works in order and report to the driver."""
        try:
            for j, w in enumerate(fl.works):
                w.wait(r.timeout)
                if fl.on_part is not None:
                    r.finished.put((fl, j, None))
            r.finished.put((fl, None, None))
        except BaseException as e:  # noqa: BLE001 - handed to the driver
            r.finished.put((fl, None, e))

    def _handle(self, r: "_Run", fl: _Flight, j: int | None, err: BaseException | None) -> None:
        """A part of ``fl`` landed (``j``), or all of it, or it failed (``err``, raised here)."""
        if err is not None:
            raise err
        if j is not None:
            fl.on_part(j)
            return
        if fl.then is not None:
            fl.then()
        self._free(fl.ins)
        self.stats.rows.append((fl.stream, fl.ins.op, fl.t0, time.perf_counter(), fl.ins.nbytes))
        fl.done = True
        q = r.lanes.get(fl.stream)
        if q is None:
            self._done.add(fl.ins.id)
            del r.busy[fl.stream]
            return
        while q and q[0].done:
            self._done.add(q.popleft().ins.id)

    def _step(self, r: "_Run") -> bool:
        """Issue every communication instruction whose deps are done, then run at most one ready
        copy (pack, unpack, keep); False when nothing could run. Receives are posted and sends go out
        before the next pack, so that packing overlaps the transfers already on the wire."""
        st, streams, pos, busy, lanes, done = self.stats, r.streams, r.pos, r.busy, r.lanes, self._done
        ran = False

        def ready(s: str, v: list) -> bool:
            return s not in busy and pos[s] < len(v) and all(d in done for d in v[pos[s]].deps)
        for s, v in streams.items():
            while ready(s, v) and v[pos[s]].op != "copy":
                ins = v[pos[s]]
                pos[s] += 1
                t0, c0 = time.perf_counter(), time.thread_time()
                fl = self._issue(ins)
                if s in lanes:
                    lanes[s].append(fl)
                else:
                    busy[s] = fl
                submit(self._waiter, r, fl)
                st.add("issue", t0, c0)
                ran = True
                if self.on_issue is not None:
                    self.on_issue(ins)
        for s, v in streams.items():
            if ready(s, v):               # a copy (communication was all issued above)
                ins = v[pos[s]]
                pos[s] += 1
                at = st.start()
                self._copy(ins)
                st.add_copy(s, ins.key, ins.nbytes, at)
                done.add(ins.id)
                return True
        return ran

    def _wait(self, r: "_Run") -> tuple:
        """The next finished flight; raises SwitchAborted when a peer is gone or nothing moves."""
        t0 = time.perf_counter()
        end = time.monotonic() + self.timeout + 5.0
        while True:
            try:
                got = r.finished.get(timeout=0.05)
                self.stats.add("idle", t0)
                return got
            except queue.Empty:
                gone = self.peer_gone() if self.peer_gone is not None else None
                if gone is not None or time.monotonic() > end:
                    why = f"device {gone} is gone" if gone is not None else f"no progress for {self.timeout:.0f} s"
                    waiting = list(r.busy.values()) + [f for q in r.lanes.values() for f in q if not f.done]
                    raise SwitchAborted(f"device {self.device}: {why} (waiting on "
                                        f"{', '.join(f'{f.ins.op} {f.ins.tag}' for f in waiting)})") from None


