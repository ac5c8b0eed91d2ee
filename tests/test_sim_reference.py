"""Compile + simulate figures stay exactly as recorded (speed work must not change results).

The configurations and the recorded digests live in ``tests/sim_reference.py`` and
``tests/data/sim_reference.json`` (regenerate only for a change meant to alter results)."""
from __future__ import annotations

import json

import pytest

from sim_reference import CONFIGS, PATH, figures

STORED = json.loads(PATH.read_text())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_program_and_simulation_unchanged(name):
    got = figures(name)
    changed = sorted(k for k in got if got[k] != STORED[name].get(k))
    assert not changed, (f"{name}: {changed} differ from tests/data/sim_reference.json; a speed change must not "
                         f"alter results. If this change is meant to (cost model, lowering rules), regenerate with "
                         f"`python tests/sim_reference.py --write` and say so in the commit")


def test_reference_covers_every_schedule_and_axis():
    from parashift.ir.schedules import schedule_names
    from parashift.strategy import Strategy
    strategies = [Strategy.parse(c[2]) for c in CONFIGS.values()]
    assert {s.schedule for s in strategies} == set(schedule_names())
    for axis in ("tp", "ep", "cp", "vpp"):
        assert any(getattr(s, axis) > 1 for s in strategies), axis
    assert {s.zero for s in strategies} >= {0, 1, 2, 3}
    assert any(s.sp for s in strategies) and {s.recompute for s in strategies} >= {"none", "selective", "full"}
