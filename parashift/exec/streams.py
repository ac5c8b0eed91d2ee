"""Logical streams on a device: one interface, a CUDA backend and its CPU twin.

A Program names logical streams per rank, and an instruction may depend on instructions of other
streams. :class:`Streams` maps each logical stream onto a backend stream and orders them with
events, never by synchronizing the device per instruction:

- ``enter(name, deps)``: a context in which work runs on stream ``name`` after everything ``deps``
  (keys of earlier work) stands for: the event recorded for a key (``mark``), or the communication
  handles of a key (``pending``: ``work.wait()`` under the stream, which on NCCL makes the stream
  wait for the NCCL stream and on gloo waits on the host);
- ``mark(name, key)``: record an event for ``key`` after the work queued so far on ``name``;
- ``pending(key, works, then)``: communication handles that ``key`` stands for (``then`` runs,
  once, right after they were first waited on);
- ``finish()``: wait on every handle no one waited on, then synchronize the device once.

Profiling (``profile=True``): ``stamp(name)`` returns a timing event recorded on ``name`` (CUDA) or
the host clock (CPU); :meth:`Streams.seconds` turns stamps into seconds after the origin stamp
(:meth:`Streams.begin`) with one synchronize. Without profiling, stamps are free and nothing is
timed.

Backends: :class:`CudaBackend` (``torch.cuda.Stream``/``Event``; logical streams named in
``default`` run on the device's current stream, the one PyTorch kernels and NCCL order
against) and :class:`HostBackend`, the CPU twin: work runs in issue order on the calling thread,
so every event is complete when recorded, a wait on an event returns at once and a wait on a
communication handle blocks the host. Tests pass a recording backend with the same methods.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any, Callable, Iterable

import torch

__all__ = ["Streams", "HostBackend", "CudaBackend", "backend_for"]


class _HostEvent:
    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = 0.0


class HostBackend:
    """The CPU twin: streams are names, work runs in issue order, events carry the host clock."""

    kind = "host"

    def stream(self, name: str) -> Any:
        return name

    def current(self) -> Any:
        return "current"

    def use(self, stream: Any) -> Any:
        return nullcontext()

    def event(self, timing: bool) -> Any:
        return _HostEvent()

    def record(self, event: Any, stream: Any) -> None:
        event.t = time.perf_counter()

    def wait(self, stream: Any, event: Any) -> None:
        """Nothing to wait for: the work before ``event`` ran before it was recorded."""

    def wait_stream(self, stream: Any, other: Any) -> None:
        """Nothing to wait for: ``other``'s work ran when it was issued."""

    def elapsed(self, a: Any, b: Any) -> float:
        return b.t - a.t

    def synchronize(self) -> None:
        """Nothing is queued on the host."""

    def drain(self, events: list, poll: Callable[[], None] | None) -> None:
        """Nothing is queued on the host: every event is complete."""


