"""The FP8 amax reduction of a training step (delayed scaling, :mod:`parashift.fp8`) as a directive.

After a chunk's last backward node, one all-reduce (MAX in the runtime) of the chunk's amaxes (input,
weight and output gradient of each FP8 GEMM weight, 4 bytes each) runs on the comm stream over every
rank of the chunk's pipeline stage (group axis ``stage``: its TP shards, CP and DP replicas), tag
``fp8.amax.c<chunk>``; the runtime pushes the reduced amaxes into the history that scales the next
steps. The simulator prices it as any small all-reduce.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..fp8 import FP8_GEMMS, get as get_recipe
from ..models import ModelSpec
from ..strategy import Strategy
from . import tags as T
from .actions import AFTER
from .graph import SAVED, Graph

__all__ = ["AmaxReduce", "amax_bytes", "amax_directives"]

_BWD = ("bwd", "bwd_input", "bwd_weight")


def amax_bytes(model: ModelSpec, strategy: Strategy) -> tuple[int, ...]:
    """Per chunk: bytes of its FP8 GEMM weights' amaxes (three fp32 values per weight tensor)."""
    out = [0] * strategy.stages
    chunk = strategy.layer_stages(model.layers)
    for t in model.tensors:
        if 0 <= t.layer < model.layers and t.name.endswith(FP8_GEMMS):
            out[int(chunk[t.layer])] += 3 * 4
    return tuple(out)


def amax_directives(model: ModelSpec, strategy: Strategy) -> list:
    """``[AmaxReduce(...)]`` when the strategy's recipe reduces amaxes once a step over more than one rank."""
    r = get_recipe(strategy.fp8)
    if r is None or not (r.delayed and r.reduces_amax) or strategy.world // strategy.pp == 1:
        return []
    return [AmaxReduce(amax_bytes(model, strategy))]


@dataclass(frozen=True)
class AmaxReduce:
    """One all-reduce of ``nbytes[c]`` amax bytes per chunk ``c`` over its stage, after the chunk's last
    backward node (a placed graph: apply after ``Place``)."""

    nbytes: tuple[int, ...]
    stampable: ClassVar[bool] = False

    def apply(self, g: Graph) -> Graph:
        out = g.owned()
        c = out.cols
        bwd: dict[int, list[int]] = {}
        stage: dict[int, int] = {}
        for i, (op, ph, ch, st) in enumerate(zip(c["op"], c["phase"], c["chunk"], c["stage"])):
            if op == "compute" and ph in _BWD:
                bwd.setdefault(ch, []).append(i)
                stage[ch] = st
        for ch, nodes in sorted(bwd.items()):
            if not self.nbytes[ch]:
                continue
            n = out.add(op="all_reduce", group="stage", chunk=ch, stage=stage[ch], tag=str(T.Fp8Tag(ch)),
                        nbytes=int(self.nbytes[ch]), stream="comm", action=(AFTER, ch))
            out.add_edges(nodes, [n] * len(nodes), SAVED)
        return out
