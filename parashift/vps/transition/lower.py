"""Lowering: run the transition passes and emit the switch Program.

Ranks of a switch Program are device ids 0..max (devices in neither list get an empty
program); groups are concrete device tuples. Per device and stage, five streams:

- ``pack``: first ``keep:<stage>`` (copies the stage's kept pieces from old to new buffers;
  allocates the stage's new buffers, and at stage 0 registers the live ``old:*`` buffers), then
  one ``pack:<tag>`` copy per outgoing transfer into its staging buffer ``buf:<tag>``; the last
  pack instruction of a stage frees the old buffers nothing needs any more (GC);
- ``send<l>`` / ``recv<l>`` (``l < lanes``): point-to-point transfers in XOR order (see
  :mod:`order`); a message of XOR round ``s`` travels on lane ``hash(s) % lanes`` at both
  ends, so the lanes of one device run concurrently and share its links;
- ``coll<l>``: collectives (:data:`parashift.collectives.COLLECTIVE_OPS`) in one global order; all
  collectives over one group (one communicator) use the same lane on every member;
- ``unpack``: one ``unpack:<tag>`` copy per received transfer, which frees its staging buffer.

``meta`` is :class:`.meta.SwitchMeta` encoded: what every key means, and every destination
piece, kept ones included (a piece with transfer -1 is kept on its device and copied by
``keep:<stage>``). A transfer's buffer holds its pieces at their byte offsets. Buffers whose old
and new regions are equal stay in place (``static_memory["state"]``) and appear in no
instruction; a runtime whose state buffers differ in shape still copies their pieces.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING

import numpy as np

from ... import cluster as _cluster
from ...cluster import Cluster, format_devices
from ...errors import PlanError
from ...ir.program import Instr, Program, RankProgram
from ..plan import SwitchPlan
from ...collectives import COLLECTIVE_OPS
from .meta import PieceTable, SwitchMeta, switch_name
from .order import collective_order, p2p_order
from .sources import select_sources
from .staging import Staging, assign_stages, budget_array, state_buffers
from .transfers import ALIGN, Transfers, build_transfers

if TYPE_CHECKING:  # pragma: no cover - the simulator is heavy; import it only when lowering
    from ...cost import CostModel

__all__ = ["Options", "lower"]

STREAMS = ("pack", "unpack")


@dataclass(frozen=True)
class Options:
    """Which passes run (all by default; turn one off for ablation or search)."""

    select_sources: bool = True
    promote: bool = True
    stage: bool = True
    coalesce: bool = True
    xor_order: bool = True
    lanes: int = 4          # concurrent send/recv/collective streams per device

    @classmethod
    def make(cls, **kw: object) -> "Options":
        names = {f.name for f in fields(cls)}
        bad = sorted(set(kw) - names)
        if bad:
            raise PlanError(f"unknown lowering option(s) {', '.join(bad)}; options are {', '.join(sorted(names))}")
        lanes = kw.pop("lanes", 4)
        if isinstance(lanes, bool) or not isinstance(lanes, (int, np.integer)) or lanes < 1:
            raise PlanError(f"lanes={lanes!r} must be a positive integer (streams per direction and device)")
        return cls(**{k: bool(v) for k, v in kw.items()}, lanes=int(lanes))


def lower(plan: SwitchPlan, cluster: "Cluster | str | None" = None, *, memory_budget=None,
          cost_model: "CostModel | None" = None, staged: bool = False, **options: object) -> Program:
    """Lower ``plan`` to a switch Program (deadlock-free by construction; ``Program.validate()``
    checks it).

    ``memory_budget``: bytes of switch state each device may hold (a number, a device ->
    bytes mapping, or None for no limit); ``cost_model``: the simulator's cost model (default:
    the cluster's). ``options``: ``select_sources``, ``promote``, ``stage``, ``coalesce``,
    ``xor_order`` (each True by default, but ``promote`` is False on a cluster of CPU processes,
    see below) and ``lanes`` (concurrent streams per direction, 4).
    ``staged``: recorded in the meta for runtimes that must release old state stage by stage.
    Raises MemoryBudgetError when the budget cannot hold the new layout, before anything moves.
    """
    t0 = time.perf_counter()
    clus = _cluster.get(cluster) if cluster is not None else plan.cluster
    # CPU (gloo) processes move everything point to point unless asked: gloo's broadcast is the root
    # sending to each member in turn (no bytes saved), and a collective cannot use the same-host local
    # reads that messages take (exec.switch.local). Measured on 4 gloo processes of one host (a 2-layer
    # GPT of width 768, switch_check, medians of 5): dp=4,zero=1 -> dp=4 1.48 s through one all_gather
    # against 0.43 s point to point; dp=2,zero=1 -> dp=4 0.55 s through two broadcasts against 0.43 s.
    opts = Options.make(**{"promote": clus.gpu.name != "cpu", **options})
    devices = sorted(set(plan.src_devices) | set(plan.dst_devices))
    clus.node_of(np.asarray(devices))          # every device must be in the cluster
    if cost_model is None:
        from ...cost import CostModel
        cost_model = CostModel.for_cluster(clus)
    cost = cost_model
    p = select_sources(plan, clus, cost) if opts.select_sources else plan
    buffers = state_buffers(p)
    budget = budget_array(memory_budget, devices[-1] + 1) if opts.stage else None
    staging = assign_stages(p, budget, buffers)
    xf = build_transfers(p, staging.piece_stage, clus, cost, coalesce=opts.coalesce, promote=opts.promote,
                         memory_safe=budget is not None)
    ranks = _emit(p, staging, xf, opts, devices)
    node = np.asarray(clus.node_of(np.asarray(devices)), dtype=np.int64)
    at = np.zeros(devices[-1] + 1, dtype=np.int64)
    at[devices] = node
    inter = p.moved & (at[p.src] != at[p.dst])
    meta = replace(_meta(p, staging, xf), staged=staged, cluster=clus.name, options=asdict(opts),
                   bytes_inter_node=int(p.nbytes[inter].sum()),
                   lower_seconds=time.perf_counter() - t0, memory_budget=None if memory_budget is None else
                   (float(memory_budget) if np.ndim(memory_budget) == 0 and not isinstance(memory_budget, dict)
                    else "per-device"))
    return Program(ranks, None, meta.encode())


def _emit(p: SwitchPlan, st: Staging, xf: Transfers, opts: Options, devices: list[int]) -> dict[int, RankProgram]:
    """Every device's streams, stage after stage (module doc)."""
    keep_bytes, allocs, frees, static = _memory_effects(p, st)
    sends, recvs = p2p_order(xf.items, xor=opts.xor_order)
    colls = collective_order(xf.items)
    lane = _lanes(xf.items, opts.lanes)
    ranks: dict[int, RankProgram] = {}
    for d in devices:
        out = _Device(d, xf.items, lane)
        s_by, r_by, c_by = (_by_stage(xf.items, ids.get(d)) for ids in (sends, recvs, colls))
        prev: tuple[int, ...] = ()
        for k in range(st.stages):
            prev = out.stage(k, prev, s_by.get(k, []), r_by.get(k, []), c_by.get(k, []), keep_bytes.get((d, k), 0),
                             tuple(allocs.get((d, k), ())), tuple(frees.get((d, k), ())))
        ranks[d] = RankProgram({s: tuple(v) for s, v in out.streams.items() if v},
                               {"state": static[d]} if d in static else {})
    idle = RankProgram({}, {})          # devices between the ids in use take no part (shared program)
    return {d: ranks.get(d, idle) for d in range(devices[-1] + 1)}


