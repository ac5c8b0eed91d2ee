"""Coalescing and primitive promotion: from moved pieces to transfers.

A *transfer* carries one contiguous buffer: a point-to-point message between a device pair
(all their pieces of one stage when coalescing, else one piece), or a collective over a group
of devices named by its members: a *broadcast* (one source, the same pieces to every member),
a *scatter* (one source, distinct pieces per member), a *gather* (distinct pieces from every
member converge on the root) or an *all_gather* (every member sends its distinct pieces to
every other). What each op means (senders, receivers, bytes per member, offsets, link load) is
the table in :mod:`parashift.collectives`. Collectives are issued only where the cost model says they
beat the point-to-point messages they replace, counting what each side cannot overlap: messages run
side by side (the busiest member's link sets their time) and overlap their packs and unpacks with
each other, where a chunked collective's member packs or unpacks every chunk on one side of it.
Each piece records its transfer and its byte
offset in the transfer's full buffer (offsets aligned to ``ALIGN`` bytes); for chunked ops the
full buffer is ``members`` chunks of ``chunk`` bytes in group order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ...cluster import Cluster
from ...ir.program import Instr
from ..plan import SwitchPlan
from ...collectives import op as op_of
from .meta import switch_name

if TYPE_CHECKING:  # pragma: no cover - the simulator is heavy; import it only when lowering
    from ...cost import CostModel

__all__ = ["Transfer", "Transfers", "build_transfers", "ALIGN"]

#: Byte alignment of every piece inside a transfer buffer (any dtype view stays aligned).
ALIGN = 16


@dataclass(frozen=True)
class Transfer:
    """One buffer on the wire. ``op``: a name in :data:`parashift.collectives.OPS`."""

    op: str
    stage: int
    root: int                    # the sender of p2p/broadcast/scatter, the receiver of gather, group[0] of all_gather
    peer: int                    # the receiver of p2p; -1 for collectives
    group: tuple[int, ...]       # sorted members of a collective (root included); () for p2p
    nbytes: int                  # p2p message / the full buffer of a collective
    chunk: int                   # per-member bytes of a chunked op
    key: str

    @property
    def senders(self) -> tuple[int, ...]:
        return op_of(self.op).senders(self.root, self.group, self.peer)

    @property
    def receivers(self) -> tuple[int, ...]:
        return op_of(self.op).receivers(self.root, self.group, self.peer)

    def member_bytes(self, device: int) -> int:
        """Bytes of this transfer's buffer on ``device`` (what it packs or receives)."""
        return op_of(self.op).member_bytes(device, self.root, self.nbytes, self.chunk)


@dataclass(frozen=True, eq=False)
class Transfers:
    """All transfers, and for every moved piece its transfer and offset (-1 for kept pieces)."""

    items: tuple[Transfer, ...]
    piece_xfer: np.ndarray
    piece_offset: np.ndarray

    def count(self, op: str | None = None) -> int:
        return sum(1 for t in self.items if op is None or t.op == op)


