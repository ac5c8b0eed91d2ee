"""Compile a traced user model (a single-device region graph from ``annotate.trace``) into a Program.

Supports data parallelism with ZeRO 0-3, pipeline parallelism (any schedule, vpp), recomputation,
``overlap_grad`` and ``overlap_param`` (a chunk is the bucket: one gradient reduction, and one
parameter gather before its first forward, per chunk, so they hide communication only where a stage
holds several chunks) and custom orders; tensor and expert parallelism need to know how a region
shards, which only the preset transformers describe, so ``tp`` and ``ep`` must be 1. Trace the model
with ONE micro-batch's input (``mbs`` sequences): the graph's FLOPs and bytes are taken per
micro-batch. Parameters are assumed to train in their traced dtype with fp32 AdamW moments (no
master copy when fp32).

Regions map to pipeline chunks by layer: regions named ``layers.{i}.*`` (or tagged ``layer=i``) form
layer i; ``embed`` regions go to the first chunk and ``head`` regions to the last; without layer
names every other region is its own layer, in order. A ``Place`` directive (``directives=``, see
:mod:`parashift.ir.user_directives`) maps regions to chunks and stages instead; where it splits a
layer, every region becomes its own layer (in chunk, then model order) and the Program's strategy
carries the placement (:class:`~parashift.ir.placement.PlacedStrategy`). ``StepMeta.regions`` records
every region's chunk, which the runtime cuts the model by.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..errors import ProgramError, StrategyError
from ..strategy import Strategy
from .directives import Fuse, Order, Place, Recompute, Replicate, Split, apply_all
from .graph import Graph
from .memory import OPTIM_FLOPS_PER_ELEMENT
from .program import Program
from .scheduler import lower
from .step_meta import StepMeta
from .placement import placed, placement_order
from .recipe import check_size
from .schedules import get_schedule, schedule_order, split_backward
from .user_directives import format_directives, resolve

__all__ = ["compile_graph"]


def _layers(g: Graph) -> Graph:
    """Renumber layers 0..L-1 (embed -1, head L)."""
    out = g.copy()
    c = out.cols
    body = [i for i in range(len(out)) if c["kind"][i] not in ("embed", "head")]
    named = sorted({c["layer"][i] for i in body if c["layer"][i] >= 0})
    if named and all(c["layer"][i] >= 0 for i in body):
        remap = {v: k for k, v in enumerate(named)}
        for i in body:
            c["layer"][i] = remap[c["layer"][i]]
        n = len(named)
    else:
        order = out.topo_order()
        pos = {int(i): k for k, i in enumerate(i for i in order if int(i) in set(body))}
        for i in body:
            c["layer"][i] = pos[i]
        n = len(body)
    for i in range(len(out)):
        if c["kind"][i] == "embed":
            c["layer"][i] = -1
        elif c["kind"][i] == "head":
            c["layer"][i] = n
    return out


def _region_order(g: Graph) -> list[int]:
    """Nodes in model order (topological; ties by trace order)."""
    return [int(i) for i in g.topo_order()]


def compile_graph(graph: Graph, strategy: "str | Strategy" = "dp=1", *, global_batch: int, name: str = "custom",
                  order: "Order | Callable[[Strategy, int], Order] | None" = None, directives: Sequence = (),
                  validate: bool = False) -> Program:
    """Program for a traced single-device region graph (see module docstring).

    ``directives``: the user's directives on regions (:mod:`parashift.ir.user_directives`); they
    refine ``strategy`` (Place sets pp and the placement, Split the micro-batches, Replicate/Shard dp,
    the ZeRO level, overlap_grad and overlap_param, Recompute, Order the order, Stream the streams of
    collectives)."""
    base = Strategy.parse(strategy)
    if base.tp > 1 or base.ep > 1 or base.cp > 1:
        raise StrategyError(f"a traced model runs with dp, pp, vpp, zero, any schedule and recompute; tp={base.tp}, "
                            f"ep={base.ep}, cp={base.cp} need a preset model (parashift.models) that says how regions "
                            f"shard")
    if not len(graph) or any(p != "fwd" for p in graph.col("phase")) or any(m != -1 for m in graph.col("mb")):
        raise ProgramError("compile_graph needs a single-device forward graph from parashift.ir.annotate.trace")
    g = _layers(graph)
    c = g.cols
    model_order = _region_order(g)
    names = [c["region"][i] for i in model_order]
    res = resolve(directives, base, names, global_batch=global_batch,
                  param_regions=[c["region"][i] for i in model_order if c["params"][i]])
    s, m = res.strategy, res.microbatches
    check_size(len(g), m, s, global_batch)
    if res.order is not None and order is not None:
        raise ProgramError(f"an Order directive and order= both give the order; keep one ({res.order})")
    order = res.order if res.order is not None else order
    if callable(order) and not isinstance(order, Order):
        order = order(s, m)
    if res.region_chunk is None:
        layers = max(c["layer"]) if any(k == "head" for k in c["kind"]) else max(c["layer"]) + 1
        if s.stages > max(layers, 1):
            raise StrategyError(f"pp*vpp={s.stages} exceeds the {layers} layers of the traced model; lower pp or vpp")
        layer_chunk = tuple(int(x) for x in s.layer_stages(max(layers, 1)))
        chunk_stage = tuple(int(s.chunk_rank_stage(ch)) for ch in range(s.stages))
        run = s
    else:
        layer_chunk = _by_layer(g, res.region_chunk, len(res.chunk_stages))
        if layer_chunk is None:
            g, layer_chunk = _place_regions(g, res.region_chunk, model_order, directives)
            c = g.cols
        chunk_stage = tuple(res.chunk_stages)
        run = placed(s, layer_chunk, chunk_stage)
    chunks = len(chunk_stage)
    node_chunk = [0 if L < 0 else chunks - 1 if L >= len(layer_chunk) else layer_chunk[L] for L in c["layer"]]
    chunk_bytes = np.bincount(node_chunk, weights=c["params"], minlength=chunks).astype(np.int64)
    stage_bytes = np.bincount(np.asarray(chunk_stage), weights=chunk_bytes, minlength=s.pp).astype(np.int64)
    z = s.zero_stage
    shard = (lambda b, sharded: -(-int(b) // s.zero_ways) if sharded else int(b))
    elems = [int(b) // 4 for b in stage_bytes]
    mem = [{"param": shard(b, z.shards_params), "grad": shard(b, z.shards_grads), "master": 0,
            "optim": shard(2 * b, z.shards_optim)} for b in stage_bytes]
    opt = tuple((OPTIM_FLOPS_PER_ELEMENT * shard(e, z.shards_optim), shard(e, z.shards_optim) * 16) for e in elems)
    act_msg = int(max(c["act"][i] for i in range(len(g)) if c["kind"][i] != "head") if len(g) > 1 else c["act"][0])
    split = split_backward(s.schedule) or res.split_backward
    if order is None:
        if run is s and split == split_backward(s.schedule):
            order = schedule_order(s, m)
        else:
            order = Order(placement_order(chunk_stage, m, split))
    vshape = run is s and get_schedule(s.schedule).vshape
    steps: list = [Split(microbatches=m)]
    if split:
        steps.append(Split(backward=True))
    steps += [
        Place(layer_chunk, chunk_stage, act_msg, opt, vshape=vshape),
        Recompute(s.recompute, 0.0, {}),
        Replicate(s.zero_ways, s.zero, tuple(int(x) for x in chunk_bytes), (0,) * chunks,
                  tuple(int(x) for x in chunk_bytes), (0,) * chunks, axis=s.zero_axis,
                  overlap=s.overlap_grad, replicas=s.dp_replicas, overlap_param=s.overlap_param),
        *res.streams,
        order,
        Fuse(),
    ]
    dist = apply_all(g, steps)
    region_chunk = {c["region"][i]: int(node_chunk[i]) for i in range(len(g))}
    meta = StepMeta.build(None, s, global_batch=global_batch, seq_len=None, microbatches=m, name=name,
                          regions=region_chunk, chunk_stages=tuple(chunk_stage),
                          directives=format_directives(list(directives)) if directives else None).encode()
    prog = lower(dist, run, static_memory=mem, meta=meta)
    if validate:
        prog.validate()
    return prog


def _by_layer(g: Graph, region_chunk: dict[str, int], chunks: int) -> "tuple[int, ...] | None":
    """The layer -> chunk map of a region placement that keeps layers whole (embedding in chunk 0,
    head in the last; every layer on one chunk, in order), else None."""
    c = g.cols
    of: dict[int, set] = {}
    for i in range(len(g)):
        ch, kind = region_chunk[c["region"][i]], c["kind"][i]
        if (kind == "embed" and ch != 0) or (kind == "head" and ch != chunks - 1):
            return None
        if kind not in ("embed", "head"):
            of.setdefault(c["layer"][i], set()).add(ch)
    if sorted(of) != list(range(len(of))) or any(len(v) != 1 for v in of.values()):
        return None
    out = tuple(next(iter(of[k])) for k in range(len(of)))
    return out if all(b >= a for a, b in zip(out, out[1:])) else None


def _place_regions(g: Graph, region_chunk: dict[str, int], model_order: list[int],
                   directives: Sequence) -> tuple[Graph, tuple[int, ...]]:
    """Give every region its own layer, in (chunk, model) order, so that a layer -> chunk map places it."""
    c = g.cols
    chunk = [region_chunk[r] for r in c["region"]]
    for u, v in zip(g.src, g.dst):
        if chunk[v] < chunk[u]:
            place = next((d for d in directives if type(d).__name__ == "Place"), "Place")
            raise ProgramError(f"{place} sends data backwards: region {c['region'][u]!r} (chunk {chunk[u]}) feeds "
                               f"region {c['region'][v]!r} (chunk {chunk[v]}); a region's chunk must not be "
                               f"before the chunks of the regions it reads")
    rank = {i: k for k, i in enumerate(model_order)}
    seq = sorted(range(len(g)), key=lambda i: (chunk[i], rank[i]))
    out = g.copy()
    for k, i in enumerate(seq):
        out.cols["layer"][i] = k
    return out, tuple(chunk[i] for i in seq)
