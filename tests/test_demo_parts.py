"""The demo's building blocks on small inputs: schedule comparison, byte matrices, the ablation, plots."""
from __future__ import annotations

import numpy as np
import pytest

from parashift import vps
from parashift.demo import ablation, bytes_matrix, compare_schedules, node_bytes, schedule_strategy, stage_ranks
from parashift.ir import parse_order
from parashift.plots import plot_bars, plot_bytes_heatmap, plot_gantt, plot_losses, plot_memory, plot_order
from parashift.errors import StrategyError
from parashift.explore import compared_schedules
from parashift.schedules import get_schedule
from parashift.demo import DemoError
from parashift.demo.real import switch_target, tiny_llama_config


@pytest.fixture(scope="module")
def tiny_plan():
    return vps.plan_switch("tiny-gpt", "dp=4,zero=1", "dp=3,zero=1", cluster="a800-2x4",
                           src_devices="0-3", dst_devices="0,1,4")


def test_bytes_matrix_accounts_for_every_moved_byte(tiny_plan):
    m = bytes_matrix(tiny_plan)
    st = tiny_plan.stats()
    assert m.sum() == st["bytes_moved"] > 0
    assert np.all(np.diag(m) == 0)                          # kept pieces are not traffic
    assert np.count_nonzero(m) == st["messages"]
    nb = node_bytes(tiny_plan)
    assert nb.shape == (2, 2) and nb.sum() == m.sum()
    assert nb[0, 1] + nb[1, 0] == st["bytes_inter_node"]


def test_ablation_has_a_row_per_pass(tiny_plan):
    df = ablation(tiny_plan, passes=("coalesce", "xor_order"))
    assert list(df["passes"]) == ["all on", "coalesce off", "xor_order off"]
    assert df["slowdown"].iloc[0] == 1.0 and (df["switch_s"] > 0).all()
    assert df.loc[1, "switch_messages"] >= df.loc[0, "switch_messages"]    # no coalescing: more messages


def test_compare_schedules_on_a_small_model():
    table, runs = compare_schedules("tiny-gpt", "cpu-local", "dp=1,pp=2", global_batch=4, seq_len=32,
                                    recompute="none")
    assert list(table["schedule"]) == list(compared_schedules())      # the registry's, gpipe left out
    assert [runs[s].strategy.vpp for s in table["schedule"]] == [get_schedule(s).chunks or 2 for s in table["schedule"]]
    assert (table["step_time_s"] > 0).all() and table["fits"].all()
    assert stage_ranks(runs["1f1b"].strategy) == [0, 1]
    with pytest.raises(StrategyError, match="unknown schedule"):
        schedule_strategy("dp=1,pp=2", "2f2b")


def test_plots_write_pngs(tmp_path):
    _, runs = compare_schedules("tiny-gpt", "cpu-local", "dp=1,pp=2", schedules=("1f1b",), global_batch=4,
                                seq_len=32, recompute="none")
    tl = runs["1f1b"].result.timeline
    plot_gantt({"a": tl, "b": tl}, str(tmp_path / "g.png"), unit="ms")
    import pandas as pd
    plot_memory(pd.DataFrame({"schedule": ["x", "y"], "states": [1e9, 2e9], "activations": [3e9, 1e9],
                              "buffers": [0, 0]}), str(tmp_path / "m.png"), capacity=4e9)
    plot_bytes_heatmap(np.array([[0, 2**30], [0, 0]]), str(tmp_path / "h.png"))
    plot_bars(["a", "b"], [1.0, 100.0], str(tmp_path / "b.png"), ylabel="s", log=True)
    plot_losses({"run": [3.0, 2.0, 1.5]}, str(tmp_path / "l.png"), marks=[(1, "switch")])
    orders = {st: [a for step in parse_order(text) for a in step] for st, text in enumerate(("0F0 0I0 0W0", "1F0 1B0"))}
    plot_order(orders, str(tmp_path / "o.png"), chunked=True, title="two stages")
    for name in ("g", "m", "h", "b", "l", "o"):
        assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG"


def test_real_data_model_and_switch_target(tmp_path):
    import json
    from parashift import models
    (tmp_path / "config.json").write_text(json.dumps(tiny_llama_config(300)))
    spec = models.get(f"hf:{tmp_path}")
    assert (spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.vocab) == (4, 64, 4, 2, 300)
    assert switch_target(["dp=2,zero=2", "dp=2,zero=1", "tp=2", "pp=2"]) == "tp=2"     # another dp/tp/pp shape
    with pytest.raises(DemoError, match="only one dp/tp/pp shape"):
        switch_target(["dp=2,zero=2", "dp=2"])
