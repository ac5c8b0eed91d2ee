"""User-named streams: each runs on a stream of its own (:mod:`.streams`).

A ``Stream(name, ops)`` directive moves collectives to a stream the Program names; the interpreter
already gives every stream its own communicator (the ``Worlds`` channel). :func:`install` also
issues that stream's instructions (and their completions) on a stream of their own: on a GPU a
CUDA stream, so their copies and reductions overlap the compute stream's kernels; on CPU the
streams' CPU twin (work in issue order: the same calls, nothing to wait for). The interpreter
orders work on the host; on the device a lane first waits for everything the current stream has
queued (what it may read), and an instruction depending on a lane's instruction waits for the
event recorded when that one completed. The built-in streams (``compute``, ``comm``, ``p2p``) run
on the device's current stream (NCCL runs each communicator's collectives on a stream of its own
and orders it against the issuing stream). Tensors handed between lanes stay referenced by the
step state until the step ends, so the caching allocator does not reuse them early.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any

from .streams import Streams, backend_for

__all__ = ["BUILTIN", "Lanes", "install"]

BUILTIN = ("compute", "comm", "p2p")


class Lanes:
    """The streams of the user-named streams of one rank, and the events of their instructions."""

    def __init__(self, streams: Streams) -> None:
        self.streams = streams

    def around(self, stream: str, deps: tuple[int, ...]) -> Any:
        """Context for running an instruction of ``stream`` that depends on instructions ``deps``."""
        return self.streams.enter(stream, deps, after_current=True)

    def done(self, stream: str, idx: int) -> None:
        """Record that instruction ``idx`` of ``stream`` has been queued to completion."""
        if self.streams.own(stream):
            self.streams.mark(stream, idx)


def install(interp: Any, backend: Any = None) -> "Lanes | None":
    """Route ``interp``'s user-named streams through lanes (``backend``: default the interpreter's
    device's, :func:`.streams.backend_for`); returns the lanes, None when the Program names no
    stream of its own."""
    if not any(s not in BUILTIN for s in interp.rp.streams):
        return None
    lanes = Lanes(Streams(backend if backend is not None else backend_for(interp.device), default=BUILTIN))
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
