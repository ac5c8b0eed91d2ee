"""The traces shipped in the repository's traces/ folder: all load, each set has its license."""
from __future__ import annotations

import numpy as np
import pytest

from parashift import traces
from parashift.errors import TraceFormatError

SHIPPED = traces.shipped()


def test_shipped_set_is_small_and_licensed():
    root = traces.root()
    assert root.name == "traces" and len(SHIPPED) >= 20
    total = sum(p.stat().st_size for p in SHIPPED)
    assert total < 3_000_000
    folders = {p.relative_to(root).parts[0] for p in SHIPPED}
    assert folders == {"bamboo", "oobleck", "parcae", "spotserve", "training-on-a-dime"}
    for f in folders:
        license_text = (root / f / "LICENSE").read_text()
        assert "MIT License" in license_text or "Apache License" in license_text
        prov = (root / f / "PROVENANCE.md").read_text()
        assert "commit" in prov.lower() and "License" in prov
    assert (root / "README.md").is_file()
    idx = traces.index()
    assert set(idx["license"]) <= {"MIT", "Apache-2.0"}
    # files listed exist, and nothing trace-like sits in a shipped folder without being listed
    listed = {root / p for p in idx["path"]}
    assert all(p.is_file() for p in listed)
    on_disk = {p for f in folders for p in (root / f).rglob("*")
               if p.is_file() and p.name not in ("LICENSE", "PROVENANCE.md")}
    assert on_disk == listed


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(traces.root())))
def test_every_shipped_trace_loads(path):
    rel = str(path.relative_to(traces.root()))
    df = traces.load(path)
    expected = traces.index().set_index("path").loc[rel, "format"]
    assert df.attrs["format"] == expected
    traces.check(df)
    curve = traces.availability(df)
    assert (curve["available"] >= 0).all()
    assert (np.diff(curve["time"].to_numpy()) >= 0).all()
    assert df.attrs["duration"] > 0
    s = traces.scale(df, devices_per_node=1, max_devices=4, time_scale=600)
    dev = np.concatenate([[s.attrs["initial_devices"]], s["devices"].to_numpy()])
    assert ((dev >= 1) & (dev <= 4)).all()
    # the shipped name resolves from anywhere
    assert traces.load(rel).equals(df)


def test_known_figures_of_the_main_traces():
    p3 = traces.describe(traces.load("bamboo/p3-trace.csv"))
    assert (p3["initial"], p3["min"], p3["max"], p3["nodes_lost"]) == (18, 10, 32, 167)
    assert p3["duration_s"] == 40920.0
    gc = traces.describe(traces.load("bamboo/gcloud/v100x1-east1c.txt"))
    assert (gc["initial"], gc["min"], gc["max"], gc["nodes_lost"], gc["largest_loss"]) == (80, 30, 80, 518, 40)
    seg = traces.describe(traces.load("parcae/segments/bert/trace_hh_55_65.txt"))
    assert (seg["initial"], seg["min"], seg["max"], seg["nodes_lost"]) == (32, 20, 32, 19)
    # Parcae's per-minute results replay the same p3 curve as Bamboo's event log
    live = traces.availability(traces.load("parcae/liveput_res/bert_p3_gbs1024_mbs8.json"))
    ev = traces.availability(traces.load("bamboo/p3-trace.csv"))
    grid = np.arange(0, 40920, 60.0) + 30
    at = lambda c: c["available"].to_numpy()[np.searchsorted(c["time"].to_numpy(), grid, "right") - 1]  # noqa
    assert (at(live) == at(ev)).all()


def test_pattern_and_env_override(tmp_path, monkeypatch):
    assert all("spotserve" in str(p) for p in traces.shipped("spotserve/*"))
    assert len(traces.shipped("spotserve/*")) == 5
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "a.csv").write_text("0,add,a\n60000,remove,a\n")
    (tmp_path / "README.md").write_text("docs")
    monkeypatch.setenv(traces.ENV, str(tmp_path))
    assert traces.root() == tmp_path
    assert traces.shipped() == [tmp_path / "mine" / "a.csv"]
    assert traces.load("mine/a.csv").attrs["format"] == "event-log"
    monkeypatch.setenv(traces.ENV, str(tmp_path / "missing"))
    with pytest.raises(TraceFormatError, match="PARASHIFT_TRACES"):
        traces.shipped()


def test_catalog_summarizes_every_shipped_trace():
    cat = traces.catalog()
    assert len(cat) == len(SHIPPED)
    assert set(cat["license"]) <= {"MIT", "Apache-2.0"}
    assert (cat["min"] >= 0).all() and (cat["max"] >= cat["min"]).all() and (cat["duration_s"] > 0).all()
    row = cat.set_index("path").loc["spotserve/trace_0304_real.txt"]
    assert (row["initial"], row["min"], row["max"], row["format"]) == (7, 7, 10, "spotserve-segment")
    assert traces.NOTICE_SECONDS == {"aws": 120.0, "gcp": 30.0}
