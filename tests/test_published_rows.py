"""The SC21 and Korthikanti rows ``benchmarks/fidelity_published.py`` predicts: every row describes a run
the simulator can compile (its model, strategy, cluster and GPU count agree), and the transcribed
times reproduce the figures their papers state (the wider tables: tests/test_published_sources.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from parashift import cluster as clusters, models
from parashift.strategy import Strategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import fidelity_published as fp  # noqa: E402


def test_every_published_row_is_a_run_the_simulator_can_compile():
    df = fp.load("korthikanti_2022,megatron_2021")
    assert set(df.file) == {"korthikanti_2022_table5.csv", "megatron_2021_table1.csv"}
    for _, row in df.iterrows():
        s = Strategy.parse(row.strategy)
        assert s.world == row.gpus, row["name"]
        assert clusters.get(row.cluster).devices >= row.gpus, row["name"]
        assert models.get(row.model).layers % s.pp == 0, row["name"]
        assert row.step_seconds > 0 and row.global_batch % (s.dp * s.mbs) == 0, row["name"]


def test_rows_state_the_software_their_papers_ran():
    """Korthikanti's 2022 runs: asynchronous TP all-reduce and fused gradient accumulation on; SC21's
    2021 software: both off (the strategy default)."""
    for _, row in fp.load("korthikanti_2022,megatron_2021").iterrows():
        s = Strategy.parse(row.strategy)
        assert (s.tp_async, s.grad_fusion) == ((True, True) if "korthikanti" in row.file else (False, False))


def _model_flops(row) -> float:
    """The papers' model FLOPs of one iteration, ``72 B s l h^2 (1 + s/(6h) + V/(12 l h))``."""
    m = models.get(row.model)
    B, s, l, h, V = row.global_batch, row.seq_len, m.layers, m.hidden, m.vocab
    return 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))


def test_korthikanti_times_give_the_papers_mfu():
    df = fp.load("korthikanti")
    sp = df[df.strategy.str.contains(",sp,")]
    mfu = [_model_flops(r) / (r.step_seconds * r.gpus * 312e12) for _, r in sp.iterrows()]
    assert mfu == pytest.approx([0.415, 0.514, 0.560, 0.563], abs=0.002)


def test_sc21_times_follow_from_their_published_throughput():
    df = fp.load("megatron_2021")
    for _, r in df.iterrows():   # the paper's equation (3), which counts the recomputed forward pass
        m = models.get(r.model)
        B, s, l, h, V = r.global_batch, r.seq_len, m.layers, m.hidden, m.vocab
        F = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
        assert F / (r.step_seconds * r.gpus) / 1e12 == pytest.approx(r.tflops_per_gpu, rel=1e-3), r["name"]


def test_set_parses_cost_model_changes():
    assert fp.overrides("grad_accum_traffic=0, pp_scatter_gather=false") == {"grad_accum_traffic": 0.0,
                                                                             "pp_scatter_gather": False}
    for bad in ("grad_accum_traffic", "no_such_field=1", "grad_accum_traffic=abc", "grad_accum_traffic=nan"):
        with pytest.raises(SystemExit):
            fp.overrides(bad)
