"""A strategy whose pipeline placement is given explicitly (a ``Place`` directive of its own).

:class:`PlacedStrategy` is a :class:`~parashift.strategy.Strategy` whose layer -> chunk map and
chunk -> stage map come from a placement instead of the even split and the schedule's rule, so that
everything reading ``layer_stages`` / ``chunk_rank_stage`` / ``stages`` (the state store, the
interpreter, the tensor layout) follows the placement the Program was compiled with. ``lower``
reads the placement off the placed graph (:func:`graph_placement`), a Program records it in
``meta["placement"]`` and :meth:`Program.from_json` restores it (:func:`placed_from_meta`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, fields
from itertools import compress, repeat
from operator import eq
from typing import Any, Mapping

import numpy as np

from ..errors import StrategyError
from ..strategy import Strategy
from .graph import equals as _equals

__all__ = ["PlacedStrategy", "placed", "placement_meta", "placed_from_meta", "base_strategy", "graph_placement",
           "placement_order"]


def base_strategy(s: Strategy) -> Strategy:
    """The plain Strategy behind ``s`` (the placement dropped)."""
    if type(s) is Strategy:
        return s
    return Strategy(**{f.name: getattr(s, f.name) for f in fields(Strategy)})


@dataclass(frozen=True)
class PlacedStrategy(Strategy):
    """``chunk_starts[c]``: first layer of chunk c (layers are contiguous per chunk; a chunk holding
    only the embedding starts where the next one does); ``chunk_stages[c]``: pipeline stage of chunk c.
    The embedding (layer -1) is in chunk 0, the head (layer == layers) in the last chunk."""

    chunk_starts: tuple[int, ...] = ()
    chunk_stages: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "chunk_starts", tuple(int(x) for x in self.chunk_starts))
        object.__setattr__(self, "chunk_stages", tuple(int(x) for x in self.chunk_stages))
        cs, st = self.chunk_stages, self.chunk_starts
        if not cs or sorted(set(cs)) != list(range(self.pp)):
            raise StrategyError(f"placement chunk->stage {list(cs)} must use every stage 0..{self.pp - 1} "
                                f"(pp={self.pp}); give each stage at least one chunk")
        if len(st) != len(cs) or any(b < a for a, b in zip(st, st[1:])):
            raise StrategyError(f"placement chunk starts {list(st)} must be non-decreasing, one per chunk "
                                f"({len(cs)}): data flows from chunk c to chunk c+1")

    @property
    def stages(self) -> int:
        return len(self.chunk_stages)

    def layer_stages(self, layers: int) -> np.ndarray:
        at = np.searchsorted(np.asarray(self.chunk_starts), np.arange(layers), side="right") - 1
        return np.clip(at, 0, len(self.chunk_starts) - 1).astype(np.int64)

    def chunk_rank_stage(self, chunk: "int | np.ndarray") -> "int | np.ndarray":
        out = np.asarray(self.chunk_stages, dtype=np.int64)[np.asarray(chunk)]
        return int(out) if np.ndim(out) == 0 else out

    def num_microbatches(self, global_batch: int) -> int:
        """As the plain strategy's, without its schedule label's micro-batch rules (the order is the
        placement's own, not that schedule's recipe)."""
        return base_strategy(self).replace(vpp=1, schedule="1f1b").num_microbatches(global_batch)

    def __str__(self) -> str:
        return str(base_strategy(self))


def placed(s: Strategy, layer_chunks: "tuple[int, ...] | list[int]", chunk_stages: "tuple[int, ...] | list[int]") -> Strategy:
    """``s`` with an explicit placement; the plain strategy when the placement is ``s``'s own."""
    lc, cs = [int(x) for x in layer_chunks], tuple(int(x) for x in chunk_stages)
    if any(b < a for a, b in zip(lc, lc[1:])):
        raise StrategyError(f"placement layer->chunk {lc} must be non-decreasing (data flows from chunk c to c+1)")
    starts = tuple(int(x) for x in np.searchsorted(np.asarray(lc, dtype=np.int64), np.arange(len(cs))))
    return _placed(s, starts, cs, len(lc))


def _placed(s: Strategy, starts: tuple[int, ...], cs: tuple[int, ...], layers: int) -> Strategy:
    b = base_strategy(s)
    p = PlacedStrategy(**{f.name: getattr(b, f.name) for f in fields(Strategy)}, chunk_starts=starts,
                       chunk_stages=cs)
    if len(cs) == b.stages and cs == tuple(int(b.chunk_rank_stage(c)) for c in range(b.stages)) \
            and np.array_equal(p.layer_stages(layers), b.layer_stages(layers)):
        return b
    return p


