"""Shared resources as fluid flows on the simulation clock: links and a device's compute.

A flow needs ``work`` seconds at the full rate of every resource it crosses. Flows on one
resource share it equally: ``n`` flows on a resource of ``capacity`` c (1 unless set, e.g. the
cores of a host) each get ``min(1, c / n)``; a flow's rate is its smallest share over its resources. Rates are
recomputed only for the flows on the resources a starting or finishing flow touches.

A flow on free resources, after a delay or not, can be *planned* (:meth:`FluidNetwork.plan`): while
no other flow touches its resources it is one queue entry, at its end, instead of one for its delay
and one for its end; the first flow that starts on one of them makes it the flow it stands for, as
it would be at that moment. When its end is processed with no other entry due at that time, what
its ``done`` would queue is processed at once (``done.process()``), as the kernel would next.
"""
from __future__ import annotations

from heapq import heappush
from typing import Hashable, Sequence

from .kernel import Event, Kernel

__all__ = ["FluidNetwork"]

_EPS = 1e-15
_INF = float("inf")   # Kernel._cur of a FIFO entry


class _Flow:
    __slots__ = ("links", "remaining", "rate", "t", "version", "done", "net")

    def __init__(self, links: tuple, work: float, done: Event, now: float, net: "FluidNetwork") -> None:
        self.links = links
        self.remaining = work
        self.rate = 0.0
        self.t = now
        self.version = 0
        self.done = done
        self.net = net


def _first_end(f: _Flow) -> None:
    """A flow's first scheduled end (version 1) was processed."""
    if f.version == 1:
        links = f.links
        if len(links) == 1:   # _finish, inline for the common case
            lst = f.net.active[links[0]]
            if len(lst) == 1:
                lst.pop()
                f.rate = 0.0
                f.done.succeed()
                return
        f.net._finish(f, 1)


#: A planned flow (a list, cheap to make): ``[links, t0, work, done, eid, state, net]``, a flow of ``work``
#: on resources ``links`` that starts at ``t0`` (its start event would have had creation number ``eid``;
#: -2: started as planned) and succeeds ``done``; ``state``: None while no other flow touched its
#: resources, the :class:`_Flow` it was made once made real while running, False if it started as a
#: real flow instead.
_Plan = list
_STATE = 5


def _plan_end(p: _Plan) -> None:
    """A planned flow's end entry: the end of the flow it stands for (its start counted too)."""
    links, _t0, _work, done, eid, state, net = p
    if state is None:   # ran alone: its start (if it waited) and its end
        planned = net.planned
        for link in links:
            del planned[link]
        env = net.env
        if eid != -2:
            env._extra += 1
        queue = env._queue
        if env._fifo or env._urgent or (queue and queue[0][0] <= env._now):
            done.succeed()
        else:   # no other entry is due now: the one succeed() would queue is processed next, so here
            env._extra += 1
            env._cur = _INF
            done.process()
    elif state is False:   # started as a real flow instead: this entry stands for nothing
        net.env._extra -= 1
    else:   # made real while running: this entry is that flow's first end
        _first_end(state)


def _plan_start(p: _Plan) -> None:
    links, _t0, work, done, _eid, _state, net = p
    net.flow(links, work, done)


def _later_end(fv: "tuple[_Flow, int]") -> None:
    f, v = fv
    f.net._finish(f, v)


