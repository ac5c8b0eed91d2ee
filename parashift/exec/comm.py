"""Asynchronous communication for the interpreter: in-flight instructions and their completion,
and the collectives on flat-buffer chunk ranges (ZeRO shards) and all-to-all splits."""
from __future__ import annotations

import datetime
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..errors import RuntimeFailure
from ..ir.program import Instr

__all__ = ["Flight", "Poller", "a2a", "all_gather", "reduce_scatter", "all_gather_flat", "reduce_scatter_flat"]

#: Flat-tensor collectives (torch >= 2.10 names, older names before).
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


#: ops whose gloo works complete only through ``wait`` (``is_completed`` stays false)
_WAIT_ONLY_GLOO = frozenset(("send", "recv", "reduce_scatter"))


@dataclass
class Flight:
    """One issued communication instruction: its work handles and what to do when they finish."""

    instr: Instr
    stream: str
    works: list
    then: Callable[[], Any] | None = None
    keep: Any = None           # tensors that must live until the works complete
    t0: Any = 0.0              # profiling stamp at issue (see .streams)
    finished: bool | None = None   # set by a helper thread for works that cannot be polled
    error: BaseException | None = None
    prep: Any = None               # the interpreter's prepared instruction


class Poller:
    """Tracks in-flight instructions and reports the finished ones.

    Collectives are polled (``Work.is_completed``); gloo send/recv and gloo reduce-scatters (torch's
    gloo reduce-scatter is an all-reduce behind a work that never reports completion by polling), which
    only complete through ``wait``, are waited on by pooled helper threads: each as it is submitted (``eager``), or only
    when the caller must wait for whichever finishes first. ``wait(timeout)`` blocks until at
    least one instruction finishes: directly on the handle when a single instruction is in flight,
    otherwise on a condition the helpers notify.
    """

    def __init__(self, gloo: bool, pool: ThreadPoolExecutor | None = None, wait_only: bool = False,
                 eager: bool = True, interrupt: Callable[[], bool] | None = None) -> None:
        self.interrupt = interrupt     # polled while waiting: true raises RuntimeFailure (a lost host, :mod:`.job.recover`)
        self.flights: list[Flight] = []
        self.gloo = gloo
        self.wait_only = wait_only     # backends whose works never report completion by polling (fake)
        self.eager = eager
        self.cond = threading.Condition()
        self.pool, self.own_pool = pool, pool is None

    def _needs_helper(self, fl: Flight) -> bool:
        return (self.gloo and fl.instr.op in _WAIT_ONLY_GLOO) or self.wait_only

    def submit(self, fl: Flight) -> None:
        self.flights.append(fl)
        if self._needs_helper(fl) and (self.eager or self.wait_only):
            self._watch(fl)

    def _watch(self, fl: Flight) -> None:
        fl.finished = False
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="parashift-p2p")
        self.pool.submit(self._wait_p2p, fl)

    def _wait_p2p(self, fl: Flight) -> None:
        err = None
        try:
            for w in fl.works:
                w.wait()
        except BaseException as e:  # noqa: BLE001 - handed to the interpreter
            err = e
        with self.cond:
            fl.finished, fl.error = True, err
            self.cond.notify_all()

    def _done(self, fl: Flight) -> bool:
        if fl.finished is not None:
            return fl.finished
        if self.gloo and fl.instr.op in _WAIT_ONLY_GLOO:
            return False                 # unwatched: only a wait on it tells
        return all(w.is_completed() for w in fl.works)

    def _finish(self, fl: Flight) -> tuple[Flight, BaseException | None]:
        self.flights.remove(fl)
        if fl.finished is not None:
            return fl, fl.error
        try:
            for w in fl.works:
                w.wait()                        # surfaces a failed work's error
        except BaseException as e:  # noqa: BLE001 - handed to the interpreter
            return fl, e
        return fl, None

    def ready(self) -> list[tuple[Flight, BaseException | None]]:
        return [self._finish(fl) for fl in [f for f in self.flights if self._done(f)]]

    def wait(self, timeout: float, root: Flight | None = None) -> list[tuple[Flight, BaseException | None]]:
        """Block until some instruction finishes (empty list after ``timeout`` seconds): directly on
        ``root`` (the one flight every blocked stream waits for) or on the only flight, else on
        whichever finishes first."""
        fl = root if root is not None else self.flights[0] if len(self.flights) == 1 else None
        if fl is not None and self.gloo and fl.finished is None and self.interrupt is None:
            try:
                for w in fl.works:
                    w.wait(datetime.timedelta(seconds=timeout))
            except BaseException as e:  # noqa: BLE001 - a timeout or a failed peer: report through _finish
                if not _failed(fl):
                    return []
                fl.error = e
            fl.finished = True           # waited once: a gloo p2p work must not be waited on again
            return [self._finish(fl)]
        for f in self.flights:           # whichever finishes first: helpers watch the p2p nobody watched yet
            if f.finished is None and (self._needs_helper(f) or self.interrupt is not None):
                self._watch(f)           # (interruptible: every flight, so that this thread only polls the flag)
        end = time.monotonic() + timeout
        nap = 5e-5
        while True:
            got = self.ready()
            if got or time.monotonic() >= end:
                return got
            if self.interrupt is not None and self.interrupt():
                raise RuntimeFailure("interrupted: a peer reported a failed step (a host of the job was lost)")
            watched = all(f.finished is not None for f in self.flights)   # nothing to poll: sleep until notified
            with self.cond:
                if not any(f.finished for f in self.flights if f.finished is not None):
                    left = max(end - time.monotonic(), 0.0)
                    self.cond.wait((min(left, 0.05) if self.interrupt is not None else left) if watched else nap)
            nap = min(nap * 2, 1e-3)

    def close(self) -> None:
        if self.pool is not None and self.own_pool:   # blocked waits (a failed step) end with the groups
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None
        self.flights.clear()