def placement_meta(s: Strategy) -> "dict[str, list[int]] | None":
    """What a Program's meta records of ``s``'s placement (None for a plain strategy)."""
    if isinstance(s, PlacedStrategy):
        return {"chunk_starts": list(s.chunk_starts), "chunk_stages": list(s.chunk_stages)}
    return None


def placed_from_meta(s: "Strategy | None", meta: Mapping[str, Any]) -> "Strategy | None":
    """The strategy a Program with ``meta`` runs under (its recorded placement applied)."""
    p = meta.get("placement")
    if s is None or not p:
        return s
    b = base_strategy(s)
    return PlacedStrategy(**{f.name: getattr(b, f.name) for f in fields(Strategy)},
                          chunk_starts=tuple(p["chunk_starts"]), chunk_stages=tuple(p["chunk_stages"]))


_LAYER = re.compile(r"(?:^|\.|\+)layers\.(\d+)(?:-(\d+))?")


def graph_placement(g: Any, s: Strategy, *, compute: "np.ndarray | None" = None, stage: "np.ndarray | None" = None,
                    chunk: "np.ndarray | None" = None) -> Strategy:
    """The strategy a placed graph runs under: ``s`` when its chunks sit where ``s`` puts them, else
    ``s`` with the graph's placement (what the runtime must follow). A PlacedStrategy is kept.
    ``compute``, ``stage``, ``chunk``: the graph's compute mask and stage and chunk columns (int64, -1
    for None) where the caller has them."""
    if isinstance(s, PlacedStrategy):
        return s
    c = g.cols
    n = len(c["op"])
    stage_col, ch = stage, chunk
    if ch is None:
        ch = np.asarray(c["chunk"])
        if ch.dtype.kind != "i":                # a None chunk: unplaced
            ch = np.fromiter((-1 if x is None else x for x in c["chunk"]), np.int64, n)
    comp = (_equals(c["op"], "compute") if compute is None else compute) & (ch >= 0)
    comp[comp] = ~_equals(list(compress(c["phase"], comp.tobytes())), "optim")
    idx = np.flatnonzero(comp)
    picked = comp.tobytes()
    stage: dict[int, int] = {}
    first: dict[int, int] = {}
    top = -1
    if len(idx):
        chs = ch[idx].astype(np.int64)
        layer = np.fromiter(compress(c["layer"], picked), np.int64, len(idx))
        head = np.flatnonzero(np.concatenate(([True], chs[1:] != chs[:-1])))      # runs of one chunk
        uch, seen = np.unique(chs[head], return_index=True)
        seen = head[seen]
        stages = np.asarray(c["stage"], np.int64)[idx[seen]] if stage_col is None else stage_col[idx[seen]]
        stage = dict(zip(uch.tolist(), stages.tolist()))
        low = np.full(int(uch[-1]) + 1, np.iinfo(np.int64).max)
        np.minimum.at(low, chs[layer >= 0], layer[layer >= 0])
        first = {k: v for k, v in enumerate(low.tolist()) if v != np.iinfo(np.int64).max}
        for region in set(compress(c["region"], picked)):   # the highest layer any region names (-1: none)
            top = max(top, max((int(m.group(2) or m.group(1)) for m in _LAYER.finditer(region or "")), default=-1))
        head = np.fromiter(map(eq, compress(c["kind"], picked), repeat("head")), bool, len(idx))
        if head.any():
            top = max(top, int(layer[head].max()) - 1)
    if not stage:
        return s
    chunks = max(stage) + 1
    if sorted(stage) != list(range(chunks)):
        return s
    layers = max(top + 1, max(first.values(), default=0))
    starts = [first.get(ch) for ch in range(chunks)]
    nxt = layers
    for ch in reversed(range(chunks)):      # a chunk with no body layer starts where the next one does
        starts[ch] = nxt if starts[ch] is None else starts[ch]
        nxt = starts[ch]
    starts[0] = 0                           # chunk 0 holds the embedding and the layers before chunk 1's
    cs = tuple(stage[ch] for ch in range(chunks))
    if sorted(set(cs)) != list(range(s.pp)) or any(b < a for a, b in zip(starts, starts[1:])):
        return s
    return _placed(s, tuple(int(x) for x in starts), cs, layers)


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
