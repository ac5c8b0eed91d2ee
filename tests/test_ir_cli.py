"""`parashift schedule` end to end."""
from __future__ import annotations

import json

from parashift.cli import main
from parashift.ir import Program


def test_schedule_json_plot_and_out(tmp_path, capsys):
    png, out = tmp_path / "order.png", tmp_path / "program.json"
    rc = main(["schedule", "--model", "tiny-gpt", "--strategy", "dp=2,pp=2,schedule=zb-h1", "--global-batch", "8",
               "--seq-len", "16", "--plot", str(png), "--out", str(out), "--json"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert res["valid"] is True and res["ranks"] == 4
    assert res["instructions"]["send"] == res["instructions"]["recv"] == 4 * 2 * 2
    assert res["compile_seconds"] >= 0
    assert res["order"]["1"].startswith("1F0 1I0 1F1 1I1")   # zb-h1: the last stage defers its W's
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    prog = Program.load(str(out))
    assert prog.world == 4 and prog.meta["schedule"] == "zb-h1"
    prog.validate()


def test_schedule_human_output_and_errors(capsys):
    assert main(["schedule", "--model", "tiny-moe", "--strategy", "dp=2,tp=2,ep=2", "--global-batch", "4",
                 "--seq-len", "16"]) == 0
    text = capsys.readouterr().out
    assert "valid: True" in text and "all_to_all=" in text and "stage 0: 0F0 0B0 0F1 0B1" in text
    assert main(["schedule", "--model", "tiny-gpt", "--strategy", "tp=3", "--global-batch", "4"]) == 1
    assert "tp=3 must divide" in capsys.readouterr().err
