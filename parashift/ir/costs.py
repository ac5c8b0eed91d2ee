"""Rough action durations for planning a schedule and ordering its p2p pairs: per chunk, forward
(F), input-grad (I) and weight-grad (W) backward, and the p2p hand-off between stages.

Only ratios matter to the list scheduler, so a first-order model is enough: compute at a fixed
fraction of the GPU's peak, tensor-parallel all-reduces (ring, on the compute stream: they lengthen
F and I but not W) and expert all-to-alls at the link bandwidth. This keeps :mod:`parashift.ir` free
of the simulator; pass your own :class:`~parashift.ir.schedules.ScheduleCosts` for anything finer.
"""
from __future__ import annotations

import numpy as np

from .. import cluster as _cluster
from ..models import ModelSpec
from ..strategy import Strategy
from .model_graph import core_attention_flops, region_flops, region_kinds
from .schedules import ScheduleCosts, get_schedule

__all__ = ["estimate_costs", "REFERENCE_CLUSTER", "COMPUTE_EFFICIENCY", "LINK_EFFICIENCY", "COMM_OVERHEAD"]

#: Cluster whose GPU and links stand in when the caller names none.
REFERENCE_CLUSTER = "a800-16x8"
#: Fraction of peak FLOP/s a dense transformer region reaches.
COMPUTE_EFFICIENCY = 0.6
#: Fraction of a link's nominal bandwidth a collective or p2p transfer reaches.
LINK_EFFICIENCY = 0.75
#: Seconds every collective pays on top of latency and bytes (launch and synchronisation).
COMM_OVERHEAD = 5e-5


def _ring_factor(k: int) -> float:
    return 2.0 * (k - 1) / k if k > 1 else 0.0


def _stage_is_multi_node(s: Strategy, cl: _cluster.Cluster) -> bool:
    return s.world // max(s.pp, 1) >= cl.per_node


def _collective(nbytes: float, steps: int, bw: float, latency: float) -> float:
    """One collective: launch/sync overhead, per-step latency, bytes at the effective bandwidth."""
    return COMM_OVERHEAD + steps * latency + nbytes / (bw * LINK_EFFICIENCY)


def estimate_costs(model: ModelSpec, strategy: Strategy, seq_len: int,
                   cluster: "str | _cluster.Cluster | None" = None) -> ScheduleCosts:
    """Per-chunk F/I/W durations (seconds) and the p2p latency of ``strategy`` on ``cluster``
    (default :data:`REFERENCE_CLUSTER`'s GPU and links)."""
    s = strategy
    cl = _cluster.get(cluster or REFERENCE_CLUSTER)
    g = cl.gpu
    rate = g.peak_flops * COMPUTE_EFFICIENCY
    tokens = s.mbs * seq_len
    db = model.dtype_bytes
    msg = tokens * model.hidden * db
    layer_flops = sum(region_flops(model, k, tokens, seq_len) for k in region_kinds(model))
    core = core_attention_flops(model, tokens, seq_len)
    comm = 0.0
    if s.tp > 1:  # ring all-reduce after attention and after the MLP / MoE block, per pass
        comm += 2 * _collective(_ring_factor(s.tp) * msg, 2 * (s.tp - 1), g.intra_bw, g.intra_latency)
    if model.is_moe and s.ep > 1 and not get_schedule(s.schedule).hides_ep_comm:  # dispatch + combine
        a2a = tokens * model.top_k * model.hidden * db * (s.ep - 1) / s.ep
        inter = s.ep * s.tp > cl.per_node
        comm += 2 * _collective(a2a, 1, g.inter_bw if inter else g.intra_bw,
                                g.inter_latency if inter else g.intra_latency)
    layers = np.bincount(s.layer_stages(model.layers), minlength=s.stages).astype(float)
    head = np.zeros(s.stages)
    head[-1] = model.head_flops(tokens)
    # the weight-grad runs the GEMMs with weights once more; the input-grad runs them too, plus the core
    # attention's backward (QK^T and AV have no weights: twice their forward FLOPs, all in I)
    gemm = (layers * (layer_flops - core) + head) / s.tp / rate
    attn = layers * core / s.tp / rate
    extra = {"none": 0.0, "selective": core, "full": layer_flops}[s.recompute] * layers / s.tp / rate
    t_comm = layers * comm
    f = gemm + attn + t_comm
    i = gemm + 2 * attn + t_comm + extra + (t_comm if s.recompute == "full" else 0.0)
    w = gemm
    multi = _stage_is_multi_node(s, cl)
    p2p = msg / ((g.inter_bw if multi else g.intra_bw) * LINK_EFFICIENCY) + (g.inter_latency if multi else g.intra_latency)
    floor = 1e-12
    return ScheduleCosts(tuple(np.maximum(f, floor).tolist()), tuple(np.maximum(i, floor).tolist()),
                         tuple(np.maximum(w, floor).tolist()), float(p2p))
