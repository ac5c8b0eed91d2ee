"""The runtime profiler keeps the rows of the last ``keep`` steps (all with ``keep_all``)."""
from __future__ import annotations

import pytest

from parashift.exec.profiler import Profiler, timeline_frame
from parashift.ir.program import Instr


def _run(prof: Profiler, steps: int) -> None:
    for step in range(steps):
        prof.begin(step, origin=10.0 * step)
        for k in range(3):
            prof.record(Instr(k, "compute", phase="fwd", flops=1.0), "compute", 10.0 * step + k, 10.0 * step + k + 0.5)


@pytest.mark.parametrize("keep,steps", [(1, 5), (3, 5), (16, 5), (4, 4)])
def test_keeps_the_last_steps(keep, steps):
    prof = Profiler(0, 0, keep=keep)
    _run(prof, steps)
    kept = sorted({r[0] for r in prof.rows})
    assert kept == list(range(max(0, steps - keep), steps))
    assert len(prof.rows) == 3 * len(kept)
    # times are relative to each step's own origin
    assert sorted({r[8] for r in prof.rows}) == [0.0, 1.0, 2.0]
    last = timeline_frame(prof.rows)                  # the last step by default
    assert len(last) == 3 and timeline_frame(prof.rows, step=kept[0])["start"].min() == 0.0


def test_keep_all_keeps_every_step():
    prof = Profiler(0, 0, keep_all=True, keep=1)
    _run(prof, 6)
    assert sorted({r[0] for r in prof.rows}) == list(range(6))
