"""A lean discrete-event kernel with simpy's semantics, for the engine's hot loop.

The engine needs only simpy's core: events that succeed once and run their callbacks, timeouts,
generator processes, all-of conditions, and one clock. :class:`Kernel` provides exactly those with
the same scheduling rule as ``simpy.Environment`` (by time, then priority — a process's start is
urgent, everything else normal — then creation order), so a simulation runs the same events in the
same order as on simpy, at a fraction of the cost per event: events are slotted objects without
values or failure handling (the engine never fails an event).

The queue is split three ways, which keeps simpy's order: urgent starts, a heap of entries for
later times, and a FIFO of entries made for the current time (an event succeeded now, a timeout
that lands now). Every heap entry for the current time was made earlier than every FIFO entry, so
the heap's go first. An entry is ``fn(arg)`` at a time: an event's is :func:`fire` on the event;
the engine schedules plain calls (:meth:`Kernel.call_at`) where no one else waits, and each counts
as the one event simpy would process there.
"""
from __future__ import annotations

from collections import deque
from heapq import heappop, heappush
from typing import Any, Callable, Generator, Sequence

__all__ = ["Kernel", "Event", "fire"]


class Event:
    """Succeeds once; its ``callbacks`` run when the kernel processes it (then ``callbacks`` is None)."""

    __slots__ = ("callbacks", "kernel")

    def __init__(self, kernel: "Kernel") -> None:
        self.callbacks: "list[Callable[[Event], None]] | None" = []
        self.kernel = kernel

    def succeed(self) -> "Event":
        k = self.kernel
        k._fifo.append((k._now, fire, self))
        return self

    def process(self) -> None:
        """Process the event now, as the kernel would the entry ``succeed`` queues: for a handler
        whose last act that is, when no other entry is due now (the caller counts it in ``_extra``)."""
        fire(self)


def fire(ev: Event) -> None:
    """Process ``ev``: run its callbacks once."""
    callbacks, ev.callbacks = ev.callbacks, None
    for cb in callbacks:   # type: ignore[union-attr]
        cb(ev)


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
        self._queue: list = []          # (time, creation number, fn, arg), later than now when made
        self._fifo: deque = deque()     # (time, fn, arg) made for the current time, in creation order
        self._urgent: deque = deque()   # (time, fn, arg) process starts
        self._eid = 0
        self._cur: float = -1      # creation number of the heap entry being processed (inf: a FIFO entry)
        self._extra = 0            # events counted without a queue entry of their own (planned flows,
        #                            entries processed at once in place of the next one: Event.process)

    @property
    def now(self) -> float:
        return self._now

    def event(self) -> Event:
        return Event(self)

    def call_at(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        """Run ``fn(arg)`` at time ``t`` (not before now), as an event made now would be."""
        if t == self._now:
            self._fifo.append((t, fn, arg))
        else:
            self._eid += 1
            heappush(self._queue, (t, self._eid, fn, arg))

    def timeout(self, delay: float) -> Event:
        """An event processed ``delay`` seconds from now."""
        if delay < 0:
            raise ValueError(f"negative delay {delay}")
        ev = Event(self)
        self.call_at(self._now + delay, fire, ev)
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
        self._urgent.append((self._now, fire, start))
        return end

    def run(self) -> int:
        """Process events until none is left; returns how many were processed (with those a planned
        flow stood for: see :meth:`FluidNetwork.plan`)."""
        queue, fifo, urgent = self._queue, self._fifo, self._urgent
        pop, popleft = heappop, fifo.popleft
        inf = float("inf")
        n = 0
        while True:
            if urgent:
                t, fn, arg = urgent.popleft()
                self._cur = -1
            elif fifo:
                if queue and queue[0][0] <= fifo[0][0]:   # the heap's entries for now were made earlier
                    t, self._cur, fn, arg = pop(queue)
                else:
                    t, fn, arg = popleft()
                    self._cur = inf
            elif queue:
                t, self._cur, fn, arg = pop(queue)
            else:
                return n + self._extra
            self._now = t
            n += 1
            fn(arg)
