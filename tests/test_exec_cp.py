"""Context parallelism in the runtime: tiny-gpt under cp trains exactly like one process, the
sequence slicing covers every token once with balanced causal work, and the runtime moves and
orders the K/V exchanges the way the Program (and so the simulator) prices them."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parashift import Strategy, models
from parashift.errors import StrategyError
from parashift.exec import run
from parashift.exec.parallel.cp import cp_mask, cp_positions
from parashift.exec.models import init_tensor
from parashift.exec.regions import Rec, RegionCtx, cp_attn_pre
from parashift.ir import compile
from parashift.ir.tags import CPTag, parse_tag
from parashift.sim import simulate
from test_exec_equivalence import GB, OPT, SEQ, check

SPEC = models.get("tiny-gpt")

CP = ["cp=2", "tp=2,sp,cp=2", "cp=2,pp=2", "dp=2,cp=2,zero=1"]


@pytest.mark.parametrize("strategy", CP)
def test_cp_matches_single_process(strategy: str) -> None:
    """Losses and final parameters within 1e-5 of one process (5 steps, gloo, 2-4 processes)."""
    check("tiny-gpt", strategy)


SLOW = [("tiny-gpt", "cp=4"), ("tiny-gpt", "dp=2,cp=2,zero=3,recompute=full"), ("tiny-gpt", "tp=2,cp=2,pp=2,zero=2"),
        ("tiny-gpt", "cp=2,pp=2,vpp=2,schedule=interleaved-1f1b"), ("tiny-gpt", "tp=2,sp,cp=2,pp=2,recompute=selective"),
        ("tiny-gpt", "cp=2,pp=2,schedule=zb-h1,recompute=full"), ("tiny-gpt", "cp=2,pp=2,vpp=2,schedule=dualpipev"),
        ("tiny-moe", "cp=2"), ("tiny-moe", "tp=2,sp,cp=2,zero=1")]


@pytest.mark.slow
@pytest.mark.parametrize("model,strategy", SLOW, ids=[f"{m}:{s}" for m, s in SLOW])
def test_cp_variants(model: str, strategy: str) -> None:
    """cp with more ranks, ZeRO-2/3, virtual stages, split backwards, recomputation and MoE."""
    check(model, strategy)


@settings(max_examples=40, deadline=None)
@given(cp=st.integers(1, 6), chunk=st.integers(1, 5))
def test_positions_cover_every_token_once_with_balanced_causal_work(cp: int, chunk: int) -> None:
    seq = 2 * cp * chunk
    pos = [cp_positions(seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(pos).tolist()) == list(range(seq))
    work = set()
    for r in range(cp):
        m = cp_mask(seq, cp, r)
        keys = torch.cat(pos)
        brute = torch.tensor([[int(k) <= int(q) for k in keys] for q in pos[r]])
        assert torch.equal(m, brute)
        work.add(int(m.sum()))
    assert len(work) == 1          # every rank has the same number of unmasked query-key pairs


@pytest.mark.parametrize("strategy", ["cp=2", "tp=2,sp,cp=2", "cp=4"])
def test_runtime_gathers_the_bytes_the_program_prices(strategy: str) -> None:
    """The K/V one rank's attention hands to the gather, times cp, is the Program's all-gather and
    reduce-scatter size (what the simulator charges)."""
    s = Strategy.parse(strategy)
    prog = compile(SPEC, s, global_batch=GB, seq_len=SEQ)
    names = {t.name: t for t in SPEC.tensors}

    def param(name: str) -> torch.Tensor:
        w = init_tensor(names[name], SPEC.layers)
        return w.chunk(s.tp, dim=names[name].tp_dim)[0] if names[name].tp_dim is not None and s.tp > 1 else w
    ctx = RegionCtx(SPEC, s.tp, 0, 1, 0, 1.0, param, lambda n: None,
                    tuple(t[cp_positions(SEQ, s.cp, 0)] for t in _rope()))
    rec = Rec("layers.0.attn", "attn", 0)
    kv = cp_attn_pre(ctx, rec, {"h": torch.randn(s.mbs, SEQ // s.cp, SPEC.hidden)}, False)
    moved = kv.numel() * SPEC.dtype_bytes * s.cp
    cp_ins = [i for i in prog.ranks[0].instrs() if i.tag and i.tag.startswith("cp.")]
    assert cp_ins and {i.nbytes for i in cp_ins} == {moved}


def _rope():
    from parashift.exec.models import rope_tables
    return rope_tables(SEQ, SPEC.head_dim)


def _cp_order(frame, prog, rank: int) -> None:
    """Each K/V exchange runs where its data exists, in ``frame`` (a simulated or measured timeline):
    fwd gather after the attention's forward compute, bwd gather before its backward compute,
    K/V-grad scatter after it."""
    rows = {int(i): (float(a), float(b)) for i, a, b in zip(frame["id"], frame["start"], frame["end"])}
    comp = {(i.region, i.phase, i.microbatch): i.id for i in prog.ranks[rank].instrs() if i.op == "compute"}
    n = 0
    for ins in prog.ranks[rank].instrs():
        tag = parse_tag(ins.tag) if ins.tag and ins.tag.startswith("cp.") else None
        if not isinstance(tag, CPTag):
            continue
        a = rows[comp[(tag.region, tag.phase, tag.mb)]]
        x = rows[ins.id]
        if tag.phase == "fwd" or tag.part == "dkv":
            assert x[0] >= a[1] - 1e-9, f"{ins} starts before its attention compute ends"
        else:
            assert a[0] >= x[1] - 1e-9, f"the backward of {tag.region} starts before {ins} lands"
        n += 1
    assert n > 0


def test_simulator_and_runtime_order_the_exchanges_alike() -> None:
    """The simulated timeline and the measured one (the same Program) both put each K/V exchange
    where the runtime needs its data (not beside the attention), so the simulator charges the
    exchanges as exposed, as the runtime (and TransformerEngine's all-gather CP) runs them."""
    res = run("tiny-gpt", "cp=2", steps=1, global_batch=GB, seq_len=SEQ, optim=OPT, timeout=120)
    prog = res.program
    measured = res.to_frame(0)
    sim = simulate(prog, "a100-1x8").timeline_of([0])
    _cp_order(sim, prog, 0)
    _cp_order(measured[measured["device"] == 0], prog, 0)


@pytest.mark.slow
def test_live_switches_into_and_out_of_cp_are_bit_exact_and_train_like_one_process() -> None:
    """The runtime's ZeRO shards over dp x cp are the VPS layout's: hot switches between cp and
    plain layouts leave exactly a fresh job's state, and the losses stay the single-process ones."""
    from parashift.exec.reference import reference_train
    from parashift.exec.switch import run_live
    from test_switch_live import GPT, check_switches
    chain = [(1, "dp=4,zero=1", None), (2, "cp=4,zero=2", None), (3, "dp=2,cp=2,zero=3", None)]
    res = run_live(GPT, "dp=2,cp=2,zero=1", steps=5, switches=chain, export=True, timeout=240, switch_timeout=30,
                   big_piece=4096, optim=OPT)
    assert [sw.get("aborted") for sw in res.switches] == [None] * len(chain)
    assert check_switches(GPT, res) == len(chain)
    ref = reference_train(GPT, 5, 8, GPT.seq_len, optim=OPT)[0]
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(res.losses, ref)), (res.losses, ref)


def test_sequence_not_divisible_by_2cp_is_refused_in_one_line() -> None:
    with pytest.raises(StrategyError, match="2\\*cp") as e:
        run("tiny-gpt", "cp=3", steps=1, global_batch=GB, seq_len=SEQ, optim=OPT, timeout=60)
    assert "\n" not in str(e.value)
