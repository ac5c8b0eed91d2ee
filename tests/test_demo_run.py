"""`parashift demo` end to end: run once into a temporary folder, then check the summary, the files
it links and that every figure is sane. Steps 3-6 run live on gloo processes."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from parashift.cli import main as cli_main
from parashift.cluster import get as get_cluster
from parashift.cost import CostModel
from parashift.demo import STEPS, run_demo
from parashift.explore import compared_schedules


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo-out")
    seen: list[str] = []
    result = run_demo(out, progress=seen.append)
    return result, seen


def _fig(result, step: int, name: str) -> float:
    return float(result.steps[step - 1].figure(name).value)


def test_every_step_ran_and_none_failed(demo):
    result, seen = demo
    assert [s.number for s in result.steps] == [1, 2, 3, 4, 5, 6]
    for s in result.steps:
        assert s.status == "ok" or s.status.startswith("not available: "), f"step {s.number}: {s.status}"
    assert result.steps[0].ok and result.steps[1].ok        # pure planning: always available
    assert result.ok
    # progress: "[i/7] ..." for every step, then the summary
    for i in range(1, 7):
        assert any(line.startswith(f"[{i}/7] ") for line in seen)
    assert seen[-1].startswith("[7/7] Summary")


def test_summary_links_existing_files_and_states_units(demo):
    result, _ = demo
    text = result.summary.read_text()
    assert result.summary == result.out / "summary.md"
    links = re.findall(r"\]\(([^)]+)\)", text)
    assert len(links) >= 6
    for rel in links:
        p = result.out / rel
        assert p.is_file() and p.stat().st_size > 0, rel
    for s in result.steps:
        assert f"## {s.number}. {s.title}" in text
        assert f"Status: **{s.status}**" in text
        for f in s.figures:
            assert f"| {f.name} | {f.text()} |" in text
    for name in ("explore_timeline.png", "explore_memory.png", "explore_trace.json", "switch_node_bytes.png",
                 "switch_vs_checkpoint.png"):
        assert (result.out / name).stat().st_size > 1000, name
    assert (result.out / "explore_timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = json.loads((result.out / "explore_trace.json").read_text())
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) > 1000


def test_explore_figures_are_sane(demo):
    result, _ = demo
    table = result.steps[0].data["table"]
    assert list(table["schedule"]) == list(compared_schedules())
    fits = table.set_index("schedule")["fits"]
    assert fits.drop("zb-2p").all()     # ZB-2p holds up to twice 1F1B's activations (the paper's 2x memory)
    ok = table[table["fits"]]
    assert (ok["step_time_s"] > 1).all() and (ok["step_time_s"] < 120).all()
    assert ((ok["bubble_fraction"] > 0) & (ok["bubble_fraction"] < 0.6)).all()
    assert ((ok["peak_memory_gib"] > 10) & (ok["peak_memory_gib"] < 80)).all()
    assert (table["mfu"] < 1).all()
    best = result.steps[0].data["best"]
    assert table.loc[table["schedule"] == best, "step_time_s"].iloc[0] == table["step_time_s"].min()
    for row in table.itertuples():
        assert _fig(result, 1, f"{row.schedule} step time") == pytest.approx(row.step_time_s)
        assert _fig(result, 1, f"{row.schedule} bubble") == pytest.approx(100 * row.bubble_fraction)


def test_switch_figures_are_sane(demo):
    result, _ = demo
    f = result.steps[1].data["figures"]
    gib = 2**30
    assert f["bytes_moved"] == f["bytes_needed"] > 0                   # moves what is missing, no more
    assert f["bytes_kept"] > f["bytes_moved"]
    # the new layout holds 3 bf16 parameter replicas (dp=3) and one ZeRO-1 sharded copy of the fp32
    # master and two Adam moments: (3 * 2 + 3 * 4) bytes per llama2-70b parameter
    assert (f["bytes_kept"] + f["bytes_moved"]) / gib == pytest.approx(68.98e9 * 18 / gib, rel=0.01)
    assert 0 < f["switch_s"] < 30
    assert f["checkpoint_restart_s"] > 10 * f["switch_s"]
    assert _fig(result, 2, "hot switch speedup over checkpoint-restart") == pytest.approx(
        f["checkpoint_restart_s"] / f["switch_s"])
    assert result.steps[1].data["plan"].dst_devices == tuple(list(range(40)) + list(range(48, 128)))


def test_live_steps_when_available(demo):
    result, _ = demo
    deploy, hot, replay = result.steps[2], result.steps[3], result.steps[4]
    if deploy.ok:
        table = deploy.data["measured"]   # the closed loop: winner (and runner-up) predicted vs measured
        best = str(deploy.data["search"].best.strategy)
        assert table["strategy"].iloc[0] == best and len(table) in (1, 2)
        for r in table.itertuples():
            tag = "winner" if r.strategy == best else "runner-up"
            ratio = _fig(result, 3, f"{tag} {r.strategy}: measured / predicted")
            assert math.isfinite(ratio) and ratio > 0
        text = result.summary.read_text()
        assert "| strategy | predicted ms | measured ms |" in text
        held = deploy.data["ranking_held"]
        assert ("The ranking held" in text) == (held is True) and ("did not hold" in text) == (held is False)
        plan = json.loads((result.out / "deploy_plan.json").read_text())
        datasheet = json.loads(json.dumps(CostModel.for_cluster(get_cluster("cpu-local")).to_json()))
        assert plan["meta"]["deploy"]["cost_model"] != datasheet   # searched with the fitted cost model
        assert _fig(result, 3, "instructions matched between run and simulation") > 0
        assert (result.out / "deploy_sim_vs_measured.png").stat().st_size > 1000
        assert (result.out / "deploy_plan.json").is_file()
    if hot.ok:
        assert _fig(result, 4, "largest relative loss difference to the static job") < 1e-5
        h = hot.data["hot"]
        assert len(h["losses"]) == len(h["static_losses"]) == len(h["restart_losses"]) == 8
        assert max(abs(a - b) / abs(b) for a, b in zip(h["restart_losses"], h["static_losses"])) < 1e-5
        for name in ("shrink 4 -> 3", "grow 3 -> 4"):
            pause = _fig(result, 4, f"{name}: hot switch pause")
            lost = _fig(result, 4, f"{name}: hot switch, training time lost")
            assert 0 < pause and 0 < lost < _fig(result, 4, f"{name}: DCP checkpoint-restart, training time lost")
        assert (result.out / "hot_switch_loss.png").stat().st_size > 1000
    if replay.ok:
        assert _fig(result, 5, "trace events replayed") >= 1
        late = _fig(result, 5, "preemptions handled after their notice ran out")
        text = result.summary.read_text()
        assert ("**FAILED**" in text) == (late > 0) and "lag_seconds" in text
        assert _fig(result, 5, "largest relative loss difference to the static job") < 1e-5
        assert (result.out / "replay.png").stat().st_size > 1000
        assert (result.out / "replay_events.csv").is_file()


def test_real_data_step_when_available(demo):
    result, _ = demo
    real = result.steps[5]
    if not real.ok:
        return
    r = real.data["real"]
    assert len(r["losses"]) == len(r["static_losses"]) == 12 and r["best"] != r["other"]
    assert r["live"]["samples"] == r["static"]["samples"]          # the same global batches, switch or not
    assert len(r["live"]["switches"]) == 1 and r["static"]["export_hf"]
    assert _fig(result, 6, "largest loss difference, switched vs static") < 1e-5
    assert _fig(result, 6, "last loss (switched run)") < _fig(result, 6, "first loss")
    assert _fig(result, 6, "exported safetensors shards") >= 1
    assert (result.out / "real_data_loss.png").stat().st_size > 1000
    cfg = json.loads((result.out / "real" / "hf-export" / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["vocab_size"] == 512
    assert "--tensor-model-parallel-size" in (result.out / "real" / "megatron_args.sh").read_text()
    assert "[parallelism]" in (result.out / "real" / "torchtitan.toml").read_text()
    commands = (result.out / "real" / "commands.sh").read_text().splitlines()
    assert [c.split()[1] for c in commands] == ["data", "search", "run", "run", "export", "export"]


def test_frame_and_json(demo):
    result, _ = demo
    df = result.frame()
    assert list(df.columns) == ["step", "figure", "value", "unit"]
    assert len(df) >= sum(max(1, len(s.figures)) for s in result.steps)
    js = json.loads(json.dumps(result.to_json()))
    assert js["steps"][1]["figures"]["simulated switch time"]["unit"] == "s"


def test_cli_demo_json_and_table(tmp_path, capsys):
    assert cli_main(["demo", "--out", str(tmp_path / "a"), "--only", "switch", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and [s["step"] for s in out["steps"]] == [2]
    assert out["steps"][0]["figures"]["checkpoint-restart estimate"]["value"] > 10
    assert (tmp_path / "a" / "summary.md").is_file()

    assert cli_main(["demo", "--out", str(tmp_path / "b"), "--only", "switch"]) == 0
    cap = capsys.readouterr()
    assert "simulated switch time" in cap.out and "summary.md" in cap.out
    assert "[2/7] Switch: planning" in cap.err


def test_cli_demo_rejects_unknown_step(tmp_path, capsys):
    assert cli_main(["demo", "--out", str(tmp_path), "--only", "explore,fly"]) == 1
    err = capsys.readouterr().err
    assert "unknown demo step(s) fly" in err and "explore" in err
    assert set(STEPS) == {"explore", "switch", "deploy", "hot-switch", "replay", "real-data"}
