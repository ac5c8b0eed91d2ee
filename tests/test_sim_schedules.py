"""The simulator on Programs from ``ir.compile``: schedules, overlap, memory of real models, CLI."""
from __future__ import annotations

import json

import numpy as np
import pytest
from test_sim_programs import unit_cost

from parashift import models
from parashift.cli import main as cli_main
from parashift.ir import compile as ir_compile
from parashift.sim import CostModel, simulate
from parashift.strategy import Strategy

# uniform costs: compute time == FLOPs, communication and memory traffic free
FREE = dict(hbm_bw=1e30, bandwidth=dict(local=1e30, intra=1e30, inter=1e30))
DEEP = models.gpt(layers=16, hidden=64, heads=4, ffn=256, vocab=64, seq_len=32, name="deep-tiny", dtype="fp32",
                  pad_vocab=8)


def _run(model, strategy: str, m: int, cluster: str = "a100-1x8", cost=None, seq_len: int = 32):
    s = Strategy.parse(strategy)
    prog = ir_compile(model, s, global_batch=m * s.dp * s.mbs, seq_len=seq_len)
    return simulate(prog, cluster, cost if cost is not None else unit_cost(**FREE))


def _bubble_time(res) -> float:
    return res.step_time * res.bubble_fraction


@pytest.mark.parametrize("pp,m", [(2, 8), (4, 8)])
def test_interleaved_bubble_shrinks_by_vpp(pp, m):
    base = _run(DEEP, f"pp={pp}", m)
    inter = _run(DEEP, f"pp={pp},vpp=2,schedule=interleaved-1f1b", m)
    ratio = _bubble_time(inter) / _bubble_time(base)
    assert ratio == pytest.approx(1 / 2, abs=0.12)
    assert inter.step_time < base.step_time


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8)])
def test_zero_bubble_and_dualpipev_have_smaller_bubbles_than_1f1b(pp, m):
    base = _run(DEEP, f"pp={pp}", m)
    zb = _run(DEEP, f"pp={pp},schedule=zb-h1", m)
    dv = _run(DEEP, f"pp={pp},vpp=2,schedule=dualpipev", m)
    assert zb.bubble_fraction < base.bubble_fraction
    assert dv.bubble_fraction < base.bubble_fraction
    assert zb.step_time < base.step_time and dv.step_time < base.step_time


def _overlap(a: np.ndarray, b: np.ndarray) -> float:
    """Total length of the intersection of two sets of [start, end) intervals (each disjoint)."""
    tot = 0.0
    for s0, e0 in a:
        lo = np.maximum(b[:, 0], s0)
        hi = np.minimum(b[:, 1], e0)
        tot += float(np.clip(hi - lo, 0, None).sum())
    return tot


def _a2a_overlap(res) -> tuple[float, float]:
    """(overall, best device) share of EP all-to-all time that runs under compute on its device."""
    tl = res.timeline
    hidden, total, best = 0.0, 0.0, 0.0
    for _dev, d in tl.groupby("device"):
        spans = d[d["op"] == "all_to_all"][["start", "end"]].to_numpy()
        comp = d[d["op"] == "compute"][["start", "end"]].to_numpy()
        t = float((spans[:, 1] - spans[:, 0]).sum())
        h = _overlap(spans, comp)
        hidden, total, best = hidden + h, total + t, max(best, h / t)
    return hidden / total, best


def test_dualpipev_overlaps_ep_all_to_all_with_compute():
    moe = models.get("tiny-moe")
    cost = CostModel.for_cluster(__import__("parashift").cluster.get("a100-1x8"))
    dv = _run(moe, "dp=2,pp=2,ep=2,vpp=2,schedule=dualpipev", 16, cost=cost)
    assert set(dv.timeline.loc[dv.timeline["op"] == "all_to_all", "stream"]) == {"comm"}
    overall, best = _a2a_overlap(dv)
    # planned with estimated F/I/W durations, an F and an I are ready together less often than on unit
    # costs (0.33 overall, 0.44 on the best device), for the same step time
    assert overall > 0.2 and best > 0.2
    # under 1f1b the all-to-alls sit on the compute stream: nothing hides them
    ob = _run(moe, "dp=2,pp=2,ep=2", 16, cost=cost)
    assert _a2a_overlap(ob)[0] == 0.0


