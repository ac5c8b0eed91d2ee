"""ZeRO-2/3 gradient handling under pipelining: one micro-batch's reduce-scatter into the shard.

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
from ..comm import reduce_scatter_flat
from ..state import Buffer, StateStore

__all__ = ["reduce_scatter_microbatch", "alloc_grads"]


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
