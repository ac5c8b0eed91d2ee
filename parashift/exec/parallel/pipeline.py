"""Pipeline parallelism in the runtime: the Program's point-to-point sends and receives between stages.

A send takes its chunk's output activation (or input gradient) from the step's mailbox; a receive is
posted into a buffer allocated once at load (:attr:`..prepared.Prepared.buf`) and lands in the
mailbox when it completes. Both use the ``p2p`` world, whose group rank is the global rank.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ...ir.tags import Payload
from ..comm import Flight
from ..prepared import Prepared

__all__ = ["send", "post_recv"]


def send(it: Any, p: Prepared) -> Flight:
    """Send a chunk's output activation or input gradient to the neighbouring stage."""
    tag, ins = p.tag, p.ins
    box = it.st.act if tag.payload is Payload.ACT else it.st.gout
    t = box.pop((tag.chunk, tag.mb)).contiguous()
    kw = {} if it.nccl else {"tag": p.itag}
    return Flight(ins, ins.stream, [dist.isend(t, group_dst=p.peer, group=p.group, **kw)], keep=t, prep=p)


def post_recv(it: Any, p: Prepared) -> Flight:
    """Post a receive into its reusable buffer; it lands in the step's mailbox when it completes."""
    tag, buf = p.tag, p.buf
    box = it.st.act if tag.payload is Payload.ACT else it.st.gout
    kw = {} if it.nccl else {"tag": p.itag}
    work = dist.irecv(buf, group_src=p.peer, group=p.group, **kw)
    key = (tag.chunk, tag.mb)

    def then() -> None:
        box[key] = buf
    fl = Flight(p.ins, p.ins.stream, [work], then=then, prep=p)
    fl.t0 = it.clock.stamp()
    return fl
