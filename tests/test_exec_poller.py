"""The runtime's Poller on works that only complete through ``wait``.

torch's gloo reduce-scatter returns a work whose ``is_completed`` never turns true (an all-reduce
behind a lazy work); a Poller that only polled it deadlocked ``dp=2,tp=2,sp,zero=2`` as soon as the
ZeRO-2 gradient reduce-scatter and a sequence-parallel reduce-scatter were in flight together.
"""
from __future__ import annotations

import threading

from parashift.exec.comm import Flight, Poller
from parashift.ir.program import Instr


class LazyWork:
    """A work like gloo's reduce-scatter: done only once waited on, never by polling."""

    def __init__(self, gate: threading.Event) -> None:
        self.gate, self.waited = gate, False

    def is_completed(self) -> bool:
        return False

    def wait(self, timeout=None) -> bool:
        self.gate.wait(5)
        self.waited = True
        return True


def _flight(i: int, op: str, gate: threading.Event) -> Flight:
    return Flight(instr=Instr.make(id=i, op=op, stream="comm", group="dp"), stream="comm", works=[LazyWork(gate)])


def test_two_lazy_reduce_scatters_in_flight_finish() -> None:
    gate = threading.Event()
    poller = Poller(gloo=True, eager=True)
    a, b = _flight(1, "reduce_scatter", gate), _flight(2, "reduce_scatter", gate)
    poller.submit(a)
    poller.submit(b)
    gate.set()
    got = []
    for _ in range(4):
        got += poller.wait(2.0)
        if len(got) == 2:
            break
    poller.close()
    assert sorted(fl.instr.id for fl, err in got) == [1, 2]
    assert all(err is None for _, err in got) and a.works[0].waited and b.works[0].waited


def test_polled_collectives_are_not_handed_to_helpers() -> None:
    """An all-reduce is polled (no helper thread), so the rule stays specific to wait-only works."""
    poller = Poller(gloo=True, eager=True)
    fl = _flight(1, "all_reduce", threading.Event())
    poller.submit(fl)
    assert fl.finished is None
    poller.close()
