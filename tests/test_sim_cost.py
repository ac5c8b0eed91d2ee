"""CostModel: JSON round trip, defaults, compute and communication formulas."""
from __future__ import annotations

import numpy as np
import pytest

from parashift import cluster as clusters
from parashift.ir.program import Instr
from parashift.sim import CostModel, CostModelError, region_units, topology
from parashift.sim.checkpoint import StorageModel, estimate_checkpoint_restart
from parashift.sim.vtrain import load_allreduce_lut, load_iterations


@pytest.mark.parametrize("name", clusters.names())
def test_defaults_for_every_preset_round_trip_through_json(name, tmp_path):
    c = clusters.get(name)
    cm = CostModel.for_cluster(c)
    assert cm.peak_flops == c.gpu.peak_flops and cm.memory_capacity == c.gpu.memory
    assert CostModel.from_json(cm.to_json()) == cm
    cm.save(str(tmp_path / "c.json"))
    assert CostModel.load(str(tmp_path / "c.json")) == cm
    assert hash(CostModel.load(str(tmp_path / "c.json"))) == hash(cm)


def test_bad_cost_model_files_are_explained(tmp_path):
    obj = CostModel.for_cluster(clusters.get("a100-1x8")).to_json()
    with pytest.raises(CostModelError, match="unknown cost model fields \\['bogus'\\]"):
        CostModel.from_json({**obj, "bogus": 1})
    with pytest.raises(CostModelError, match="unknown collective algorithm"):
        CostModel.from_json({**obj, "algorithm": "butterfly"})
    with pytest.raises(CostModelError, match="lacks link classes"):
        CostModel.from_json({**obj, "latency": {"intra": 1e-6}})
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(CostModelError, match="cannot read cost model"):
        CostModel.load(str(tmp_path / "x.json"))


def test_region_units_parse_fused_and_single_regions():
    assert region_units("embed+layers.0-3") == (("embed", 1), ("layer", 4))
    assert region_units("layers.4-7+head") == (("layer", 4), ("head", 1))
    assert region_units("layers.2-2") == (("layer", 1),)
    assert region_units("layers.5.attn") == (("attn", 1),)
    assert region_units("layers.5.moe.experts") == (("moe", 1),)
    assert region_units(None) == (("layer", 1),)


def test_compute_time_is_flops_over_rate_or_the_dispatch_floor():
    cm = CostModel.for_cluster(clusters.get("a100-1x8"))
    i = Instr(0, "compute", phase="bwd", region="layers.3.mlp", flops=1e12)
    expect = 1e12 / (312e12 * cm.efficiency["bwd"] * cm.region_efficiency["mlp"])
    assert cm.compute_time(i) == pytest.approx(expect)
    # a tiny op takes as long as launching its kernels; fused regions count every layer
    tiny = Instr(0, "compute", phase="bwd", region="layers.3.mlp", flops=1e3)
    assert cm.compute_time(tiny) == pytest.approx(cm.region_floor["mlp"] * cm.phase_floor["bwd"])
    fused = Instr(0, "compute", phase="fwd", region="embed+layers.0-3", flops=1e3)
    assert cm.compute_time(fused) == pytest.approx(cm.region_floor["embed"] + 4 * cm.region_floor["layer"])
    # a memory-bound op is limited by HBM bandwidth
    m = Instr(0, "compute", phase="fwd", region="layers.3.mlp", flops=1.0, nbytes=10**10)
    assert cm.compute_time(m) >= 10**10 / (2e12 * cm.memory_efficiency)
    # the optimizer streams its state bytes
    o = Instr(0, "compute", phase="optim", nbytes=4 * 10**9, flops=1e9)
    assert cm.compute_time(o) == pytest.approx(4e9 / (2e12 * cm.memory_efficiency) + cm.optim_overhead)


def test_instruction_timing_for_planners_compares_p2p_and_broadcast():
    c = clusters.get("a800-2x8")
    cm = CostModel.for_cluster(c).replace(algorithm="ring")
    b = 2**28
    send_intra = cm.time(Instr(0, "send", peer=1, nbytes=b), c, (0, 1))
    send_inter = cm.time(Instr(0, "send", peer=8, nbytes=b), c, (0, 8))
    assert send_inter > 5 * send_intra
    bcast = cm.time(Instr(0, "broadcast", group=tuple(range(8)), nbytes=b, root=0), c, tuple(range(8)))
    assert bcast == pytest.approx(cm.comm_overhead + 7 * cm.latency["intra"] + b / cm.link_bw("intra"))
    # 7 separate sends from the root cost more than one pipelined broadcast
    assert 7 * send_intra > bcast
    with pytest.raises(CostModelError, match="devices=\\(src, dst\\)"):
        cm.time(Instr(0, "send", peer=1, nbytes=b), c, (0,))


