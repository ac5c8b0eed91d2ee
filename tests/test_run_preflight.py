"""`parashift run` checks the machine before it starts anything, and compares a plan's prediction
with what it measured."""
import pytest

from parashift import ir
from parashift.cli import main, preflight as pf


def test_preflight_counts_processes_per_core_and_simulated_memory():
    small = ir.compile("tiny-gpt", "dp=2,pp=2", global_batch=8, seq_len=32)
    figs = pf.preflight(small, cores=2, memory=8 * 2**30)
    assert figs["processes"] == 4 and figs["processes_per_core"] == 2
    assert 4 * pf.PROCESS_BYTES < figs["memory_estimate"] < 4 * pf.PROCESS_BYTES + 2**30
    wide = ir.compile("tiny-gpt", "dp=32", global_batch=32, seq_len=32)
    with pytest.raises(pf.PreflightError, match=r"32 processes on 2 cores \(16.0 per core.*--force"):
        pf.preflight(wide, cores=2, memory=64 * 2**30)
    with pytest.raises(pf.PreflightError, match="of memory .* available.*a smaller model"):
        pf.preflight(small, cores=2, memory=2**30)


def test_run_refuses_in_one_line_unless_forced(monkeypatch, capsys):
    monkeypatch.setattr(pf.os, "cpu_count", lambda: 2)
    argv = ["run", "--model", "tiny-gpt", "--strategy", "dp=32", "--global-batch", "32", "--steps", "1"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot run tiny-gpt on 32 processes" in err and "--force" in err


def test_prediction_reads_the_plan_and_spots_the_datasheet_cost_model(tmp_path):
    from parashift import search
    res = search.tune("tiny-gpt", "cpu-local", devices=2, global_batch=8, seq_len=32, n_trials=5, seed=0)
    res.export(str(tmp_path / "plan.json"))
    from parashift.exec import load_plan
    pred = pf.prediction(load_plan(str(tmp_path / "plan.json")))
    assert pred["step_time"] == pytest.approx(res.best.step_time) and pred["uncalibrated"] is True
    fitted = res.cost_model or __import__("parashift").sim.CostModel.for_cluster(res.cluster)
    res2 = search.tune("tiny-gpt", "cpu-local", devices=2, global_batch=8, seq_len=32, n_trials=5, seed=0,
                       cost_model=fitted.replace(peak_flops=fitted.peak_flops * 0.5))
    res2.export(str(tmp_path / "plan2.json"))
    assert pf.prediction(load_plan(str(tmp_path / "plan2.json")))["uncalibrated"] is False
    assert pf.prediction(ir.compile("tiny-gpt", "dp=2", global_batch=8, seq_len=32)) is None