def _failed(fl: Flight) -> bool:
    try:
        for w in fl.works:
            w.wait(datetime.timedelta(milliseconds=1))
    except BaseException:  # noqa: BLE001
        return True
    return False


def a2a(t: torch.Tensor, in_splits: list[int], out_splits: list[int], group) -> tuple[Any, torch.Tensor]:
    """Start an all-to-all of rows of ``t`` (``in_splits`` rows to each member); returns (work, output)."""
    out = t.new_empty((sum(out_splits),) + tuple(t.shape[1:]))
    work = dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits, group=group, async_op=True)
    return work, out


def reduce_scatter(b, chunk: int, group) -> tuple[Any, Callable[[], None], Any]:
    """Reduce-scatter chunk's gradient range of buffer ``b`` onto the members' ZeRO shards."""
    grad, shard = b.grad_buffer(), b.grad_shard_buffer()
    segs, L = b.segments(chunk)
    if all(hi - lo == b.q for lo, hi in segs):      # the chunk is the whole buffer: shards line up
        return reduce_scatter_flat(shard, grad, group=group, async_op=True), lambda: None, grad
    inp = torch.zeros(b.n * L, dtype=grad.dtype, device=grad.device)
    for i, (lo, hi) in enumerate(segs):
        inp[i * L:i * L + hi - lo] = grad[lo:hi]
    out = torch.empty(L, dtype=grad.dtype, device=grad.device)
    work = reduce_scatter_flat(out, inp, group=group, async_op=True)
    lo, hi = segs[b.index]

    def then() -> None:
        shard[lo - b.lo:hi - b.lo] = out[:hi - lo]
    return work, then, inp


def all_gather(b, chunk: int, group, dest: torch.Tensor, src: torch.Tensor, base: int,
               span: tuple[int, int] | None = None) -> tuple[Any, Callable[[], None], Any]:
    """All-gather chunk's parameter range of ``b`` (or buffer range ``span``) from the members' shards.

    ``src``: this rank's shard (buffer coordinates ``[b.lo, b.hi)``); ``dest[x - base]`` receives
    buffer element ``x`` of the chunk's range.
    """
    segs, L = b.segments(chunk, span)
    mine = src
    if all(hi - lo == b.q for lo, hi in segs) and base == 0 and dest.numel() >= b.padded:
        inp = mine.clone()
        return all_gather_flat(dest[:b.padded], inp, group=group, async_op=True), lambda: None, inp
    lo_j, hi_j = segs[b.index]
    inp = torch.zeros(L, dtype=dest.dtype, device=dest.device)
    inp[:hi_j - lo_j] = mine[lo_j - b.lo:hi_j - b.lo]
    out = torch.empty(b.n * L, dtype=dest.dtype, device=dest.device)
    work = all_gather_flat(out, inp, group=group, async_op=True)

    def then() -> None:
        for i, (lo, hi) in enumerate(segs):
            if hi > lo:
                dest[lo - base:hi - base] = out[i * L:i * L + hi - lo]
    return work, then, (inp, out)
