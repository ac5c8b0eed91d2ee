"""`parashift plan`: JSON keys, the text report, device lists and one-line errors."""
import json

import pytest

from parashift.cli import main

KEYS = {"verified", "plan_seconds", "bytes_kept", "bytes_moved", "bytes_needed", "bytes_inter_node", "messages",
        "src_devices", "dst_devices"}


def test_plan_json_node_loss(capsys):
    argv = ["plan", "--model", "llama2-7b", "--src", "dp=4,tp=4,pp=2,zero=1", "--dst", "dp=3,tp=4,pp=2,zero=1",
            "--cluster", "a800-4x8", "--dst-devices", "0-7,16-31", "--switch-placement", "given", "--json"]
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    assert KEYS <= set(r)
    assert r["verified"] is True and r["bytes_moved"] == r["bytes_needed"] > 0
    assert r["src_devices"] == "0-31" and r["dst_devices"] == "0-7,16-31"
    assert 0 < r["bytes_inter_node"] <= r["bytes_moved"] and r["messages"] > 0


def test_plan_keep_placement_orders_devices_within_nodes(capsys):
    base = ["plan", "--model", "llama2-7b", "--src", "dp=2,tp=4,zero=1", "--dst", "dp=1,tp=8", "--cluster",
            "a800-1x8", "--json"]
    assert main(base + ["--switch-placement", "given"]) == 0
    given = json.loads(capsys.readouterr().out)
    assert main(base) == 0   # keep is the default, as in `run --switch-placement`
    kept = json.loads(capsys.readouterr().out)
    assert given["dst_devices"] == "0-7" and kept["dst_devices"] != "0-7"
    assert kept["verified"] and kept["bytes_moved"] < given["bytes_moved"]


def test_plan_text_and_frame(capsys, tmp_path):
    out = tmp_path / "pieces.csv"
    assert main(["plan", "--model", "tiny-moe", "--src", "dp=4,ep=4,zero=1", "--dst", "dp=2,tp=2,ep=2",
                 "--frame", str(out)]) == 0
    text = capsys.readouterr().out
    assert "verified: every destination element covered exactly once" in text and "moved" in text
    import pandas as pd
    df = pd.read_csv(out)
    assert list(df.columns) == ["tensor", "kind", "src", "dst", "lo", "hi", "nbytes"]


@pytest.mark.parametrize("argv,msg", [
    (["--model", "nope", "--src", "dp=2", "--dst", "dp=1"], "unknown model 'nope'"),
    (["--model", "tiny-gpt", "--src", "dp=2", "--dst", "tp=3"], "tp=3 must divide"),
    (["--model", "tiny-gpt", "--src", "dp=2", "--dst", "dp=2", "--dst-devices", "0-2"],
     "runs 2 ranks but 3 destination devices"),
    (["--model", "tiny-gpt", "--src", "dp=2", "--dst", "dp=2", "--cluster", "zz-1x8"], "unknown cluster"),
    (["--model", "tiny-gpt", "--src", "dp=2", "--dst", "dp=2", "--src-devices", "0-x"], "bad device list item"),
])
def test_plan_errors(capsys, argv, msg):
    assert main(["plan", *argv]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and msg in err[0]


def test_plan_program_simulate_and_budget(capsys, tmp_path):
    from parashift.ir.program import Program
    out = tmp_path / "switch.json"
    argv = ["plan", "--model", "tiny-gpt", "--src", "pp=4", "--dst", "dp=2,tp=2", "--cluster", "a100-1x4",
            "--program", str(out), "--simulate", "--json"]
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    for k in ("switch_seconds", "checkpoint_restart_seconds", "speedup", "stages", "peak_memory_max", "lower_seconds"):
        assert k in r
    assert r["stages"] == 1 and r["speedup"] > 1 and r["switch_seconds"] > 0
    prog = Program.load(str(out)).validate()
    assert prog.meta["kind"] == "switch" and prog.world == 4
    budget = int(r["peak_memory_max"] * 0.7)
    assert main(argv + ["--memory-budget", str(budget)]) == 0
    tight = json.loads(capsys.readouterr().out)
    assert tight["stages"] > 1 and tight["peak_memory_max"] <= budget
    assert main(argv[:-1] + ["--memory-budget", "1KiB"]) == 1
    err = capsys.readouterr().err
    assert "more than its budget" in err and "raise the budget" in err
    assert main(argv[:-1] + ["--off", "promote,xor_order"]) == 0
    text = capsys.readouterr().out
    assert "simulated switch" in text and "checkpoint-restart estimate" in text
    assert main(argv[:-1] + ["--memory-budget", "lots"]) == 1
    assert "cannot read memory budget" in capsys.readouterr().err
