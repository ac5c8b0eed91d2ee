"""The bad-input corpus: every sub-command and every file a user can pass, each bad input ending in
one line on stderr (no traceback), a non-zero exit code and no file left behind.

Rows are (id, argv, exit code); ``{F}`` is the folder of bad files, ``{O}`` an empty output folder.
"""
import json

import pytest

from parashift.cli.inputs import COST_MODEL_SCHEMA

from .conftest import run_cli

SIM = ["simulate", "--model", "tiny-gpt", "--cluster", "cpu-local", "--strategy", "dp=1", "--global-batch", "8",
       "--seq-len", "32"]
SCHED = ["schedule", "--model", "tiny-gpt", "--strategy", "dp=1", "--global-batch", "8"]
SEARCH = ["search", "--model", "tiny-gpt", "--cluster", "cpu-local", "--global-batch", "8", "--seq-len", "32",
          "--trials", "2", "--no-progress"]
PLAN = ["plan", "--model", "tiny-gpt", "--src", "dp=2", "--dst", "dp=1"]
PT = ["plan-trace", "bamboo/p3-trace.csv", "--model", "tiny-gpt", "--cluster", "cpu-local", "--global-batch", "8",
      "--seq-len", "32"]
REPLAY = ["replay", "bamboo/p3-trace.csv"]
RUN = ["run"]
CAL = ["calibrate", "--out", "{O}/c.json"]
BASES = {"simulate": SIM, "schedule": SCHED, "search": SEARCH, "plan": PLAN, "plan-trace": PT, "replay": REPLAY,
         "run": RUN, "calibrate": CAL}

# ---- numbers: option -> values that must be refused (exit 2: argparse type; 1: checked later) ----------------
NAN = ["nan", "inf", "-inf", "abc", ""]
NUMBERS = {
    "simulate": {"--global-batch": NAN + ["0", "-8", "1e400", "99999999999998", "2.5"],
                 "--seq-len": NAN + ["0", "-1", "99999999", "1.5"]},
    "schedule": {"--global-batch": NAN + ["0", "-3", "99999999999998"], "--seq-len": ["0", "nan", "99999999"]},
    "search": {"--trials": NAN + ["0", "-1", "1e9"], "--seed": NAN + ["-1", "1.5", str(2**33)],
               "--top": ["0", "-2", "nan"], "--devices": ["0", "-1", "nan"], "--global-batch": ["0", "nan", "1e30"],
               "--zero": ["5", "-1", "x", ",", "0,9"], "--mbs": ["0", "-1", "x", "1,0"],
               "--recompute": ["foo", "none,foo", ","], "--schedules": ["nope", "1f1b,x"]},
    "plan": {"--switch-memory-budget": ["nan", "inf", "-5", "0", "abc", "5XB", "1e400"],
             "--memory-budget": ["nan", "inf"], "--off": ["foo", "stage,bar"], "--kinds": [",", ""]},
    "plan-trace": {"--devices-per-node": ["0", "-1", "nan", "1.5"], "--devices": ["0", "-1", "nan"],
                   "--max-devices": ["0", "-4"], "--top-k": ["0", "-1", "nan"], "--max-candidates": ["0", "inf"],
                   "--seed": ["-1", "nan"], "--from": ["nan", "-5", "inf"], "--to": ["nan", "-1"],
                   "--trials": ["0", "nan"], "--zero": ["5"], "--mbs": ["0"], "--recompute": ["foo"]},
    "replay": {"--nprocs": ["0", "-1", "nan", "100000"], "--max-procs": ["0", "nan"],
               "--time-scale": ["0", "-1", "nan", "inf"], "--notice": ["-1", "nan"],
               "--devices-per-node": ["0", "-2", "nan"], "--max-steps": ["0", "-1"], "--timeout": ["0", "-1", "nan"],
               "--max-events": ["0", "nan"], "--from": ["-1", "nan"], "--global-batch": ["0", "nan"]},
    "run": {"--lr": ["nan", "-1", "0", "inf", "abc"], "--timeout": ["0", "-5", "nan", "inf"],
            "--steps": ["0", "-1", "nan"], "--nprocs": ["0", "-1", "100000"], "--global-batch": ["0", "nan"],
            "--seq-len": ["0", "99999999"], "--switch-notice": ["-1", "nan"]},
    "calibrate": {"--runs": ["0", "-1", "nan"], "--nprocs": ["0", "nan"], "--steps": ["0", "nan"],
                  "--host-cores": ["-1", "nan", "inf"], "--global-batch": ["0", "nan"]},
}
CASES = [(f"{cmd} {opt}={v!r}", BASES[cmd] + [f"{opt}={v}"], None)
         for cmd, opts in NUMBERS.items() for opt, vals in opts.items() for v in vals]

