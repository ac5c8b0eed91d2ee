"""Expert parallelism in the runtime: the handler of the Program's ``ep.*`` all-to-alls.

The forward's dispatch first exchanges the per-expert token counts (a blocking all-to-all) and keeps
the split sizes for the layer's other three exchanges: the combine sends expert outputs back to the
tokens' owners, and the backward runs both the other way round.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..comm import Flight, a2a
from ..prepared import Prepared

__all__ = ["exchange"]


def exchange(it: Any, p: Prepared) -> Flight:
    """An MoE layer's all-to-all (``ep.*``): dispatch or combine, forward or backward."""
    ins, stream, g, tag = p.ins, p.ins.stream, p.group, p.tag
    c, mb, which, phase = ins.chunk, tag.mb, tag.which.value, tag.phase
    env, genv = it.st.e(c, mb), it.st.g(c, mb)
    skey = f"moe.splits.{tag.layer}"
    if phase == "fwd" and which == "dispatch":
        counts = env["moe.counts"]
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts.contiguous(), group=g)
        ins_, outs = counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        env[skey] = (ins_, outs)
        work, out = a2a(env["moe.xs"], ins_, outs, g)

        def then_d() -> None:
            env["moe.xr"], env["moe.recv_counts"] = out, recv_counts
        return Flight(ins, stream, [work], then=then_d, keep=env["moe.xs"])
    sends, recvs = env[skey]
    if phase == "fwd":            # combine: expert outputs go back to the tokens' owners
        src, dst, box, i_s, o_s = "moe.yr", "moe.ys", env, recvs, sends
    elif which == "combine":      # bwd of combine: output grads travel like the dispatch
        src, dst, box, i_s, o_s = "moe.ys", "moe.yr", genv, sends, recvs
    else:                         # bwd of dispatch: input grads travel like the combine
        src, dst, box, i_s, o_s = "moe.xr", "moe.xs", genv, recvs, sends
    t = box.pop(src)
    work, out = a2a(t, i_s, o_s, g)

    def then() -> None:
        box[dst] = out
    return Flight(ins, stream, [work], then=then, keep=t)