def _memory_effects(p: SwitchPlan, st: Staging) -> tuple[dict, dict, dict, dict]:
    """Per (device, stage): bytes its kept pieces copy, the state buffers it allocates and frees;
    per device: bytes of state reused in place."""
    names, kinds, buf = p.src_layout.table.names, p.kinds, st.buffers
    lookup = np.zeros(int(buf.task.max(initial=0)) + 1, dtype=np.int64)
    for t, k in st.task_stage.items():
        lookup[t] = k
    bstage = lookup[buf.task]
    # kept pieces that need a copy (their buffer is not reused in place)
    n_t = len(names)
    bkey = (buf.dev * 8 + buf.kind) * n_t + buf.tensor
    kept = ~p.moved
    pkey = (p.dst * 8 + p.kind) * n_t + p.tensor
    reused_keys = np.sort(bkey[buf.reused])
    if len(reused_keys):
        pos = np.minimum(np.searchsorted(reused_keys, pkey), len(reused_keys) - 1)
        in_place = kept & (reused_keys[pos] == pkey)
    else:
        in_place = np.zeros(len(p), dtype=bool)
    copy = kept & ~in_place
    keep_bytes: dict[tuple[int, int], int] = {}
    for d, k, b in zip(p.dst[copy].tolist(), st.piece_stage[copy].tolist(), p.nbytes[copy].tolist()):
        keep_bytes[(d, k)] = keep_bytes.get((d, k), 0) + b
    allocs: dict[tuple[int, int], list[tuple[str, int]]] = {}
    frees: dict[tuple[int, int], list[str]] = {}
    label: dict[tuple[str, int, int], str] = {}        # every device names a buffer alike
    for prefix, size in (("old", buf.old), ("new", buf.new)):
        i = np.flatnonzero((~buf.reused) & (size > 0))
        for d, k, t, s, b in zip(buf.dev[i].tolist(), buf.kind[i].tolist(), buf.tensor[i].tolist(),
                                 bstage[i].tolist(), size[i].tolist()):
            name = label.get((prefix, k, t))
            if name is None:
                name = label[(prefix, k, t)] = switch_name(prefix, kinds[k], names[t])
            if prefix == "old":         # live from the start, freed by the stage that packs it
                allocs.setdefault((d, 0), []).append((name, b))
                frees.setdefault((d, s), []).append(name)
            else:
                allocs.setdefault((d, s), []).append((name, b))
    r = np.flatnonzero(buf.reused)
    static = dict(zip(*(x.tolist() for x in _group_sum(buf.dev[r], buf.old[r]))))
    return keep_bytes, allocs, frees, static


