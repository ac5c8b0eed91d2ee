"""Generated bad inputs: numbers (hypothesis), truncations and byte flips of valid files."""
import importlib
import json

from hypothesis import HealthCheck, given, settings, strategies as st

from parashift.cli import main
from parashift.cli.inputs import load_cost_model, load_plan
from parashift.errors import ParashiftError

_NUM_TEXT = st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), st.integers(-10**12, 10**12).map(str),
                      st.text(max_size=6))
_S = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_S
@given(batch=_NUM_TEXT)
def test_any_global_batch_ends_cleanly(batch, capsys, monkeypatch):
    # the micro-batch limit lowered from 65,536 to 256: a valid batch above it takes the limit's error path
    # (as 65,537 up to 2^20 do; the limit itself: test_ir_compile.py) instead of simulating for up to 100 s
    monkeypatch.setattr(importlib.import_module("parashift.ir.compile"), "MAX_MICROBATCHES", 256)
    rc = main(["simulate", "--model", "tiny-gpt", "--cluster", "cpu-local", "--strategy", "dp=1",
               f"--global-batch={batch}", "--seq-len", "16", "--json"])
    err = capsys.readouterr().err
    assert rc in (0, 1, 2) and "Traceback" not in err and "internal error" not in err
    assert rc == 0 or len(err.strip().splitlines()) == 1


@_S
@given(value=_NUM_TEXT, flag=st.sampled_from(["--top-k", "--devices-per-node", "--devices", "--seed", "--from"]))
def test_plan_trace_numbers_are_range_checked(value, flag, capsys):
    # a bad --cost-model path makes every accepted number end at the cost model, before the planning work
    rc = main(["plan-trace", "bamboo/p3-trace.csv", "--model", "tiny-gpt", "--cluster", "cpu-local", "--global-batch",
               "8", "--seq-len", "16", f"{flag}={value}", "--cost-model", "/nonexistent.json"])
    err = capsys.readouterr().err
    assert rc in (1, 2) and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def _mutants(data: bytes, cuts, flips):
    for c in cuts:
        yield data[:c]
    for pos, byte in flips:
        b = bytearray(data)
        b[pos % len(b)] = byte
        yield bytes(b)


@settings(max_examples=60, deadline=None)
@given(cut=st.integers(0, 10**6), pos=st.integers(0, 10**6), byte=st.integers(0, 255))
def test_cost_model_truncations_and_flips(tmp_path_factory, cut, pos, byte):
    from parashift.cluster import get
    from parashift.cost import CostModel
    data = json.dumps(CostModel.for_cluster(get("cpu-local")).to_json()).encode()
    f = tmp_path_factory.mktemp("cm") / "c.json"
    for m in _mutants(data, [cut % (len(data) + 1)], [(pos, byte)]):
        f.write_bytes(m)
        try:
            load_cost_model(str(f))
        except ParashiftError as e:
            assert "\n" not in str(e)


@settings(max_examples=40, deadline=None)
@given(cut=st.integers(0, 10**6), pos=st.integers(0, 10**6), byte=st.integers(0, 255))
def test_plan_truncations_and_flips(tmp_path_factory, cut, pos, byte):
    d = tmp_path_factory.mktemp("plan")
    assert main(["schedule", "--model", "tiny-gpt", "--strategy", "dp=1", "--global-batch", "4", "--out",
                 str(d / "p.json")]) == 0
    data = (d / "p.json").read_bytes()
    for m in _mutants(data, [cut % (len(data) + 1)], [(pos, byte)]):
        (d / "m.json").write_bytes(m)
        try:
            load_plan(str(d / "m.json"))
        except ParashiftError:
            pass