# ---- whole argv that must fail --------------------------------------------------------------------------------
CASES += [
    ("run huge switch device", RUN + ["--steps", "4", "--switch-at", "2:dp=2:0,99999999"], 1),
    ("run switch after last step", RUN + ["--steps", "4", "--switch-at", "9:dp=2"], 1),
    ("run switch bad grammar", RUN + ["--switch-at", "x:dp=2"], 1),
    ("run seq-len memory", RUN + ["--seq-len", "4000000", "--global-batch", "1000000"], 1),
    ("run huge world", RUN + ["--strategy", "dp=1024"], 1),
    ("run bad strategy", RUN + ["--strategy", "dp=x"], 1),
    ("run unknown model", RUN + ["--model", "gpt-9"], 1),
    ("run switch with plan", RUN + ["{F}/plan_ok_missing.json", "--switch-at", "1:dp=2"], 1),
    ("schedule microbatch bound", SCHED[:-1] + ["1048576", "--strategy", "dp=1,pp=4"], 1),
    ("simulate unknown cluster", SIM[:4] + ["nope-1x8"] + SIM[5:], 1),
    ("simulate strategy too big", SIM[:6] + ["dp=64"] + SIM[7:], 1),
    ("search storage not a url", SEARCH + ["--storage", "new.db"], 1),
    ("search storage no folder", SEARCH + ["--storage", "sqlite:////nonexistent/dir/s.db"], 1),
    ("search storage folder", SEARCH + ["--storage", "sqlite:///{F}"], 1),
    ("search storage bad driver", SEARCH + ["--storage", "nosuchdb://u:pw@h/x"], 1),
    ("search unknown model", SEARCH[:2] + ["gpt-9"] + SEARCH[3:], 1),
    ("plan bad devices", PLAN + ["--src-devices", "0-x"], 1),
    ("plan-trace traversal", ["plan-trace", "../../../../etc/shadow"] + PT[2:], 1),
    ("plan-trace traversal 2", ["plan-trace", "bamboo/../../../etc/passwd"] + PT[2:], 1),
    ("plan-trace no such", ["plan-trace", "nope/none.csv"] + PT[2:], 1),
    ("plan-trace folder", ["plan-trace", "{F}"] + PT[2:], 1),
    ("plan-trace to before from", PT + ["--from", "100", "--to", "50"], 1),
    ("replay traversal", ["replay", "../../../../etc/shadow"], 1),
    ("replay folder", ["replay", "{F}"], 1),
    ("replay to before from", REPLAY + ["--from", "100", "--to", "10"], 1),
    ("calibrate no timelines", CAL + ["--from-timelines", "{F}/none"], 1),
    ("calibrate strategies world", CAL + ["--nprocs", "2", "--strategies", "dp=4"], 1),
    ("calibrate unknown cluster", CAL + ["--cluster", "zz-1x1"], 1),
    ("unknown command", ["frobnicate"], 2),
    ("unknown option", SIM + ["--frob"], 2),
    ("missing required", ["simulate"], 2),
]

# ---- outputs: unwritable or wrong kinds, checked before the work ---------------------------------------------
OUTS = {"simulate": ["--timeline", "--plot"], "schedule": ["--out", "--plot"], "search": ["--out", "--plot"],
        "plan": ["--frame", "--program"], "plan-trace": ["--plot", "--table"], "replay": ["--plot", "--table"],
        "run": ["--timeline"], "calibrate": ["--out"]}
for cmd, flags in OUTS.items():
    base = [a for a in BASES[cmd] if a != "{O}/c.json" and a != "--out"] if cmd == "calibrate" else BASES[cmd]
    for flag in flags:
        image = flag == "--plot"
        for what, path in (("missing folder", "/nonexistent/x.png" if image else "/nonexistent/x.json"),
                           ("a folder", "{O}"), ("trailing slash", "{O}/sub/"), ("empty", "")):
            CASES.append((f"{cmd} {flag} {what}", base + [flag, path], 1))
        if image:
            CASES.append((f"{cmd} {flag} not an image", base + [flag, "{O}/plot.txt"], 1))
            CASES.append((f"{cmd} {flag} no suffix", base + [flag, "{O}/plot"], 1))
CASES += [
    ("search partial outputs", SEARCH + ["--out", "{O}/p.json", "--plot", "/nonexistent/p.png"], 1),
    ("schedule partial outputs", SCHED + ["--out", "{O}/p.json", "--plot", "{O}"], 1),
    ("schedule same path twice", SCHED + ["--out", "{O}/p.png", "--plot", "{O}/p.png"], 1),
    ("demo out is a file", ["demo", "--out", "{F}/binary.json"], 1),
]