def _by_stage(items: tuple, ids: list[int] | None) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for k in ids or ():
        out.setdefault(items[k].stage, []).append(k)
    return out


def _lanes(items: tuple, lanes: int):
    """The lane of every transfer: one per collective group (the same on every member), and for a
    message the Fibonacci hash of its XOR round (equal at both ends): the top bits of the 32-bit
    product, so consecutive rounds land on different lanes even for a few devices."""
    group_lane: dict[tuple[int, ...], int] = {}
    for t in items:
        if t.op in COLLECTIVE_OPS:
            group_lane.setdefault(t.group, len(group_lane) % lanes)

    def lane(t) -> int:
        if t.op in COLLECTIVE_OPS:
            return group_lane[t.group]
        return (((t.root ^ t.peer) * 2654435761) & 0xFFFFFFFF) * lanes >> 32
    return lane


class _Device:
    """One device's streams as they are emitted (instruction ids in emission order)."""

    def __init__(self, device: int, items: tuple, lane) -> None:
        self.d, self.items, self.lane = device, items, lane
        self.streams: dict[str, list[Instr]] = {s: [] for s in STREAMS}
        self.count = 0

    def emit(self, stream: str, op: str, **kw) -> int:
        i, self.count = self.count, self.count + 1
        self.streams.setdefault(stream, []).append(Instr(i, op, stream, **kw))
        return i

    def stage(self, k: int, prev: tuple[int, ...], sends: list[int], recvs: list[int], colls: list[int],
              keep_bytes: int, alloc: tuple, gc: tuple) -> tuple[int, ...]:
        """Emit stage ``k`` after ``prev``; returns the instructions the next stage waits on."""
        d, items = self.d, self.items
        begin = self.emit("pack", "copy", deps=prev, nbytes=keep_bytes, key=switch_name("keep", k), alloc=alloc)
        last = {"pack": begin}
        packed: dict[int, int] = {}
        for x in sends + [x for x in colls if d in items[x].senders]:
            t = items[x]
            nb = t.member_bytes(d)
            packed[x] = last["pack"] = self.emit("pack", "copy", deps=(begin,), nbytes=nb, key=switch_name("pack", t.key),
                                                 alloc=((switch_name("buf", t.key), nb),))
        if gc:                          # the stage's last pack frees the old buffers nothing needs any more
            stream = self.streams["pack"]
            stream[-1] = replace(stream[-1], free=stream[-1].free + gc)
        for x in sends:
            t, b = items[x], switch_name("buf", items[x].key)
            ln = f"send{self.lane(t)}"
            last[ln] = self.emit(ln, "send", deps=(packed[x],), nbytes=t.nbytes, peer=t.peer, tag=t.key, key=b,
                                 free=(b,))
        got: list[tuple[int, int]] = []
        for x in recvs:
            t, b = items[x], switch_name("buf", items[x].key)
            ln = f"recv{self.lane(t)}"
            last[ln] = self.emit(ln, "recv", deps=(begin,), nbytes=t.nbytes, peer=t.root, tag=t.key, key=b,
                                 alloc=((b, t.nbytes),))
            got.append((x, last[ln]))
        for x in colls:
            t, b = items[x], switch_name("buf", items[x].key)
            ln = f"coll{self.lane(t)}"
            gives, gets = d in t.senders, d in t.receivers
            # a sender's buffer exists since its pack; a receiver's is freed by its unpack
            last[ln] = self.emit(ln, t.op, deps=(packed[x],) if gives else (begin,), nbytes=t.nbytes, group=t.group,
                                 root=t.root, tag=t.key, key=b, alloc=() if gives else ((b, t.member_bytes(d)),),
                                 free=(b,) if gives and not gets else ())
            if gets:
                got.append((x, last[ln]))
        for x, rid in got:
            t = items[x]
            last["unpack"] = self.emit("unpack", "copy", deps=(rid,), nbytes=t.member_bytes(d),
                                       key=switch_name("unpack", t.key), free=(switch_name("buf", t.key),))
        return tuple(sorted(last.values()))


