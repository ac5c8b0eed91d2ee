"""State stores as a switch sees them: strided views of global boxes, and whole-model arrays.

The runtime's :class:`~parashift.exec.state.StateStore` keeps a rank's states in flat buffers;
:func:`piece_view` maps a piece (a global box of one tensor and kind) onto a strided view of the
right flat buffer (no copy). :func:`store_arrays`, :func:`full_from_arrays` and
:func:`store_from_full` convert between stores and full (global) arrays, for tests, restarts and
checkpoint baselines.
"""
from __future__ import annotations

import numpy as np
import torch

from ...errors import SwitchAborted
from ...models import ModelSpec
from ...strategy import Strategy
from ..state import StateStore

__all__ = ["STATE_KINDS", "kind_tensor", "piece_view", "layout_store", "store_arrays", "full_from_arrays",
           "store_from_full"]

#: Store attributes that make up the switched state (master only for non-fp32 models).
STATE_KINDS = ("param", "master", "exp_avg", "exp_avg_sq")


def kind_tensor(store: StateStore, family: str, kind: str) -> tuple[torch.Tensor, int]:
    """(flat tensor holding ``kind`` of ``family``, buffer coordinate of its element 0)."""
    b = store.buffers[family]
    if kind == "param":
        return b.param, (b.lo if b.zero_stage.shards_params else 0)
    t = getattr(b, kind)
    if t is None:
        raise SwitchAborted(f"rank {store.rank} keeps no {kind!r} state ({store.spec.dtype} training); "
                            f"plan the switch with the model's state kinds")
    return t, (b.lo if b.zero_stage.shards_optim else 0)


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


def layout_store(spec: ModelSpec, strategy: Strategy, rank: int) -> StateStore:
    """The StateStore geometry of ``rank`` in ``strategy`` without its memory (every buffer a
    stride-0 stand-in of the right size): what another device holds, for planning."""
    return StateStore(spec, strategy, rank, torch.device("cpu"), init=False,
                      alloc=lambda n, dt, dev: torch.empty(1, dtype=dt).expand(n))


def store_arrays(store: StateStore) -> dict[str, dict[str, np.ndarray]]:
    """family -> kind -> a copy of the flat state buffer (what a switch moves), as numpy."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for fam, b in store.buffers.items():
        for k in STATE_KINDS:
            t = getattr(b, k)
            if t is not None:
                out.setdefault(fam, {})[k] = t.detach().cpu().clone().numpy()
    return out


def full_from_arrays(spec: ModelSpec, strategy: Strategy, arrays: dict[int, dict]) -> dict[tuple[str, str], np.ndarray]:
    """Assemble the full (global) state (tensor, kind) -> array from every rank's ``store_arrays``."""
    out: dict[tuple[str, str], np.ndarray] = {}
    for rank, fams in arrays.items():
        skel = StateStore(spec, strategy, rank, torch.device("cpu"), init=False)
        for fam, kinds in fams.items():
            b = skel.buffers[fam]
            for k, arr in kinds.items():
                getattr(b, k).copy_(torch.from_numpy(arr))
                for p in b.pieces:
                    full = out.setdefault((p.name, k), np.full(next(t.shape for t in spec.tensors if t.name == p.name),
                                                               np.nan, dtype=arr.dtype))
                    flat, base = kind_tensor(skel, fam, k)
                    lo, hi = p.start - base, p.start - base + p.numel
                    if lo >= 0 and hi <= flat.numel():
                        full[p.box()] = flat[lo:hi].view(p.sizes).numpy()
                    elif hi > 0 and lo < flat.numel():   # a ZeRO shard holds part of it: write that part
                        a, e = max(lo, 0), min(hi, flat.numel())
                        region = full[p.box()].reshape(-1)
                        region[a - lo:e - lo] = flat[a:e].numpy()
                        full[p.box()] = region.reshape(p.sizes)
    return out


def store_from_full(spec: ModelSpec, strategy: Strategy, rank: int, full: dict[tuple[str, str], np.ndarray],
                    opt_step: int = 0) -> StateStore:
    """The store a job started directly in ``strategy`` from the full state ``full`` would hold."""
    s = StateStore(spec, strategy, rank, torch.device("cpu"), init=False)
    for fam, b in s.buffers.items():
        b.step = opt_step
        for k in STATE_KINDS:
            t = getattr(b, k)
            if t is None:
                continue
            flat, base = kind_tensor(s, fam, k)
            padded = torch.zeros(b.padded, dtype=flat.dtype)
            for p in b.pieces:
                padded[p.start:p.start + p.numel] = torch.from_numpy(np.ascontiguousarray(full[(p.name, k)][p.box()])).reshape(-1)
            flat.copy_(padded[base:base + flat.numel()])
    return s
