"""A lean discrete-event kernel with simpy's semantics, for the engine's hot loop.

The engine needs only simpy's core: events that succeed once and run their callbacks, timeouts,
generator processes, all-of conditions, and one clock. :class:`Kernel` provides exactly those with
the same scheduling rule as ``simpy.Environment`` (a heap ordered by time, then priority — a
process's start is urgent, everything else normal — then creation order), so a simulation runs
the same events in the same order as on simpy, at a fraction of the cost per event: events are
slotted objects without values or failure handling (the engine never fails an event).
"""
from __future__ import annotations

from heapq import heappop, heappush
from typing import Callable, Generator, Sequence

__all__ = ["Kernel", "Event"]

_URGENT, _NORMAL = 0, 1


class Event:
    """Succeeds once; its ``callbacks`` run when the kernel processes it (then ``callbacks`` is None)."""

    __slots__ = ("callbacks", "kernel")

    def __init__(self, kernel: "Kernel") -> None:
        self.callbacks: "list[Callable[[Event], None]] | None" = []
        self.kernel = kernel

    def succeed(self) -> "Event":
        k = self.kernel
        k._eid += 1
        heappush(k._queue, (k._now, _NORMAL, k._eid, self))
        return self


class _AllOf:
    """Succeeds ``done`` once every one of ``events`` has been processed (simpy's ``AllOf``)."""

    __slots__ = ("left", "done")

    def __init__(self, events: Sequence[Event], done: Event) -> None:
        self.done = done
        self.left = len(events)
        if not events:
            done.succeed()
            return
        for ev in events:
            if ev.callbacks is None:
                self._check(ev)
            else:
                ev.callbacks.append(self._check)

    def _check(self, _ev: Event) -> None:
        self.left -= 1
        if self.left == 0:
            self.done.succeed()


class Kernel:
    """The clock and event queue (``now``, ``event``, ``timeout``, ``process``, ``all_of``, ``run``)."""

    def __init__(self) -> None:
        self._now: float = 0   # an int until the first event, as simpy's clock starts
        self._queue: list = []
        self._eid = 0

    @property
    def now(self) -> float:
        return self._now

    def event(self) -> Event:
        return Event(self)

    def timeout(self, delay: float) -> Event:
        """An event processed ``delay`` seconds from now."""
        if delay < 0:
            raise ValueError(f"negative delay {delay}")
        ev = Event(self)
        self._eid += 1
        heappush(self._queue, (self._now + delay, _NORMAL, self._eid, ev))
        return ev

    def all_of(self, events: Sequence[Event]) -> Event:
        done = Event(self)
        _AllOf(events, done)
        return done

    def process(self, gen: Generator[Event, None, None]) -> Event:
        """Run ``gen``: it yields events and resumes once each is processed; the returned event
        succeeds when it ends. It starts (urgently) when the kernel reaches the current time."""
        end = Event(self)

        def resume(_ev: Event) -> None:
            for ev in gen:
                if ev.callbacks is not None:
                    ev.callbacks.append(resume)
                    return
            end.succeed()

        start = Event(self)
        start.callbacks.append(resume)   # type: ignore[union-attr]
        self._eid += 1
        heappush(self._queue, (self._now, _URGENT, self._eid, start))
        return end

    def run(self) -> int:
        """Process events until none is left; returns how many were processed."""
        queue = self._queue
        pop = heappop
        n = 0
        while queue:
            self._now, _, _, ev = pop(queue)
            n += 1
            callbacks, ev.callbacks = ev.callbacks, None
            for cb in callbacks:
                cb(ev)
        return n
