"""ZeRO in the runtime: ZeRO-3's parameter gathers and ZeRO-2/3 gradient buckets under pipelining.

A ``z3.*`` all-gather (:func:`gather_params`) fills a named copy of a chunk's (or one region's)
parameters from every rank's shard, which the compute that uses it selects and the Program frees.

The Program allocates each micro-batch's gradient bucket (one region's parameters, or a chunk's)
at its first backward instruction (buffer ``zg.c<c>.m<mb>[.<region>]``) and reduce-scatters it right
after its last one (tag ``dp.grad.c<c>.m<mb>[.<region>]``); :func:`reduce_scatter_microbatch`
issues that collective, adds this rank's part into the gradient shard when it lands and releases
the bucket.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ...ir.tags import StepBuffer
from ..comm import Flight, all_gather, reduce_scatter_flat
from ..prepared import Prepared
from ..state import Buffer, StateStore

__all__ = ["reduce_scatter_microbatch", "alloc_grads", "gather_params"]


def reduce_scatter_microbatch(b: Buffer, chunk: int, mb: int, region: str | None, group
                              ) -> tuple[Any, Callable[[], None], Any]:
    """(work, then, keep): reduce-scatter micro-batch ``mb``'s gradient bucket ``region`` (None: the
    chunk's) over the DP group; ``then`` adds this rank's segment into ``b.grad_shard`` and frees the bucket."""
    (a, grad), shard = b.bucket(chunk, mb, region), b.grad_shard_buffer()
    segs, L = b.segments(chunk, (a, a + grad.numel()))
    if all(hi - lo == b.q for lo, hi in segs):        # the chunk spans the buffer: shards line up
        inp = grad
    else:
        inp = torch.zeros(b.n * L, dtype=grad.dtype, device=grad.device)
        for i, (lo, hi) in enumerate(segs):
            inp[i * L:i * L + hi - lo] = grad[lo - a:hi - a]
    out = torch.empty(L, dtype=grad.dtype, device=grad.device)
    work = reduce_scatter_flat(out, inp, group=group, async_op=True)
    lo, hi = segs[b.index]

    def then() -> None:
        shard[lo - b.lo:hi - b.lo] += out[:hi - lo]
        b.free_mb_grad(chunk, mb, region)
    return work, then, (inp, out)


def alloc_grads(store: StateStore, names: tuple[str, ...]) -> None:
    """Allocate the ``zg`` / ``zge`` gradient buffers an instruction's ``alloc`` names (dense and,
    when experts sync with them, expert families for ``zg``; expert families for ``zge``)."""
    for name in names:
        buf = StepBuffer.parse(name)
        for b in store.families("edp" if buf.kind == "zge" else "dp"):
            if b.per_mb and buf.chunk in b.ranges:
                b.alloc_mb_grad(buf.chunk, buf.mb, buf.region)


def gather_params(it: Any, p: Prepared) -> Flight:
    """ZeRO-3 (``z3.*``): all-gather a chunk's (or the tag's region's) parameters, dense or expert, into
    the copy ``z3.c<chunk>.<phase>.m<mb>[.<region>]``."""
    ins, stream, g, tag = p.ins, p.ins.stream, p.group, p.tag
    c, region = tag.chunk, tag.region
    name = f"z3.c{c}.{tag.phase}.m{tag.mb}" + ("" if region is None else f".{region}")
    works, thens, keep = [], [], []
    for b in it.store.families("edp" if tag.expert else "dp"):
        if c not in b.ranges:
            continue
        copy = b.new_copy(c, name, region)
        w, then, k = all_gather(b, c, g, copy, b.param, base=b.bucket_span(c, region)[0],
                                span=None if region is None else b.bucket_span(c, region))
        works.append(w)
        thens.append(then)
        keep.append(k)
    return Flight(ins, stream, [w for w in works if w is not None], then=lambda: [f() for f in thens],
                  keep=keep)


class LiveTensors:
    """Activation bytes one rank holds: the distinct tensors (by data pointer) that the live
    regions keep for their backward, each counted once however many regions share it (a block's
    output is the next block's input)."""

    def __init__(self) -> None:
        self.count: dict[int, list[int]] = {}          # data pointer -> [bytes, regions holding it]
        self.held: dict[tuple, list[int]] = {}         # region key -> its data pointers
        self.total = 0

    def hold(self, key: tuple, objs: list) -> int:
        """(Re)account what region ``key`` keeps; returns the rank's total."""
        self.release(key)
        ptrs: dict[int, int] = {}
        stack, tensor = list(objs), torch.Tensor
        while stack:
            o = stack.pop()
            if isinstance(o, tensor):
                p = o.data_ptr()
                if p not in ptrs:
                    ptrs[p] = o.nbytes
            elif isinstance(o, dict):
                stack.extend(o.values())
            elif isinstance(o, (list, tuple)):
                stack.extend(o)
        count, total = self.count, self.total
        for p, n in ptrs.items():
            cell = count.get(p)
            if cell is None:
                count[p] = [n, 1]
                total += n
            else:
                cell[1] += 1
        self.total = total
        self.held[key] = list(ptrs)
        return total

    def release(self, key: tuple) -> int:
        for p in self.held.pop(key, ()):
            cell = self.count[p]
            cell[1] -= 1
            if cell[1] == 0:
                self.total -= cell[0]
                del self.count[p]
        return self.total