def _align(n: np.ndarray) -> np.ndarray:
    return -(-n // ALIGN) * ALIGN


def _layout(rows: np.ndarray, nbytes: np.ndarray) -> tuple[np.ndarray, int]:
    """Aligned offsets of ``rows`` packed in order, and the buffer size."""
    size = _align(nbytes[rows])
    off = np.concatenate([[0], np.cumsum(size)[:-1]]) if len(rows) else np.zeros(0, dtype=np.int64)
    return off.astype(np.int64), int(size.sum())


def _p2p_time(cost: CostModel, cluster: Cluster, pairs: list[tuple[int, int, int]]) -> float:
    """Seconds of point-to-point messages (src, dst, bytes) that share one endpoint's link."""
    return sum(cost.time(Instr(0, "send", "comm", nbytes=int(b), peer=d, tag="x"), cluster, (s, d))
               for s, d, b in pairs)


def _coll_time(cost: CostModel, cluster: Cluster, op: str, nbytes: int, group: tuple[int, ...]) -> float:
    return cost.time(Instr(0, op, "comm", nbytes=int(nbytes), group=group, root=group[0], tag="x"), cluster, group)


def _copy_time(cost: CostModel, cluster: Cluster, device: int, nbytes: int) -> float:
    """Seconds of one on-device copy (a pack or an unpack) of ``nbytes``."""
    return cost.time(Instr(0, "copy", "comm", nbytes=int(nbytes)), cluster, (device, device))


def build_transfers(plan: SwitchPlan, stage: np.ndarray, cluster: Cluster, cost: CostModel, *,
                    coalesce: bool = True, promote: bool = True, memory_safe: bool = False) -> Transfers:
    """Group the moved pieces of each stage into transfers (see the module docstring).

    ``memory_safe``: promote only broadcasts, whose buffers are never larger than the
    point-to-point staging they replace (scatter and gather pad every chunk to the largest).
    """
    n = len(plan)
    xfer = np.full(n, -1, dtype=np.int64)
    offset = np.full(n, -1, dtype=np.int64)
    items: list[Transfer] = []
    moved = np.flatnonzero(plan.moved)
    if len(moved) == 0:
        return Transfers((), xfer, offset)
    free = np.zeros(n, dtype=bool)
    free[moved] = True

    def add(t: Transfer, rows: np.ndarray, offs: np.ndarray) -> None:
        xfer[rows] = len(items)
        offset[rows] = offs
        free[rows] = False
        items.append(t)

    if promote:
        loads = _Loads(plan, moved, stage, cluster, cost)
        if not memory_safe:
            _promote_all_gathers(plan, stage, cluster, cost, free, add, loads)
        _promote_broadcasts(plan, stage, cluster, cost, free, add, loads)
        for op in () if memory_safe else ("scatter", "gather"):     # rooted chunked ops
            _promote_rooted(plan, stage, cluster, cost, free, add, op, loads)
    rest = np.flatnonzero(free)
    if len(rest) == 0:
        return Transfers(tuple(items), xfer, offset)
    src, dst, stg = plan.src[rest], plan.dst[rest], stage[rest]
    order = np.lexsort((plan.tensor[rest], plan.kind[rest], dst, src, stg))
    rest = rest[order]
    src, dst, stg = src[order], dst[order], stg[order]
    if coalesce:
        new = np.ones(len(rest), dtype=bool)
        new[1:] = (src[1:] != src[:-1]) | (dst[1:] != dst[:-1]) | (stg[1:] != stg[:-1])
    else:
        new = np.ones(len(rest), dtype=bool)
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], len(rest))
    size = _align(plan.nbytes[rest])
    csum = np.concatenate([[0], np.cumsum(size)])
    for a, b in zip(starts.tolist(), ends.tolist()):
        s, d, k = int(src[a]), int(dst[a]), int(stg[a])
        tag = switch_name("send", k, s, (d,), *(() if coalesce else (int(rest[a]),)))
        add(Transfer("send", k, s, d, (), int(csum[b] - csum[a]), 0, tag), rest[a:b], csum[a:b] - csum[a])
    return Transfers(tuple(items), xfer, offset)


def _group_ids(cols: list[np.ndarray]) -> np.ndarray:
    """Dense id per row of equal column tuples (lexsort instead of a row-wise unique)."""
    n = len(cols[0])
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort(cols[::-1])
    new = np.zeros(n, dtype=bool)
    new[0] = True
    for c in cols:
        cs = c[order]
        new[1:] |= cs[1:] != cs[:-1]
    ids = np.empty(n, dtype=np.int64)
    ids[order] = np.cumsum(new) - 1
    return ids


def _box_keys(plan: SwitchPlan, rows: np.ndarray) -> np.ndarray:
    """Row ids of identical (tensor, kind, box) within ``rows`` (same id, same data)."""
    return _group_ids([plan.tensor[rows], plan.kind[rows], *plan.lo[rows].T, *plan.hi[rows].T])


