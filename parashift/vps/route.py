"""Routing: intersect a destination layout with a source layout and pick a source per piece.

Works per *geometry group*: kinds that both layouts store in the same blocks (e.g. the three
ZeRO-sharded optimizer kinds) share one computation. All steps are numpy over whole arrays:

1. source atoms: the source intervals of each local shard refined into disjoint flat ranges,
   each with the set of blocks (hence devices) holding it; overlapping copies (tied
   embeddings sharded at different offsets in two stages' ZeRO buffers) are split here;
2. destination intervals, deduplicated, each with the devices that need it;
3. the join: only local shards that overlap on their TP/EP dimensions are paired, then
   their boxes are intersected, giving pieces (atom, destination interval, box);
4. expansion of pieces to needing devices, and the source choice: the device itself if it
   already holds the piece, else a holder on its node, else the holders of the same set
   take turns in snake order over pieces sorted by size (balancing bytes sent).
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np

from .boxes import concat_ranges, flat_to_boxes, intersect, nonempty, volume
from .layout import Layout
from .tensors import shard_origin

__all__ = ["Routes", "route"]


class Routes(NamedTuple):
    """Pieces of one geometry group: tensor, source and destination device, box, elements, and
    the holder set of each piece (``holders``: index into the CSR ``hs_ptr``/``hs_dev`` of
    distinct sets of devices that hold it, devices ascending)."""

    tensor: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    numel: np.ndarray
    holders: np.ndarray
    hs_ptr: np.ndarray
    hs_dev: np.ndarray


def set_ids(ptr: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Exact id of each CSR row's value list (equal lists, equal ids); rows must be non-empty."""
    n = len(ptr) - 1
    cnt = np.diff(ptr)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    pos = np.arange(len(values)) - np.repeat(ptr[:-1], cnt)
    mult = np.random.default_rng(12345).integers(1, 2**63, size=int(cnt.max()), dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        h = np.add.reduceat((values.astype(np.uint64) + np.uint64(1)) * mult[pos], ptr[:-1])
    _, first, ids = np.unique(np.stack([cnt.astype(np.uint64), h], axis=1), axis=0, return_index=True,
                              return_inverse=True)
    ids = ids.ravel()
    # verify element by element against the first row of each id; hash collisions get their own id
    rep = first[ids]
    bad_el = values != values[np.repeat(ptr[rep], cnt) + pos]
    bad = np.flatnonzero(np.bincount(np.repeat(np.arange(n), cnt), weights=bad_el, minlength=n) > 0)
    if len(bad):
        ids = ids.copy()
        ids[bad] = ids.max() + 1 + np.arange(len(bad))
        _, ids = np.unique(ids, return_inverse=True)
    return ids.astype(np.int64)


def _selected_intervals(lay: Layout, mask: int):
    sel = np.flatnonzero((lay.block_kinds[lay.iv_block] & mask) != 0)
    s = lay.strategy
    key = (lay.iv_tensor[sel] * s.tp + lay.iv_tp[sel]) * s.ep + lay.iv_ep[sel]
    return sel, key


def _csr_expand(ptr: np.ndarray, values: np.ndarray, owner: np.ndarray):
    """For each owner id, the values of ``ptr``-CSR row ``owner``: (repeat index, values)."""
    counts = ptr[owner + 1] - ptr[owner]
    return np.repeat(np.arange(len(owner), dtype=np.int64), counts), values[concat_ranges(ptr[owner], counts)]


def _source_atoms(lay: Layout, mask: int, scale: int):
    """Disjoint source atoms: (key, start, stop) and the holder blocks of each (pairs)."""
    sel, key = _selected_intervals(lay, mask)
    a = key * scale + lay.iv_start[sel]
    b = key * scale + lay.iv_stop[sel]
    ends = np.unique(np.concatenate([a, b]))
    first = np.searchsorted(ends, a)
    last = np.searchsorted(ends, b)
    cnt = last - first
    pair_atom = concat_ranges(first, cnt)
    pair_block = np.repeat(lay.iv_block[sel], cnt)
    nb = lay.num_blocks
    uniq = np.unique(pair_atom * nb + pair_block)
    pair_atom, pair_block = uniq // nb, uniq % nb
    atom_ids, pair_atom = np.unique(pair_atom, return_inverse=True)   # dense atom numbering
    akey = ends[atom_ids] // scale
    return akey, ends[atom_ids] % scale, ends[atom_ids + 1] - akey * scale, pair_atom, pair_block


def _dest_intervals(lay: Layout, mask: int, scale: int):
    """Distinct destination intervals (key, start, stop) and the blocks needing each (pairs)."""
    sel, key = _selected_intervals(lay, mask)
    a = key * scale + lay.iv_start[sel]
    stop = lay.iv_stop[sel]
    order = np.lexsort((stop, a))
    a, stop, blocks = a[order], stop[order], lay.iv_block[sel][order]
    new = np.ones(len(a), dtype=bool)
    new[1:] = (a[1:] != a[:-1]) | (stop[1:] != stop[:-1])
    dint = np.cumsum(new) - 1
    akey = a[new] // scale
    return akey, a[new] - akey * scale, stop[new], dint, blocks


def _boxes(lay: Layout, key: np.ndarray, start: np.ndarray, stop: np.ndarray):
    s = lay.strategy
    tensor = key // (s.tp * s.ep)
    tp, ep = (key // s.ep) % s.tp, key % s.ep
    idx, _, lo, hi = flat_to_boxes(lay.lshape[tensor], start, stop)
    origin = shard_origin(lay.table, lay.lshape, tensor[idx], tp[idx], ep[idx])
    return idx, lo + origin, hi + origin


@lru_cache(maxsize=4096)
def _overlaps(n: int, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """Pairs (i, j) where part i of n split in a parts overlaps part j of n split in b parts."""
    i = np.arange(a)[:, None]
    j = np.arange(b)[None, :]
    ok = (i * (n // a) < (j + 1) * (n // b)) & (j * (n // b) < (i + 1) * (n // a))
    ii, jj = np.nonzero(ok)
    return ii.astype(np.int64), jj.astype(np.int64)


def _key_pairs(src: Layout, dst: Layout) -> tuple[np.ndarray, np.ndarray]:
    """(source key, destination key) of every pair of overlapping local shards."""
    tab = src.table
    s, d = src.strategy, dst.strategy
    rows = np.arange(tab.count)
    ntp = np.where(tab.tp_dim >= 0, tab.shape[rows, np.maximum(tab.tp_dim, 0)], 0)
    nep = np.where(tab.ep_dim >= 0, tab.shape[rows, np.maximum(tab.ep_dim, 0)], 0)
    sig, inv = np.unique(np.stack([ntp, nep], axis=1), axis=0, return_inverse=True)
    sk, dk = [], []
    for g, (nt, ne) in enumerate(sig.tolist()):
        ts = np.flatnonzero(inv.ravel() == g)
        tp_i, tp_j = _overlaps(nt, s.tp, d.tp) if nt else (np.zeros(1, np.int64), np.zeros(1, np.int64))
        ep_i, ep_j = _overlaps(ne, s.ep, d.ep) if ne else (np.zeros(1, np.int64), np.zeros(1, np.int64))
        ci = np.repeat(tp_i, len(ep_i))
        cj = np.repeat(tp_j, len(ep_j))
        ei, ej = np.tile(ep_i, len(tp_i)), np.tile(ep_j, len(tp_j))
        sk.append(((ts[:, None] * s.tp + ci[None, :]) * s.ep + ei[None, :]).ravel())
        dk.append(((ts[:, None] * d.tp + cj[None, :]) * d.ep + ej[None, :]).ravel())
    return np.concatenate(sk), np.concatenate(dk)


def _join(skey_box: np.ndarray, dkey_box: np.ndarray, kp_s: np.ndarray, kp_d: np.ndarray):
    """Index pairs (source box, destination box) of overlapping local shards (boxes sorted by key)."""
    s0 = np.searchsorted(skey_box, kp_s, side="left")
    ns = np.searchsorted(skey_box, kp_s, side="right") - s0
    d0 = np.searchsorted(dkey_box, kp_d, side="left")
    nd = np.searchsorted(dkey_box, kp_d, side="right") - d0
    rep = ns * nd
    pid = np.repeat(np.arange(len(rep)), rep)
    f = np.arange(int(rep.sum()), dtype=np.int64) - np.repeat(np.cumsum(rep) - rep, rep)
    return s0[pid] + f // nd[pid], d0[pid] + f % nd[pid]


def route(src: Layout, dst: Layout, src_mask: int, dst_mask: int, src_devices: np.ndarray,
          dst_devices: np.ndarray, node_of: np.ndarray) -> Routes:
    """Pieces that rebuild the destination kinds of ``dst_mask`` from the source kinds of ``src_mask``.

    ``src_devices[rank]``/``dst_devices[rank]``: device of each rank; ``node_of[device]``: its node.
    """
    scale = int(max(src.lshape.prod(axis=1).max(), dst.lshape.prod(axis=1).max())) + 1
    # 1. source atoms with holder devices (CSR, devices ascending within an atom)
    akey, astart, astop, pa, pb = _source_atoms(src, src_mask, scale)
    pr, ranks = _csr_expand(src.block_rank_ptr, src.block_ranks, pb)
    h_atom, h_dev = pa[pr], src_devices[ranks]
    order = np.lexsort((h_dev, h_atom))
    h_atom, h_dev = h_atom[order], h_dev[order]
    keep = np.ones(len(h_atom), dtype=bool)
    keep[1:] = (h_atom[1:] != h_atom[:-1]) | (h_dev[1:] != h_dev[:-1])
    h_atom, h_dev = h_atom[keep], h_dev[keep]
    h_ptr = np.searchsorted(h_atom, np.arange(len(akey) + 1))
    sbox_atom, s_lo, s_hi = _boxes(src, akey, astart, astop)
    # 2. destination intervals with needing devices
    dkey, dstart, dstop, dint, dblock = _dest_intervals(dst, dst_mask, scale)
    pr, ranks = _csr_expand(dst.block_rank_ptr, dst.block_ranks, dblock)
    n_int, n_dev = dint[pr], dst_devices[ranks]
    order = np.argsort(n_int, kind="stable")
    n_int, n_dev = n_int[order], n_dev[order]
    n_ptr = np.searchsorted(n_int, np.arange(len(dkey) + 1))
    dbox_int, d_lo, d_hi = _boxes(dst, dkey, dstart, dstop)
    # 3. join overlapping local shards, intersect their boxes
    kp_s, kp_d = _key_pairs(src, dst)
    si, di = _join(akey[sbox_atom], dkey[dbox_int], kp_s, kp_d)
    lo, hi = intersect(s_lo[si], s_hi[si], d_lo[di], d_hi[di])
    ok = nonempty(lo, hi)
    atom, pint, lo, hi = sbox_atom[si[ok]], dbox_int[di[ok]], lo[ok], hi[ok]
    # 4. expand to needing devices
    counts = n_ptr[pint + 1] - n_ptr[pint]
    row_piece = np.repeat(np.arange(len(atom)), counts)
    dev = n_dev[concat_ranges(n_ptr[pint], counts)]
    atom = atom[row_piece]
    numel = volume(lo, hi)[row_piece]
    hset = set_ids(h_ptr, h_dev)
    src_dev = _choose(atom, dev, numel, h_ptr, h_dev, hset, node_of)
    tensor = akey[atom] // (src.strategy.tp * src.strategy.ep)
    # distinct holder sets as their own CSR
    _, first = np.unique(hset, return_index=True)
    cnt = np.diff(h_ptr)[first]
    hs_ptr = np.concatenate([[0], np.cumsum(cnt)]).astype(np.int64)
    hs_dev = h_dev[concat_ranges(h_ptr[first], cnt)]
    return Routes(tensor, src_dev, dev, lo[row_piece], hi[row_piece], numel, hset[atom], hs_ptr, hs_dev)


def _choose(atom: np.ndarray, dev: np.ndarray, numel: np.ndarray, h_ptr: np.ndarray, h_dev: np.ndarray,
            hset: np.ndarray, node_of: np.ndarray) -> np.ndarray:
    """Source device per row: itself if it holds the atom, else a holder on its node, else
    balanced over the atom's holders (snake order over rows sorted by size)."""
    n_atoms = len(h_ptr) - 1
    h_atom = np.repeat(np.arange(n_atoms), np.diff(h_ptr))
    big = int(max(h_dev.max(initial=0), dev.max(initial=0))) + 1
    out = np.full(len(atom), -1, dtype=np.int64)
    # same device
    hk = h_atom * big + h_dev                                   # sorted (atom, device)
    q = atom * big + dev
    pos = np.minimum(np.searchsorted(hk, q), len(hk) - 1)
    kept = hk[pos] == q
    out[kept] = dev[kept]
    # same node
    rest = np.flatnonzero(~kept)
    h_node = node_of[h_dev]
    nn = int(node_of.max(initial=0)) + 1
    order = np.lexsort((h_dev, h_node, h_atom))
    nk = (h_atom * nn + h_node)[order]
    qn = atom[rest] * nn + node_of[dev[rest]]
    left = np.searchsorted(nk, qn, side="left")
    cnt = np.searchsorted(nk, qn, side="right") - left
    has = cnt > 0
    pick = left[has] + dev[rest][has] % cnt[has]
    out[rest[has]] = h_dev[order][pick]
    # balanced over the holder set
    rest = rest[~has]
    if len(rest):
        n_h = np.diff(h_ptr)
        a = atom[rest]
        order = np.lexsort((dev[rest], -numel[rest], hset[a]))
        g = hset[a][order]
        start = np.searchsorted(g, g, side="left")
        k = np.arange(len(order)) - start
        h = n_h[a[order]]
        p = k % (2 * h)
        idx = np.where(p < h, p, 2 * h - 1 - p)
        out[rest[order]] = h_dev[h_ptr[a[order]] + idx]
    return out
