"""A new user's bad inputs, command by command: each ends in one line on stderr naming the problem, a
non-zero exit code and no traceback, in text and in --json mode.

Rows are (id, argv, a piece of the message); ``{F}`` is a folder of bad files. Most rows were tracebacks,
hangs or silently wrong results before (see the commit messages); the rest guard the neighbours that worked.
"""
import json

import pytest

from parashift.cli import main

SIM = ["simulate", "--cluster", "a100-1x8", "--strategy", "dp=1", "--global-batch", "2", "--seq-len", "8", "--model"]
TINY = ["simulate", "--model", "tiny-gpt", "--global-batch", "8", "--seq-len", "32"]
SCHED = ["schedule", "--model", "tiny-gpt", "--global-batch", "4"]
RL = ["search-rl", "--model", "tiny-gpt", "--cluster", "cpu-local", "--devices", "4", "--prompts", "8",
      "--prompt-len", "8", "--rollout-tokens", "8"]
PT = ["--model", "tiny-gpt", "--cluster", "cpu-local", "--global-batch", "8", "--seq-len", "32"]
G = "gpt:layers=2,hidden=8,heads=4"
MOE = "moe:layers=2,hidden=8,heads=4,experts=4,top_k=2,expert_ffn=8"

CASES = [
    # ---- inline and JSON models ---------------------------------------------------------------------------------
    ("pad_vocab zero", SIM + [G + ",pad_vocab=0"], "pad_vocab=0 must be a positive integer"),
    ("pad_vocab negative", SIM + [G + ",pad_vocab=-3"], "pad_vocab=-3 must be a positive integer"),
    ("kv_heads zero", SIM + [G + ",kv_heads=0"], "kv_heads=0 must be a positive integer"),
    ("ffn zero", SIM + [G + ",ffn=0"], "ffn=0 must be a positive integer"),
    ("head_dim zero", SIM + [G + ",head_dim=0"], "head_dim=0 must be a positive integer"),
    ("heads not dividing hidden", SIM + ["gpt:layers=2,hidden=8,heads=3"], "heads=3 must divide hidden=8"),
    ("heads over hidden", SIM + ["gpt:layers=2,hidden=8,heads=16"], "heads=16 must divide hidden=8"),
    ("kv_heads not dividing heads", SIM + [G + ",kv_heads=3"], "kv_heads=3 must divide heads=4"),
    ("shared_ffn negative", SIM + [MOE + ",shared_ffn=-8"], "shared_ffn=-8 must be a whole number >= 0"),
    ("top_k over experts", SIM + ["moe:layers=2,hidden=8,heads=4,experts=4,top_k=5,expert_ffn=8"],
     "top_k=5 exceeds experts=4"),
    ("empty model name", SIM + [G + ",name="], "name must not be empty"),
    ("too many layers", SIM + ["gpt:layers=99999999,hidden=8,heads=1"], "exceeds the limit of 10,000 layers"),
    ("duplicate model key", SIM + ["gpt:layers=2,layers=3,hidden=8,heads=4"], "given twice"),
    ("fractional layers in JSON", SIM + ["{F}/m_float.json"], "layers=2.7 must be an integer"),
    ("infinite layers in JSON", SIM + ["{F}/m_inf.json"], "layers=inf must be an integer"),
    ("experts text in JSON", SIM + ["{F}/m_experts.json"], "experts='x' must be an integer"),
    ("nested model JSON", SIM + ["{F}/nested.json"], "nests deeper than 64 levels"),
    ("latin-1 model JSON", SIM + ["{F}/latin1.json"], "is not UTF-8 text"),
    ("model folder", SIM + ["{F}"], "is a folder"),
    # ---- strategies ---------------------------------------------------------------------------------------------
    ("blank strategy", TINY + ["--cluster", "cpu-local", "--strategy", ""], "'' is empty"),
    ("comma strategy", SCHED + ["--strategy", ","], "',' is empty"),
    ("blank plan source", ["plan", "--model", "tiny-gpt", "--src", " ", "--dst", "dp=1"], "' ' is empty"),
    ("tp not dividing heads", TINY + ["--cluster", "cpu-local", "--strategy", "tp=3"], "tp=3 must divide"),
    ("pp over layers", TINY + ["--cluster", "cpu-local", "--strategy", "pp=8"], "exceeds the 4 layers"),
    ("ep not dividing experts", SIM + [MOE, "--strategy", "dp=3,ep=3", "--global-batch", "3"],
     "ep=3 must divide the expert count"),
    ("cp with odd seq-len", SCHED + ["--strategy", "cp=2", "--seq-len", "33"], "multiple of 2*cp=4"),
    ("sp with seq-len not a multiple of tp", SCHED + ["--strategy", "tp=2,sp", "--seq-len", "3"],
     "needs them to be a multiple of tp"),
    ("run sp with seq-len not a multiple of tp", ["run", "--strategy", "tp=2,sp", "--seq-len", "3", "--steps", "1"],
     "needs them to be a multiple of tp"),
    ("seq-len past learned positions", ["simulate", "--model", "gpt3-1.3b", "--cluster", "a100-1x8", "--strategy",
                                        "dp=8", "--global-batch", "8", "--seq-len", "4096"], "learns positions for 2048"),
    ("zero=4", SCHED + ["--strategy", "zero=4"], "zero=4 is not a ZeRO stage"),
    ("duplicate strategy key", SCHED + ["--strategy", "dp=2,dp=2"], "given twice"),
    ("cpu-local too small", TINY + ["--cluster", "cpu-local", "--strategy", "dp=999"], "e.g. cpu-local:nodes="),
    # ---- cluster overrides and files ----------------------------------------------------------------------------
    ("duplicate cluster key", ["clusters", "--cluster", "a100-1x8:nodes=2,nodes=3"], "given twice"),
    ("infinite nodes", ["clusters", "--cluster", "a100-1x8:nodes=1e400"], "must be a finite number"),
    ("infinite memory", TINY + ["--strategy", "dp=1", "--cluster", "a100-1x8:memory=1e400"], "must be a finite"),
    ("near-zero peak", TINY + ["--strategy", "dp=1", "--cluster", "a100-1x8:peak_bf16=1e-300"], "must be at least 1"),
    ("infinite cluster file", ["clusters", "--cluster", "{F}/cl_inf.json"], "must be a finite number"),
    ("nested cluster file", ["clusters", "--cluster", "{F}/nested.json"], "nests deeper than 64 levels"),
    ("zero nodes", ["clusters", "--cluster", "a100-0x8"], "at least one node"),
    ("negative bandwidth", ["clusters", "--cluster", "a100-1x8:nic_bw=-5GB"], "nic_bw='-5GB'"),
    ("unknown cluster key", ["clusters", "--cluster", "a100-1x8:foo=1"], "unknown cluster key 'foo'"),
    ("device beyond a cpu cluster", ["plan", "--model", "tiny-gpt", "--src", "dp=2", "--dst", "tp=2", "--cluster",
                                     "cpu-local:per_node=1"], "cpu-local:nodes=2,per_node=1"),
    # ---- cost models ----------------------------------------------------------------------------------------------
    ("near-zero cost-model peak", TINY + ["--cluster", "cpu-local", "--strategy", "dp=2", "--cost-model",
                                          "{F}/cm_peak.json"], "peak_flops must be >= 1"),
    ("near-zero efficiency", TINY + ["--cluster", "cpu-local", "--strategy", "dp=2", "--cost-model",
                                     "{F}/cm_eff.json"], "must be >= 1e-06"),
    ("huge latency", TINY + ["--cluster", "cpu-local", "--strategy", "dp=2", "--cost-model", "{F}/cm_lat.json"],
     "must be at most 3600"),
    # ---- search-rl --------------------------------------------------------------------------------------------------
    ("rl prompts huge", RL[:8] + ["99999999"] + RL[9:], "must be at most 1048576"),
    ("rl train layout too wide", RL + ["--train", "dp=8"], "runs 8 devices but the job has 4"),
    ("rl rollout layout too wide", RL + ["--rollout", "dp=8"], "runs 8 devices but the job has 4"),
    ("rl nested cost model", RL + ["--cost-model", "{F}/nested.json"], "nests deeper than 64 levels"),
    # ---- traces -------------------------------------------------------------------------------------------------------
    ("trace time beyond 30 years", ["plan-trace", "{F}/tr_bigt.csv"] + PT, "is beyond 1e+09 s"),
    ("empty trace name", ["plan-trace", ""] + PT, "the trace name is empty"),
    ("count trace window outside", ["plan-trace", "{F}/tr4.csv"] + PT + ["--from", "100"], "is empty"),
    ("replay snapshots without hosts", ["replay", "bamboo/p3-trace.csv", "--snapshot-every", "3"], "add --hosts"),
    ("replay seconds-per-step without hosts", ["replay", "bamboo/p3-trace.csv", "--seconds-per-step", "5"],
     "add --hosts"),
    # ---- run and calibrate: refused before any process starts -----------------------------------------------------------
    ("run strategy-for without endpoint", ["run", "--strategy-for", "2:dp=2", "--steps", "1"], "multi-host"),
    ("run heartbeat without endpoint", ["run", "--heartbeat-timeout", "3", "--steps", "1"], "multi-host"),
    ("calibrate no strategies", ["calibrate", "--out", "{F}/c.json", "--strategies", ";"], "names no strategy"),
    ("measured batch text", ["calibrate", "--out", "{F}/c.json", "--cluster", "a100-1x8", "--measured",
                             "{F}/me_gb.csv"], "global_batch 'x'"),
    ("measured batch fraction", ["calibrate", "--out", "{F}/c.json", "--cluster", "a100-1x8", "--measured",
                                 "{F}/me_frac.csv"], "global_batch '32.5'"),
    ("directives a folder", ["run", "--directives", "{F}", "--steps", "1"], "is a folder"),
    ("directives blank", ["run", "--directives", "", "--steps", "1"], "--directives is empty"),
    ("Order of a string", ["run", "--strategy", "pp=2", "--directives", "Order('nope')", "--steps", "1"],
     "give a dict of stage -> order"),
    ("demo with no step", ["demo", "--out", "{F}/demo", "--only", ","], "names no step"),
]


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    from parashift.cluster import get
    from parashift.cost import CostModel
    files = {
        "m_float.json": '{"layers": 2.7, "hidden": 8, "heads": 2}',
        "m_inf.json": '{"layers": 1e400, "hidden": 8, "heads": 2}',
        "m_experts.json": '{"experts": "x", "layers": 2, "hidden": 8, "heads": 2}',
        "nested.json": "[" * 10000 + "]" * 10000,
        "cl_inf.json": '{"gpu": "a100", "nodes": 1e400}',
        "tr_bigt.csv": "time,devices\n0,4\n1e300,2\n",
        "tr4.csv": "time,devices\n0,4\n10,2\n20,8\n30,8\n",
        "me_gb.csv": "model,strategy,global_batch,seq_len,step_seconds\ngpt3-1.3b,dp=8,x,2048,1\n",
        "me_frac.csv": "model,strategy,global_batch,seq_len,step_seconds\ngpt3-1.3b,dp=8,32.5,2048,1\n",
    }
    for name, text in files.items():
        (d / name).write_text(text)
    (d / "latin1.json").write_bytes('{"layers": "caf\xe9"}'.encode("latin-1"))
    for name, mutate in (("cm_peak.json", lambda o: o.__setitem__("peak_flops", 1e-300)),
                         ("cm_eff.json", lambda o: o["efficiency"].update({k: 1e-300 for k in o["efficiency"]})),
                         ("cm_lat.json", lambda o: o["latency"].update({k: 1e300 for k in o["latency"]}))):
        obj = CostModel.for_cluster(get("cpu-local")).to_json()
        mutate(obj)
        (d / name).write_text(json.dumps(obj))
    return d


