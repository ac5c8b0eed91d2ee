"""The shape-aware compute model (parashift.cost.compute) and the knobs fitted on one node."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from parashift import cluster as clusters, models
from parashift.cost import CostModel, Workload, gemm_time
from parashift.cost.compute import tiles
from parashift.cost.fitted import A100_VTRAIN, KNOBS
from parashift.cost.model import knobs_of
from parashift.ir.program import Instr

A100 = CostModel.for_cluster(clusters.get("a100-1x8"))


def _brute_tiles(m: int, n: int, tm: int, tn: int) -> int:
    """Output tiles counted one by one (any tile that holds at least one element)."""
    return sum(1 for i in range(0, m, tm) for j in range(0, n, tn))


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 700), n=st.integers(1, 700), k=st.integers(1, 4096))
def test_gemm_time_counts_tiles_and_waves_like_brute_force(m, n, k):
    cm = A100.replace(gemm_overhead=0.0, hbm_bw=1e30)  # compute-bound only
    best = min(math.ceil(_brute_tiles(m, n, tm, tn) / cm.sms) * 2 * tm * tn * k / (cm.peak_flops / cm.sms * eff)
               for tm, tn, eff in tiles(cm))
    assert gemm_time(cm, m, n, k) == pytest.approx(best * (k + cm.gemm_k_half) / k)
    assert max(e for _, _, e in tiles(cm)) == cm.gemm_efficiency
    # never faster than the ceiling on the FLOPs it really does
    assert gemm_time(cm, m, n, k) >= 2 * m * n * k / (cm.peak_flops * cm.gemm_efficiency) * (1 - 1e-9)


def test_wave_quantization_and_memory_bound_gemms():
    cm = A100.replace(gemm_overhead=0.0)
    tm, tn = cm.gemm_tile_m, cm.gemm_tile_n
    fast_hbm = cm.replace(hbm_bw=1e30)
    one_wave = gemm_time(fast_hbm, tm * cm.sms, tn, 8192)
    over = gemm_time(fast_hbm, tm * (cm.sms + 1), tn, 8192)   # one more large tile: a second wave or smaller tiles
    assert 1.3 * one_wave < over <= 2 * one_wave * (1 + 1e-9)
    # a skinny GEMM (one token) streams its weight: HBM-bound, far below the ceiling
    w = 12288 * 4 * 12288
    t = gemm_time(cm, 1, 4 * 12288, 12288)
    assert t == pytest.approx((w + 12288 + 4 * 12288) * 2 / (cm.hbm_bw * cm.memory_efficiency))
    big = gemm_time(cm, 8192, 8192, 8192)
    assert 2 * 8192**3 / big > 2 * 12288 * 4 * 12288 / t * 50   # FLOP/s of the large one >> the skinny one


def test_large_gemms_run_at_the_sustained_ceiling_small_ones_below_it():
    cm = A100.replace(gemm_overhead=0.0)
    assert cm.gemm_sustained < cm.gemm_efficiency   # the A100 preset: power-limited clock below the best tile's rate
    flops = 2 * 2048 * 12800 * 25600                 # a 1T model's MLP GEMM under TP=8: long k, many full waves
    assert gemm_time(cm, 2048, 12800, 25600) == pytest.approx(flops / (cm.peak_flops * cm.gemm_sustained))
    uncapped = cm.replace(gemm_sustained=1.0)
    assert gemm_time(uncapped, 2048, 12800, 25600) < gemm_time(cm, 2048, 12800, 25600) / 1.03
    # a small, wave-quantized GEMM is slower per FLOP than the ceiling anyway: the cap does not touch it
    assert gemm_time(cm, 1024, 384, 1024) == gemm_time(uncapped, 1024, 384, 1024)
    with pytest.raises(Exception, match="gemm_sustained"):
        cm.replace(gemm_sustained=1.5)


def test_tensor_parallel_layers_do_not_shrink_by_tp_but_sequence_parallel_helps():
    m = models.get("gpt3-175b")
    one = Workload(m, tp=1, mbs=1, seq_len=2048).time(A100, "layer", "fwd")
    eight = Workload(m, tp=8, mbs=1, seq_len=2048).time(A100, "layer", "fwd")
    sp = Workload(m, tp=8, mbs=1, seq_len=2048, sp=True).time(A100, "layer", "fwd")
    assert one / 8 < eight < one / 4          # norms and dropouts stay whole on every TP rank
    assert sp < eight
    # micro-batch of one is less efficient per token than 8
    mb8 = Workload(m, tp=8, mbs=8, seq_len=2048).time(A100, "layer", "fwd")
    assert mb8 < 8 * eight


def test_unfused_attention_pays_for_scores_flash_does_not():
    flash = models.get("gpt:layers=2,hidden=4096,heads=32,seq_len=8192")
    unfused = models.get("gpt:layers=2,hidden=4096,heads=32,seq_len=8192,flash_attention=false")
    cm = A100.replace(attention_score_bytes=10.0)
    tf = Workload(flash, tp=1, mbs=1, seq_len=8192).time(cm, "attn", "fwd")
    tu = Workload(unfused, tp=1, mbs=1, seq_len=8192).time(cm, "attn", "fwd")
    assert tu > tf
    scores = 32 * 8192**2 * 10.0 / (cm.hbm_bw * cm.memory_efficiency)
    assert tu - tf == pytest.approx(scores, rel=0.5)


def test_selective_recompute_reruns_only_the_core_attention_and_nothing_under_cp():
    m = models.get("gpt:layers=2,hidden=4096,heads=32,seq_len=4096,flash_attention=false")
    full = Workload(m, tp=4, mbs=1, seq_len=4096, recompute="full")
    sel = Workload(m, tp=4, mbs=1, seq_len=4096, recompute="selective")
    core_fwd = sel._parts(A100, "attn")[1][0]
    assert core_fwd > 0 and sel.time(A100, "attn", "recompute") == core_fwd
    assert sel.time(A100, "mlp", "recompute") == 0.0 and sel.time(A100, "layer", "recompute") == core_fwd
    assert full.time(A100, "attn", "recompute") == full.time(A100, "attn", "fwd") > core_fwd
    ins = Instr(0, "compute", phase="recompute", region="layers.0.attn", flops=1e9)
    # no dispatch floor of the whole region and no re-run TP all-reduce: only the core's kernels
    assert A100.compute_time(ins, work=sel) == core_fwd < A100.compute_time(ins, work=full)
    cp = Workload(m, tp=4, mbs=1, seq_len=4096, cp=2, recompute="selective")
    assert cp.time(A100, "attn", "recompute") == 0.0   # the CP attention backward re-runs the core itself
    from parashift.strategy import Strategy
    assert Workload.of(m, Strategy.parse("dp=1,tp=4,recompute=selective"), 4096).selective


def test_phases_compose_and_moe_falls_back_to_flops():
    w = Workload(models.get("llama2-7b"), tp=2, mbs=2, seq_len=4096)
    for kind in ("attn", "mlp", "embed", "head"):
        assert w.time(A100, kind, "bwd") == pytest.approx(w.time(A100, kind, "bwd_input") + w.time(A100, kind, "bwd_weight"))
        assert w.time(A100, kind, "recompute") == w.time(A100, kind, "fwd")
    assert w.time(A100, "layer", "fwd") == pytest.approx(w.time(A100, "attn", "fwd") + w.time(A100, "mlp", "fwd"))
    moe = Workload(models.get("qwen3-30b-a3b"), tp=1, mbs=1, seq_len=4096)
    assert moe.time(A100, "moe", "fwd") is None
    ins = Instr(0, "compute", phase="fwd", region="layers.0.moe", flops=1e12)
    assert A100.compute_time(ins, work=moe) == pytest.approx(A100.replace(compute_model="flops").compute_time(ins))


def test_compute_model_flops_keeps_the_old_rule_and_old_files_load_as_flops(tmp_path):
    ins = Instr(0, "compute", phase="fwd", region="layers.0.mlp", flops=1e13)
    w = Workload(models.get("llama2-7b"), tp=1, mbs=1, seq_len=4096)
    flops = A100.replace(compute_model="flops")
    assert flops.compute_time(ins, work=w) == flops.compute_time(ins)
    assert A100.compute_time(ins, work=w) != flops.compute_time(ins)
    obj = A100.to_json()
    del obj["compute_model"]
    assert CostModel.from_json(obj).compute_model == "flops"
    with pytest.raises(Exception, match="compute_model"):
        A100.replace(compute_model="magic")


def test_a100_presets_use_the_knobs_fitted_on_one_node():
    fitted = CostModel.load(str(Path(__file__).resolve().parents[1] / "benchmarks" / "vtrain_a100_cost.json"))
    assert set(A100_VTRAIN) == set(KNOBS)
    for name in ("a100-1x8", "a100-64x8", "a800-16x8"):
        got = knobs_of(CostModel.for_cluster(clusters.get(name)))
        assert got == pytest.approx(knobs_of(fitted))
    raw = knobs_of(CostModel.for_gpu(clusters.GPUS["a100"], fitted=False))
    assert raw != pytest.approx(A100_VTRAIN)
