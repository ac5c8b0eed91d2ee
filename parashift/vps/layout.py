"""Layouts: which (tensor, kind, global box) regions every rank of a strategy holds.

A rank's state is organized in *blocks*, each a flat buffer of the rank's local (TP/EP)
shards concatenated in model order:

- slot 0, dense: the dense tensors of the rank's pipeline stage, shared by the ``dp x cp`` ranks
  with the same (tp, pp) coordinates (context-parallel ranks hold the same parameters);
- slot 1, experts: the expert tensors of the rank's (pp, tp, ep) shard, shared by the ``edp``
  ranks of its expert-data-parallel group;
- slots 2 and 3: the same two buffers under ZeRO, padded to a multiple of the group size
  (``dp x cp`` for dense, as Megatron's distributed optimizer shards over the data-parallel
  group with context parallelism; ``edp`` for experts) and split evenly, one shard per rank;
  with hybrid sharding (``shard=N``) the group is N consecutive DP ranks and shard ``j`` is held by
  the ``dp // N`` ranks whose DP index is ``j`` modulo N (its replicas).

A block holds some kinds: the kinds ZeRO does not shard live in slots 0/1, the sharded ones in
slots 2/3 (stage 1 shards master and moments, 2 also grads, 3 also params). Blocks are
computed once per symmetry class; ``regions()`` expands them to ranks on demand. A block is
a list of *intervals* (tensor, local-shard flat range, offset in the buffer), and each
interval is mapped back to at most ``2*ndim - 1`` global boxes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..errors import PlanError
from ..models import ModelSpec, get as get_model
from ..strategy import Strategy
from .boxes import concat_ranges, flat_to_boxes, volume
from .tensors import TensorTable, held_by_stage, local_shape, shard_origin, tensor_table

__all__ = ["Layout", "Regions", "layout", "SLOTS"]

SLOTS = ("dense", "experts", "zero_dense", "zero_experts")


class Regions(NamedTuple):
    """Expanded regions, one row per (rank, kind, box); ``kind`` indexes ``Layout.kinds``."""

    rank: np.ndarray
    tensor: np.ndarray
    kind: np.ndarray
    lo: np.ndarray
    hi: np.ndarray

    @property
    def numel(self) -> np.ndarray:
        return volume(self.lo, self.hi)


@dataclass(frozen=True, eq=False)
class Layout:
    """The regions every rank of ``strategy`` holds for ``model`` (see the module docstring).

    Arrays (struct-of-arrays): blocks ``block_slot``, ``block_kinds`` (bit k set: holds
    ``kinds[k]``), ``block_size`` (buffer elements incl. ZeRO padding), ``block_ranks`` CSR
    (``block_rank_ptr``); ``rank_blocks[world, 4]`` (block per slot, -1 if none); intervals
    ``iv_*`` sorted by block (``iv_tp``/``iv_ep``: the local shard's TP/EP index, 0 when the
    tensor is not cut along that axis); boxes ``box_*`` sorted by interval (global coordinates).
    """

    model: ModelSpec
    strategy: Strategy
    kinds: tuple[str, ...]
    table: TensorTable
    lshape: np.ndarray
    block_slot: np.ndarray
    block_kinds: np.ndarray
    block_size: np.ndarray
    block_rank_ptr: np.ndarray
    block_ranks: np.ndarray
    rank_blocks: np.ndarray
    iv_block: np.ndarray
    iv_tensor: np.ndarray
    iv_tp: np.ndarray
    iv_ep: np.ndarray
    iv_start: np.ndarray
    iv_stop: np.ndarray
    iv_offset: np.ndarray
    box_iv: np.ndarray
    box_flat: np.ndarray
    box_lo: np.ndarray
    box_hi: np.ndarray

    # ---- sizes --------------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return self.strategy.world

    @property
    def num_blocks(self) -> int:
        return len(self.block_slot)

    def kind_index(self, kind: str) -> int:
        if kind not in self.kinds:
            raise PlanError(f"kind {kind!r} is not held by {self.model.name}; kinds are {', '.join(self.kinds)}")
        return self.kinds.index(kind)

    def kind_mask(self, kinds: "tuple[str, ...] | list[str] | None") -> int:
        """Bitmask of ``kinds`` (all kinds when None)."""
        if kinds is None:
            return (1 << len(self.kinds)) - 1
        return sum(1 << self.kind_index(k) for k in kinds)

    def sharded(self, kind: str) -> bool:
        """Does ZeRO shard ``kind`` in this layout."""
        return self.strategy.zero_stage.shards(kind)

    # ---- CSR helpers ----------------------------------------------------------------------------
    @property
    def block_iv_ptr(self) -> np.ndarray:
        return np.searchsorted(self.iv_block, np.arange(self.num_blocks + 1))

    @property
    def iv_box_ptr(self) -> np.ndarray:
        return np.searchsorted(self.box_iv, np.arange(len(self.iv_block) + 1))

    def blocks_with(self, kinds_mask: int) -> np.ndarray:
        """Ids of the blocks holding any kind of the mask."""
        return np.flatnonzero(self.block_kinds & kinds_mask)

    # ---- expansion ----------------------------------------------------------------------------------
    def regions(self, ranks: "np.ndarray | list[int] | None" = None,
                kinds: "tuple[str, ...] | list[str] | None" = None) -> Regions:
        """Every (rank, tensor, kind, box) the ranks hold (all ranks and kinds by default)."""
        ranks = np.arange(self.world) if ranks is None else np.asarray(ranks, dtype=np.int64)
        mask = self.kind_mask(kinds)
        rb = self.rank_blocks[ranks]                                  # [n, slots]
        r = np.repeat(ranks, rb.shape[1])
        b = rb.ravel()
        keep = b >= 0
        r, b = r[keep], b[keep]
        box_ptr = np.searchsorted(self.box_iv, self.block_iv_ptr)     # block -> box range
        rr, bb, kk = [], [], []
        for k in range(len(self.kinds)):
            if not mask & (1 << k):
                continue
            m = (self.block_kinds[b] & (1 << k)) != 0
            rr.append(r[m])
            bb.append(b[m])
            kk.append(np.full(int(m.sum()), k, dtype=np.int64))
        r, b, k = np.concatenate(rr), np.concatenate(bb), np.concatenate(kk)
        order = np.lexsort((k, r))
        r, b, k = r[order], b[order], k[order]
        counts = box_ptr[b + 1] - box_ptr[b]
        rows = concat_ranges(box_ptr[b], counts)
        return Regions(np.repeat(r, counts), self.iv_tensor[self.box_iv[rows]], np.repeat(k, counts),
                       self.box_lo[rows], self.box_hi[rows])

    def bytes_per_rank(self, kind: str | None = None, *, padded: bool = False) -> np.ndarray:
        """Static bytes each rank holds, of one kind or of all kinds (``padded``: count ZeRO padding)."""
        if kind is not None:
            self.kind_index(kind)
        elems = np.bincount(self.iv_block, weights=self.iv_stop - self.iv_start,
                            minlength=self.num_blocks).astype(np.int64)
        if padded:
            elems = self.block_size
        per_block = np.zeros(self.num_blocks, dtype=np.int64)
        for k, name in enumerate(self.kinds):
            if kind is not None and name != kind:
                continue
            held = (self.block_kinds & (1 << k)) != 0
            per_block += np.where(held, elems * self.model.kind_bytes(name), 0)
        rb = self.rank_blocks
        return np.where(rb >= 0, per_block[np.maximum(rb, 0)], 0).sum(axis=1)

    def to_frame(self, ranks: "np.ndarray | list[int] | None" = None,
                 kinds: "tuple[str, ...] | list[str] | None" = None):
        """Columns ``rank, tensor, kind, lo, hi, nbytes`` (lo/hi: global, half-open tuples)."""
        import pandas as pd
        reg = self.regions(ranks, kinds)
        nd = self.table.ndim[reg.tensor]
        kb = np.array([self.model.kind_bytes(k) for k in self.kinds], dtype=np.int64)
        lo = [tuple(row[:n]) for row, n in zip(reg.lo.tolist(), nd.tolist())]
        hi = [tuple(row[:n]) for row, n in zip(reg.hi.tolist(), nd.tolist())]
        return pd.DataFrame({
            "rank": reg.rank, "tensor": np.array(self.table.names, dtype=object)[reg.tensor],
            "kind": np.array(self.kinds, dtype=object)[reg.kind], "lo": lo, "hi": hi,
            "nbytes": reg.numel * kb[reg.kind]})

    def buffers_frame(self, rank: int):
        """The flat buffers of one rank: ``slot, kinds, buffer_size, tensor, start, stop, offset``
        (a tensor's local-shard elements ``[start, stop)`` sit at ``offset`` in the buffer)."""
        import pandas as pd
        rows = []
        ptr = self.block_iv_ptr
        for slot, b in enumerate(self.rank_blocks[rank]):
            if b < 0:
                continue
            kinds = ",".join(k for i, k in enumerate(self.kinds) if self.block_kinds[b] & (1 << i))
            for i in range(ptr[b], ptr[b + 1]):
                rows.append((SLOTS[slot], kinds, int(self.block_size[b]), self.table.names[self.iv_tensor[i]],
                             int(self.iv_start[i]), int(self.iv_stop[i]), int(self.iv_offset[i])))
        return pd.DataFrame(rows, columns=["slot", "kinds", "buffer_size", "tensor", "start", "stop", "offset"])

    def __repr__(self) -> str:
        return (f"Layout({self.model.name}, {self.strategy}, world={self.world}, blocks={self.num_blocks}, "
                f"boxes={len(self.box_iv)})")


# ---- construction -------------------------------------------------------------------------------------
def _partition(tensors: np.ndarray, sizes: np.ndarray, parts: int):
    """Split the concatenation of ``tensors`` (element counts ``sizes``) into ``parts`` equal
    shards, padding the end. Returns (shard, tensor, start, stop, offset-in-shard) and the shard size."""
    off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    total = int(off[-1])
    q = -(-total // parts)
    js = np.arange(parts, dtype=np.int64)
    lo = js * q
    hi = np.minimum(lo + q, total)
    first = np.searchsorted(off[1:], lo, side="right")
    last = np.searchsorted(off[:-1], hi, side="left")
    cnt = np.maximum(last - first, 0)
    j = np.repeat(js, cnt)
    k = concat_ranges(first, cnt)
    a = np.maximum(lo[j], off[k]) - off[k]
    b = np.minimum(hi[j], off[k + 1]) - off[k]
    keep = b > a
    j, k, a, b = j[keep], k[keep], a[keep], b[keep]
    return j, tensors[k], a, b, off[k] + a - lo[j], q


def layout(model: "ModelSpec | str", strategy: "Strategy | str") -> Layout:
    """The layout of ``strategy`` for ``model`` (validates the strategy first)."""
    model = get_model(model)
    s = Strategy.parse(strategy)
    s.validate(model)
    table = tensor_table(model)
    lshape = local_shape(table, s)
    lnumel = np.prod(lshape, axis=1)
    held = held_by_stage(model, table, s)
    kinds = model.state_kinds
    sharded_mask = sum(1 << i for i, k in enumerate(kinds) if s.zero_stage.shards(k))
    plain_mask = ((1 << len(kinds)) - 1) & ~sharded_mask
    D = s.dpcp                                                     # replicas: (dp, cp), cp fastest
    grid = np.arange(s.world).reshape(s.pp, D, s.tp)               # rank at (pp, dp*cp + cp, tp)
    expert = table.expert

    blk_slot, blk_kinds, blk_size, blk_ranks = [], [], [], []
    ivs: list[tuple[np.ndarray, ...]] = []
    rank_blocks = np.full((s.world, len(SLOTS)), -1, dtype=np.int64)
    nblocks = 0
    families = [(False, 1)] + ([(True, s.ep)] if expert.any() else [])
    R = s.dp_replicas                                              # copies of each ZeRO shard
    for fam_expert, E in families:
        group = (D // s.ep if fam_expert else D) // R
        for zero_slot, mask in ((False, plain_mask), (True, sharded_mask)):
            if not mask:
                continue
            slot = (2 if zero_slot else 0) + (1 if fam_expert else 0)
            G = group if zero_slot else 1
            c, e, j = np.meshgrid(np.arange(s.tp), np.arange(E), np.arange(G), indexing="ij")
            c, e, j = c.ravel(), e.ravel(), j.ravel()             # block order within a stage: (c, e, j)
            nb = len(c)
            for st in range(s.pp):
                ts = np.flatnonzero(held[st] & (expert == fam_expert))
                jj, t, a, b, off, q = _partition(ts, lnumel[ts], G)
                base = nblocks
                nblocks += nb
                # ranks of each block: (pp=st, dp, tp=c); dp = j + G*[0..R) (zero dense: the shard's
                # replicas), e + ep*j (zero experts: ep == 1 with replicas),
                # all dp (plain dense) or e + ep*[0..edp) (plain experts)
                if zero_slot:
                    dps = (e + s.ep * j if fam_expert else j)[:, None] + G * np.arange(R)[None, :]
                elif fam_expert:
                    dps = e[:, None] + s.ep * np.arange(D // s.ep)[None, :]
                else:
                    dps = np.broadcast_to(np.arange(D)[None, :], (nb, D))
                ranks = grid[st, dps, c[:, None]]
                blk_ranks.append(ranks)
                rank_blocks[ranks.ravel(), slot] = np.repeat(base + np.arange(nb), ranks.shape[1])
                blk_slot.append(np.full(nb, slot))
                blk_kinds.append(np.full(nb, mask))
                sizes = np.bincount(jj, weights=b - a, minlength=G).astype(np.int64)
                blk_size.append(np.full(nb, q if zero_slot else int(sizes.sum()), dtype=np.int64))
                # replicate the shard intervals over the (c, e) classes of this stage
                n = len(t)
                rep = np.arange(s.tp * E)
                cc, ee = rep // E, rep % E
                tt = np.tile(t, len(rep))
                ivs.append((base + np.repeat(rep, n) * G + np.tile(jj, len(rep)), tt,
                            np.where(table.tp_dim[tt] >= 0, np.repeat(cc, n), 0),
                            np.where(table.ep_dim[tt] >= 0, np.repeat(ee, n), 0),
                            np.tile(a, len(rep)), np.tile(b, len(rep)), np.tile(off, len(rep))))
    iv = [np.concatenate([x[i] for x in ivs]).astype(np.int64) for i in range(7)]
    order = np.lexsort((iv[6], iv[0]))
    iv_block, iv_tensor, iv_tp, iv_ep, iv_start, iv_stop, iv_offset = (x[order] for x in iv)
    box_iv, flat, lo, hi = flat_to_boxes(lshape[iv_tensor], iv_start, iv_stop)
    origin = shard_origin(table, lshape, iv_tensor, iv_tp, iv_ep)[box_iv]
    ptr = np.concatenate([[0], np.cumsum(np.concatenate([np.repeat(r.shape[1], r.shape[0]) for r in blk_ranks]))])
    return Layout(
        model=model, strategy=s, kinds=kinds, table=table, lshape=lshape,
        block_slot=np.concatenate(blk_slot).astype(np.int64), block_kinds=np.concatenate(blk_kinds).astype(np.int64),
        block_size=np.concatenate(blk_size), block_rank_ptr=ptr.astype(np.int64),
        block_ranks=np.concatenate([r.ravel() for r in blk_ranks]).astype(np.int64), rank_blocks=rank_blocks,
        iv_block=iv_block, iv_tensor=iv_tensor, iv_tp=iv_tp, iv_ep=iv_ep, iv_start=iv_start, iv_stop=iv_stop,
        iv_offset=iv_offset, box_iv=box_iv, box_flat=flat, box_lo=lo + origin, box_hi=hi + origin)
