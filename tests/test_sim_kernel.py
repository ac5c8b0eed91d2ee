"""The engine's lean event kernel runs events in exactly simpy's order (same times, same ties, same
count), on random mixes of what the engine uses: timeouts (many at equal times), events succeeded
from callbacks and from other processes, all-of conditions and generator processes."""
from __future__ import annotations

import random

import pytest

from parashift.sim.kernel import Kernel

simpy = pytest.importorskip("simpy")


class _Simpy:
    """simpy behind the kernel's interface."""

    def __init__(self) -> None:
        self.env = simpy.Environment()

    @property
    def now(self):
        return self.env.now

    def timeout(self, d):
        return self.env.timeout(d)

    def event(self):
        return self.env.event()

    def process(self, gen):
        return self.env.process(gen)

    def all_of(self, evs):
        return simpy.AllOf(self.env, evs)

    def run(self) -> int:
        n = 0
        while self.env._queue:
            self.env.step()
            n += 1
        return n


def _scenario(k, seed: int, procs: int = 6, steps: int = 40) -> tuple[list, int]:
    log: list = []
    shared = [k.event() for _ in range(procs)]   # shared[p] is succeeded by process p, awaited by p + 1

    def child(name, d):
        log.append((name, "start", repr(k.now)))
        yield k.timeout(d)
        log.append((name, "child", repr(k.now)))

    def proc(p: int):
        rng = random.Random(seed * 1000 + p)
        for s in range(steps):
            what = rng.randrange(6)
            if what == 0:
                yield k.timeout(rng.choice([0, 0.25, 0.5, 1.0]))
            elif what == 1:             # an event succeeded by a timeout's callback
                ev = k.event()
                k.timeout(rng.choice([0, 0.5])).callbacks.append(lambda _e, ev=ev: ev.succeed())
                yield ev
            elif what == 2:
                yield k.all_of([k.timeout(rng.choice([0, 0.25, 0.75])) for _ in range(rng.randrange(3))])
            elif what == 3 and s == steps // 2:
                shared[p].succeed()
            elif what == 4 and s > steps // 2 and shared[(p - 1) % procs].callbacks is not None:
                yield shared[(p - 1) % procs]
            elif what == 5:             # a process started mid-run (it starts urgently, before normal events)
                k.process(child((p, s), rng.choice([0, 0.25])))
            log.append((p, s, repr(k.now)))

    ends = [k.process(proc(p)) for p in range(procs)]
    for p, e in enumerate(ends):
        e.callbacks.append(lambda _e, p=p: log.append((p, "end", repr(k.now))))
    return log, k.run()


@pytest.mark.parametrize("seed", range(8))
def test_kernel_matches_simpy(seed):
    ours = _scenario(Kernel(), seed)
    ref = _scenario(_Simpy(), seed)
    assert ours == ref
    assert len(ours[0]) > 100