def test_llama2_70b_memory_fit_and_what_dominates():
    m = models.get("llama2-70b")
    one_node = _run(m, "dp=1,tp=8,pp=1", 4, cluster="a800-1x8", cost=CostModel.for_cluster(
        __import__("parashift").cluster.get("a800-1x8")), seq_len=4096)
    assert not one_node.fits
    assert one_node.memory_summary()["dominant"] == "states"
    assert one_node.peak_memory_max > 80 * 2**30
    c = __import__("parashift").cluster.get("a800-4x8")
    fits = _run(m, "dp=1,tp=8,pp=4,zero=1,recompute=selective", 8, cluster="a800-4x8",
                cost=CostModel.for_cluster(c), seq_len=4096)
    assert fits.fits, fits.memory_frame()
    assert len(fits.peak_memory) == 32


def test_folding_equals_unfolded_on_compiled_programs():
    for model, strategy in [(models.get("tiny-gpt"), "dp=2,tp=2,pp=2,zero=1"),
                            (models.get("tiny-moe"), "dp=4,pp=2,ep=2")]:
        s = Strategy.parse(strategy)
        prog = ir_compile(model, s, global_batch=4 * s.dp, seq_len=32)
        cost = CostModel.for_cluster(__import__("parashift").cluster.get("a100-2x4"))
        a = simulate(prog, "a100-2x4", cost)
        b = simulate(prog, "a100-2x4", cost, fold=False)
        assert len(a.raw.folding.members) < len(b.raw.folding.members)
        key = ["rank", "stream", "id"]
        ta = a.timeline.sort_values(key).reset_index(drop=True)
        tb = b.timeline.sort_values(key).reset_index(drop=True)
        assert ta.equals(tb)
        assert a.peak_memory == b.peak_memory


def test_cli_simulate_json_and_outputs(tmp_path, capsys):
    trace, plot = tmp_path / "t.json", tmp_path / "t.png"
    rc = cli_main(["simulate", "--model", "tiny-gpt", "--cluster", "cpu-local", "--strategy", "dp=2,pp=2",
                   "--global-batch", "8", "--seq-len", "32", "--trace", str(trace), "--plot", str(plot), "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    for k in ("step_time", "tokens_per_s", "mfu", "bubble_fraction", "peak_memory", "peak_memory_max", "fits",
              "sim_seconds"):
        assert k in out
    assert out["step_time"] > 0 and out["fits"] is True and len(out["peak_memory"]) == 4
    assert json.load(open(trace))["traceEvents"] and plot.stat().st_size > 1000
    cm = tmp_path / "cost.json"
    CostModel.for_cluster(__import__("parashift").cluster.get("cpu-local")).replace(
        efficiency={k: 0.15 for k in ("fwd", "bwd", "bwd_input", "bwd_weight", "recompute", "optim")}).save(str(cm))
    rc = cli_main(["simulate", "--model", "tiny-gpt", "--cluster", "cpu-local", "--strategy", "dp=2,pp=2",
                   "--global-batch", "8", "--seq-len", "32", "--cost-model", str(cm), "--json"])
    slower = json.loads(capsys.readouterr().out)
    assert rc == 0 and slower["step_time"] > out["step_time"]
    rc = cli_main(["simulate", "--model", "llama2-70b", "--cluster", "a800-1x8", "--strategy", "tp=8",
                   "--global-batch", "1", "--seq-len", "4096"])
    text = capsys.readouterr().out
    assert rc == 0 and "DOES NOT FIT" in text and "dominated by states" in text
    rc = cli_main(["simulate", "--model", "tiny-gpt", "--cluster", "cpu-local", "--strategy", "tp=3",
                   "--global-batch", "8", "--seq-len", "32"])
    assert rc == 1 and "tp=3" in capsys.readouterr().err


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 12)])
def test_compiled_1f1b_matches_the_closed_form(pp, m):
    """Uniform stages (head and optimizer made free; tp=2 keeps the head its own region and all
    communication is free): step == (m + pp - 1)(tf + tb), bubble (pp - 1)/(m + pp - 1)."""
    eff = dict(fwd=1.0, bwd=1.0, bwd_input=1.0, bwd_weight=1.0, recompute=1.0, optim=1e30)
    cost = unit_cost(**FREE, efficiency=eff, region_efficiency=dict(embed=1.0, attn=1.0, mlp=1.0, moe=1.0,
                                                                    head=1e30, layer=1.0), compute_model="flops")
    s = Strategy.parse(f"tp=2,pp={pp}")
    prog = ir_compile(DEEP, s, global_batch=m, seq_len=32)
    res = simulate(prog, "a100-1x8", cost)
    stage0 = [i for i in prog.ranks[0].streams["compute"] if i.op == "compute" and i.microbatch == 0]
    tf = sum(cost.compute_time(i) for i in stage0 if i.phase == "fwd")
    tb = sum(cost.compute_time(i) for i in stage0 if i.phase == "bwd")
    assert res.step_time == pytest.approx((m + pp - 1) * (tf + tb), rel=1e-9)
    assert res.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1), rel=1e-6)
