"""Shared fixtures of the bad-input corpus: a folder of bad files made once per session."""
import json
import os

import pytest

from parashift.cli import main


@pytest.fixture(scope="session")
def good(tmp_path_factory):
    """Valid files to mutate: a cost model and a deploy plan."""
    d = tmp_path_factory.mktemp("good")
    from parashift.cluster import get
    from parashift.cost import CostModel
    CostModel.for_cluster(get("cpu-local")).save(str(d / "cost.json"))
    assert main(["schedule", "--model", "tiny-gpt", "--strategy", "dp=1", "--global-batch", "8",
                 "--out", str(d / "plan.json")]) == 0
    return d


def run_cli(argv, capsys, out_dir):
    """Run the CLI in-process; return (exit code, stderr lines, files left in out_dir)."""
    before = set(os.listdir(out_dir))
    rc = main(argv)
    err = capsys.readouterr().err
    # progress lines ("replay: ...") and deprecation warnings are not the error message
    lines = [ln for ln in err.splitlines() if ln.startswith("parashift") and ": warning:" not in ln]
    assert "Traceback" not in err, err
    left = sorted(set(os.listdir(out_dir)) - before)
    return rc, lines, left


def write(path, data):
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return str(path)


def dumps(obj):
    return json.dumps(obj)
