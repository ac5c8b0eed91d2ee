"""A strategy whose pipeline placement is given explicitly (a user's ``Place`` directive).

:class:`PlacedStrategy` is a :class:`~parashift.strategy.Strategy` whose layer -> chunk map and
chunk -> stage map come from a placement instead of the even split and the schedule's rule, so that
everything reading ``layer_stages`` / ``chunk_rank_stage`` / ``stages`` (the state store, the
interpreter, the tensor layout) follows the placement the Program was compiled with. A Program
records it in ``meta["placement"]`` and :meth:`Program.from_json` restores it (:func:`placed_from_meta`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

import numpy as np

from ..errors import StrategyError
from ..strategy import Strategy

__all__ = ["PlacedStrategy", "placed", "placement_meta", "placed_from_meta", "base_strategy"]


def base_strategy(s: Strategy) -> Strategy:
    """The plain Strategy behind ``s`` (the placement dropped)."""
    if type(s) is Strategy:
        return s
    return Strategy(**{f.name: getattr(s, f.name) for f in fields(Strategy)})


@dataclass(frozen=True)
class PlacedStrategy(Strategy):
    """``layer_chunks[i]``: chunk of layer i; ``chunk_stages[c]``: pipeline stage of chunk c."""

    layer_chunks: tuple[int, ...] = ()
    chunk_stages: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "layer_chunks", tuple(int(x) for x in self.layer_chunks))
        object.__setattr__(self, "chunk_stages", tuple(int(x) for x in self.chunk_stages))
        cs = self.chunk_stages
        if not cs or sorted(set(cs)) != list(range(self.pp)):
            raise StrategyError(f"placement chunk->stage {list(cs)} must use every stage 0..{self.pp - 1} "
                                f"(pp={self.pp}); give each stage at least one chunk")
        lc = self.layer_chunks
        if any(b < a for a, b in zip(lc, lc[1:])) or (lc and (lc[0] < 0 or lc[-1] >= len(cs))):
            raise StrategyError(f"placement layer->chunk {list(lc)} must be non-decreasing chunks in "
                                f"[0, {len(cs)}) (data flows from chunk c to chunk c+1)")

    @property
    def stages(self) -> int:
        return len(self.chunk_stages)

    def layer_stages(self, layers: int) -> np.ndarray:
        if layers != len(self.layer_chunks):
            raise StrategyError(f"the placement maps {len(self.layer_chunks)} layers but the model has {layers}; "
                                f"map every layer in Place")
        return np.asarray(self.layer_chunks, dtype=np.int64)

    def chunk_rank_stage(self, chunk: "int | np.ndarray") -> "int | np.ndarray":
        out = np.asarray(self.chunk_stages, dtype=np.int64)[np.asarray(chunk)]
        return int(out) if np.ndim(out) == 0 else out

    def __str__(self) -> str:
        return str(base_strategy(self))


def placed(s: Strategy, layer_chunks: "tuple[int, ...] | list[int]", chunk_stages: "tuple[int, ...] | list[int]") -> Strategy:
    """``s`` with an explicit placement; the plain strategy when the placement is ``s``'s own."""
    b = base_strategy(s)
    lc, cs = tuple(int(x) for x in layer_chunks), tuple(int(x) for x in chunk_stages)
    if len(cs) == b.stages and lc == tuple(int(x) for x in b.layer_stages(len(lc))) \
            and cs == tuple(int(b.chunk_rank_stage(c)) for c in range(b.stages)):
        return b
    return PlacedStrategy(**{f.name: getattr(b, f.name) for f in fields(Strategy)}, layer_chunks=lc,
                          chunk_stages=cs)


def placement_meta(s: Strategy) -> "dict[str, list[int]] | None":
    """What a Program's meta records of ``s``'s placement (None for a plain strategy)."""
    if isinstance(s, PlacedStrategy):
        return {"layer_chunks": list(s.layer_chunks), "chunk_stages": list(s.chunk_stages)}
    return None


def placed_from_meta(s: "Strategy | None", meta: Mapping[str, Any]) -> "Strategy | None":
    """The strategy a Program with ``meta`` runs under (its recorded placement applied)."""
    p = meta.get("placement")
    if s is None or not p:
        return s
    return placed(s, p["layer_chunks"], p["chunk_stages"])


def placement_order(chunk_stages: "tuple[int, ...] | list[int]", m: int, split_backward: bool) -> dict:
    """A deadlock-free order for any placement (``Order`` steps per stage): the list scheduler of
    :mod:`parashift.ir.schedules` with unit costs, each stage holding at most as many micro-batches
    in flight as chunks lie from its first chunk to the last (1F1B's bound for one chunk per stage).
    Without a split backward every input-grad and its weight-grad form one ``B``."""
    from .actions import Action
    from .schedules import _list_schedule
    cs = [int(x) for x in chunk_stages]
    pp = max(cs) + 1
    first = {s: cs.index(s) for s in range(pp)}
    steps = _list_schedule(pp, m, cs, lambda s: len(cs) - first[s], (lambda s: pp - 1) if split_backward
                           else (lambda s: 0), overlap=False)
    if split_backward:
        return steps
    return {s: [tuple(Action(a.chunk, "B", a.mb) if a.type == "I" else a for a in step if a.type != "W")
                for step in ss if any(a.type != "W" for a in step)] for s, ss in steps.items()}
