"""``parashift run --switch-at``: a live job that reshapes, shrinks and grows, reported as JSON."""
import json

import numpy as np

from parashift.cli import main


def _run_json(capsys, argv: list[str]) -> dict:
    """``parashift <argv>`` in this process; its JSON output."""
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_run_switch_at_json_reports_every_switch(capsys):
    argv = ["run", "--model", "tiny-gpt", "--strategy", "dp=2,tp=2", "--nprocs", "4", "--steps", "6",
            "--switch-at", "2:dp=4,zero=1", "--switch-at", "3:dp=2,zero=2:1,3", "--switch-at", "4:tp=2,pp=2:0,1,2,4",
            "--json"]
    out = _run_json(capsys, argv)
    assert len(out["losses"]) == 6 and all(np.isfinite(out["losses"]))
    assert [s["step"] for s in out["switches"]] == [2, 3, 4]
    assert [s["dst"] for s in out["switches"]] == ["dp=4,tp=1,pp=1,zero=1", "dp=2,tp=1,pp=1,zero=2",
                                                   "dp=1,tp=2,pp=2"]
    assert out["devices"] == [[0, 1, 2, 3], [0, 1, 2, 3], [1, 3], [0, 1, 2, 4]]
    for s in out["switches"]:
        assert 0 < s["pause_seconds"] < s["seconds"]
        assert "aborted" not in s
    assert out["losses"][-1] < out["losses"][0]


def test_switch_memory_budget_stages_the_switch_and_frees_old_state(capsys):
    argv = ["run", "--model", "tiny-gpt", "--strategy", "dp=2,tp=2", "--nprocs", "4", "--steps", "3",
            "--switch-at", "2:dp=4,zero=1", "--json"]
    whole = _run_json(capsys, argv)
    staged = _run_json(capsys, argv + ["--switch-memory-budget", "1.6MiB"])
    assert staged["losses"] == whole["losses"]
    (w,), (s,) = whole["switches"], staged["switches"]
    assert (w["stages"], w["released_bytes"]) == (1, 0)
    assert s["stages"] > 1 and s["released_bytes"] > 0 and s["peak_bytes"] < w["peak_bytes"]
    assert w["fits"] and w["budget_auto"] and w["memory_budget"] is None and w["planned_peak_bytes"] > 0
    assert not s["budget_auto"] and s["memory_budget"] == int(1.6 * 2**20)


def test_bad_switch_at_is_a_one_line_error(capsys):
    assert main(["run", "--strategy", "dp=2", "--steps", "4", "--switch-at", "2:dp=3:0,1"]) == 1
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "3 ranks but 2 devices" in lines[0]


def test_switch_placement_keep_reorders_and_given_keeps_the_listed_order(capsys):
    argv = ["run", "--model", "tiny-gpt", "--strategy", "dp=2,tp=2", "--nprocs", "4", "--steps", "3",
            "--switch-at", "2:dp=2,tp=2,zero=1:3,2,1,0", "--json"]
    kept = _run_json(capsys, argv)
    given = _run_json(capsys, argv + ["--switch-placement", "given"])
    assert given["devices"][1] == [3, 2, 1, 0]
    assert sorted(kept["devices"][1]) == [0, 1, 2, 3] and kept["devices"][1] != [3, 2, 1, 0]
    assert kept["switches"][0]["bytes_moved"] < given["switches"][0]["bytes_moved"]
    assert kept["losses"] == given["losses"]
