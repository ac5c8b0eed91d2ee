"""Tensor and sequence parallelism in the runtime: the handlers of the Program's ``tp.*`` and ``sp.*``
collectives.

Without SP a region's TP reduction is an all-reduce of its partial output (forward) or input gradient
(backward); the cross-entropy statistics are all-gathered. With SP each reduction runs as the
Program's reduce-scatter along the sequence (the residual add on this rank's rows) and all-gather;
the column-parallel GEMMs keep their input's rows only (:func:`keep_rows`), re-gathered by the
``sp ... input`` all-gather for their weight gradients (a gradient whose input has not landed waits
for it, :func:`defer_weight_grad`). Each handler takes the interpreter and the prepared instruction
and returns its :class:`..comm.Flight`; its completion finishes the region.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from ...ir.tags import SPTag
from ..comm import Flight, all_gather_flat, reduce_scatter_flat
from ..models import accumulate_linear_grad
from ..prepared import Prepared
from ..regions import Rec

__all__ = ["needs_reduction", "reduce", "keep_rows", "defer_weight_grad", "sequence"]


def needs_reduction(strategy: Any, phase: str, kind: str) -> bool:
    """Whether a region of ``kind`` ends its ``phase`` (fwd, else bwd) with a TP reduction."""
    if strategy.tp == 1:
        return False
    if phase == "fwd":
        return kind in ("embed", "attn", "mlp", "moe.combine", "head")
    return kind in ("head", "mlp", "attn", "moe.route")


def reduce(it: Any, p: Prepared) -> Flight:
    """A region's TP reduction (``tp.*``): the forward's all-reduce (or the cross-entropy statistics'
    all-gather) finishes its forward; the backward's finishes its backward."""
    ins, stream, g, tag = p.ins, p.ins.stream, p.group, p.tag
    c, mb = ins.chunk, tag.mb
    rec = it.st.recs[(c, mb)][tag.region]
    if tag.phase == "fwd":
        if ins.key == "ce_stats" or ins.op == "all_gather":
            local = rec.pending
            out = torch.empty((it.strategy.tp,) + tuple(local.shape[1:]), dtype=local.dtype, device=local.device)
            work = all_gather_flat(out, local.contiguous(), group=g, async_op=True)

            def then_ce() -> None:
                rec.pending = out
                it.fwd_done(c, mb, rec)
            return Flight(ins, stream, [work], then=then_ce)
        work = dist.all_reduce(rec.pending, group=g, async_op=True)
        return Flight(ins, stream, [work], then=lambda: it.fwd_done(c, mb, rec))
    work = dist.all_reduce(rec.pending, group=g, async_op=True)

    def then_b() -> None:
        it.st.open_bwd[c] -= 1
        it.bwd_done(c, mb, rec, rec.t.pop("_drop", True))
    return Flight(ins, stream, [work], then=then_b)


def _rows(it: Any) -> slice:
    """This TP rank's rows of the sequence."""
    L = it.seq // it.strategy.tp
    return slice(it.coords["tp"] * L, (it.coords["tp"] + 1) * L)


def keep_rows(it: Any, c: int, mb: int, rec: Rec) -> None:
    """SP: the column-parallel GEMM of a block (qkv, fc1, the output layer) keeps only this rank's
    sequence rows of its input; the backward's ``sp ... input`` all-gather restores the rest."""
    if not it.strategy.sp or rec.kind not in ("attn", "mlp", "head"):
        return
    key, z = (c, mb, rec.region), rec.t["z_leaf"]
    k = next(j for j, u in enumerate(rec.tape.uses) if u.x is z)
    if key in it.st.sp_full:       # a recompute after the re-gather landed
        rec.tape.uses[k].x = it.st.sp_full.pop(key)
        return
    it.st.sp_x[key] = (k, z.detach()[:, _rows(it)].transpose(0, 1).contiguous())
    rec.tape.uses[k].x = None


def defer_weight_grad(it: Any, c: int, mb: int, rec: Rec) -> None:
    """Before a region's weight gradients: the GEMM whose input is not re-gathered yet gets its
    gradient when the re-gather lands (its output gradient is kept until then)."""
    key = (c, mb, rec.region)
    if key not in it.st.sp_x or rec.dys is None:
        return
    k = it.st.sp_x[key][0]
    live = [j for j, u in enumerate(rec.tape.uses) if u.y.requires_grad]
    if k in live and rec.dys[live.index(k)] is not None:
        i = live.index(k)
        it.st.sp_dy[key] = (rec.tape.uses[k].key, rec.dys[i])
        rec.dys[i] = None


