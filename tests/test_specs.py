"""Specs: model presets, Strategy text and validation, the rank grid, clusters and device lists."""
from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from parashift import Strategy, cluster as clusters, models
from parashift.errors import ClusterError, DeviceListError, StrategyError, UnknownPresetError
from parashift.ir.schedules import get_schedule
from parashift.strategy import RECOMPUTE, SCHEDULES


# ---- models ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(models.PUBLIC_PARAMS))
def test_presets_match_public_parameter_counts(name):
    m = models.get(name)
    assert abs(m.params / models.PUBLIC_PARAMS[name] - 1) < 0.01, (name, m.params)


def test_every_preset_listed_and_tiny_models_are_tiny():
    assert set(models.PUBLIC_PARAMS) | {"tiny-gpt", "tiny-moe"} == set(models.names())
    for n in ("tiny-gpt", "tiny-moe"):
        assert models.get(n).params < 10e6 and models.get(n).dtype == "fp32"
    assert models.get("qwen3-235b-a22b").layers == 94 and models.get("qwen3-235b-a22b").experts == 128
    assert models.get("llama2-70b").kv_heads == 8


def test_unknown_model_lists_presets():
    with pytest.raises(UnknownPresetError) as e:
        models.get("llama-3")
    assert "llama2-70b" in str(e.value) and "tiny-moe" in str(e.value)


def test_custom_models_and_tensor_metadata():
    m = models.gpt(layers=2, hidden=32, heads=4, kv_heads=2, vocab=100, seq_len=16, pad_vocab=8)
    assert m.vocab == 104 and m.ffn == 128
    names = [t.name for t in m.tensors]
    assert names[0] == "embed.word" and names[-1] == "head.out" and len(set(names)) == len(names)
    assert m.tensor("layers.1.attn.qkv.weight").shape == (32 + 2 * 16, 32)
    assert m.tensor("layers.1.attn.qkv.weight").tp_dim == 0 and m.tensor("layers.1.attn.out.weight").tp_dim == 1
    moe = models.moe(2, 32, 4, vocab=64, experts=4, top_k=2, expert_ffn=16, shared_ffn=8)
    fc1 = moe.tensor("layers.0.moe.experts.fc1")
    assert fc1.shape == (4, 32, 32) and fc1.ep_dim == 0 and fc1.tp_dim == 1
    assert moe.active_params < moe.params
    with pytest.raises(StrategyError, match="kv_heads=3 must divide heads=4"):
        models.gpt(2, 32, 4, kv_heads=3)
    with pytest.raises(StrategyError, match="top_k=5 exceeds experts=4"):
        models.moe(2, 32, 4, experts=4, top_k=5, expert_ffn=8)


# ---- Strategy text ----------------------------------------------------------------------------------------
@st.composite
def any_strategy(draw):
    cp = draw(st.integers(1, 3))
    ep = 1 if cp > 1 else draw(st.integers(1, 4))
    dp = ep * draw(st.integers(1, 4))
    schedule = draw(st.sampled_from(SCHEDULES))
    vpp = draw(st.sampled_from(get_schedule(schedule).vpp_choices((2, 4))))
    tp = draw(st.integers(1, 8))
    return Strategy(dp=dp, tp=tp, pp=draw(st.integers(1, 8)), ep=ep,
                    zero=draw(st.integers(0, 3)), vpp=vpp, mbs=draw(st.integers(1, 4)), schedule=schedule,
                    recompute=draw(st.sampled_from(RECOMPUTE)), cp=cp, sp=tp > 1 and draw(st.booleans()),
                    tp_async=tp > 1 and draw(st.booleans()), grad_fusion=draw(st.booleans()))


@settings(max_examples=200, deadline=None)
@given(any_strategy())
def test_strategy_text_round_trips(s):
    assert Strategy.parse(str(s)) == s
    assert Strategy.parse(s) is s
    t = Strategy.parse(str(s))
    assert hash(t) == hash(s) and str(t) == str(s) == str(s)       # the text is kept, not part of equality
    assert pickle.loads(pickle.dumps(s)) == s and str(pickle.loads(pickle.dumps(s))) == str(s)
    other = s.replace(mbs=s.mbs + 1)                                # a replaced strategy has its own text
    assert other != s and Strategy.parse(str(other)) == other and f"mbs={s.mbs + 1}" in str(other)


