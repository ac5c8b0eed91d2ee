"""A rolled-back switch does not silently drop the later scheduled switches: the result lists them."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))   # tests/switch_faults.py

from switch_faults import Corrupt  # noqa: E402

from parashift.cli import main  # noqa: E402
from parashift.cli import run_live as cli_run_live  # noqa: E402


def test_switches_after_a_rollback_are_reported(monkeypatch, capsys):
    real = cli_run_live.run_live

    def faulty(*a, **kw):   # corrupt a buffer of the first switch: it rolls back
        return real(*a, **kw, switch_timeout=20, faults=Corrupt(device=1, switch=1))
    monkeypatch.setattr(cli_run_live, "run_live", faulty)
    rc = main(["run", "--strategy", "dp=2,tp=2", "--steps", "5", "--switch-at", "2:dp=4,zero=1",
               "--switch-at", "4:dp=2,tp=2", "--switch-notice", "1", "--timeout", "120", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and len(out["losses"]) == 5
    assert "rolled back" in out["switches"][0]["aborted"]
    (skip,) = out["skipped_switches"]
    assert skip["step"] == 4 and "rolled back" in skip["reason"]