def _group_sum(key: np.ndarray, val: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct keys and the sum of ``val`` per key."""
    uniq, inv = np.unique(key, return_inverse=True)
    return uniq, np.bincount(inv, weights=val, minlength=len(uniq)).astype(np.int64)


def _meta(p: SwitchPlan, st: Staging, xf: Transfers) -> SwitchMeta:
    """What every key packs and unpacks: every destination piece, kept ones included."""
    moved = p.moved
    pieces = PieceTable(p.tensor, p.kind, p.src, p.dst, p.lo, p.hi, p.nbytes, st.piece_stage, xf.piece_xfer,
                        xf.piece_offset)
    return SwitchMeta(
        model=p.model.name, src=str(p.src_strategy), dst=str(p.dst_strategy),
        src_devices=format_devices(p.src_devices), dst_devices=format_devices(p.dst_devices),
        kinds=tuple(p.kinds), tensors=tuple(p.src_layout.table.names), stages=st.stages, align=ALIGN,
        dims=int(p.lo.shape[1]), transfers=tuple(t.key for t in xf.items), pieces=pieces,
        bytes_moved=int(p.nbytes[moved].sum()), bytes_kept=int(p.nbytes[~moved].sum()),
        messages=xf.count("send"), collectives={o: xf.count(o) for o in COLLECTIVE_OPS})
