"""The measured timeline and the simulated one share a schema and join on instruction id;
the runtime executes every instruction, in its stream's order."""
from __future__ import annotations

import json


from parashift.cli import main as cli_main
from parashift.exec import run
from parashift.exec.profiler import TIMELINE_COLUMNS
from parashift.sim import TIMELINE_COLUMNS as SIM_COLUMNS
from parashift.sim import simulate


def test_measured_and_simulated_timelines_join_on_instruction_id(tmp_path):
    res = run("tiny-gpt", "dp=2,pp=2,zero=1", steps=2, global_batch=8, seq_len=16, timeout=120)
    measured = res.to_frame()
    simulated = simulate(res.program, "cpu-local").timeline
    assert tuple(measured.columns) == tuple(SIM_COLUMNS) == TIMELINE_COLUMNS
    assert tuple(simulated.columns) == tuple(SIM_COLUMNS)
    keys = ["rank", "id"]
    joined = measured.merge(simulated, on=keys, suffixes=("_run", "_sim"), validate="one_to_one")
    assert len(joined) == len(measured) == len(simulated) == res.program.num_instructions()
    for col in ("stream", "op", "phase", "nbytes"):
        a, b = joined[f"{col}_run"], joined[f"{col}_sim"]
        assert ((a == b) | (a.isna() & b.isna())).all(), col
    assert (measured["end"] >= measured["start"]).all()
    # each stream ran its instructions in program order
    for (rank, stream), grp in measured.groupby(["rank", "stream"]):
        order = [i.id for i in res.program.ranks[rank].streams[stream]]
        assert grp.sort_values("start", kind="stable")["id"].tolist() == order
        assert (grp.sort_values("start")["start"].diff().dropna() >= 0).all()

    trace = tmp_path / "trace.json"
    res.to_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == len(measured)


def test_cli_run_json_and_plan_file(tmp_path, capsys):
    from parashift.exec import compile_program
    trace = tmp_path / "t.json"
    code = cli_main(["run", "--model", "tiny-gpt", "--strategy", "dp=2", "--steps", "2", "--global-batch", "4",
                     "--seq-len", "16", "--trace", str(trace), "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"losses", "step_times", "peak_memory", "strategy", "nprocs"}
    assert len(out["losses"]) == 2 and out["nprocs"] == 2 and len(out["peak_memory"]) == 2
    assert trace.exists()

    plan = tmp_path / "plan.json"
    compile_program("tiny-gpt", "dp=2", global_batch=4, seq_len=16).save(str(plan))
    assert cli_main(["run", str(plan), "--steps", "2", "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["losses"] == out["losses"]          # the same program, data and optimizer

    assert cli_main(["run", "--model", "tiny-gpt", "--strategy", "dp=2", "--nprocs", "3", "--steps", "1"]) == 1
    assert "needs 2 processes" in capsys.readouterr().err
