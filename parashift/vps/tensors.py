"""A model's tensor inventory as numpy arrays, and how a strategy cuts each tensor.

Pure geometry shared by :mod:`layout` and :mod:`plan`: shapes padded to a common rank,
the TP/EP local-shard shape of every tensor, where each local shard sits in the global
tensor, and which pipeline stage holds which tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..errors import StrategyError
from ..models import ModelSpec
from ..states import KINDS, ZERO_STAGE
from ..strategy import Strategy

__all__ = ["TensorTable", "tensor_table", "ZERO_STAGE", "KINDS", "local_shape", "shard_origin", "held_by_stage"]


@dataclass(frozen=True, eq=False)
class TensorTable:
    """Struct-of-arrays view of ``model.tensors`` (model order); shapes padded with trailing 1s."""

    names: tuple[str, ...]
    shape: np.ndarray      # [T, D] int64
    ndim: np.ndarray       # [T]
    tp_dim: np.ndarray     # [T], -1: replicated over TP
    ep_dim: np.ndarray     # [T], -1: dense tensor
    layer: np.ndarray      # [T]
    tied: np.ndarray       # [T] bool

    @property
    def count(self) -> int:
        return len(self.names)

    @property
    def dims(self) -> int:
        return self.shape.shape[1]

    @property
    def expert(self) -> np.ndarray:
        return self.ep_dim >= 0


@lru_cache(maxsize=64)
def tensor_table(model: ModelSpec) -> TensorTable:
    """The (cached) array view of a model's tensors."""
    ts = model.tensors
    d = max(len(t.shape) for t in ts)
    shape = np.ones((len(ts), d), dtype=np.int64)
    for i, t in enumerate(ts):
        shape[i, :len(t.shape)] = t.shape
    return TensorTable(
        names=tuple(t.name for t in ts), shape=shape,
        ndim=np.array([len(t.shape) for t in ts], dtype=np.int64),
        tp_dim=np.array([-1 if t.tp_dim is None else t.tp_dim for t in ts], dtype=np.int64),
        ep_dim=np.array([-1 if t.ep_dim is None else t.ep_dim for t in ts], dtype=np.int64),
        layer=np.array([t.layer for t in ts], dtype=np.int64),
        tied=np.array([t.tied for t in ts], dtype=bool))


def _split_dims(table: TensorTable, strategy: Strategy) -> np.ndarray:
    """Per tensor and dimension, into how many equal parts TP and EP cut it."""
    parts = np.ones_like(table.shape)
    rows = np.arange(table.count)
    m = table.tp_dim >= 0
    parts[rows[m], table.tp_dim[m]] *= strategy.tp
    m = table.ep_dim >= 0
    parts[rows[m], table.ep_dim[m]] *= strategy.ep
    return parts


def local_shape(table: TensorTable, strategy: Strategy) -> np.ndarray:
    """``[T, D]`` shape of each tensor's TP/EP local shard; raises if a cut is uneven."""
    parts = _split_dims(table, strategy)
    bad = np.argwhere(table.shape % parts)
    if len(bad):
        t, d = (int(x) for x in bad[0])
        raise StrategyError(
            f"{table.names[t]} has size {int(table.shape[t, d])} along dimension {d}, which "
            f"tp={strategy.tp}/ep={strategy.ep} cannot split evenly; pick tp and ep that divide it")
    return table.shape // parts


def shard_origin(table: TensorTable, lshape: np.ndarray, tensor: np.ndarray, tp: np.ndarray,
                 ep: np.ndarray) -> np.ndarray:
    """Global coordinates of the first element of local shard (tp, ep) of each tensor."""
    tensor = np.asarray(tensor, dtype=np.int64)
    lo = np.zeros((len(tensor), table.dims), dtype=np.int64)
    rows = np.arange(len(tensor))
    td, ed = table.tp_dim[tensor], table.ep_dim[tensor]
    m = td >= 0
    lo[rows[m], td[m]] += np.asarray(tp)[m] * lshape[tensor[m], td[m]]
    m = ed >= 0
    lo[rows[m], ed[m]] += np.asarray(ep)[m] * lshape[tensor[m], ed[m]]
    return lo


def held_by_stage(model: ModelSpec, table: TensorTable, strategy: Strategy) -> np.ndarray:
    """``[pp, T]`` bool: does pipeline stage s hold tensor t.

    Layers go to virtual stages with :meth:`Strategy.layer_stages`; the embedding (layer -1)
    joins chunk 0, the head (layer == layers) the last chunk, and a tied embedding is held by
    the stages of both the first and the last chunk.
    """
    chunk_of_layer = strategy.layer_stages(model.layers)
    layer = table.layer
    chunk = np.where(layer < 0, 0, np.where(layer >= model.layers, strategy.stages - 1,
                                            chunk_of_layer[np.clip(layer, 0, model.layers - 1)]))
    stage = np.asarray(strategy.chunk_rank_stage(chunk), dtype=np.int64)
    held = np.zeros((strategy.pp, table.count), dtype=bool)
    held[stage, np.arange(table.count)] = True
    last = int(strategy.chunk_rank_stage(strategy.stages - 1))
    held[last, table.tied] = True
    return held
