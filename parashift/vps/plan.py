"""Switch plans: what every device keeps, sends and receives to go from one layout to another.

``plan_switch(model, src, dst)`` intersects the destination layout with the source layout
(see :mod:`route`) and returns a :class:`SwitchPlan`: a struct-of-arrays table of pieces
``(tensor, kind, src device, dst device, box)``. A piece with ``src == dst`` is kept in place.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from .. import cluster as _cluster
from ..cluster import Cluster, format_devices, parse_devices
from ..errors import DeviceListError, PlanError
from ..models import ModelSpec, get as get_model
from ..strategy import Strategy
from .boxes import covered_volume, exactly_once, group_pairs, intersect, volume
from .layout import Layout, layout
from .route import route
from .tensors import KINDS

__all__ = ["SwitchPlan", "plan_switch", "DEFAULT_KINDS", "resolve_devices", "default_cluster"]

#: Kinds a switch between iterations moves (gradients are empty then).
DEFAULT_KINDS = ("param", "master", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True, eq=False)
class SwitchPlan:
    """Pieces (struct-of-arrays, one row each) that rebuild ``dst_layout`` from ``src_layout``.

    ``kind`` indexes ``kinds``; ``src``/``dst`` are device ids; ``lo``/``hi`` global boxes
    padded with trailing unit dimensions; ``nbytes`` the bytes of each piece. ``holders``: the
    set of source devices that hold each piece, an index into the CSR ``hs_ptr``/``hs_dev``
    (what a later pass may choose ``src`` from).
    """

    def holder_devices(self, i: int) -> np.ndarray:
        """Devices that hold piece ``i`` in the source layout."""
        if self.holders is None:
            raise PlanError("this plan records no holder sets; build it with plan_switch")
        h = int(self.holders[i])
        return self.hs_dev[self.hs_ptr[h]:self.hs_ptr[h + 1]]

    def replace(self, **changes) -> "SwitchPlan":
        """A copy with some fields changed (plans are values: passes return new ones)."""
        import dataclasses
        return dataclasses.replace(self, **changes)

    model: ModelSpec
    src_layout: Layout
    dst_layout: Layout
    src_devices: tuple[int, ...]
    dst_devices: tuple[int, ...]
    cluster: Cluster
    kinds: tuple[str, ...]
    tensor: np.ndarray
    kind: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    nbytes: np.ndarray
    holders: np.ndarray | None = None
    hs_ptr: np.ndarray | None = None
    hs_dev: np.ndarray | None = None
    meta: dict = field(default_factory=dict)

    @property
    def src_strategy(self) -> Strategy:
        return self.src_layout.strategy

    @property
    def dst_strategy(self) -> Strategy:
        return self.dst_layout.strategy

    def __len__(self) -> int:
        return len(self.tensor)

    @property
    def moved(self) -> np.ndarray:
        """Mask of pieces that travel between devices."""
        return self.src != self.dst

    def to_frame(self):
        """Columns ``tensor, kind, src, dst, lo, hi, nbytes`` (one row per piece)."""
        import pandas as pd
        nd = self.src_layout.table.ndim[self.tensor]
        return pd.DataFrame({
            "tensor": np.array(self.src_layout.table.names, dtype=object)[self.tensor],
            "kind": np.array(self.kinds, dtype=object)[self.kind],
            "src": self.src, "dst": self.dst,
            "lo": [tuple(r[:n]) for r, n in zip(self.lo.tolist(), nd.tolist())],
            "hi": [tuple(r[:n]) for r, n in zip(self.hi.tolist(), nd.tolist())],
            "nbytes": self.nbytes})

    # ---- checks ------------------------------------------------------------------------------------
    def _kind_bytes(self) -> np.ndarray:
        return np.array([self.model.kind_bytes(k) for k in self.kinds], dtype=np.int64)

    def _held(self, lay: Layout, devices: tuple[int, ...]):
        """Regions of the plan's kinds as (group key by device/tensor/kind, lo, hi)."""
        reg = lay.regions(kinds=self.kinds)
        kmap = np.array([self.kinds.index(k) if k in self.kinds else -1 for k in lay.kinds])
        dev = np.asarray(devices, dtype=np.int64)[reg.rank]
        return self._group(dev, reg.tensor, kmap[reg.kind]), reg.lo, reg.hi

    def _group(self, dev: np.ndarray, tensor: np.ndarray, kind: np.ndarray) -> np.ndarray:
        return (dev * self.src_layout.table.count + tensor) * len(self.kinds) + kind

    def _describe(self, group: int) -> str:
        k = group % len(self.kinds)
        t = (group // len(self.kinds)) % self.src_layout.table.count
        d = group // len(self.kinds) // self.src_layout.table.count
        return f"{self.src_layout.table.names[t]} ({self.kinds[k]}) on device {d}"

    def verify(self) -> "SwitchPlan":
        """Raise PlanError unless every destination element is covered exactly once by a piece
        whose source device holds it in the source layout. Returns the plan."""
        vol = volume(self.lo, self.hi)
        bad = np.flatnonzero(vol * self._kind_bytes()[self.kind] != self.nbytes)
        if len(bad):
            raise PlanError(f"piece {int(bad[0])} has {int(self.nbytes[bad[0]])} bytes for "
                            f"{int(vol[bad[0]])} elements; the plan is corrupt, rebuild it with plan_switch")
        sg, slo, shi = self._held(self.src_layout, self.src_devices)
        pg = self._group(self.src, self.tensor, self.kind)
        inside = covered_volume(self.lo, self.hi, pg, slo, shi, sg)
        bad = np.flatnonzero(inside != vol)
        if len(bad):
            i = int(bad[0])
            raise PlanError(f"piece {i} asks {self._describe(int(pg[i]))} for {tuple(self.lo[i])}-"
                            f"{tuple(self.hi[i])}, which that device does not hold; rebuild the plan")
        dg, dlo, dhi = self._held(self.dst_layout, self.dst_devices)
        cov = exactly_once(dlo, dhi, dg, self.lo, self.hi, self._group(self.dst, self.tensor, self.kind))
        if not cov.ok:
            raise PlanError(f"destination {self._describe(cov.group)} is not covered exactly once "
                            f"({cov.reason}); rebuild the plan with plan_switch")
        return self

    @cached_property
    def bytes_needed(self) -> int:
        """Bytes destinations need that their device does not already hold (computed from the
        layouts, independently of the pieces)."""
        kb = self._kind_bytes()
        dg, dlo, dhi = self._held(self.dst_layout, self.dst_devices)
        sg, slo, shi = self._held(self.src_layout, self.src_devices)
        total = int((volume(dlo, dhi) * kb[dg % len(self.kinds)]).sum())
        ia, jb = group_pairs(dg, sg)
        ilo, ihi = intersect(dlo[ia], dhi[ia], slo[jb], shi[jb])
        return total - int((volume(ilo, ihi) * kb[dg[ia] % len(self.kinds)]).sum())

    def stats(self) -> dict:
        """``bytes_kept, bytes_moved, bytes_needed, bytes_inter_node, messages`` (messages: device
        pairs that exchange data, one coalesced message each) plus ``pieces``."""
        moved = self.moved
        node = self.cluster.node_of
        inter = moved.copy()
        if moved.any():
            inter[moved] = node(self.src[moved]) != node(self.dst[moved])
        pairs = np.unique(self.src[moved] * (max(self.src.max(initial=0), self.dst.max(initial=0)) + 1)
                          + self.dst[moved])
        return {"bytes_kept": int(self.nbytes[~moved].sum()), "bytes_moved": int(self.nbytes[moved].sum()),
                "bytes_needed": self.bytes_needed, "bytes_inter_node": int(self.nbytes[inter].sum()),
                "messages": int(len(pairs)), "pieces": int(moved.sum())}

    def __repr__(self) -> str:
        return (f"SwitchPlan({self.model.name}: {self.src_strategy} on {len(self.src_devices)} devices -> "
                f"{self.dst_strategy} on {len(self.dst_devices)} devices, {len(self)} pieces)")


def resolve_devices(devices: "str | list[int] | tuple[int, ...] | np.ndarray | None", strategy: Strategy,
                    which: str) -> tuple[int, ...]:
    """Device ids of each rank (rank i on device i by default); the count must match the world."""
    devs = parse_devices(devices, default=strategy.world)
    if len(devs) != strategy.world:
        raise DeviceListError(
            f"{which} strategy {strategy} runs {strategy.world} ranks but {len(devs)} {which} devices were "
            f"given ({format_devices(devs) or 'none'}); list exactly {strategy.world} devices or change dp/tp/pp")
    return devs


def default_cluster(devices: "tuple[int, ...]") -> Cluster:
    """Nodes of 8 A800s, enough to hold every device id (used when no cluster is given)."""
    return _cluster.get("a800-1x8").with_devices(max(devices) + 1)


def _kinds(model: ModelSpec, kinds: "tuple[str, ...] | list[str] | str") -> tuple[str, ...]:
    if isinstance(kinds, str):
        kinds = tuple(k for k in kinds.split(",") if k)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise PlanError(f"unknown state kind(s) {', '.join(unknown)}; kinds are {', '.join(KINDS)}")
    if "master" in kinds and "master" not in model.state_kinds and tuple(kinds) != DEFAULT_KINDS:
        raise PlanError(f"{model.name} trains in {model.dtype} and keeps no master copy; drop 'master'")
    out = tuple(k for k in KINDS if k in kinds and k in model.state_kinds)
    if not out:
        raise PlanError("no state kinds to move; pass some of " + ", ".join(model.state_kinds))
    return out


def plan_switch(model: "ModelSpec | str", src: "Strategy | str", dst: "Strategy | str", *,
                cluster: "Cluster | str | None" = None, src_devices=None, dst_devices=None,
                kinds: "tuple[str, ...] | list[str] | str" = DEFAULT_KINDS, placement: str = "given") -> SwitchPlan:
    """Plan the switch of ``model``'s state from strategy ``src`` to ``dst``.

    ``src_devices``/``dst_devices``: device id of each rank (a list or text such as
    ``"0-39,48-127"``; rank i on device i by default). ``cluster`` places devices on nodes
    (default: nodes of 8). Every device keeps what it already holds, takes the rest from a
    holder on its node when there is one, and otherwise spreads its requests over the holders.
    ``placement="keep"`` reorders ``dst_devices`` within each node so that devices keep the most
    state in place (see :mod:`.placement`; the plan's ``dst_devices`` is the order chosen);
    ``"given"`` keeps the order as given.
    """
    if placement not in ("given", "keep"):
        raise PlanError(f"unknown placement {placement!r}; use 'given' (rank i on the i-th destination "
                        f"device) or 'keep' (the order of the destination devices that keeps the most state)")
    plan = _plan(model, src, dst, cluster, src_devices, dst_devices, kinds)
    if placement == "keep":
        from .placement import best_order
        order = best_order(plan)
        if order != plan.dst_devices:
            plan = _plan(plan.model, plan.src_strategy, plan.dst_strategy, plan.cluster, plan.src_devices, order,
                         plan.kinds)
    return plan


def _plan(model, src, dst, cluster, src_devices, dst_devices, kinds) -> SwitchPlan:
    model = get_model(model)
    src_s, dst_s = Strategy.parse(src), Strategy.parse(dst)
    src_l, dst_l = layout(model, src_s), layout(model, dst_s)
    sdev = resolve_devices(src_devices, src_s, "source")
    ddev = resolve_devices(dst_devices, dst_s, "destination")
    clus = _cluster.get(cluster) if cluster is not None else default_cluster(sdev + ddev)
    every = np.arange(max(max(sdev), max(ddev)) + 1)
    node_of = np.asarray(clus.node_of(every), dtype=np.int64)   # raises if a device is not in the cluster
    kinds = _kinds(model, kinds)
    kb = np.array([model.kind_bytes(k) for k in kinds], dtype=np.int64)
    groups: dict[tuple[bool, bool], list[int]] = {}
    for i, k in enumerate(kinds):
        groups.setdefault((src_l.sharded(k), dst_l.sharded(k)), []).append(i)
    parts = []
    sd, dd = np.asarray(sdev, dtype=np.int64), np.asarray(ddev, dtype=np.int64)
    hs_ptr, hs_dev, base, off = [np.zeros(1, dtype=np.int64)], [], 0, 0
    for ks in groups.values():
        names = [kinds[i] for i in ks]
        r = route(src_l, dst_l, src_l.kind_mask(names), dst_l.kind_mask(names), sd, dd, node_of)
        r = r._replace(holders=r.holders + base)
        hs_ptr.append(r.hs_ptr[1:] + off)
        hs_dev.append(r.hs_dev)
        base += len(r.hs_ptr) - 1
        off += len(r.hs_dev)
        for i in ks:
            parts.append((r, i))
    cat = lambda f: np.concatenate([f(r, i) for r, i in parts])  # noqa: E731
    return SwitchPlan(
        model=model, src_layout=src_l, dst_layout=dst_l, src_devices=sdev, dst_devices=ddev, cluster=clus,
        kinds=kinds, tensor=cat(lambda r, i: r.tensor), kind=cat(lambda r, i: np.full(len(r.tensor), i)),
        src=cat(lambda r, i: r.src), dst=cat(lambda r, i: r.dst), lo=cat(lambda r, i: r.lo),
        hi=cat(lambda r, i: r.hi), nbytes=cat(lambda r, i: r.numel * kb[i]), holders=cat(lambda r, i: r.holders),
        hs_ptr=np.concatenate(hs_ptr), hs_dev=np.concatenate(hs_dev))