def test_parse_defaults_and_examples():
    s = Strategy.parse("dp=2,pp=4,vpp=2,mbs=1,schedule=interleaved-1f1b,recompute=full")
    assert (s.dp, s.tp, s.pp, s.vpp, s.zero, s.recompute) == (2, 1, 4, 2, 0, "full")
    assert str(Strategy.parse("dp=4,tp=2,pp=2,zero=1")) == "dp=4,tp=2,pp=2,zero=1"
    assert Strategy.parse("").world == 1 and Strategy.parse("pp=2,vpp=2").schedule == "interleaved-1f1b"


@pytest.mark.parametrize("text,msg", [
    ("dp=2,foo=1", "unknown strategy key 'foo'"), ("dp", "is not key=value"), ("dp=x", "must be an integer"),
    ("dp=2,dp=3", "given twice"), ("zero=4", "not a ZeRO stage"), ("tp=0", "must be at least 1"),
    ("dp=4,ep=3", "ep=3 must divide dp=4"), ("schedule=foo", "unknown schedule"),
    ("recompute=some", "unknown recompute"), ("pp=2,vpp=2,schedule=1f1b", "runs one chunk per stage"),
    ("schedule=interleaved-1f1b", "needs vpp >= 2"), ("pp=2,vpp=3,schedule=dualpipev", "exactly 2 chunks per stage; set vpp=2"),
])
def test_parse_errors_say_what_and_how(text, msg):
    with pytest.raises(StrategyError, match=msg):
        Strategy.parse(text)


def test_validate_lists_every_problem_with_its_fix():
    m = models.get("llama2-70b")
    with pytest.raises(StrategyError) as e:
        Strategy.parse("dp=2,tp=3,pp=96").validate(m, devices=8)
    msg = str(e.value)
    assert "tp=3 must divide the attention heads (64)" in msg and "KV heads (8)" in msg
    assert "pp*vpp=96 exceeds the 80 layers" in msg and "does not match the 8 devices" in msg
    assert Strategy.parse("dp=2,ep=2").problems(m) == [
        "ep=2 needs a mixture-of-experts model; llama2-70b is dense, set ep=1"]
    q = models.get("qwen3-235b-a22b")
    assert "ep=3 must divide the expert count (128)" in " ".join(Strategy.parse("dp=3,ep=3").problems(q))
    assert Strategy.parse("dp=4,tp=4,pp=8,ep=4").problems(q) == []
    assert Strategy.parse("pp=8").problems(q) == []            # 94 layers over 8 stages