@pytest.mark.parametrize("json_mode", [False, True], ids=["text", "json"])
@pytest.mark.parametrize("argv,expect", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_ends_in_one_line(argv, expect, json_mode, bad, capsys):
    argv = [a.replace("{F}", str(bad)) for a in argv] + (["--json"] if json_mode else [])
    rc = main(argv)
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.startswith("parashift")]
    assert rc not in (0, 3), (rc, err)
    assert "Traceback" not in err and "internal error" not in err, err
    assert len(lines) == 1 and expect in lines[0], err
    assert out == "", out   # nothing half-printed on stdout, in JSON mode neither


def test_count_trace_window_cuts_the_rows():
    """``plan-trace --from/--to`` on a time,devices CSV: the count in force opens the window, a row closes it."""
    import pandas as pd

    from parashift.cli.plan_trace import _count_window
    df = pd.DataFrame({"time": [0.0, 10.0, 20.0, 30.0], "devices": [4, 2, 8, 8]})
    got = _count_window("t", df, 12, 25)
    assert got["time"].tolist() == [12.0, 20.0, 25.0] and got["devices"].tolist() == [2, 8, 8]
    assert _count_window("t", df, 0, None)["time"].tolist() == [0.0, 10.0, 20.0, 30.0]


def test_inline_spec_runs_and_valid_overrides_stay():
    """What the checks must not refuse: an inline spec is a model (not MODULE:NAME); defaults still apply."""
    from parashift import cluster, models
    from parashift.cli.run_user import is_user_model
    assert not is_user_model("gpt:layers=2,hidden=8,heads=2") and is_user_model("mymod:MODEL")
    m = models.get("gpt:layers=2,hidden=8,heads=2")
    assert (m.kv_heads, m.ffn, m.head_dim) == (2, 32, 4)
    assert models.get("gpt:layers=2,hidden=8,heads=3,head_dim=4").head_dim == 4   # explicit head_dim: any heads
    assert cluster.get("a100-1x8:nic_bw=12.5GB,inter_latency=8us").nic_bw == 12.5e9
    assert cluster.get("cpu-local").with_devices(10**4).name.startswith("cpu-local:nodes=")


def test_json_mode_prints_strict_json(capsys):
    """A missing number (NaN: a device count where nothing fits) prints as null, so strict parsers (jq) read it."""
    from parashift.cli import emit
    emit({"step_time": float("nan"), "rows": [{"t": float("inf")}, (1.5, float("-inf"))]}, True)
    text = capsys.readouterr().out

    def refuse(const):
        raise ValueError(const)
    assert json.loads(text, parse_constant=refuse) == {"step_time": None, "rows": [{"t": None}, [1.5, None]]}


def test_search_rejects_oversized_steps_before_bounding_them():
    """A step over the compiler's micro-batch limit is ruled out at once (the memory bound replayed all of them)."""
    import time

    from parashift.search.evaluate import SimEvaluator
    from parashift.strategy import Strategy
    ev = SimEvaluator("tiny-gpt", "cpu-local", global_batch=2**20, seq_len=32)
    t0 = time.perf_counter()
    assert not ev.could_fit(Strategy.parse("dp=1,pp=2"))
    out = ev(Strategy.parse("dp=1,pp=2"))
    assert out.status == "invalid" and "micro-batches per step exceed" in out.reason
    assert time.perf_counter() - t0 < 2.0