class FluidNetwork:
    """Processor-sharing resources keyed by any hashable name."""

    def __init__(self, env: Kernel) -> None:
        self.env = env
        self.active: dict[Hashable, list[_Flow]] = {}
        self.capacity: dict[Hashable, float] = {}   # resources whose capacity is not 1
        self.planned: dict[Hashable, _Plan] = {}    # resource -> the planned flow alone on it

    def plan(self, links: tuple, delay: float, work: float, done: Event) -> bool:
        """Arrange what ``env.timeout(delay)`` then ``flow(links, work, done)`` (or, with no delay,
        ``flow`` now) would do, if ``links`` are free now (no flow, none planned, capacity 1) and
        ``work`` is positive; else do nothing and return False. The planned flow's start keeps its
        place in the event order, and the flow is made real (as it would be then) when another flow
        starts on one of its resources before it ends; the events counted are the same. Its end entry
        is made now, not at its start: only a queue entry made between the two for exactly its end
        time could change places with it (the reference figures, tests/data/sim_reference.json, do
        not move)."""
        if work <= 0.0 or delay < 0.0:
            return False
        active, planned, capacity = self.active, self.planned, self.capacity
        for link in links:
            if link in planned or active.get(link) or (capacity and link in capacity):
                return False
        env = self.env
        eid = env._eid
        t0 = env._now + delay
        if delay > 0.0:
            eid += 1
            p = [links, t0, work, done, eid, None, self]
        else:
            p = [links, t0, work, done, -2, None, self]
        for link in links:
            planned[link] = p
        env._eid = eid = eid + 1
        heappush(env._queue, (t0 + work, eid, _plan_end, p))
        return True

    def _realize(self, p: _Plan) -> None:
        """Another flow starts on one of ``p``'s resources now: make ``p`` the flow it stands for."""
        links, t0, work, done, eid, _state, _net = p
        planned = self.planned
        for link in links:
            del planned[link]
        env = self.env
        now = env._now
        if now > t0 or (now == t0 and env._cur > eid):   # its start was processed before now
            f = _Flow(links, work, done, t0, self)
            f.rate = 1.0
            f.version = 1
            active = self.active
            for link in links:   # alone until now; its end is p's entry (_plan_end)
                active.setdefault(link, []).append(f)
            p[_STATE] = f
            if eid != -2:
                env._extra += 1
        else:   # its start is still to come, in its place
            p[_STATE] = False
            heappush(env._queue, (t0, eid, _plan_start, p))

    def flow(self, links: Sequence[Hashable], work: float, done: "Event | None" = None) -> Event:
        """An event (``done``, or a new one) that succeeds when ``work`` seconds of full-rate
        service have been received."""
        env = self.env
        if done is None:
            done = env.event()
        if work <= 0.0:
            done.succeed()
            return done
        if type(links) is not tuple:
            links = tuple(links)
        planned = self.planned
        if planned:
            for link in links:
                p = planned.get(link)
                if p is not None:
                    self._realize(p)
        f = _Flow(links, work, done, env._now, self)
        shared = False
        cap = self.capacity
        active = self.active
        for link in links:
            lst = active.get(link)
            if lst is None:
                active[link] = [f]
            elif lst:
                shared = shared or len(lst) >= (cap.get(link, 1.0) if cap else 1.0)
                lst.append(f)
            else:
                lst.append(f)
        if not shared:  # alone on all its resources: full rate, no one else changes (as _schedule)
            f.rate = 1.0
            f.version = 1
            env.call_at(env._now + work, _first_end, f)
        else:
            self._update(self._neighbours(links))
        return done

    # ---- internals ----------------------------------------------------------------------------
    def _neighbours(self, links: tuple) -> list[_Flow]:
        seen: dict[int, _Flow] = {}
        for link in links:
            for g in self.active.get(link, ()):
                seen[id(g)] = g
        return list(seen.values())

    def _schedule(self, f: _Flow) -> None:
        f.version += 1
        delay = f.remaining / f.rate
        if delay < 0:
            raise ValueError(f"negative delay {delay}")
        self.env.call_at(self.env._now + delay, _later_end, (f, f.version))

    def _update(self, flows: list[_Flow]) -> None:
        now = self.env.now
        active = self.active
        cap = self.capacity
        for f in flows:
            rate = min(min(1.0, cap.get(link, 1.0) / len(active[link])) for link in f.links)
            if f.rate:
                f.remaining -= f.rate * (now - f.t)
                if f.remaining < _EPS:
                    f.remaining = 0.0
            f.t = now
            if rate != f.rate:
                f.rate = rate
                self._schedule(f)

    def _finish(self, f: _Flow, version: int) -> None:
        if version != f.version:
            return  # rescheduled since
        others = False
        active = self.active
        for link in f.links:
            lst = active[link]
            if len(lst) == 1:
                lst.pop()
            else:
                lst.remove(f)
                others = True
        f.rate = 0.0
        if others:
            self._update(self._neighbours(f.links))
        f.done.succeed()
