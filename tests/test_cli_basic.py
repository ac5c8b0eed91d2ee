"""The CLI's shared behaviour: --json, one-line errors with a non-zero exit, python -m parashift."""
import json
import subprocess
import sys

import pytest

from parashift import models
from parashift.cli import main


def test_models_json_lists_presets(capsys):
    assert main(["models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == models.names()
    assert all(r["params"] == models.get(r["name"]).params for r in rows)


def test_models_table(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "llama2-70b" in out and "68.98B" in out


def test_python_dash_m_runs_the_same_cli():
    out = subprocess.run([sys.executable, "-m", "parashift", "models", "--json"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert json.loads(out)[0]["name"] == models.names()[0]


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["plan", "--model", "gpt-9", "--src", "dp=2", "--dst", "dp=1"]])
def test_user_error_is_one_line_and_nonzero(argv):
    r = subprocess.run([sys.executable, "-m", "parashift", *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "unknown model 'gpt-9'" in lines[0] and "llama2-70b" in lines[0]