# ---- files the user passes -------------------------------------------------------------------------------------
FILE_BYTES = {
    "binary.json": b"\x00\x01\x02\xff\xfe" * 50,
    "latin1.json": "{\"gpu\": \"caf\xe9\"}".encode("latin-1"),
    "nested.json": b"[" * 100000 + b"]" * 100000,
    "nested_obj.json": b'{"a":' * 5000 + b"1" + b"}" * 5000,
    "empty.json": b"",
    "list.json": b"[1, 2, 3]",
    "string.json": b'"cost"',
    "null.json": b"null",
    "truncated.json": b'{"peak_flops": 1e12, "hbm_bw": ',
    "nan.json": b'{"peak_flops": NaN}',
    "trace_binary.csv": b"\x00\xff" * 100,
    "trace_nested.json": b"[" * 100000,
    "trace_empty.csv": b"",
    "trace_comments.csv": b"# nothing\n# here\n",
    "trace_shadowlike.txt": b"root:$6$abcdefgh$SECRETHASHVALUE:19000:0:99999:7:::\n",
    "avail_text.csv": b"time,available\n0,4\n10,abc\n",
    "avail_neg.csv": b"time,available\n0,4\n10,-1\n",
    "avail_frac.csv": b"time,available\n0,4\n10,1.5\n",
    "avail_nan.csv": b"time,available\n0,nan\n",
    "avail_inf_time.csv": b"time,available\ninf,4\n",
    "avail_back.csv": b"time,available\n0,4\n10,2\n5,3\n",
    "avail_wide.csv": b"time,available\n0,4,9\n",
    "avail_header_only.csv": b"time,available\n",
    "devices_text.csv": b"time,devices\n0,x\n",
    "devices_neg_time.csv": b"time,devices\n-5,4\n",
    "latin1.csv": "time,available\n0,4\n10,\xe9\n".encode("latin-1"),
}


def _cost(good, mutate):
    obj = json.loads((good / "cost.json").read_text())
    mutate(obj)
    return json.dumps(obj)


def _plan(good, mutate):
    obj = json.loads((good / "plan.json").read_text())
    mutate(obj)
    return json.dumps(obj)


COST_FIELDS = [k.rstrip("!") for k in COST_MODEL_SCHEMA if k.rstrip("!") not in ("format", "gpu", "algorithm")]
COST_MUTATIONS = {}
for k in COST_FIELDS:
    COST_MUTATIONS[f"cost_{k}_str.json"] = (lambda k: lambda o: o.__setitem__(k, "x"))(k)
    COST_MUTATIONS[f"cost_{k}_null.json"] = (lambda k: lambda o: o.__setitem__(k, None))(k)
    COST_MUTATIONS[f"cost_{k}_neg.json"] = (lambda k: lambda o: o.__setitem__(
        k, {"local": -1.0, "intra": -1.0, "inter": -1.0} if isinstance(o[k], dict) else -1.0))(k)
