"""User-named streams on GPUs: each runs on a CUDA stream of its own.

A ``Stream(name, ops)`` directive moves collectives to a stream the Program names; the interpreter
already gives every stream its own communicator (the ``Worlds`` channel). On NCCL, :func:`install`
also issues that stream's instructions (and their completions) under a CUDA stream of its own,
so their copies and reductions overlap the compute stream's kernels. The interpreter orders work
on the host; on the GPU the lane first waits for everything the default stream has queued (what
it may read), and an instruction depending on a lane's instruction waits for the CUDA event
recorded when that one completed. Tensors handed between lanes stay referenced by the step state
until the step ends, so the caching allocator does not reuse them early.

Written for GPUs and not exercised on CPU (gloo): there ``install`` does nothing.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

__all__ = ["BUILTIN", "CudaLanes", "install"]

BUILTIN = ("compute", "comm", "p2p")


class CudaLanes:
    """CUDA streams of the user-named streams of one rank, and the events of their instructions."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.lanes: dict[str, Any] = {}
        self.events: dict[int, Any] = {}

    def around(self, stream: str, deps: tuple[int, ...]) -> Any:
        """Context for running an instruction of ``stream`` that depends on instructions ``deps``."""
        here = torch.cuda.current_stream(self.device)
        if stream in BUILTIN:
            for d in deps:
                ev = self.events.get(d)
                if ev is not None:
                    here.wait_event(ev)
            return nullcontext()
        lane = self.lanes.get(stream)
        if lane is None:
            lane = self.lanes[stream] = torch.cuda.Stream(device=self.device)
        lane.wait_stream(here)
        for d in deps:
            ev = self.events.get(d)
            if ev is not None:
                lane.wait_event(ev)
        return torch.cuda.stream(lane)

    def done(self, stream: str, idx: int) -> None:
        """Record that instruction ``idx`` of ``stream`` has been queued to completion."""
        if stream in BUILTIN:
            return
        ev = torch.cuda.Event()
        ev.record(self.lanes[stream])
        self.events[idx] = ev


def install(interp: Any) -> "CudaLanes | None":
    """Route ``interp``'s user-named streams through CUDA lanes (NCCL only); returns the lanes."""
    if not getattr(interp, "nccl", False) or not any(s not in BUILTIN for s in interp.rp.streams):
        return None
    lanes = CudaLanes(interp.device)
    issue, complete = interp._issue, interp._complete

    def _issue(p: Any) -> Any:
        with lanes.around(p.ins.stream, p.deps):
            fl = issue(p)
        if fl is None:
            lanes.done(p.ins.stream, p.idx)
        return fl

    def _complete(fl: Any, err: "BaseException | None") -> None:
        p = fl.prep
        with lanes.around(fl.stream, ()) if p is not None else nullcontext():
            complete(fl, err)
        if p is not None:
            lanes.done(fl.stream, p.idx)

    interp._issue, interp._complete = _issue, _complete
    return lanes
