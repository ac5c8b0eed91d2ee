"""A planned flow (``FluidNetwork.plan``) is exact: on random mixes of delayed flows over shared
resources, with many equal start times (flows issued together, flows that start as another ends or
as a planned one starts), every flow ends at the same time, in the same order, with the same event
count, as when each is run as ``timeout(delay)`` then ``flow``. (Works are random, so no two flows
end at exactly the same time: see ``FluidNetwork.plan`` for that case.)"""
from __future__ import annotations

import random

import pytest

from parashift.sim.fluid import FluidNetwork
from parashift.sim.kernel import Kernel

_LINKS = [("out", "intra", 0), ("in", "intra", 1), ("out", "inter", 0), ("copy", 2)]


def _scenario(seed: int, use_plan: bool) -> tuple[list, int, int]:
    k = Kernel()
    net = FluidNetwork(k)
    rng = random.Random(seed)
    log: list = []
    planned = [0]

    def issue(spec) -> None:
        name, links, delay, work, then = spec
        done = k.event()
        done.callbacks.append(lambda _e: ended(name, then))
        if use_plan and net.plan(links, delay, work, done):
            planned[0] += 1
        elif delay > 0:
            k.timeout(delay).callbacks.append(lambda _e: net.flow(links, work, done))
        else:
            net.flow(links, work, done)

    def ended(name, then) -> None:
        log.append((name, repr(k.now)))
        if then is not None:   # a chain: the next flow starts as this one ends
            issue(then)

    grid = [0.0, 0.25, 0.5, 0.75, 1.0, 1.5]   # few distinct starts and delays: many equal start times
    for i in range(30):
        links = tuple(rng.sample(_LINKS, rng.choice([1, 1, 2])))
        then = None
        if rng.random() < 0.4:
            then = (f"{i}b", tuple(rng.sample(_LINKS, 1)), rng.choice(grid), rng.uniform(0.1, 1.0), None)
        spec = (f"{i}", links, rng.choice(grid), rng.uniform(0.1, 1.0), then)
        k.call_at(rng.choice(grid) * 2, lambda _a, spec=spec: issue(spec))
    n = k.run()
    return log, n, planned[0]


@pytest.mark.parametrize("seed", range(25))
def test_planned_flows_match_plain_flows(seed):
    plain, n_plain, _ = _scenario(seed, use_plan=False)
    ours, n_ours, planned = _scenario(seed, use_plan=True)
    assert ours == plain
    assert n_ours == n_plain
    assert len(plain) > 30


def test_plans_are_made_and_made_real():
    """The scenarios do exercise plans (and touching them, else every flow would be planned)."""
    total = planned = 0
    for seed in range(25):
        log, _n, p = _scenario(seed, use_plan=True)
        total += len(log)
        planned += p
    assert 0 < planned < total