COST_MUTATIONS.update({
    "cost_zero_eff.json": lambda o: o["efficiency"].update({k: 0.0 for k in o["efficiency"]}),
    "cost_zero_peak.json": lambda o: o.__setitem__("peak_flops", 0),
    "cost_neg_latency.json": lambda o: o["latency"].__setitem__("intra", -1e-6),
    "cost_missing_peak.json": lambda o: o.pop("peak_flops"),
    "cost_unknown_key.json": lambda o: o.__setitem__("turbo", 1),
    "cost_bad_format.json": lambda o: o.__setitem__("format", "other"),
    "cost_bad_algorithm.json": lambda o: o.__setitem__("algorithm", "magic"),
    "cost_missing_link.json": lambda o: o["bandwidth"].pop("inter"),
    "cost_bool_peak.json": lambda o: o.__setitem__("peak_flops", True),
    "cost_list_eff.json": lambda o: o.__setitem__("efficiency", [1, 2]),
})
PLAN_MUTATIONS = {
    "plan_no_programs.json": lambda o: o.pop("programs"),
    "plan_no_ranks.json": lambda o: o.pop("ranks"),
    "plan_no_meta.json": lambda o: o.pop("meta"),
    "plan_no_strategy.json": lambda o: o.pop("strategy"),
    "plan_no_format.json": lambda o: o.pop("format"),
    "plan_no_version.json": lambda o: o.pop("version"),
    "plan_bad_version.json": lambda o: o.__setitem__("version", 999),
    "plan_programs_str.json": lambda o: o.__setitem__("programs", "x"),
    "plan_ranks_list.json": lambda o: o.__setitem__("ranks", [0]),
    "plan_rank_oob.json": lambda o: o["ranks"].__setitem__("0", 7),
    "plan_rank_neg.json": lambda o: o["ranks"].__setitem__("0", -1),
    "plan_rank_name.json": lambda o: o["ranks"].__setitem__("x", 0),
    "plan_empty_ranks.json": lambda o: o.__setitem__("ranks", {}),
    "plan_empty_streams.json": lambda o: [p["streams"].__setitem__(k, []) for p in o["programs"] for k in p["streams"]],
    "plan_no_streams.json": lambda o: [p.__setitem__("streams", {}) for p in o["programs"]],
    "plan_streams_list.json": lambda o: [p.__setitem__("streams", []) for p in o["programs"]],
    "plan_instr_short.json": lambda o: [p["streams"].__setitem__(k, [[0, "fwd"]]) for p in o["programs"]
                                        for k in p["streams"]],
    "plan_instr_bad_field.json": lambda o: [p["streams"].__setitem__(k, [[0, "fwd", {"nope": 1}]])
                                            for p in o["programs"] for k in p["streams"]],
    "plan_meta_batch_str.json": lambda o: o["meta"].__setitem__("global_batch", "8"),
    "plan_meta_batch_zero.json": lambda o: o["meta"].__setitem__("global_batch", 0),
    "plan_meta_no_model.json": lambda o: o["meta"].pop("model"),
    "plan_meta_bad_model.json": lambda o: o["meta"].__setitem__("model", "gpt-9"),
    "plan_bad_strategy.json": lambda o: o.__setitem__("strategy", "dp=x"),
    "plan_strategy_int.json": lambda o: o.__setitem__("strategy", 3),
    "plan_static_neg.json": lambda o: [p.__setitem__("static_memory", {"a": -1}) for p in o["programs"]],
}


@pytest.fixture(scope="session")
def bad(tmp_path_factory, good):
    d = tmp_path_factory.mktemp("bad")
    for name, data in FILE_BYTES.items():
        (d / name).write_bytes(data)
    for name, fn in COST_MUTATIONS.items():
        (d / name).write_text(_cost(good, fn))
    for name, fn in PLAN_MUTATIONS.items():
        (d / name).write_text(_plan(good, fn))
    with open(d / "huge_trace.csv", "wb") as f:   # sparse: over the trace size limit, no disk used
        f.truncate(20 * 2**20)
    (d / "sub").mkdir()
    return d


GENERIC = [n for n in FILE_BYTES if not n.startswith(("trace_", "avail_", "devices_"))]
TRACES = [n for n in FILE_BYTES if n.startswith(("trace_", "avail_", "devices_", "binary", "nested", "empty",
                                                  "latin1"))] + ["huge_trace.csv"]
CASES += [(f"cost model {n}", SIM + ["--cost-model", "{F}/" + n], 1) for n in GENERIC + list(COST_MUTATIONS)]
CASES += [(f"search cost model {n}", SEARCH + ["--cost-model", "{F}/" + n], 1)
          for n in ("binary.json", "nested.json", "cost_zero_peak.json", "cost_neg_latency.json")]
CASES += [(f"calibrate base {n}", CAL + ["--base", "{F}/" + n], 1) for n in ("list.json", "cost_zero_eff.json")]
CASES += [(f"plan-trace cost model {n}", PT + ["--cost-model", "{F}/" + n], 1) for n in ("nan.json",)]
CASES += [(f"run plan {n}", RUN + ["{F}/" + n], 1) for n in GENERIC + list(PLAN_MUTATIONS) + ["sub"]]
CASES += [(f"plan-trace {n}", ["plan-trace", "{F}/" + n] + PT[2:], 1) for n in TRACES]
CASES += [(f"replay {n}", ["replay", "{F}/" + n], 1) for n in TRACES if not n.startswith(("avail", "devices"))]
CASES += [("run missing plan", RUN + ["{F}/none.json"], 1), ("simulate missing cost", SIM + ["--cost-model", "/x/y"], 1)]

assert len(CASES) >= 250, len(CASES)


@pytest.mark.parametrize("argv,code", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(argv, code, bad, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    argv = [a.replace("{F}", str(bad)).replace("{O}", str(out)) for a in argv]
    rc, lines, left = run_cli(argv, capsys, out)
    assert rc == code if code is not None else rc in (1, 2), (rc, lines)
    assert len(lines) == 1, lines
    assert "Traceback" not in lines[0] and "internal error" not in lines[0], lines[0]
    assert lines[0].startswith("parashift"), lines[0]
    assert "SECRETHASH" not in lines[0] and "root:" not in lines[0]   # errors never echo a file's contents
    assert left == [], left
