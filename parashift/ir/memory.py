"""Bytes a training step holds: static states per rank (ZeRO-aware) and activations per micro-batch.

Static memory comes from ``parashift.vps.layout`` (``static_memory``); ``analytic_static_memory``
derives the same bytes from the tensor inventory (TP shards along ``tp_dim``, EP shards experts, ZeRO
shards the DP group's flat buffer padded to a multiple of the group size), and a test checks both agree. Activation bytes follow Megatron-LM
(Korthikanti et al. 2022, no sequence parallelism): per layer ``sbh(10 + 24/t + 5as/(ht))`` without
recomputation, ``sbh(10 + 24/t)`` with selective recomputation, and the region inputs (``2sbh`` each)
with full recomputation, for 16-bit activations (scaled by ``dtype_bytes / 2``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..models import ModelSpec
from ..strategy import Strategy

__all__ = ["ChunkParams", "chunk_params", "static_memory", "analytic_static_memory", "optimizer_elements",
           "region_activation", "OPTIM_FLOPS_PER_ELEMENT"]

OPTIM_FLOPS_PER_ELEMENT = 10.0


@dataclass(frozen=True)
class ChunkParams:
    """Per virtual stage (chunk): parameter elements one rank holds before ZeRO sharding."""

    dense: np.ndarray        # [chunks] elements of dense tensors (TP shard)
    expert: np.ndarray       # [chunks] elements of expert tensors (TP and EP shard)
    tied: int                # elements of the tied word embedding's TP shard (0 when untied)

    def total(self) -> np.ndarray:
        return self.dense + self.expert


def chunk_params(model: ModelSpec, strategy: Strategy) -> ChunkParams:
    """Elements per chunk on one rank: embedding in chunk 0, head (and a tied embedding copy) in the last."""
    s = strategy
    layer_chunk = s.layer_stages(model.layers)
    dense = np.zeros(s.stages, np.int64)
    expert = np.zeros(s.stages, np.int64)
    tied = 0
    for t in model.tensors:
        n = t.numel
        if t.tp_dim is not None:
            n //= s.tp
        if t.ep_dim is not None:
            n //= s.ep
        if t.layer < 0:
            chunks = [0]
            if t.tied and s.stages > 1:
                chunks.append(s.stages - 1)
                tied = n
        elif t.layer >= model.layers:
            chunks = [s.stages - 1]
        else:
            chunks = [int(layer_chunk[t.layer])]
        for c in chunks:
            (expert if t.ep_dim is not None else dense)[c] += n
    return ChunkParams(dense, expert, tied)


def _shard(n: int, ways: int) -> int:
    return -(-n // ways)


def static_memory(model: ModelSpec, strategy: Strategy) -> list[dict[str, int]]:
    """Per pipeline stage: {"param", "grad", "master", "optim"} bytes one rank of that stage holds,
    taken from ``parashift.vps.layout`` (ZeRO buffers with their padding); ``analytic_static_memory``
    computes the same numbers from the inventory alone."""
    from ..vps import layout
    lay = layout(model, strategy)
    per = {k: lay.bytes_per_rank(k, padded=True) for k in lay.kinds}
    zero = np.zeros(strategy.world, np.int64)
    out = []
    for st in range(strategy.pp):
        r = st * strategy.tp * strategy.dp
        out.append({"param": int(per["param"][r]), "grad": int(per["grad"][r]),
                    "master": int(per.get("master", zero)[r]),
                    "optim": int(per["exp_avg"][r] + per["exp_avg_sq"][r])})
    return out


def analytic_static_memory(model: ModelSpec, strategy: Strategy) -> list[dict[str, int]]:
    """``static_memory`` from the tensor inventory alone (no VPS layout)."""
    s = strategy
    cp = chunk_params(model, s)
    stage_of = np.asarray(s.chunk_rank_stage(np.arange(s.stages)))
    pb, gb = model.kind_bytes("param"), model.kind_bytes("grad")
    master = 0 if model.dtype == "fp32" else 4
    out = []
    for st in range(s.pp):
        mask = stage_of == st
        dense, exp_ = int(cp.dense[mask].sum()), int(cp.expert[mask].sum())
        edp = s.dp // s.ep if s.ep > 1 else s.dp

        def z(n: int, ways: int, stage: int) -> int:
            return _shard(n, ways) if s.zero >= stage else n

        elems = {k: z(dense, s.dp, lvl) + z(exp_, edp, lvl) for k, lvl in (("param", 3), ("grad", 2), ("opt", 1))}
        out.append({"param": elems["param"] * pb, "grad": elems["grad"] * gb,
                    "master": elems["opt"] * master, "optim": elems["opt"] * 8})
    return out


def optimizer_elements(model: ModelSpec, strategy: Strategy) -> list[int]:
    """Per stage: parameter elements whose optimizer states one rank updates."""
    s = strategy
    cp = chunk_params(model, s)
    stage_of = np.asarray(s.chunk_rank_stage(np.arange(s.stages)))
    edp = s.dp // s.ep if s.ep > 1 else s.dp
    out = []
    for st in range(s.pp):
        mask = stage_of == st
        d, e = int(cp.dense[mask].sum()), int(cp.expert[mask].sum())
        out.append(_shard(d, s.dp) + _shard(e, edp) if s.zero >= 1 else d + e)
    return out


def region_activation(model: ModelSpec, kind: str, *, mbs: int, seq_len: int, tp: int, recompute: str) -> int:
    """Activation bytes one region stashes for its backward, per micro-batch on one rank."""
    s, b, h, t = seq_len, mbs, model.hidden, tp
    a = model.heads
    sbh = s * b * h
    scale = model.dtype_bytes / 2
    mats_in = 2 if model.gated else 1
    if recompute == "full":
        return int(2 * sbh * scale) if kind not in ("embed", "moe.experts", "moe.combine") else 0
    if kind == "attn":
        v = sbh * (5 + 8 / t)
        if recompute == "none" and not model.flash_attention:
            v += 5 * a * s * s * b / t
    elif kind == "mlp":
        v = sbh * 5 + 2 * s * b * model.ffn * (mats_in + 1) / t
    elif kind == "moe.route":
        v = sbh * 5 + 2 * s * b * model.shared_ffn * (mats_in + 1) / t + 4 * s * b * model.experts
    elif kind == "moe.experts":
        k = model.top_k
        v = 2 * s * b * k * h + 2 * s * b * k * model.expert_ffn * (mats_in + 1) / t
    elif kind == "moe.combine":
        v = 2 * s * b * model.top_k * h
    elif kind == "head":
        v = 4 * sbh + 4 * s * b * model.vocab / t / scale
    else:  # embed
        v = 0.0
    return int(v * scale)
