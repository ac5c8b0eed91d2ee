"""Staged release: a live switch under a memory budget frees the old state stage by stage.

A switch lowered with a memory budget has several stages; the Program frees each stage's old
buffers (``free`` of ``old:<kind>:<tensor>``) once the stage has packed them, and allocates the
next stage's new buffers, so that no device holds both layouts whole. The runtime keeps each
layout's state in a few flat buffers per rank, so here an old buffer is the page range of its
(kind, tensor) region in its flat buffer, handed back to the kernel (``MADV_DONTNEED``), and the
destination store is allocated lazily (its pages arrive as the transfer writes them).

Safety comes first: a region is released only once its stage is *verified* (every participant
published a clean record and every received checksum equals its sender's), and only when the
verified pieces this device itself sent or kept cover the region whole, so that every released
byte has a verified copy in the new layout. An abort at a later stage then restores the released
regions from those copies (:func:`restore`): the old layout comes back whole and training goes on
in it. Only the death of a device that holds such a copy loses state, and the error says which.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...errors import SwitchAborted
from ...ir.program import Program
from ...vps.transition import PieceTable, SwitchMeta, parse_switch_name
from ..state import StateStore
from .memory import advise_free
from .stores import kind_tensor, layout_store, piece_view
from .wire import timedelta

__all__ = ["Releases", "restore", "RESTORE_TAG"]

RESTORE_TAG = 1 << 30          # point-to-point tags of restored pieces: RESTORE_TAG + piece row


@dataclass(frozen=True)
class _Region:
    numel: int                 # elements of (kind, tensor) the device holds
    lo: tuple[int, ...]        # the tensor's box on the device
    hi: tuple[int, ...]
    whole: bool                # the device holds the whole box (not a ZeRO shard of it)
    flat: torch.Tensor | None = None
    a: int = 0                 # element range of the region in ``flat``
    e: int = 0


def _region(store: StateStore, kind: str, tensor: str) -> _Region | None:
    p = store.pieces.get(tensor)
    if p is None:
        return None
    try:
        flat, base = kind_tensor(store, p.group, kind)
    except SwitchAborted:
        return None
    a, e = max(p.start, base) - base, min(p.start + p.numel, base + flat.numel()) - base
    if e <= a:
        return None
    lo = tuple(p.offsets)
    return _Region(e - a, lo, tuple(o + n for o, n in zip(lo, p.sizes)), e - a == p.numel, flat, a, e)


class Releases:
    """Which old regions every device releases after each verified stage, and from which verified
    copies each would be restored (the same answer on every device: it depends only on the
    Program and the source layout); this device's releases so far.

    A region of device ``d`` is covered after stage ``k`` by the distinct boxes ``d`` sent or kept
    in stages ``<= k``, or, when ``d`` holds the whole box (a replica another device was chosen to
    send), by the distinct boxes inside it that anyone sent; it is released only when covered."""

    def __init__(self, program: Program, device: int, old: StateStore | None, spec, src, src_devices) -> None:
        meta = SwitchMeta.of(program)
        self.P = meta.pieces
        self.names, self.kinds = meta.tensors, meta.kinds
        self.device, self.old = device, old
        self.spec, self.src, self.src_devices = spec, src, tuple(src_devices)
        self._layouts: dict[int, StateStore] = {}
        self.gc: dict[tuple[int, int], list[tuple[str, str]]] = {}     # (device, stage) -> (kind, tensor)
        for d, rp in program.ranks.items():
            stage = -1
            for ins in rp.streams.get("pack", ()):
                what, arg = parse_switch_name(ins.key)
                if what == "keep":
                    stage = int(arg[0])
                for name in ins.free:
                    what, arg = parse_switch_name(name)
                    if what == "old":
                        self.gc.setdefault((d, stage), []).append(arg)
        self.released: list[tuple[str, str]] = []
        self.released_bytes = 0

    def region(self, d: int, kind: str, tensor: str) -> _Region | None:
        """(kind, tensor) on device ``d`` in the source layout (None when it holds none)."""
        if d == self.device and self.old is not None:
            return _region(self.old, kind, tensor)
        if d not in self.src_devices:
            return None
        if d not in self._layouts:
            self._layouts[d] = layout_store(self.spec, self.src, self.src_devices.index(d))
        return _region(self._layouts[d], kind, tensor)

    def cover(self, d: int, kind: str, tensor: str, upto: int) -> list[int] | None:
        """Rows of distinct verified boxes that restore (kind, tensor) of ``d`` after stage ``upto``,
        or None when they do not cover it."""
        r = self.region(d, kind, tensor)
        if r is None or tensor not in self.names or kind not in self.kinds:
            return None
        P = self.P
        mine = (P.tensor == self.names.index(tensor)) & (P.kind == self.kinds.index(kind)) & (P.stage <= upto)
        own = np.flatnonzero(mine & (P.src == d))
        got = _distinct(P, own)
        if _volume(P, got) == r.numel:
            return got
        if not r.whole:
            return None
        nd = len(r.lo)
        inside = mine & np.all(P.lo[:, :nd] >= np.asarray(r.lo), axis=1) & np.all(P.hi[:, :nd] <= np.asarray(r.hi), axis=1)
        got = _distinct(P, np.flatnonzero(inside))
        return got if _volume(P, got) == r.numel else None

    def release(self, stage: int) -> int:
        """Release this device's old regions the Program frees at ``stage`` (call once the stage is
        verified on every participant); returns the bytes handed back."""
        got = 0
        for kind, tensor in self.gc.get((self.device, stage), ()):
            if self.cover(self.device, kind, tensor, stage) is None:
                continue                # kept whole until the commit (no verified copy covers it)
            r = self.region(self.device, kind, tensor)
            got += advise_free(r.flat, r.a, r.e)
            self.released.append((kind, tensor))
        self.released_bytes += got
        return got

    def released_by(self, d: int, before: int) -> list[tuple[str, str, list[int]]]:
        """(kind, tensor, restoring rows) of every region device ``d`` released before stage ``before``."""
        out = []
        for k in range(before):
            for kind, tensor in self.gc.get((d, k), ()):
                rows = self.cover(d, kind, tensor, k)
                if rows is not None:
                    out.append((kind, tensor, rows))
        return out


def _distinct(P: PieceTable, rows: np.ndarray) -> list[int]:
    """The first row of each distinct box among ``rows``."""
    if not len(rows):
        return []
    boxes = np.concatenate([P.lo[rows], P.hi[rows]], axis=1)
    _, first = np.unique(boxes, axis=0, return_index=True)
    return sorted(rows[first].tolist())


def _volume(P: PieceTable, rows: list[int]) -> int:
    return int(np.prod(P.hi[rows] - P.lo[rows], axis=1).sum()) if rows else 0


def restore(rel: Releases, before: int, world, index: dict[int, int], new: StateStore | None,
            timeout: float, gone: frozenset = frozenset()) -> int:
    """Put back every region released before stage ``before`` on every device, from the verified
    copies in the new stores (collective over the switch's surviving participants: each calls it;
    ``gone``: devices that failed); returns the bytes this device got back. Raises SwitchAborted
    when the copy of a region this device released was on a device that failed."""
    me = rel.device
    works, then, got = [], [], 0
    td = timedelta(timeout)
    try:
        _post(rel, before, world, index, new, gone, works, then)
        for w, _ in works:
            w.wait(td)
    except SwitchAborted:
        raise
    except Exception as e:  # noqa: BLE001 - a dead holder surfaces as a gloo error
        raise SwitchAborted(f"device {me}: the old state released by the switch could not be restored "
                            f"({type(e).__name__}); a device holding its verified copy failed") from e
    for view, buf in then:
        view.copy_(buf)
        got += buf.numel() * buf.element_size()
    return got


def _post(rel: Releases, before: int, world, index: dict[int, int], new: StateStore | None, gone: frozenset,
          works: list, then: list) -> None:
    """Post this device's sends and receives of :func:`restore` (local copies run at once)."""
    P, me = rel.P, rel.device
    for d in sorted(set(index) - set(gone)):
        for kind, tensor, rows in rel.released_by(d, before):
            for i in rows:
                holder = int(P.dst[i])
                if me not in (d, holder):
                    continue
                if holder in gone:
                    raise SwitchAborted(f"device {me}: part of its old {kind} of {tensor}, released by the switch, "
                                        f"was verified only on device {holder}, which failed; this device's state "
                                        f"is incomplete: restart from a checkpoint")
                lo, hi = tuple(P.lo[i].tolist()), tuple(P.hi[i].tolist())
                if holder == d:                     # kept on the device: a local copy back
                    piece_view(rel.old, tensor, kind, lo, hi).copy_(piece_view(new, tensor, kind, lo, hi))
                elif me == holder:
                    t = piece_view(new, tensor, kind, lo, hi).contiguous()
                    works.append((world.send([t.view(-1)], index[d], RESTORE_TAG + i), t))
                else:
                    view = piece_view(rel.old, tensor, kind, lo, hi)
                    buf = torch.empty(view.shape, dtype=view.dtype)
                    works.append((world.recv([buf.view(-1)], index[holder], RESTORE_TAG + i), buf))
                    then.append((view, buf))