def test_topology_signature():
    c = clusters.get("a100-2x8")
    assert topology(c, [0, 1, 2, 3]) == (4, 1, 4, False)
    assert topology(c, [0, 8, 1, 9]) == (4, 2, 2, False)
    assert topology(c, [3, 3]) == (2, 1, 2, True)


def test_a100_defaults_reproduce_nccl_allreduce_measurements():
    """The shipped nccl-tests LUT (2-8 A100s, 1 MiB-1 GiB) within 8% mean error."""
    c = clusters.get("a100-1x8")
    cm = CostModel.for_cluster(c)
    errs = []
    for n in range(2, 9):
        lut = load_allreduce_lut(n)
        for b, t in zip(lut["nbytes"], lut["seconds"]):
            pred = cm.time(Instr(0, "all_reduce", group=tuple(range(n)), nbytes=int(b)), c, tuple(range(n)))
            errs.append(abs(pred - t) / t)
    assert np.mean(errs) < 0.08


def test_vtrain_iterations_load():
    df = load_iterations()
    assert len(df) == 1440
    assert (df["tp"] * df["dp"] * df["pp"] == df["gpus"]).all()
    assert df["time_ms"].between(10, 10_000).all()


def test_checkpoint_restart_estimate_is_explicit_and_monotone():
    a = estimate_checkpoint_restart("llama2-70b", "dp=4,tp=8,pp=4,zero=1", "dp=8,tp=4,pp=4,zero=1", "a800-16x8")
    assert a.total_seconds == pytest.approx(a.save_seconds + a.restart_seconds + a.load_seconds)
    assert a.restart_seconds == StorageModel().restart_seconds
    # 69B params: bf16 params + fp32 master + two fp32 moments = 14 bytes each, written once
    assert a.bytes_written == pytest.approx(14 * 68.98e9, rel=0.01)
    assert a.bytes_read > a.bytes_written  # parameters are read by every DP replica
    fast = estimate_checkpoint_restart("llama2-70b", "dp=4,tp=8,pp=4,zero=1", "dp=8,tp=4,pp=4,zero=1",
                                       "a800-16x8", StorageModel(write_bw_per_node=8e9, read_bw_per_node=16e9))
    assert fast.save_seconds < a.save_seconds and fast.load_seconds < a.load_seconds
    small = estimate_checkpoint_restart("llama2-7b", "dp=16,tp=8", "dp=8,tp=8,pp=2", "a800-16x8")
    assert small.save_seconds < a.save_seconds


def test_fitted_a100_model_predicts_held_out_vtrain_rows():
    """The cost model fitted on vTrain's fit half (benchmarks/vtrain_a100_cost.json, seed-0 split)
    predicts a sample of the other half within 10% mean error; the A100 preset carries the same knobs;
    datasheet numbers alone do far worse."""
    from pathlib import Path

    from parashift.sim import simulate
    from parashift.sim.vtrain import program_of
    fitted = CostModel.load(str(Path(__file__).resolve().parents[1] / "benchmarks" / "vtrain_a100_cost.json"))
    df = load_iterations()
    perm = np.random.default_rng(0).permutation(len(df))
    test_rows = np.sort(perm[len(df) // 2:])[::18]  # 40 held-out rows
    c = clusters.get("a100-1x8")
    errs, raw, preset = [], [], []
    datasheet = CostModel.for_gpu(c.gpu, fitted=False)
    for i in test_rows:
        row = df.iloc[int(i)]
        prog, model = program_of(row)
        errs.append(abs(simulate(prog, c, fitted, model=model).step_time * 1e3 / row.time_ms - 1))
        raw.append(abs(simulate(prog, c, datasheet, model=model).step_time * 1e3 / row.time_ms - 1))
        preset.append(abs(simulate(prog, c, model=model).step_time * 1e3 / row.time_ms - 1))
    assert np.mean(errs) < 0.10
    assert np.mean(raw) > 2 * np.mean(errs)
    assert np.mean(preset) == pytest.approx(np.mean(errs), rel=1e-6)
