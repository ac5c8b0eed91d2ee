"""A fast lower bound on the model-state bytes each device holds, to reject strategies early.

The search calls this before compiling: a strategy whose parameters, gradients and optimizer
states alone exceed a device's memory cannot fit whatever its activations, so it is marked
infeasible without being compiled or simulated. The bound follows the layout rules of
DESIGN.md (TP shards a tensor's TP dimension, EP its expert dimension, PP assigns layers to
chunks, ZeRO-k shards the DP group's flat buffers) and rounds every share *down*, so it never
exceeds what the compiled Program reserves.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..models import ModelSpec
from ..strategy import Strategy

__all__ = ["state_bytes_per_stage", "state_bytes_lower_bound"]

@lru_cache(maxsize=32)
def _inventory(model: ModelSpec) -> tuple[np.ndarray, ...]:
    """Per tensor: numel, layer (embedding -1, head = layers), TP-sharded, expert, tied flags."""
    t = model.tensors
    return (np.array([x.numel for x in t], dtype=np.int64), np.array([x.layer for x in t], dtype=np.int64),
            np.array([x.tp_dim is not None for x in t]), np.array([x.ep_dim is not None for x in t]),
            np.array([x.tied for x in t]))


def state_bytes_per_stage(model: ModelSpec, strategy: Strategy) -> np.ndarray:
    """Lower bound of the model-state bytes (param, grad, master, Adam moments) one device of
    each pipeline stage holds; shape ``[pp]``."""
    s = strategy
    numel, layer, tp_sharded, expert, tied = _inventory(model)
    layer_chunk = s.layer_stages(model.layers)
    chunk = np.where(layer < 0, 0, np.where(layer >= model.layers, s.stages - 1,
                                            layer_chunk[np.clip(layer, 0, model.layers - 1)]))
    stage = np.asarray(s.chunk_rank_stage(chunk), dtype=np.int64)
    local = numel // np.where(tp_sharded, s.tp, 1) // np.where(expert, s.ep, 1)
    # bytes per element of each kind, and the DP group that ZeRO shards it over
    pb = model.kind_bytes("param")
    master = 0 if model.dtype == "fp32" else 4
    shard = np.full(len(numel), s.shard) if s.shard else np.where(expert, max(s.edp, 1) * s.cp, s.dpcp)
    z = s.zero_stage
    param = local * pb // (shard if z.shards_params else 1)
    grad = local * pb // (shard if z.shards_grads else 1)
    optim = local * (master + 8) // (shard if z.shards_optim else 1)
    per_tensor = param + grad + optim
    out = np.bincount(stage, weights=per_tensor, minlength=s.pp)
    last = int(s.chunk_rank_stage(s.stages - 1))
    if model.tied and last != 0:  # the head stage keeps its own copy of the tied embedding
        out[last] += per_tensor[tied].sum()
    return out


def state_bytes_lower_bound(model: ModelSpec, strategy: Strategy) -> float:
    """Largest per-device lower bound over the pipeline stages."""
    return float(state_bytes_per_stage(model, strategy).max())
