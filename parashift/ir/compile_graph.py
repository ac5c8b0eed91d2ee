"""Compile a traced user model (a single-device region graph from ``annotate.trace``) into a Program.

Supports data parallelism with ZeRO 0-3, pipeline parallelism (any schedule, vpp), recomputation and
custom orders; tensor and expert parallelism need to know how a region shards, which only the
preset transformers describe, so ``tp`` and ``ep`` must be 1. Trace the model with ONE micro-batch's
input (``mbs`` sequences): the graph's FLOPs and bytes are taken per micro-batch. Parameters are
assumed to train in their traced dtype with fp32 AdamW moments (no master copy when fp32).

Regions map to pipeline chunks by layer: regions named ``layers.{i}.*`` (or tagged ``layer=i``) form
layer i; ``embed`` regions go to the first chunk and ``head`` regions to the last; without layer
names every other region is its own layer, in order.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ..errors import ProgramError, StrategyError
from ..strategy import Strategy
from .directives import Fuse, Order, Place, Recompute, Replicate, Split, apply_all
from .graph import Graph
from .memory import OPTIM_FLOPS_PER_ELEMENT
from .program import Program
from .scheduler import lower
from .schedules import get_schedule, schedule_order, split_backward

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


def compile_graph(graph: Graph, strategy: "str | Strategy", *, global_batch: int, name: str = "custom",
                  order: "Order | Callable[[Strategy, int], Order] | None" = None, validate: bool = False) -> Program:
    """Program for a traced single-device region graph (see module docstring)."""
    s = Strategy.parse(strategy)
    if s.tp > 1 or s.ep > 1 or s.cp > 1:
        raise StrategyError(f"a traced model runs with dp, pp, vpp, zero, any schedule and recompute; tp={s.tp}, "
                            f"ep={s.ep}, cp={s.cp} need a preset model (parashift.models) that says how regions shard")
    if not len(graph) or any(p != "fwd" for p in graph.col("phase")) or any(m != -1 for m in graph.col("mb")):
        raise ProgramError("compile_graph needs a single-device forward graph from parashift.ir.annotate.trace")
    g = _layers(graph)
    c = g.cols
    layers = max(c["layer"]) if any(k == "head" for k in c["kind"]) else max(c["layer"]) + 1
    if s.stages > max(layers, 1):
        raise StrategyError(f"pp*vpp={s.stages} exceeds the {layers} layers of the traced model; lower pp or vpp")
    m = s.num_microbatches(global_batch)
    if callable(order) and not isinstance(order, Order):
        order = order(s, m)
    layer_chunk = tuple(int(x) for x in s.layer_stages(max(layers, 1)))
    chunk_stage = tuple(int(s.chunk_rank_stage(ch)) for ch in range(s.stages))
    chunk_bytes = np.zeros(s.stages, np.int64)
    for i in range(len(g)):
        L = c["layer"][i]
        ch = 0 if L < 0 else s.stages - 1 if L >= len(layer_chunk) else layer_chunk[L]
        chunk_bytes[ch] += c["params"][i]
    stage_bytes = np.bincount(np.asarray(chunk_stage), weights=chunk_bytes, minlength=s.pp).astype(np.int64)
    shard = (lambda b, lvl: -(-int(b) // s.dp) if s.zero >= lvl else int(b))
    elems = [int(b) // 4 for b in stage_bytes]
    mem = [{"param": shard(b, 3), "grad": shard(b, 2), "master": 0, "optim": shard(2 * b, 1)} for b in stage_bytes]
    opt = tuple((OPTIM_FLOPS_PER_ELEMENT * shard(e, 1), shard(e, 1) * 16) for e in elems)
    act_msg = int(max(c["act"][i] for i in range(len(g)) if c["kind"][i] != "head") if len(g) > 1 else c["act"][0])
    steps: list = [Split(microbatches=m)]
    if split_backward(s.schedule):
        steps.append(Split(backward=True))
    steps += [
        Place(layer_chunk, chunk_stage, act_msg, opt, vshape=get_schedule(s.schedule).vshape),
        Recompute(s.recompute, 0.0, {}),
        Replicate(s.dp, s.zero, tuple(int(x) for x in chunk_bytes), (0,) * s.stages,
                  tuple(int(x) for x in chunk_bytes), (0,) * s.stages),
        order if order is not None else schedule_order(s, m),
        Fuse(),
    ]
    dist = apply_all(g, steps)
    meta = {"model": name, "strategy": str(s), "schedule": s.schedule, "global_batch": int(global_batch),
            "seq_len": None, "microbatches": m, "mbs": s.mbs, "kind": "train_step"}
    prog = lower(dist, s, static_memory=mem, meta=meta)
    if validate:
        prog.validate()
    return prog
