"""The tag grammar: every tag type prints as text that parses back to it, and every tag, key and
buffer name of real training-step and switch Programs parses (and prints back unchanged)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from parashift import Strategy, models, vps
from parashift.errors import ProgramError
from parashift.ir import tags as T
from parashift.ir.compile import compile as ir_compile
from parashift.vps import transition as VT

ints = st.integers(0, 10_000)
names = st.text("abcdefghijklmnopqrstuvwxyz0123456789._+-", min_size=1, max_size=24).filter(
    lambda x: x == x.strip())
step_tags = st.one_of(
    st.builds(T.P2PTag, st.sampled_from(T.Payload), ints, ints),
    st.builds(T.TPTag, names, st.sampled_from(T.TP_PHASES), ints),
    st.builds(T.EPTag, ints, st.sampled_from(T.A2A), st.sampled_from(T.EP_PHASES), ints),
    st.builds(T.SyncTag, st.sampled_from(T.Axis), st.sampled_from(T.Sync), ints),
    st.builds(lambda a, c, m: T.SyncTag(a, T.Sync.GRAD, c, m), st.sampled_from(T.Axis), ints, ints),
    st.builds(lambda a, c, m, r: T.SyncTag(a, T.Sync.GRAD, c, m, r), st.sampled_from(T.Axis), ints, ints, names),
    st.builds(lambda a, c, r: T.SyncTag(a, T.Sync.PARAM, c, None, r), st.sampled_from(T.Axis), ints, names),
    st.builds(T.Z3Tag, st.booleans(), ints, st.sampled_from(T.Z3_PHASES), ints),
    st.builds(lambda c, p, m, r: T.Z3Tag(False, c, p, m, r), ints, st.sampled_from(T.Z3_PHASES), ints, names),
    st.just(T.EmbedTag()),
    st.builds(T.Fp8Tag, st.integers(0, 99)),
    st.builds(T.SPTag, names, st.sampled_from(T.TP_PHASES), st.sampled_from(T.SP_HOPS), ints),
    st.builds(T.CPTag, names, st.sampled_from(T.TP_PHASES), st.sampled_from(T.CP_PARTS), ints))
members = st.lists(ints, min_size=1, max_size=5).map(tuple)
transfers = st.one_of(
    st.builds(T.TransferTag, st.just("send"), ints, ints, ints.map(lambda x: (x,)), st.none() | ints),
    st.builds(T.TransferTag, st.sampled_from(["broadcast", "scatter", "gather"]), ints, ints, members))


@settings(max_examples=300, deadline=None)
@given(step_tags)
def test_step_tags_round_trip(tag) -> None:
    assert T.parse_tag(str(tag)) == tag


@settings(max_examples=200, deadline=None)
@given(st.one_of(
    st.builds(T.StepKey, st.sampled_from(["grad", "param"]), ints, st.sampled_from(["dense", "expert"])),
    st.just(T.StepKey("grad", None, "embed")), st.sampled_from(T.FLAT_KEYS).map(T.StepKey)))
def test_step_keys_round_trip(key) -> None:
    assert T.StepKey.parse(str(key)) == key


@settings(max_examples=200, deadline=None)
@given(st.one_of(
    st.builds(lambda k, c, m: T.StepBuffer(k, m, chunk=c), st.sampled_from(["act", "zg", "zge"]), ints, ints),
    st.builds(lambda c, m, r: T.StepBuffer("zg", m, chunk=c, region=r), ints, ints, names),
    st.builds(lambda c, p, m, r: T.StepBuffer("z3", m, chunk=c, phase=p, region=r), ints,
              st.sampled_from(T.Z3_PHASES), ints, names),
    st.builds(lambda r, m: T.StepBuffer("rc", m, region=r), names, ints),
    st.builds(lambda k, c, p, m: T.StepBuffer(k, m, chunk=c, phase=p), st.sampled_from(["z3", "z3e"]), ints,
              st.sampled_from(T.Z3_PHASES), ints)))
def test_step_buffers_round_trip(buf) -> None:
    assert T.StepBuffer.parse(str(buf)) == buf


@settings(max_examples=300, deadline=None)
@given(transfers)
def test_transfer_tags_round_trip(tag) -> None:
    assert T.TransferTag.parse(str(tag)) == tag
    key = T.SwitchKey("pack", transfer=str(tag))
    assert T.SwitchKey.parse(str(key)) == key and key.transfer_tag == tag


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["old", "new"]), names.filter(lambda x: ":" not in x), names)
def test_state_buffers_round_trip(which, kind, tensor) -> None:
    b = T.StateBuffer(which, kind, tensor)
    assert T.StateBuffer.parse(str(b)) == b


@pytest.mark.parametrize("text", ["act.c1", "act.cx.m0", "tp.attn.optim.m0", "ep.layers.1.moe.swap.fwd.m0",
                                  "dp.weights.c0", "z3.param.c0.optim.m1", "embed", "", "grad.c0.m0.x"])
def test_bad_step_tags_say_what_is_wrong(text: str) -> None:
    with pytest.raises(ProgramError, match="parashift.ir.tags"):
        T.parse_tag(text)


@pytest.mark.parametrize("text", ["x0:1>2", "s0:1", "b0:1:2", "s0:1>2,3", "g0:1>2", "s0:a>1"])
def test_bad_transfer_tags_say_what_is_wrong(text: str) -> None:
    with pytest.raises(ProgramError):
        T.TransferTag.parse(text)


def _step_names(model: str, strategy: str):
    prog = ir_compile(model, Strategy.parse(strategy), global_batch=8, seq_len=32)
    for rp in {id(r): r for r in prog.ranks.values()}.values():
        for ins in rp.instrs():
            yield ins


@pytest.mark.parametrize("model,strategy", [
    ("tiny-gpt", "tp=2,pp=2,dp=2,zero=1,recompute=selective"), ("tiny-moe", "dp=4,ep=2,tp=2,zero=3,pp=2"),
    ("tiny-gpt", "pp=2,vpp=2,schedule=dualpipev,recompute=full"), ("tiny-moe", "dp=2,ep=2,zero=2"),
    ("tiny-gpt", "tp=2,sp,pp=2,dp=2"), ("tiny-gpt", "cp=2,dp=2,zero=1")])
def test_every_tag_of_a_compiled_step_parses(model: str, strategy: str) -> None:
    seen = set()
    for ins in _step_names(model, strategy):
        if ins.tag is not None:
            tag = T.parse_tag(ins.tag)
            assert str(tag) == ins.tag
            seen.add(type(tag))
        if ins.key is not None:
            assert str(T.StepKey.parse(ins.key)) == ins.key
        for name in [n for n, _ in ins.alloc] + list(ins.free):
            assert str(T.StepBuffer.parse(name)) == name
    assert T.P2PTag in seen or "pp=2" not in strategy
    assert (T.SPTag in seen) == (",sp" in strategy) and (T.CPTag in seen) == ("cp=" in strategy)


def test_every_tag_of_a_switch_program_parses() -> None:
    for name, s, d in [("tiny-gpt", "dp=2,tp=2,pp=2,zero=1", "dp=4,pp=2,zero=2"),
                       ("tiny-moe", "dp=4,ep=4,zero=1", "dp=2,tp=2,ep=2,zero=3")]:
        plan = vps.plan_switch(models.get(name), s, d, cluster="a100-2x4")
        for coalesce in (True, False):
            prog = VT.lower(plan, coalesce=coalesce)
            ops = set()
            for rp in prog.ranks.values():
                for ins in rp.instrs():
                    if ins.tag is not None:
                        t = T.TransferTag.parse(ins.tag)
                        assert str(t) == ins.tag
                        ops.add(t.op)
                        assert (t.op == "send") == (ins.op in ("send", "recv"))
                    if ins.key is not None:
                        k = T.SwitchKey.parse(ins.key)
                        assert str(k) == ins.key
                        if k.action != "keep":
                            assert str(k.transfer_tag) == k.transfer
                    for buf in [n for n, _ in ins.alloc] + list(ins.free):
                        if buf.startswith("buf:"):
                            assert str(T.SwitchKey.parse(buf)) == buf
                        else:
                            assert str(T.StateBuffer.parse(buf)) == buf
            assert all(str(T.TransferTag.parse(x)) == x for x in prog.meta["transfers"])
            assert "send" in ops


def test_mb_namer_names_as_str_and_checks_once():
    name = T.mb_namer(lambda m: T.TPTag("layers.3.attn", "bwd", m))
    assert [name(mb) for mb in (0, 7, 511)] == [str(T.TPTag("layers.3.attn", "bwd", mb)) for mb in (0, 7, 511)]
    rc = T.mb_namer(lambda m: T.StepBuffer("rc", m, region="layers.0.mlp"))
    assert rc(12) == str(T.StepBuffer("rc", 12, region="layers.0.mlp"))
    with pytest.raises(ProgramError):
        T.mb_namer(lambda m: T.TPTag(" padded", "fwd", m))           # the record's own check runs
    with pytest.raises(ProgramError):
        T.mb_namer(lambda m: T.SyncTag(T.Axis.DP, T.Sync.GRAD, 0))  # no micro-batch at the end
