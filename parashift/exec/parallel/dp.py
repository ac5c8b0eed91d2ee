"""Data parallelism in the runtime: the handler of the Program's ``dp.*`` synchronizations.

A gradient sync all-reduces a chunk's gradients over its DP (or expert-DP) group, or under ZeRO
reduce-scatters them into this rank's shard (a whole chunk, or one micro-batch's bucket:
:func:`.zero.reduce_scatter_microbatch`); under hybrid sharding the replicas then sum their shard.
A parameter sync (ZeRO-1/2) all-gathers the updated shards back into the full parameters.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..comm import Flight, all_gather, reduce_scatter
from ..prepared import Prepared
from .zero import reduce_scatter_microbatch

__all__ = ["sync"]


def sync(it: Any, p: Prepared) -> Flight:
    """A DP synchronization (``dp.*``) of one chunk over every state family of the tag's axis."""
    ins, stream, g, tag = p.ins, p.ins.stream, p.group, p.tag
    what, c = tag.what.value, tag.chunk
    works, thens, keep = [], [], []
    for b in it.store.families(tag.axis.value):
        if c not in b.ranges:
            continue
        if what == "grad" and ins.op == "all_reduce":
            a, e = b.ranges[c]
            works.append(dist.all_reduce(b.grad_buffer()[a:e], group=g, async_op=True))
        elif what == "replica":          # hybrid sharding: the chunk's part of the shard, summed over replicas
            if b.n == 1:
                a, e = b.ranges[c]
                works.append(dist.all_reduce(b.grad_buffer()[a:e], group=g, async_op=True))
                continue
            lo, hi = b.segments(c)[0][b.index]
            if hi > lo:                  # the replicas hold the same shard: the same segment, or none
                works.append(dist.all_reduce(b.grad_shard_buffer()[lo - b.lo:hi - b.lo], group=g,
                                             async_op=True))
        elif what == "grad":
            mb = tag.mb
            w, then, k = reduce_scatter(b, c, g) if mb is None else \
                reduce_scatter_microbatch(b, c, mb, tag.region, g)
            works.append(w)
            thens.append(then)
            keep.append(k)
        elif what == "param":
            # overlap_param gathers a region (tag region) while the step's forward runs: written
            # through .data, whose version counter is its own, so the earlier regions' saved
            # views of the same buffer stay valid for their backward (the ranges are disjoint)
            w, then, k = all_gather(b, c, g, b.param.data, b.param_shard(), base=0,
                                    span=None if tag.region is None else b.bucket_span(c, tag.region))
            works.append(w)
            thens.append(then)
            keep.append(k)
        else:
            raise RuntimeError(f"unknown DP payload {what!r}")
    return Flight(ins, stream, [w for w in works if w is not None], then=lambda: [f() for f in thens],
                  keep=keep)
