"""fit_programs: parameters fitted to whole-program times with the simulator in the loop (the
local link of hot-switch Programs, which training timelines never exercise)."""
from __future__ import annotations

import numpy as np
import pytest

from parashift import calibrate, cluster as clusters, models, sim
from parashift.calibrate import CalibrationError
from parashift.calibrate.programs import fit_programs, simulated_times
from parashift.strategy import Strategy
from parashift.vps import plan_switch
from parashift.vps.transition import lower

CL = clusters.get("cpu-local")
BASE = sim.CostModel.for_cluster(CL)
SPEC = models.get("tiny-gpt")
CASES = (("dp=4", "tp=2,dp=2"), ("tp=2,dp=2", "dp=2,pp=2"), ("dp=2,pp=2", "pp=4"), ("pp=4", "dp=4,zero=1"))


def switch_program(src: str, dst: str):
    plan = plan_switch(SPEC, Strategy.parse(src), Strategy.parse(dst), cluster=CL, src_devices=[0, 1, 2, 3],
                       dst_devices=[0, 1, 2, 3])
    return lower(plan, CL)


def test_recovers_the_local_link_from_switch_times():
    progs = [switch_program(a, b) for a, b in CASES]
    assert any(i.op == "copy" for p in progs for rp in p.ranks.values() for i in rp.instrs())
    truth = BASE.replace(latency=dict(BASE.latency, local=2e-4), link_efficiency=dict(BASE.link_efficiency, local=0.05))
    seconds = simulated_times(progs, CL, truth)
    cm, table = fit_programs(progs, seconds, CL)
    assert set(table["name"]) == {"latency.local", "link_bw.local"}
    assert cm.latency["local"] == pytest.approx(2e-4, rel=0.02)
    assert cm.link_bw("local") == pytest.approx(truth.link_bw("local"), rel=0.02)
    np.testing.assert_allclose(simulated_times(progs, CL, cm), seconds, rtol=0.01)
    # what the programs never use stays at base
    assert cm.latency["inter"] == BASE.latency["inter"] and cm.comm_overhead == BASE.comm_overhead


def test_bad_program_times_are_explained():
    p = switch_program(*CASES[0])
    with pytest.raises(CalibrationError, match="one measured time per Program"):
        fit_programs([p], [1.0, 2.0], CL)
    with pytest.raises(CalibrationError, match="positive seconds"):
        fit_programs([p], [0.0], CL)
    assert calibrate.fit_programs is fit_programs


def test_recovers_a_fixed_switch_overhead_from_zero():
    progs = [switch_program(a, b) for a, b in CASES]
    truth = BASE.replace(switch_overhead=1.5e-3, link_efficiency=dict(BASE.link_efficiency, local=0.05))
    seconds = simulated_times(progs, CL, truth)
    # the overhead is paid by every switch, on top of its Program
    plain = simulated_times(progs, CL, truth.replace(switch_overhead=0.0))
    np.testing.assert_allclose(seconds - plain, 1.5e-3, rtol=1e-9)
    cm, table = fit_programs(progs, seconds, CL, params=("switch_overhead", "link_bw.local"))
    assert BASE.switch_overhead == 0.0 and set(table["name"]) == {"switch_overhead", "link_bw.local"}
    assert cm.switch_overhead == pytest.approx(1.5e-3, rel=0.02)
    assert cm.link_bw("local") == pytest.approx(truth.link_bw("local"), rel=0.02)
    assert sim.simulate_switch(progs[0], CL, cm).switch_time == pytest.approx(seconds[0], rel=0.01)
