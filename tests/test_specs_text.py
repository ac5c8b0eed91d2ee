"""Models and clusters from text: presets, inline specs, JSON files, overrides; the clusters command."""
from __future__ import annotations

import json

import pytest

from parashift import cluster as clusters, models
from parashift.cli import main
from parashift.cost import CostModel
from parashift.errors import ClusterError, ParashiftError, StrategyError, UnknownPresetError


def test_inline_gpt_spec_matches_the_builder_and_names_itself():
    m = models.get("gpt:layers=96,hidden=12288,heads=96,vocab=51200,gated=false,norm=ln,bias=true")
    ref = models.gpt(96, 12288, 96, vocab=51200, gated=False, norm="ln", bias=True)
    assert m.params == ref.params and m.ffn == 4 * 12288 and not m.gated
    assert models.get(m.name) == m          # a compiled Program's meta["model"] rebuilds the model
    e = models.get("moe:layers=4,hidden=64,heads=4,experts=8,top_k=2,expert_ffn=64,shared_ffn=64")
    assert e.is_moe and e.experts == 8 and e.top_k == 2


@pytest.mark.parametrize("text, match", [
    ("gpt:layers=2,hiden=64,heads=2", "unknown gpt model key 'hiden'"),
    ("gpt:layers=two,hidden=64,heads=2", "layers='two' must be an integer"),
    ("gpt:hidden=64,heads=2", "lacks layers"),
    ("gpt:layers=2,hidden=64,heads=2,norm=batch", "norm='batch' must be one of"),
    ("gpt:layers=2,hidden=64,heads=3,kv_heads=2", "kv_heads=2 must divide"),
    ("moe:layers=2,hidden=64,heads=2", "lacks experts"),
    ("gpt:layers=2,layers=3,hidden=64,heads=2", "given twice"),
    ("gpt:layers=2,hidden=64,heads=2,dropout=some", "dropout='some' must be a number"),
    ("gpt:layers=2,hidden=64,heads=2,dropout=1.5", r"dropout=1.5 must be in \[0, 1\)"),
])
def test_bad_inline_specs_name_the_key(text, match):
    with pytest.raises(StrategyError, match=match):
        models.get(text)


def test_model_json_file(tmp_path):
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"name": "mine", "layers": 2, "hidden": 128, "heads": 4, "vocab": 1000}))
    m = models.get(str(f))
    assert m.name == "mine" and m.layers == 2 and m.vocab == 1024   # padded to 128
    f.write_text(json.dumps({"layers": 2, "hidden": 128, "heads": 4, "colour": "red"}))
    with pytest.raises(StrategyError, match="unknown gpt model key 'colour'"):
        models.get(str(f))
    with pytest.raises(ParashiftError, match="does not exist"):
        models.get(str(tmp_path / "none.json"))
    with pytest.raises(UnknownPresetError, match="inline spec"):
        models.get("gpt-9")


def test_cluster_overrides_nics_and_units():
    c = clusters.get("a100-64x8:inter_bw=12.5GB,nics_per_node=4")
    assert (c.nic_bw, c.nics_per_node, c.devices) == (12.5e9, 4, 512)
    assert c.inter_bw == pytest.approx(12.5e9 * 4 / 8)          # one device's share of its node's NICs
    assert CostModel.for_cluster(c).bandwidth["inter"] == c.inter_bw
    assert clusters.get("a100-2x8").inter_bw == 25e9 and clusters.get("a800-2x8").inter_bw == 12.5e9
    d = clusters.get("h100-2x8:nic_bw=400Gb,memory=96GiB,intra_latency=4us,peak_fp8=2P")
    assert d.nic_bw == 50e9 and d.gpu.memory == 96 * 2**30 and d.gpu.intra_latency == 4e-6
    assert d.gpu.peak("fp8") == 2e15 and d.gpu.peak("bf16") == 989e12
    assert clusters.get(c.name) == c                              # the name parses back
    assert c.with_devices(1024).devices == 1024 and c.with_devices(1024).nics_per_node == 4


@pytest.mark.parametrize("text, match", [
    ("a100-4x8:bogus=1", "unknown cluster key 'bogus'"),
    ("a100-4x8:nic_bw=fast", "nic_bw='fast' is not a number"),
    ("a100-4x8:nics_per_node=2.5", "nics_per_node='2.5' must be a positive integer"),
    ("a100-4x8:hbm_bw=3us", "hbm_bw='3us': a time unit"),
    ("a100-4x8:nic_bw", "not key=value"),
    ("tpu-4x8", "unknown cluster"),
])
def test_bad_cluster_text_names_the_key(text, match):
    with pytest.raises(ParashiftError, match=match):
        clusters.get(text)


def test_cluster_json_file(tmp_path):
    f = tmp_path / "mine.json"
    f.write_text(json.dumps({"gpu": "a100", "nodes": 4, "per_node": 8, "nics_per_node": 4, "nic_bw": "200Gb",
                             "hbm_bw": "1.6TB"}))
    c = clusters.get(str(f))
    assert (c.name, c.devices, c.nic_bw, c.gpu.hbm_bw) == ("mine", 32, 25e9, 1.6e12)
    f.write_text(json.dumps({"gpu": "z100", "nodes": 4}))
    with pytest.raises(ClusterError, match="unknown gpu 'z100'"):
        clusters.get(str(f))
    f.write_text(json.dumps({"gpu": "a100", "hosts": [8, 8, 4], "nic_bw": "200Gb"}))   # nodes of unequal sizes
    c = clusters.get(str(f))
    assert (c.name, c.nodes, c.per_node, c.devices, c.node_of(16), c.nic_bw) == ("mine", 3, 8, 20, 2, 25e9)
    for obj, what in (({"gpu": "a100", "nodes": 4}, "gives no per_node"),      # no silent default size
                      ({"gpu": "a100"}, "gives no nodes or per_node"),
                      ({"gpu": "a100", "hosts": [8], "nodes": 1}, "drop nodes and per_node")):
        f.write_text(json.dumps(obj))
        with pytest.raises(ClusterError, match=what):
            clusters.get(str(f))


def test_clusters_command_lists_presets_and_described_clusters(capsys):
    assert main(["clusters", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["name"] for r in rows} == set(clusters.names())
    assert main(["clusters", "--cluster", "a100-64x8:nics_per_node=4", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["nics_per_node"] == 4 and row["inter_bw_per_device"] == pytest.approx(12.5e9)
    assert main(["clusters"]) == 0
    assert "nics" in capsys.readouterr().out
    assert main(["clusters", "--cluster", "a100-1x8:nope=1"]) == 1
    err = capsys.readouterr().err
    assert "unknown cluster key 'nope'" in err and len(err.strip().splitlines()) == 1


def test_simulate_takes_an_inline_model_and_an_overridden_cluster(capsys):
    argv = ["simulate", "--model", "gpt:layers=4,hidden=1024,heads=16", "--strategy", "dp=2,pp=2,tp=2",
            "--global-batch", "16", "--seq-len", "1024", "--json"]
    assert main(argv + ["--cluster", "a100-2x8"]) == 0
    fast = json.loads(capsys.readouterr().out)["step_time"]
    assert main(argv + ["--cluster", "a100-2x8:nic_bw=1GB,per_node=4"]) == 0   # pipeline stages on two nodes
    slow = json.loads(capsys.readouterr().out)["step_time"]
    assert slow > fast
