"""A step whose capability is missing says so ("not available: why") and shows no figures; a step
that breaks says "failed: ..." and makes `parashift demo` exit non-zero, after writing the summary."""
from __future__ import annotations

import pytest

import parashift.demo as demo
from parashift.cli import main as cli_main
from parashift.demo import DemoContext, Figure, NotAvailable, StepResult, require, run_step, write_summary


def _ok(ctx, res):
    res.add("speed", 12345.6, "tokens/s")
    res.add("pause", 0.0123, "s")


def _missing(ctx, res):
    require("parashift.no_such_module", "replay")


def _missing_name(ctx, res):
    require("parashift.sim", "time_travel")


def _broken(ctx, res):
    res.add("half done", 1.0, "s")
    raise ValueError("boom")


def test_run_step_statuses(tmp_path):
    ctx = DemoContext(tmp_path)
    ok = run_step(1, "One", _ok, ctx)
    assert ok.ok and ok.figure("speed").text() == "12,346 tokens/s" and ok.figure("pause").text() == "0.0123 s"
    gone = run_step(2, "Two", _missing, ctx)
    assert gone.status.startswith("not available: parashift.no_such_module cannot be imported")
    assert run_step(3, "Three", _missing_name, ctx).status == "not available: parashift.sim has no time_travel yet"
    bad = run_step(4, "Four", _broken, ctx)
    assert bad.status.startswith("failed: ValueError: boom (at test_demo_status.py:")
    with pytest.raises(NotAvailable):
        require("parashift.no_such_module")

    path = write_summary(tmp_path, [ok, gone, bad], 3.0)
    text = path.read_text()
    assert "| speed | 12,346 tokens/s |" in text
    assert "Status: **not available: parashift.no_such_module cannot be imported" in text
    assert "Status: **failed: ValueError: boom" in text


def test_figure_text_units():
    assert Figure("n", 1126, "messages").text() == "1,126 messages"
    assert Figure("x", 179.6, "x").text() == "179.6 x"
    assert Figure("loss", 5.5647, "").text() == "5.56"
    assert Figure("tiny", 3e-7, "").text() == "3e-07"


def test_cli_exits_nonzero_when_a_step_fails(tmp_path, monkeypatch, capsys):
    steps = [("Explore: fake", _ok), ("Switch: fake", _broken), ("Tune and deploy: fake", _missing),
             ("Hot switch: fake", _ok), ("Replay: fake", _missing_name), ("Real data: fake", _ok)]
    monkeypatch.setattr(demo, "_steps", lambda: steps)
    assert cli_main(["demo", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "1 step(s) failed" in err and "2. failed: ValueError: boom" in err
    text = (tmp_path / "summary.md").read_text()
    assert "## 3. Tune and deploy: fake" in text and "not available" in text

    steps[1] = ("Switch: fake", _ok)
    assert cli_main(["demo", "--out", str(tmp_path), "--json"]) == 0     # missing capabilities are not failures
