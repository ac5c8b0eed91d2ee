"""Context parallelism in the runtime: the sequence split over the CP ranks and the handlers of the
Program's ``cp.*`` collectives.

Slicing is load-balanced for causal attention (as Megatron-LM does): the sequence is cut into
``2*cp`` equal chunks and CP rank ``r`` holds chunks ``r`` and ``2*cp-1-r``, so every rank has the
same number of unmasked query-key pairs. Tokens, targets and rope angles are those of the rank's
global positions; the loss is the rank's token losses over the global batch's token count, so the
DP x CP gradient all-reduce (or ZeRO reduce-scatter) sums to the single-process gradient.

What each instruction does (the Program's ``Shard("cp")`` orders them as TransformerEngine's
``cp_comm_type="all_gather"`` runs them; the bytes are the ones it prices):

* attention ``fwd`` compute: norm, QKV projection and rope on the local tokens; their K/V (kept
  until the backward) are what ``cp.<attn>.fwd.kv``, next on the comm stream, all-gathers. Its
  completion runs the core attention over every rank's K/V (causal mask by global position) and
  the output projection, as the TP/SP reductions' completions finish their regions; the Program's
  consumers wait for the gather. (A profile therefore books the core attention to the gather.)
* ``cp.<attn>.bwd.kv`` gathers the K/V again before the attention ``bwd`` compute: the output
  projection's backward, then the core attention re-run and its backward (dq and the gradients of
  every rank's K/V; the re-run output also gives the output projection's weight gradient).
  ``cp.<attn>.bwd.dkv`` reduce-scatters those to their owners; its completion runs rope's and the
  QKV projection's backward and hands the input gradient to the TP reduction or the norm's
  backward. A split backward's weight half waits for that scatter (the Program says so).
* a ``recompute`` of the attention rebuilds its QKV graph from the saved input; the core is re-run
  by the backward in any case.
"""
from __future__ import annotations

from typing import Any

import torch

from ...errors import RuntimeFailure
from ...ir.tags import CPTag
from ..comm import Flight, all_gather_flat, reduce_scatter_flat
from ..prepared import Prepared
from ..regions import KINDS, Rec, cp_attn_bwd_core, cp_attn_bwd_out, cp_attn_bwd_qkv, cp_attn_core, cp_attn_pre
from .tp import defer_weight_grad, needs_reduction

__all__ = ["cp_positions", "cp_mask", "setup", "take", "attn_fwd", "attn_bwd", "attn_recompute", "exchange"]