def sequence(it: Any, p: Prepared) -> Flight:
    """An SP collective (``sp.*``): the input re-gather of a column-parallel GEMM, or one hop (reduce-scatter,
    all-gather) of a region's TP reduction along the sequence."""
    tag = p.tag
    assert isinstance(tag, SPTag)
    if tag.hop == "input":
        return _regather_input(it, p, tag)
    if tag.hop == "rs":
        return _reduce_scatter(it, p, tag)
    return _all_gather(it, p, tag)


def _regather_input(it: Any, p: Prepared, tag: SPTag) -> Flight:
    """All-gather a GEMM's input rows; on landing, its deferred weight gradient, or its recompute's input."""
    ins, g, tp = p.ins, p.group, it.strategy.tp
    c, mb, key = ins.chunk, tag.mb, (ins.chunk, tag.mb, tag.region)
    k, mine = it.st.sp_x[key]       # popped when it lands: until then weight gradients wait for it
    full = mine.new_empty((tp * mine.shape[0],) + tuple(mine.shape[1:]))
    work = all_gather_flat(full, mine, group=g, async_op=True)

    def then_in() -> None:
        del it.st.sp_x[key]
        x = full.transpose(0, 1)
        if key in it.st.sp_dy:
            name, dy = it.st.sp_dy.pop(key)
            it.store.grad_mb[c] = mb
            accumulate_linear_grad(it.ctx.acc(*name), dy, x, it.ctx.grad_fusion)
        else:
            rec = it.st.recs.get((c, mb), {}).get(tag.region)
            if rec is not None and rec.built and len(rec.tape.uses) > k:
                rec.tape.uses[k].x = x
            else:                 # its forward ran without a graph: the recompute takes it
                it.st.sp_full[key] = x
    return Flight(ins, ins.stream, [work], then=then_in, keep=mine)


def _reduce_scatter(it: Any, p: Prepared, tag: SPTag) -> Flight:
    """The reduction's first hop: reduce-scatter along the sequence (a flat buffer for an MoE route), then
    the forward's residual add on this rank's rows."""
    ins, g, tp = p.ins, p.group, it.strategy.tp
    rec = it.st.recs[(ins.chunk, tag.mb)][tag.region]
    t = rec.pending
    if t.dim() == 3 and t.shape[1] == it.seq:     # [b, n, h]; else a flat buffer (MoE route)
        inp = t.transpose(0, 1).contiguous()
    else:
        inp = t.new_zeros(-(-t.numel() // tp) * tp)
        inp[:t.numel()] = t.reshape(-1)
    out = inp.new_empty((inp.shape[0] // tp,) + tuple(inp.shape[1:]))
    work = reduce_scatter_flat(out, inp, group=g, async_op=True)
    shape = tuple(t.shape)

    def then_rs() -> None:
        if tag.phase == "fwd" and rec.kind != "embed":    # the residual add, on this rank's rows only
            res = rec.saved["moe.res"] if rec.kind == "moe.combine" else rec.t["h"].detach()
            out.add_(res.transpose(0, 1)[_rows(it)])
        rec.pending = out
        rec.t["sp_shape"] = shape
    return Flight(ins, ins.stream, [work], then=then_rs, keep=inp)


def _all_gather(it: Any, p: Prepared, tag: SPTag) -> Flight:
    """The reduction's second hop: all-gather the reduced rows; on landing the region's forward or
    backward finishes."""
    ins, g, tp = p.ins, p.group, it.strategy.tp
    c, mb = ins.chunk, tag.mb
    rec = it.st.recs[(c, mb)][tag.region]
    mine = rec.pending
    full = mine.new_empty((tp * mine.shape[0],) + tuple(mine.shape[1:]))
    work = all_gather_flat(full, mine, group=g, async_op=True)
    shape = rec.t.pop("sp_shape")

    def then_ag() -> None:
        x = full.transpose(0, 1).contiguous() if len(shape) == 3 and shape[1] == it.seq \
            else full[:math.prod(shape)].view(shape)
        if tag.phase == "fwd":
            it.fwd_done(c, mb, rec, h=x)
            return
        rec.pending = x
        it.st.open_bwd[c] -= 1
        it.bwd_done(c, mb, rec, rec.t.pop("_drop", True))
    return Flight(ins, ins.stream, [work], then=then_ag, keep=mine)