class _Loads:
    """Seconds each device's outgoing and incoming links are busy, to keep promotions from
    moving the bottleneck: a collective replaces messages only if the busiest link among its
    members does not get busier (a chain broadcast, for instance, makes every member forward)."""

    def __init__(self, plan: SwitchPlan, rows: np.ndarray, stage: np.ndarray, cluster: Cluster,
                 cost: CostModel) -> None:
        self.bw_intra, self.bw_inter = cost.link_bw("intra"), cost.link_bw("inter")
        self.fixed_intra = cost.comm_overhead + cost.latency["intra"]
        self.fixed_inter = cost.comm_overhead + cost.latency["inter"]
        n = int(max(plan.src.max(initial=0), plan.dst.max(initial=0))) + 1
        self.node = np.asarray(cluster.node_of(np.arange(n)), dtype=np.int64)
        src, dst = plan.src[rows], plan.dst[rows]
        sec = plan.nbytes[rows] / self.bw(src, dst)
        # plus the fixed cost of one message per device pair and stage
        pair, inv = np.unique(np.stack([stage[rows], src, dst], axis=1), axis=0, return_inverse=True)
        fixed = self.fixed(pair[:, 1], pair[:, 2])
        left = np.bincount(inv.ravel(), weights=plan.nbytes[rows], minlength=len(pair))
        self.pair_bytes = {tuple(k): int(v) for k, v in zip(pair.tolist(), left.tolist())}
        self.out = np.bincount(src, weights=sec, minlength=n) + np.bincount(pair[:, 1], weights=fixed, minlength=n)
        self.inn = np.bincount(dst, weights=sec, minlength=n) + np.bincount(pair[:, 2], weights=fixed, minlength=n)

    def fixed(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.where(self.node[a] == self.node[b], self.fixed_intra, self.fixed_inter)

    def bw(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.where(self.node[a] == self.node[b], self.bw_intra, self.bw_inter)

    def try_replace(self, stage: int, p2p: list[tuple[int, int, int]], group: tuple[int, ...],
                    out_bytes: dict[int, int], in_bytes: dict[int, int], fixed: float) -> bool:
        """Swap the point-to-point bytes ``p2p`` (src, dst, bytes) of ``stage`` for a collective
        whose members send and receive ``out_bytes``/``in_bytes`` and each pay ``fixed`` seconds;
        keep the swap only if no member's link gets busier. A pair's message (and its fixed
        cost) disappears when none of its bytes are left."""
        g = np.asarray(group)
        bwg = self.bw_inter if len(np.unique(self.node[g])) > 1 else self.bw_intra
        d_out = {m: fixed for m in group}
        d_in = {m: fixed for m in group}
        for s, d, b in p2p:
            gone = self.pair_bytes.get((stage, s, d), 0) <= b
            sec = b / float(self.bw(s, d)) + (float(self.fixed(s, d)) if gone else 0.0)
            d_out[s] -= sec
            d_in[d] -= sec
        for m, b in out_bytes.items():
            d_out[m] += b / bwg
        for m, b in in_bytes.items():
            d_in[m] += b / bwg
        before = max(max(self.out[m], self.inn[m]) for m in group)
        after = max(max(self.out[m] + d_out[m], self.inn[m] + d_in[m]) for m in group)
        if after > before * (1 + 1e-9):
            return False
        for m in group:
            self.out[m] += d_out[m]
            self.inn[m] += d_in[m]
        for s, d, b in p2p:
            self.pair_bytes[(stage, s, d)] = self.pair_bytes.get((stage, s, d), 0) - b
        return True


def _data_groups(plan: SwitchPlan, stage: np.ndarray, free: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[tuple[int, int, tuple[int, ...]], list[int]]] | None:
    """Free rows that send one box from one source to several devices, sorted by (data, dst): the
    rows, the start and end of each data group, and the groups bundled by (stage, src, dsts)."""
    rows = np.flatnonzero(free)
    box = _box_keys(plan, rows)
    inv = _group_ids([stage[rows], plan.src[rows], box])
    cnt = np.bincount(inv)
    multi = cnt[inv] >= 2
    if not multi.any():
        return None
    rows, inv = rows[multi], inv[multi]
    order = np.lexsort((plan.dst[rows], inv))
    rows, inv = rows[order], inv[order]
    bundles: dict[tuple[int, int, tuple[int, ...]], list[int]] = {}
    starts = np.flatnonzero(np.r_[True, inv[1:] != inv[:-1]])
    ends = np.append(starts[1:], len(rows))
    for a, b in zip(starts.tolist(), ends.tolist()):
        r0 = int(rows[a])
        dsts = tuple(int(x) for x in plan.dst[rows[a:b]])
        bundles.setdefault((int(stage[r0]), int(plan.src[r0]), dsts), []).append(a)
    return rows, starts, ends, bundles


def _bundle_rows(rows: np.ndarray, starts: np.ndarray, ends: np.ndarray, firsts: list[int],
                 offs: np.ndarray, base: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Every row of the data groups starting at ``firsts`` and its offset (``base`` + its box's)."""
    members, member_off = [], []
    for f, o in zip(firsts, offs.tolist()):
        b = ends[np.searchsorted(starts, f)]
        members.append(rows[f:b])
        member_off.append(np.full(b - f, base + o))
    return np.concatenate(members), np.concatenate(member_off)


def _promote_all_gathers(plan, stage, cluster, cost, free, add, loads: _Loads) -> None:
    """Every member of a group sending its own pieces to every other member: one all_gather if
    cheaper than the messages (each member's chunk padded to the largest)."""
    got = _data_groups(plan, stage, free)
    if got is None:
        return
    rows, starts, ends, bundles = got
    done: set[tuple[int, tuple[int, ...]]] = set()
    for (k, s, dsts) in list(bundles):
        group = tuple(sorted((s,) + dsts))
        if len(group) < 3 or (k, group) in done:
            continue
        keys = [(k, m, tuple(x for x in group if x != m)) for m in group]
        if not all(key in bundles for key in keys):
            continue
        done.add((k, group))
        layouts = [_layout(rows[np.array(bundles[key])], plan.nbytes) for key in keys]
        chunk = max(size for _, size in layouts)
        total = chunk * len(group)
        pairs = [(m, d, size) for m, (_, size) in zip(group, layouts) for d in group if d != m]
        # the members' messages run side by side: the busiest member's link sets their time (its
        # sends, or with half-duplex links its sends and receives together)
        share = (lambda m, p: p[0] == m) if cluster.gpu.duplex else (lambda m, p: m in p[:2])
        t_p2p = max(_p2p_time(cost, cluster, [p for p in pairs if share(m, p)]) for m in group)
        # a member packs its chunk before the collective and unpacks the others' after it, while
        # messages overlap their copies with each other (only the first pack and last unpack show)
        t_ag = _coll_time(cost, cluster, "all_gather", total, group) + _copy_time(cost, cluster, group[0], total)
        if t_ag >= t_p2p + 2 * _copy_time(cost, cluster, group[0], chunk):
            continue
        exact = [(m, d, int(plan.nbytes[rows[np.array(bundles[key])]].sum()))
                 for m, key in zip(group, keys) for d in group if d != m]
        if not loads.try_replace(k, exact, group, *op_of("all_gather").link_bytes(group[0], group, total, chunk),
                                 _coll_time(cost, cluster, "all_gather", 0, group)):
            continue
        parts = [_bundle_rows(rows, starts, ends, bundles[key], offs, p * chunk)
                 for p, (key, (offs, _)) in enumerate(zip(keys, layouts))]
        add(Transfer("all_gather", k, group[0], -1, group, total, chunk, switch_name("all_gather", k, group[0], group)),
            np.concatenate([r for r, _ in parts]), np.concatenate([o for _, o in parts]))


def _promote_broadcasts(plan, stage, cluster, cost, free, add, loads: _Loads) -> None:
    """One source sending the same pieces to several devices: a broadcast over them if cheaper."""
    got = _data_groups(plan, stage, free)
    if got is None:
        return
    rows, starts, ends, bundles = got
    for (k, s, dsts), firsts in bundles.items():
        data = rows[np.array(firsts)]                     # one row per distinct box
        offs, total = _layout(data, plan.nbytes)
        group = tuple(sorted((s,) + dsts))
        t_bc = _coll_time(cost, cluster, "broadcast", total, group)
        pairs = [(s, d, total) for d in dsts]
        if t_bc >= _p2p_time(cost, cluster, pairs):
            continue
        if not loads.try_replace(k, [(s, d, int(plan.nbytes[data].sum())) for d in dsts], group,
                                 *op_of("broadcast").link_bytes(s, group, total, 0),
                                 _coll_time(cost, cluster, "broadcast", 0, group)):
            continue
        add(Transfer("broadcast", k, s, -1, group, total, 0, switch_name("broadcast", k, s, dsts)),
            *_bundle_rows(rows, starts, ends, firsts, offs))


def _promote_rooted(plan, stage, cluster, cost, free, add, op: str, loads: _Loads) -> None:
    """scatter: one source, distinct pieces to several devices; gather: several sources, one
    destination. Promoted when one rooted collective beats the point-to-point messages."""
    rows = np.flatnonzero(free)
    if len(rows) == 0:
        return
    out = op_of(op).chunk_from == "root"       # scatter: the root sends; gather: it receives
    root = plan.src[rows] if out else plan.dst[rows]
    other = plan.dst[rows] if out else plan.src[rows]
    order = np.lexsort((plan.tensor[rows], plan.kind[rows], other, root, stage[rows]))
    rows, root, other, stg = rows[order], root[order], other[order], stage[rows][order]
    starts = np.flatnonzero(np.r_[True, (root[1:] != root[:-1]) | (stg[1:] != stg[:-1])])
    ends = np.append(starts[1:], len(rows))
    size = _align(plan.nbytes[rows])
    # per (group, peer): bytes; per group: distinct peers -- all at once, then loop over candidates only
    grp = np.repeat(np.arange(len(starts)), ends - starts)
    newpeer = np.r_[True, (grp[1:] != grp[:-1]) | (other[1:] != other[:-1])]
    pair = np.cumsum(newpeer) - 1
    pair_bytes = np.bincount(pair, weights=size).astype(np.int64)
    pair_grp = grp[newpeer]
    pair_peer = other[newpeer]
    npeers = np.bincount(pair_grp, minlength=len(starts))
    pstart = np.concatenate([[0], np.cumsum(npeers)[:-1]])
    for g in np.flatnonzero(npeers >= 2).tolist():
        a, b = int(starts[g]), int(ends[g])
        ps = slice(int(pstart[g]), int(pstart[g] + npeers[g]))
        uniq, per = pair_peer[ps], pair_bytes[ps]
        r = int(root[a])
        chunk = int(per.max())
        group = tuple(sorted([r] + uniq.tolist()))
        total = chunk * len(group)
        # the root packs (scatter) or unpacks (gather) every chunk on one side of the collective and a
        # member its own chunk on the other, where messages overlap their copies with each other
        # (only the first pack and the last unpack show)
        t_c = _coll_time(cost, cluster, op, total, group) + _copy_time(cost, cluster, r, total + chunk)
        pairs = [(r, int(p), int(x)) if out else (int(p), r, int(x)) for p, x in zip(uniq, per)]
        if t_c >= _p2p_time(cost, cluster, pairs) + 2 * _copy_time(cost, cluster, r, chunk):
            continue
        out_b, in_b = op_of(op).link_bytes(r, group, total, chunk)
        raw = np.bincount(np.searchsorted(uniq, other[a:b]), weights=plan.nbytes[rows[a:b]]).astype(np.int64)
        exact = [(r, int(p), int(x)) if out else (int(p), r, int(x)) for p, x in zip(uniq, raw)]
        if not loads.try_replace(int(stg[a]), exact, group, out_b, in_b, _coll_time(cost, cluster, op, 0, group)):
            continue
        pos = np.searchsorted(np.asarray(group), other[a:b])
        first_of_peer = np.searchsorted(other[a:b], other[a:b], side="left")
        csum = np.concatenate([[0], np.cumsum(size[a:b])])
        offs = pos * chunk + csum[:-1] - csum[first_of_peer]
        tag = switch_name(op, int(stg[a]), r, uniq.tolist())
        add(Transfer(op, int(stg[a]), r, -1, group, total, chunk, tag), rows[a:b], offs)
