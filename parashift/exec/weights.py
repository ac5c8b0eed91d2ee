"""Hugging Face safetensors in and out through the VPS: a checkpoint folder is one more layout.

Loading (:func:`load_store`): each rank asks the layout (:func:`parashift.vps.layout`) which boxes of
which tensors it holds (``param``, and ``master`` for non-fp32 models), maps every box onto the Hugging
Face tensors it comes from (:func:`hf_reads`: the fused q/k/v rows grouped per KV head and the
interleaved gate/up rows of :mod:`.hf` become runs of rows, strided in parashift's tensor) and reads
exactly those slices with ``safe_open(...).get_slice(name)[box]`` straight into the store's strided
views. No rank reads or holds more than its own boxes.

Export (:func:`export_hf`): collective over the job. Every tensor has one writer rank (tensors in model
order, split into ``world`` files of about equal bytes); the boxes of a tensor come from one holder each
(the lowest rank among identical copies, checked to cover the tensor exactly once) by point-to-point
messages, so a rank holds at most the tensors of its own file (never the whole model). Each writer writes
``model-0000i-of-0000n.safetensors``; rank 0 writes ``model.safetensors.index.json``, ``config.json`` and
``generation_config.json``.
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch

from ..errors import ModelError, RuntimeFailure
from ..models import ModelSpec
from ..strategy import Strategy
from .hf import _PER_EXPERT, _rows, check_convertible, to_hf

__all__ = ["hf_reads", "load_store", "export_hf", "weight_files", "INDEX"]

INDEX = "model.safetensors.index.json"

#: (Hugging Face key, source slices, destination slices into the box)
Read = tuple[str, tuple[slice, ...], tuple[slice, ...]]


def weight_files(folder: str) -> dict[str, str]:
    """Hugging Face key -> file of the ``*.safetensors`` in ``folder`` (only the files' headers are read)."""
    from safetensors import safe_open
    index = os.path.join(folder, INDEX)
    if os.path.exists(index):
        with open(index) as fh:
            wm = json.load(fh).get("weight_map", {})
        return {k: os.path.join(folder, v) for k, v in wm.items()}
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")) if os.path.isdir(folder) else []
    if not files:
        raise ModelError(f"{folder}: no *.safetensors weights; save the model with save_pretrained or start from "
                         f"initial values")
    out = {}
    for f in files:
        with safe_open(os.path.join(folder, f), framework="pt") as fh:
            out.update({k: os.path.join(folder, f) for k in fh.keys()})
    return out


def _interleaved(a: int, b: int, dim: int, box: tuple[slice, ...], keys: tuple[str, str],
                 shift: tuple[int, int] = (0, 0)) -> list[Read]:
    """Rows ``[a, b)`` of dimension ``dim`` interleaving two sources (even rows: ``keys[0]``, odd: ``keys[1]``;
    source row ``i // 2 + shift``)."""
    out = []
    for par, key, sh in ((0, keys[0], shift[0]), (1, keys[1], shift[1])):
        first = a + ((par - a) % 2)
        if first >= b:
            continue
        n = len(range(first, b, 2))
        src, dst = list(box), [slice(None)] * len(box)
        src[dim] = slice(first // 2 + sh, first // 2 + sh + n)
        dst[dim] = slice(first - a, b - a, 2)
        out.append((key, tuple(src), tuple(dst)))
    return out


def hf_reads(spec: ModelSpec, name: str, lo: tuple[int, ...], hi: tuple[int, ...],
             keys: "set[str] | dict | None" = None) -> list[Read]:
    """The Hugging Face slices that make up box ``[lo, hi)`` of parashift tensor ``name``: each
    (key, source slices, destination slices into the box). ``keys``: the checkpoint's keys (Hub
    per-expert names are read when the fused ones are absent)."""
    parts = _rows(spec)[name]
    box = tuple(slice(a, b) for a, b in zip(lo, hi))
    nd = len(box)
    rest = (slice(None),) * (nd - 1)
    a, b = lo[0], hi[0]
    kinds = {p for _, p in parts}
    by = {p: k for k, p in parts}
    if kinds == {None}:
        key = parts[0][0]
        if keys is not None and key not in keys and (".mlp.experts." in key or key.endswith("mlp.gate.weight")):
            return _per_expert(spec, key, box, keys)
        return [(key, box, (slice(None),) * nd)]
    if kinds <= {"q", "k", "v"}:                 # rows grouped per KV head: r query heads, key, value
        hd, r = spec.head_dim, spec.heads // spec.kv_heads
        g_rows = (r + 2) * hd
        out = []
        for g in range(a // g_rows, (b - 1) // g_rows + 1):
            for part, s0, n, h0 in (("q", 0, r * hd, g * r * hd), ("k", r * hd, hd, g * hd),
                                    ("v", (r + 1) * hd, hd, g * hd)):
                x0, x1 = max(a, g * g_rows + s0), min(b, g * g_rows + s0 + n)
                if x0 < x1:
                    src = h0 + x0 - (g * g_rows + s0)
                    out.append((by[part], (slice(src, src + x1 - x0),) + box[1:], (slice(x0 - a, x1 - a),) + rest))
        return out
    if kinds == {"gate", "up"}:
        return _interleaved(a, b, 0, box, (by["gate"], by["up"]))
    if kinds == {"gate_up"}:                     # [E, 2f, h]: gate rows, then up rows -> interleaved on dim 1
        key = by["gate_up"]
        if keys is not None and key not in keys:
            return _per_expert(spec, key, box, keys)
        f = spec.expert_ffn
        return _interleaved(lo[1], hi[1], 1, box, (key, key), (0, f))
    raise ModelError(f"no Hugging Face reading rule for {name!r} (parts {sorted(map(str, kinds))})")


def _per_expert(spec: ModelSpec, fused: str, box: tuple[slice, ...], keys) -> list[tuple]:
    """Box reads of a fused expert tensor (or router) from the Hub's per-expert names; an expert's reads
    carry a fourth item (True): their source has no expert dimension."""
    prefix = fused.split(".mlp.")[0] + "."
    for gate, up, down, router in _PER_EXPERT:
        if prefix + gate.format(e=0) in keys:
            break
    else:
        raise ModelError(f"Hugging Face weights lack {fused!r} and its per-expert names; the checkpoint does not "
                         f"match its config.json")
    if fused.endswith("mlp.gate.weight"):
        return [(prefix + router, box, (slice(None),) * len(box))]
    out = []
    for e in range(box[0].start, box[0].stop):
        at = slice(e - box[0].start, e - box[0].start + 1)
        if fused.endswith("gate_up_proj"):
            for key, src, dst in _interleaved(box[1].start, box[1].stop, 0, box[1:],
                                              (prefix + gate.format(e=e), prefix + up.format(e=e))):
                out.append((key, src, (at,) + dst, True))
        else:
            out.append((prefix + down.format(e=e), box[1:], (at, slice(None), slice(None)), True))
    return out


def _holder_kinds(spec: ModelSpec) -> tuple[str, ...]:
    return ("param",) if spec.dtype == "fp32" else ("param", "master")


def load_store(spec: ModelSpec, strategy: Strategy, rank: int, device: torch.device, folder: str):
    """Rank ``rank``'s StateStore of ``strategy`` with its parameters (and master weights) read from the
    safetensors in ``folder`` (or beside the file ``folder``): only the boxes the rank's layout holds are read."""
    from safetensors import safe_open
    from ..vps.layout import layout
    from .state import StateStore
    from .switch.stores import piece_view
    check_convertible(spec)
    folder = folder if os.path.isdir(folder) else os.path.dirname(folder)
    files = weight_files(folder)
    store = StateStore(spec, strategy, rank, device, init=False)
    lay = layout(spec, strategy)
    reg = lay.regions([rank], kinds=_holder_kinds(spec))
    nd = lay.table.ndim
    handles: dict[str, Any] = {}
    try:
        for t, k, lo, hi in zip(reg.tensor.tolist(), reg.kind.tolist(), reg.lo.tolist(), reg.hi.tolist()):
            name, kind, n = lay.table.names[t], lay.kinds[k], int(nd[t])
            lo, hi = tuple(lo[:n]), tuple(hi[:n])
            dst = piece_view(store, name, kind, lo, hi)
            for read in hf_reads(spec, name, lo, hi, files):
                key, src, at = read[:3]
                if key not in files:
                    raise ModelError(f"Hugging Face weights lack {key!r} (parashift {name!r}); the checkpoint does "
                                     f"not match its config.json")
                fh = handles.get(files[key])
                if fh is None:
                    fh = handles[files[key]] = safe_open(files[key], framework="pt").__enter__()
                sl = fh.get_slice(key)
                if len(read) == 4:          # a per-expert tensor: its box drops the expert dimension
                    dst[at].copy_(sl[src].unsqueeze(0))
                else:
                    want = tuple(s.stop - s.start for s in src)
                    shape = tuple(sl.get_shape())
                    if any(s.stop > d for s, d in zip(src, shape)) or len(shape) != len(src):
                        raise ModelError(f"Hugging Face weight {key!r} has shape {shape}, too small for parashift "
                                         f"{name!r} box {lo}-{hi}; the checkpoint does not match its config.json")
                    dst[at].copy_(sl[src].reshape(want))
    finally:
        for fh in handles.values():
            fh.__exit__(None, None, None)
    return store


# ---- export -----------------------------------------------------------------------------------------
def _cover(spec: ModelSpec, strategy: Strategy) -> list[tuple[str, list[tuple[int, tuple, tuple]]]]:
    """Per tensor (model order): its boxes, each from one holder (rank, lo, hi), covering it exactly once."""
    from ..vps.boxes import exactly_once
    from ..vps.layout import layout
    lay = layout(spec, strategy)
    reg = lay.regions(kinds=("param",))
    seen: dict[tuple, int] = {}
    for r, t, lo, hi in zip(reg.rank.tolist(), reg.tensor.tolist(), reg.lo.tolist(), reg.hi.tolist()):
        n = int(lay.table.ndim[t])
        seen.setdefault((t, tuple(lo[:n]), tuple(hi[:n])), r)     # ranks ascend: the lowest holder of a copy
    by: dict[int, list] = {}
    for (t, lo, hi), r in seen.items():
        by.setdefault(t, []).append((r, lo, hi))
    out = []
    for t, name in enumerate(lay.table.names):
        boxes = sorted(by.get(t, []), key=lambda x: x[1])
        shape = spec.tensor(name).shape
        nd = len(shape)
        plo = np.array([b[1] for b in boxes], dtype=np.int64).reshape(-1, nd)
        phi = np.array([b[2] for b in boxes], dtype=np.int64).reshape(-1, nd)
        cov = exactly_once(np.zeros((1, nd), np.int64), np.array([shape], np.int64), np.zeros(1, np.int64),
                           plo, phi, np.zeros(len(boxes), np.int64))
        if not cov.ok:
            raise RuntimeFailure(f"exporting {name!r}: the boxes of {strategy} do not cover it exactly once "
                                 f"({cov.reason}); the layout is inconsistent")
        out.append((name, boxes))
    return out


def _writers(spec: ModelSpec, names: list[str], world: int) -> list[int]:
    """Writer rank (file index) of each tensor: model order cut into ``world`` runs of about equal bytes."""
    sizes = np.array([int(np.prod(spec.tensor(n).shape)) for n in names], dtype=np.float64)
    mid = np.cumsum(sizes) - sizes / 2
    files = min(world, len(names))
    return np.minimum((mid / sizes.sum() * files).astype(np.int64), files - 1).tolist()


def export_hf(store, folder: str, group=None) -> dict:
    """Write the parameters of every rank's ``store`` (the job's stores, one per process) as a Hugging
    Face folder. Collective over ``group`` (the layout's whole world, ranks numbered as the strategy's;
    None: the default process group); returns this rank's written
    file and keys. ZeRO-3 and ``overlap_param`` runs call it outside a step with their parameters whole."""
    import torch.distributed as dist
    from .switch.stores import piece_view
    spec, strategy, me = store.spec, store.strategy, store.rank
    check_convertible(spec)
    from ..models.hf import hf_config
    config = hf_config(spec)            # refused before anything is sent
    cover = _cover(spec, strategy)
    writer = _writers(spec, [n for n, _ in cover], strategy.world)
    files = max(writer) + 1
    mine: dict[str, torch.Tensor] = {}
    sends, recvs = [], []
    tag = 0
    for (name, boxes), w in zip(cover, writer):
        full = torch.empty(spec.tensor(name).shape, dtype=_dtype(spec), device=_comm_device(store)) if w == me else None
        for r, lo, hi in boxes:
            tag += 1
            box = tuple(slice(a, b) for a, b in zip(lo, hi))
            if r == me and w == me:
                full[box].copy_(piece_view(store, name, "param", lo, hi))
            elif r == me:
                buf = piece_view(store, name, "param", lo, hi).contiguous()
                sends.append((dist.isend(buf, group_dst=w, group=group, tag=tag), buf))
            elif w == me:
                buf = torch.empty(tuple(b - a for a, b in zip(lo, hi)), dtype=full.dtype, device=_comm_device(store))
                recvs.append((dist.irecv(buf, group_src=r, group=group, tag=tag), full, box, buf))
        if full is not None:
            mine[name] = full
    for work, full, box, buf in recvs:
        work.wait()
        full[box].copy_(buf)
    for work, _ in sends:
        work.wait()
    os.makedirs(folder, exist_ok=True)
    out = {"file": None, "keys": [], "bytes": 0}
    if me < files:
        from safetensors.torch import save_file
        hf = to_hf(spec, {k: v.detach().cpu() for k, v in mine.items()})
        fname = f"model-{me + 1:05d}-of-{files:05d}.safetensors"
        save_file(hf, os.path.join(folder, fname), metadata={"format": "pt"})
        out = {"file": fname, "keys": sorted(hf), "bytes": sum(v.numel() * v.element_size() for v in hf.values())}
    parts: list = [None] * strategy.world
    dist.all_gather_object(parts, out, group=group)
    if me == 0:
        wm = {k: p["file"] for p in parts if p["file"] for k in p["keys"]}
        with open(os.path.join(folder, INDEX), "w") as fh:
            json.dump({"metadata": {"total_size": sum(p["bytes"] for p in parts)},
                       "weight_map": dict(sorted(wm.items()))}, fh, indent=2)
        with open(os.path.join(folder, "config.json"), "w") as fh:
            json.dump(config, fh, indent=2)
        with open(os.path.join(folder, "generation_config.json"), "w") as fh:
            json.dump({k: config[k] for k in ("bos_token_id", "eos_token_id") if config.get(k) is not None}
                      | {"_from_model_config": True}, fh, indent=2)
    dist.barrier(group=group)
    return out


def _dtype(spec: ModelSpec) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[spec.dtype]


def _comm_device(store) -> torch.device:
    return next(iter(store.buffers.values())).device
