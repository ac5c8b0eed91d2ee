"""`parashift search` and `parashift plan-trace` end to end, with the real compiler, simulator and runtime."""
import json

import pandas as pd
import pytest

from parashift import ir, search
from parashift.cli import main
from parashift.ir.program import Program

TINY = ["--model", "tiny-gpt", "--cluster", "cpu-local", "--global-batch", "16", "--seq-len", "32"]


def test_search_json_writes_a_plan_that_parashift_run_trains(tmp_path, capsys):
    plan, png = tmp_path / "plan.json", tmp_path / "search.png"
    assert main(["search", *TINY, "--devices", "4", "--trials", "25", "--seed", "0", "--out", str(plan),
                 "--plot", str(png), "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("best", "best_tokens_per_s", "best_step_time", "trials", "feasible_trials", "search_seconds"):
        assert key in out
    assert out["trials"] == 25 and 0 < out["feasible_trials"] <= 25 and out["best_tokens_per_s"] > 0
    assert png.stat().st_size > 10_000
    # the plan is exactly the Program the search scored, plus how it was made
    saved = Program.load(str(plan))
    best = search.canonical(__import__("parashift").Strategy.parse(out["best"]))
    deploy = saved.meta["deploy"]
    bare = saved.replace(meta={k: v for k, v in saved.meta.items() if k != "deploy"})
    assert bare == ir.compile("tiny-gpt", best, global_batch=16, seq_len=32)
    assert deploy["strategy"] == out["best"] and deploy["model"] == "tiny-gpt" and deploy["devices"] == 4
    assert deploy["cost_model"]["format"] == "parashift.cost_model"
    assert deploy["predicted"]["tokens_per_s"] == pytest.approx(out["best_tokens_per_s"])
    rc = main(["run", str(plan), "--steps", "2", "--json"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    ran = json.loads(cap.out)
    assert ran["predicted_step_seconds"] == pytest.approx(deploy["predicted"]["step_time"])
    assert ran["measured_step_seconds"] > 0 and ran["cost_model_calibrated"] is False
    assert any("uncalibrated" in w for w in ran["warnings"])
    assert len(ran["losses"]) == 2 and all(l > 0 for l in ran["losses"]) and ran["strategy"] == out["best"]


def test_search_resumes_from_sqlite_and_reports_the_pareto_front(tmp_path, capsys):
    db = f"sqlite:///{tmp_path / 's.db'}"
    args = ["search", *TINY, "--devices", "2", "--trials", "8", "--storage", db, "--json", "--no-progress",
            "--objective", "throughput,memory", "--zero", "0,1"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    second = json.loads(capsys.readouterr().out)
    assert first["trials"] == 8 and second["trials"] == 16 and second["study_name"] == first["study_name"]
    front = second["pareto"]
    assert front and all(a["peak_memory"] <= b["peak_memory"] for a, b in zip(front, front[1:]))


def test_plan_trace_cli_on_a_hand_built_trace(tmp_path, capsys):
    csv = tmp_path / "trace.csv"
    pd.DataFrame({"time": [0, 30, 31, 60], "devices": [4, 2, 4, 4]}).to_csv(csv, index=False)
    png = tmp_path / "plan.png"
    assert main(["plan-trace", str(csv), *TINY, "--schedules", "1f1b", "--zero", "0,1", "--mbs", "1,2",
                 "--recompute", "none", "--plot", str(png), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    pol = out["policies"]
    assert set(pol) == set(search.POLICIES)
    assert pol["switch-aware"]["tokens"] >= pol["hot-switch"]["tokens"] > pol["checkpoint-restart"]["tokens"]
    assert pol["checkpoint-restart"]["lost_seconds"] > pol["hot-switch"]["lost_seconds"]
    assert [r["devices"] for r in out["per_count"]] == [2, 4]
    assert png.stat().st_size > 10_000


def test_plan_trace_reads_a_shipped_trace(capsys):
    assert main(["plan-trace", "bamboo/p3-trace.csv", "--to", "1800", "--model", "gpt3-1.3b", "--cluster",
                 "a100-4x8", "--devices-per-node", "1", "--global-batch", "64", "--seq-len", "2048",
                 "--schedules", "1f1b", "--zero", "1", "--mbs", "1", "--recompute", "none", "--top-k", "1",
                 "--max-candidates", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["segments"] > 1 and out["duration_s"] == pytest.approx(1800)
    assert all(r["devices"] <= 32 for r in out["per_count"])


def test_search_offers_tp_async_and_grad_fusion(capsys):
    """--tp-async off,on searches both (tp_async only where tp > 1), --grad-fusion on only it; a value
    other than off/on is refused in one line."""
    assert main(["search", *TINY, "--devices", "4", "--trials", "30", "--seed", "0", "--tp-async", "off,on",
                 "--grad-fusion", "on", "--zero", "0", "--recompute", "none", "--json", "--no-progress",
                 "--top", "30"]) == 0
    top = [__import__("parashift").Strategy.parse(c["strategy"]) for c in json.loads(capsys.readouterr().out)["top"]]
    assert top and all(s.grad_fusion for s in top)
    assert all(s.tp > 1 for s in top if s.tp_async) and any(s.tp_async for s in top)
    assert any(not s.tp_async and s.tp > 1 for s in top)
    assert main(["search", *TINY, "--trials", "1", "--tp-async", "yes", "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tp-async: 'yes' is not one of off, on" in err[0], err