def test_layers_split_evenly_earlier_stages_take_more():
    s = Strategy.parse("pp=8")
    sizes = np.bincount(s.layer_stages(94))
    assert sizes.tolist() == [12] * 6 + [11] * 2
    d = Strategy.parse("pp=4,vpp=2,schedule=dualpipev")
    assert [d.chunk_rank_stage(c) for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    i = Strategy.parse("pp=4,vpp=2")
    assert [i.chunk_rank_stage(c) for c in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


# ---- the rank grid --------------------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(any_strategy())
def test_coords_rank_and_groups_agree(s):
    ranks = np.arange(s.world)
    c = s.coords(ranks)
    assert np.array_equal(s.rank(c["tp"], c["dp"], c["pp"], c["cp"]), ranks)
    assert np.array_equal(c["tp"], ranks % s.tp)                           # TP fastest
    assert np.array_equal(c["cp"], (ranks // s.tp) % s.cp)                 # then CP (Megatron order)
    assert np.array_equal(c["ep"] + s.ep * c["edp"], c["dp"])
    for axis, size in (("tp", s.tp), ("dp", s.dp), ("pp", s.pp), ("ep", s.ep), ("edp", s.edp), ("cp", s.cp),
                       ("dpcp", s.dpcp)):
        g = s.groups(axis)
        assert g.shape == (s.world // size, size)
        assert np.array_equal(np.sort(g.ravel()), ranks)                   # a partition of the world
        for r in (0, s.world - 1, s.world // 2):
            mine = s.group(r, axis)
            assert r in mine and any(tuple(row) == mine for row in g.tolist())
            others = [s.coords(x) for x in mine]
            fixed = {"tp": ("dp", "pp", "cp"), "dp": ("tp", "pp", "cp"), "pp": ("tp", "dp", "cp"),
                     "ep": ("tp", "pp", "edp", "cp"), "edp": ("tp", "pp", "ep", "cp"), "cp": ("tp", "dp", "pp"),
                     "dpcp": ("tp", "pp")}[axis]
            assert all(o[k] == s.coords(r)[k] for o in others for k in fixed)


def test_sp_cp_parse_and_check():
    s = Strategy.parse("dp=2,tp=2,sp,cp=2")
    assert (s.sp, s.cp, s.world, s.dpcp, s.grad_axis) == (True, 2, 8, 4, "dpcp")
    assert str(s) == "dp=2,tp=2,pp=1,cp=2,sp" and Strategy.parse("tp=2,sp=0").sp is False
    assert s.group(0, "cp") == (0, 2) and s.group(0, "dp") == (0, 4) and s.group(0, "dpcp") == (0, 2, 4, 6)
    with pytest.raises(StrategyError, match="needs tp > 1"):
        Strategy.parse("dp=2,sp")
    with pytest.raises(StrategyError, match="must be on or off"):
        Strategy.parse("tp=2,sp=maybe")
    with pytest.raises(StrategyError, match="use cp=1 for mixture-of-experts"):
        Strategy.parse("dp=2,ep=2,cp=2")
    assert any("multiple of 2*cp=6" in p for p in Strategy.parse("cp=3").problems(models.get("tiny-gpt")))


def test_coords_out_of_range():
    with pytest.raises(StrategyError, match="outside the world of 4"):
        Strategy.parse("dp=4").coords(4)


# ---- clusters and device lists --------------------------------------------------------------------------
@pytest.mark.parametrize("name,devices,per_node", [
    ("a800-16x8", 128, 8), ("a800-128x8", 1024, 8), ("a100-64x8", 512, 8), ("h100-2x4", 8, 4), ("H200-1x8", 8, 8),
])
def test_cluster_names_parse(name, devices, per_node):
    c = clusters.get(name)
    assert c.devices == devices and c.per_node == per_node and c.memory > 70 * 2**30
    assert c.node_of(devices - 1) == c.nodes - 1
    assert c.node_of(np.arange(devices)).tolist() == [d // per_node for d in range(devices)]


def test_cluster_presets_and_errors():
    for n in clusters.names():
        assert clusters.get(n).devices >= 1
    assert clusters.get("cpu-local").gpu.name == "cpu"
    assert clusters.get("a800-16x8").gpu.memory == 80 * 2**30
    with pytest.raises(UnknownPresetError, match="unknown cluster 'k80-2x8'"):
        clusters.get("k80-2x8")
    with pytest.raises(UnknownPresetError, match="e.g. a800-16x8"):
        clusters.get("a800-16")
    with pytest.raises(ClusterError, match="at least one node"):
        clusters.get("a100-0x8")
    with pytest.raises(ClusterError, match="device 16 is not in a800-2x8"):
        clusters.get("a800-2x8").node_of(16)
    assert clusters.get("a800-2x8").with_devices(17).name == "a800-3x8"


def test_device_lists():
    assert clusters.parse_devices("0-39,48-127") == tuple(range(40)) + tuple(range(48, 128))
    assert clusters.parse_devices(" 3, 1-2 ") == (3, 1, 2)
    assert clusters.parse_devices([5, 4]) == (5, 4)
    assert clusters.parse_devices(None, default=3) == (0, 1, 2)
    assert clusters.format_devices(tuple(range(40)) + tuple(range(48, 128))) == "0-39,48-127"
    for bad, msg in (("0-", "bad device list item"), ("5-2", "bad device list item"), ("a", "bad device"),
                     ("1,1", "names a device twice"), ([-1], "non-negative")):
        with pytest.raises(DeviceListError, match=msg):
            clusters.parse_devices(bad)
    with pytest.raises(ClusterError, match="no device list"):
        clusters.parse_devices(None)


@settings(max_examples=100, deadline=None)
@given(st.sets(st.integers(0, 300), min_size=1, max_size=60))
def test_device_list_text_round_trips(devs):
    d = tuple(sorted(devs))
    assert clusters.parse_devices(clusters.format_devices(d)) == d


@settings(max_examples=60, deadline=None)
@given(any_strategy())
def test_peers_move_along_one_axis(s):
    ranks = np.arange(s.world)
    c = s.coords(ranks)
    for axis, size in (("pp", s.pp), ("cp", s.cp)):
        for off in (f"{axis}+1", f"{axis}-1"):
            q = s.coords(s.peer(ranks, off))
            step = 1 if off.endswith("+1") else -1
            assert np.array_equal(q[axis], (c[axis] + step) % size)
            assert all(np.array_equal(q[k], c[k]) for k in ("tp", "dp", "pp", "cp") if k != axis)
    with pytest.raises(StrategyError, match="is not 'pp\\+k'"):
        s.peer(0, "dp+1")
