"""ZeRO-2/3 gradient handling under pipelining: one micro-batch's reduce-scatter into the shard.

The Program allocates a chunk-sized gradient per (chunk, micro-batch) at its first backward
instruction (buffer ``zg.c<c>.m<mb>``) and reduce-scatters it right after its last one
(tag ``dp.grad.c<c>.m<mb>``); :func:`reduce_scatter_microbatch` issues that collective, adds this
rank's part into the gradient shard when it lands and releases the chunk-sized buffer.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..ir.tags import StepBuffer
from .comm import reduce_scatter_flat
from .state import Buffer, StateStore

__all__ = ["reduce_scatter_microbatch", "alloc_grads"]


def reduce_scatter_microbatch(b: Buffer, chunk: int, mb: int, group) -> tuple[Any, Callable[[], None], Any]:
    """(work, then, keep): reduce-scatter micro-batch ``mb``'s gradient of ``chunk`` over the DP
    group; ``then`` accumulates this rank's segment into ``b.grad_shard`` and frees the buffer."""
    grad, shard = b.mb_grad(chunk, mb), b.grad_shard_buffer()
    a = b.chunk_span(chunk)[0]
    segs, L = b.segments(chunk)
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
        b.free_mb_grad(chunk, mb)
    return work, then, (inp, out)


def alloc_grads(store: StateStore, names: tuple[str, ...]) -> None:
    """Allocate the ``zg`` / ``zge`` gradient buffers an instruction's ``alloc`` names (dense and,
    when experts sync with them, expert families for ``zg``; expert families for ``zge``)."""
    for name in names:
        buf = StepBuffer.parse(name)
        for b in store.families("edp" if buf.kind == "zge" else "dp"):
            if b.per_mb and buf.chunk in b.ranges:
                b.alloc_mb_grad(buf.chunk, buf.mb)