def cp_positions(seq: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions of the tokens CP rank ``rank`` holds (chunks ``rank`` and ``2cp-1-rank`` of ``2cp``)."""
    if seq % (2 * cp):
        raise ValueError(f"seq_len={seq} is not a multiple of 2*cp={2 * cp}")
    n = seq // (2 * cp)
    a, b = rank, 2 * cp - 1 - rank
    return torch.cat([torch.arange(a * n, (a + 1) * n), torch.arange(b * n, (b + 1) * n)])


def cp_mask(seq: int, cp: int, rank: int) -> torch.Tensor:
    """Boolean mask ``[seq/cp, seq]``: local query i may attend to gathered key j (keys in CP rank
    order, each rank's in its local order) iff j's global position is not after i's."""
    q = cp_positions(seq, cp, rank)
    k = torch.cat([cp_positions(seq, cp, j) for j in range(cp)])
    return k.unsqueeze(0) <= q.unsqueeze(1)


# The interpreter's context parallelism: functions of the interpreter ``it``; the step's state lives in
# ``it.st.cp``: ``("kv"|"bkv"|"dkv", chunk, mb, region) -> tensor``, the local K/V to gather, the K/V
# gathered for a backward and the K/V gradients to scatter.

def setup(it: Any, seq: int) -> None:
    """This rank's positions, rope tables and attention mask for a global sequence of ``seq``."""
    cp, r = it.strategy.cp, it.coords["cp"]
    it.cp_pos = cp_positions(seq, cp, r).to(it.device)
    it.ctx.rope = tuple(t[it.cp_pos] for t in it.ctx.rope)
    it.ctx.cp, it.ctx.cp_mask = cp, cp_mask(seq, cp, r).to(it.device)


def take(it: Any, rows: torch.Tensor) -> torch.Tensor:
    """This rank's sequence positions of ``[b, seq]`` tokens or targets."""
    return rows[:, it.cp_pos] if it.strategy.cp > 1 else rows


def attn_fwd(it: Any, c: int, mb: int, rec: Rec, env: dict, grad: bool) -> None:
    """Attention forward up to its K/V (the gather's completion finishes it)."""
    it.st.cp[("kv", c, mb, rec.region)] = cp_attn_pre(it.ctx, rec, env, grad)


def attn_bwd(it: Any, c: int, mb: int, rec: Rec, full: bool) -> None:
    """Attention backward up to the K/V gradients (the reduce-scatter's completion finishes it)."""
    cp_attn_bwd_out(it.ctx, rec, it.st.g(c, mb))
    rec.t["_drop"] = full
    it.st.open_bwd[c] = it.st.open_bwd.get(c, 0) + 1     # the DP sync waits for the qkv weight grads
    kv = it.st.cp.pop(("bkv", c, mb, rec.region), None)
    if kv is None:
        raise RuntimeFailure(f"the backward of {rec.region} (chunk {c}, micro-batch {mb}) ran before its "
                             f"cp K/V all-gather landed; rebuild the Program with parashift.ir.compile")
    it.st.cp[("dkv", c, mb, rec.region)] = cp_attn_bwd_core(it.ctx, rec, kv)


def attn_recompute(it: Any, rec: Rec, saved: dict) -> None:
    """A recompute of the attention rebuilds its QKV graph from the saved input (the core is
    re-run by the backward anyway)."""
    cp_attn_pre(it.ctx, rec, saved, True)


def exchange(it: Any, p: Prepared) -> Flight:
    """A ``cp.*`` collective: the K/V all-gather (forward: its landing runs the core attention) or the
    K/V-gradient reduce-scatter (its landing runs the QKV backward)."""
    ins, tag, g, cp = p.ins, p.tag, p.group, it.strategy.cp
    assert isinstance(tag, CPTag)
    c, mb = ins.chunk, tag.mb
    key = (c, mb, tag.region)
    if tag.part == "kv":
        rec = it.st.recs[(c, mb)][tag.region]
        mine = it.st.cp.pop(("kv",) + key) if tag.phase == "fwd" else rec.saved["kv_local"]
        full = mine.new_empty((cp * mine.shape[0],) + tuple(mine.shape[1:]))
        work = all_gather_flat(full, mine, group=g, async_op=True)
        kv_all = full.view((cp,) + tuple(mine.shape))

        def then_kv() -> None:
            if tag.phase == "fwd":
                cp_attn_core(it.ctx, rec, kv_all)
                if not needs_reduction(it.strategy, "fwd", rec.kind):
                    it.fwd_done(c, mb, rec)
                return
            it.st.cp[("bkv",) + key] = kv_all
        return Flight(ins, ins.stream, [work], then=then_kv, keep=mine)
    if tag.part != "dkv":
        raise RuntimeFailure(f"unknown CP exchange {tag.part!r} in {ins}")
    rec = it.st.recs[(c, mb)][tag.region]
    inp = it.st.cp.pop(("dkv",) + key).contiguous()
    out = inp.new_empty(tuple(inp.shape[1:]))
    work = reduce_scatter_flat(out.view(-1), inp.view(-1), group=g, async_op=True)

    def then_dkv() -> None:
        cp_attn_bwd_qkv(it.ctx, rec, out)
        full = rec.t.pop("_drop")
        if full:
            defer_weight_grad(it, c, mb, rec)
            KINDS[rec.kind].bwd_weight(it.ctx, rec)
        if needs_reduction(it.strategy, "bwd", rec.kind):       # the open count now stands for the TP reduction
            rec.t["_drop"] = full
        else:
            it.st.open_bwd[c] -= 1
            it.bwd_done(c, mb, rec, drop=full)
    return Flight(ins, ins.stream, [work], then=then_dkv, keep=inp)