class CudaBackend:
    """CUDA streams and events of one device."""

    kind = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def stream(self, name: str) -> Any:
        return torch.cuda.Stream(device=self.device)

    def current(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def use(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def event(self, timing: bool) -> Any:
        return torch.cuda.Event(enable_timing=timing)

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def wait_stream(self, stream: Any, other: Any) -> None:
        stream.wait_stream(other)

    def elapsed(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1000.0

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def drain(self, events: list, poll: Callable[[], None] | None) -> None:
        """Wait until every event completed, calling ``poll()`` every millisecond meanwhile."""
        while not all(e.query() for e in events):
            if poll is not None:
                poll()
            time.sleep(0.001)


def backend_for(device: "torch.device | str | None") -> "HostBackend | CudaBackend":
    """The backend of ``device``: CUDA streams on a CUDA device, the CPU twin elsewhere."""
    device = torch.device(device if device is not None else "cpu")
    return CudaBackend(device) if device.type == "cuda" else HostBackend()


class _Pending:
    __slots__ = ("works", "then", "waited")

    def __init__(self, works: list, then: Callable[[], None] | None) -> None:
        self.works, self.then, self.waited = works, then, set()


class Streams:
    """Logical streams of one rank on one device, ordered by events (see the module docstring)."""

    def __init__(self, backend: Any, default: Iterable[str] = ("compute",), profile: bool = False) -> None:
        self.backend, self.profile = backend, profile
        self.default = frozenset(default)
        self._streams: dict[str, Any] = {}
        self._events: dict[Any, tuple[str, Any]] = {}      # key -> (stream name, event)
        self._pending: dict[Any, _Pending] = {}            # key -> communication handles
        self._origin: Any = None
        self._host0 = 0.0

    def handle(self, name: str) -> Any:
        """The backend stream of logical stream ``name`` (created on first use)."""
        s = self._streams.get(name)
        if s is None:
            s = self._streams[name] = self.backend.current() if name in self.default else self.backend.stream(name)
            if name not in self.default:     # a new stream starts after what the device queued before it existed
                self.backend.wait_stream(s, self.backend.current())
        return s

    def own(self, name: str) -> bool:
        """Whether ``name`` runs on a stream of its own (not the device's current stream)."""
        return name not in self.default

    def enter(self, name: str, deps: Iterable[Any] = (), after_current: bool = False) -> Any:
        """A context running work on ``name`` after ``deps`` (``after_current``: also after all work
        queued so far on the device's current stream, what a lane may read)."""
        s = self.handle(name)
        if after_current and self.own(name):
            self.backend.wait_stream(s, self.backend.current())
        for d in deps:
            self._after(name, s, d)
        return self.backend.use(s)

    def wait(self, name: str, deps: Iterable[Any]) -> None:
        """Make stream ``name`` wait for ``deps`` (as :meth:`enter` does, without running anything)."""
        s = self.handle(name)
        for d in deps:
            self._after(name, s, d)

    def _after(self, name: str, s: Any, key: Any) -> None:
        p = self._pending.get(key)
        if p is not None:
            if name not in p.waited:
                with self.backend.use(s):
                    for w in p.works:
                        w.wait()
                first = not p.waited
                p.waited.add(name)
                if first and p.then is not None:
                    with self.backend.use(s):
                        p.then()
            return
        got = self._events.get(key)
        if got is not None and got[0] != name:       # same stream: ordered already
            self.backend.wait(s, got[1])

    def mark(self, name: str, key: Any) -> None:
        """Record that ``key`` is done once the work queued so far on ``name`` is."""
        ev = self.backend.event(False)
        self.backend.record(ev, self.handle(name))
        self._events[key] = (name, ev)

    def pending(self, key: Any, works: list, then: Callable[[], None] | None = None) -> None:
        """``key`` stands for the communication handles ``works``: whoever depends on it waits on them."""
        self._pending[key] = _Pending(list(works), then)

    def waited(self, key: Any) -> bool:
        p = self._pending.get(key)
        return p is None or bool(p.waited)

    def finish(self, name: str | None = None, poll: Callable[[], None] | None = None) -> None:
        """Wait (on stream ``name``, default the first default stream) on every handle nobody
        waited on, then for everything queued on every stream: one wait, polling ``poll()`` (which
        may raise: a peer is gone) while the device works."""
        name = name if name is not None else (min(self.default) if self.default else "current")
        for key, p in list(self._pending.items()):
            if not p.waited:
                self._after(name, self.handle(name), key)
        ends = []
        for s in set(self._streams.values()) | {self.backend.current()}:
            ev = self.backend.event(False)
            self.backend.record(ev, s)
            ends.append(ev)
        self.backend.drain(ends, poll)
        self._pending.clear()
        self._events.clear()

    def forget(self) -> None:
        """Drop every event and handle (after an abort: nothing will wait on them)."""
        self._pending.clear()
        self._events.clear()

    # ---- profiling ------------------------------------------------------------------------------------
    def begin(self) -> float:
        """The origin of profiling stamps (the start of a step), on the device's current stream;
        returns the host clock at that moment."""
        self._origin = self.stamp()
        self._host0 = time.perf_counter()
        return self._host0

    def stamp(self, name: str | None = None) -> Any:
        """A timing stamp on ``name`` (default: the current stream); None with profiling off."""
        if not self.profile:
            return None
        ev = self.backend.event(True)
        self.backend.record(ev, self.handle(name) if name is not None else self.backend.current())
        return ev

    def seconds(self, stamps: list[Any]) -> list[float]:
        """Seconds from the origin to each of ``stamps`` (one synchronize for all of them); a float
        stamp is a host clock reading (``time.perf_counter``), compared with the origin's."""
        if not stamps:
            return []
        self.backend.synchronize()
        return [s - self._host0 if isinstance(s, float) else self.backend.elapsed(self._origin, s) for s in stamps]
