"""What the anchors do that the simulator prices: Megatron's full recomputation re-runs the TP
reduction of each recomputed region, and gradient reductions wait for the whole backward unless
``overlap_grad`` lets each chunk's start as soon as its backward is done."""
from __future__ import annotations

import pytest

from parashift import Strategy, cluster, models
from parashift.cost import CostModel
from parashift.cost.compute import Workload
from parashift.ir import compile
from parashift.sim import simulate

SPEC = models.gpt(8, 2048, 16, vocab=1024, seq_len=1024, name="anchor", pad_vocab=128)
A100 = cluster.get("a100-2x8")


def _instr(prog, phase: str, region: str):
    return next(i for i in prog.ranks[0].instrs() if i.op == "compute" and i.phase == phase and i.region == region)


@pytest.mark.parametrize("sp", [False, True])
def test_full_recompute_under_tp_repays_the_forward_reduction(sp):
    s = Strategy.parse("tp=8,recompute=full" + (",sp" if sp else ""))
    prog = compile(SPEC, s, global_batch=2, seq_len=1024)
    work = Workload.of(SPEC, s, 1024)
    cm = CostModel.for_cluster(A100)
    tokens_bytes = s.mbs * 1024 * SPEC.hidden * SPEC.dtype_bytes
    topo = (8, 1, 8, False)
    ops = ("reduce_scatter", "all_gather") if sp else ("all_reduce",)
    reduction = sum(cm.op_time(op, cm.collective_phases(op, tokens_bytes, topo)) for op in ops)
    for region in ("layers.0.attn", "layers.0.mlp"):
        fwd, rc = _instr(prog, "fwd", region), _instr(prog, "recompute", region)
        t_fwd = cm.compute_time(fwd, work=work)
        assert cm.compute_time(rc, work=work) == pytest.approx(t_fwd + reduction, rel=1e-9)
        assert cm.replace(recompute_tp_comm=False).compute_time(rc, work=work) == pytest.approx(t_fwd, rel=1e-9)
    # one rank (tp=1) has no reduction to re-run
    s1 = Strategy.parse("recompute=full")
    p1 = compile(SPEC, s1, global_batch=2, seq_len=1024)
    rc1 = next(i for i in p1.ranks[0].instrs() if i.phase == "recompute")
    w1 = Workload.of(SPEC, s1, 1024)
    assert cm.compute_time(rc1, work=w1) == cm.replace(recompute_tp_comm=False).compute_time(rc1, work=w1)


def _grad_syncs_and_backward_end(res):
    """Per rank: start times of its gradient all-reduces and the end of its last backward."""
    syncs: dict[int, list[float]] = {}
    last_bwd: dict[int, float] = {}
    for rep, stream, ins, a, b in res.raw.records:
        if ins.op == "all_reduce" and str(ins.tag).startswith("dp.grad."):
            syncs.setdefault(rep, []).append(a)
        if ins.op == "compute" and ins.phase in ("bwd", "bwd_input", "bwd_weight"):
            last_bwd[rep] = max(last_bwd.get(rep, 0.0), b)
    return syncs, last_bwd


def test_gradient_reduction_waits_for_the_whole_backward_unless_overlapped():
    base = "dp=2,pp=2,vpp=2,mbs=1"
    out = {}
    for extra in ("", ",overlap_grad"):
        s = Strategy.parse(base + extra)
        res = simulate(compile(SPEC, s, global_batch=8, seq_len=1024), A100)
        syncs, last_bwd = _grad_syncs_and_backward_end(res)
        assert syncs and all(len(v) == 2 for v in syncs.values())          # one per chunk of the stage
        early = [a for r, v in syncs.items() for a in v if a < last_bwd[r] - 1e-12]
        out[extra] = (res.step_time, early)
    assert out[""][1] == []                                 # Megatron's default: after the flush
    assert out[",overlap_grad"][1]                          # a chunk's reduction overlaps the other's backward
    assert out[",overlap_grad"][0] < out[""][0]


def test_overlap_grad_is_a_strategy_key_that_round_trips():
    s = Strategy.parse("dp=4,pp=2,vpp=2,overlap_grad")
    assert s.overlap_grad and "overlap_grad" in str(s)
    assert Strategy.parse(str(s)) == s
    assert not Strategy.parse("dp=4,overlap_grad=0").overlap_grad
    with pytest.raises(Exception, match="overlap_grad"):
        Strategy(overlap_grad="yes")  # type: ignore[arg-type]


def test_gradient_accumulation_streams_the_gradients_once_per_later_microbatch():
    """Every micro-batch but the first adds its weight gradients into the step's (PyTorch's
    AccumulateGrad; Megatron-LM's local DDP): 3 x dtype bytes per parameter through HBM."""
    s = Strategy.parse("mbs=1")
    prog = compile(SPEC, s, global_batch=4, seq_len=1024)
    work = Workload.of(SPEC, s, 1024)
    cm = CostModel.for_cluster(A100)
    hbm = cm.hbm_bw * cm.memory_efficiency
    h, f = SPEC.hidden, SPEC.ffn
    mlp_mats = 3 if SPEC.gated else 2                                     # gate, up, down
    per_layer = (4 * h * h + mlp_mats * h * f) * 3 * SPEC.dtype_bytes / hbm   # qkv + out, the MLP
    assert work.grad_accum(cm, "layer") == pytest.approx(per_layer, rel=1e-9)
    whole = SPEC.layers * per_layer + work.grad_accum(cm, "embed") + work.grad_accum(cm, "head")
    assert work.grad_accum(cm, "head") == pytest.approx(SPEC.vocab * h * 3 * SPEC.dtype_bytes / hbm, rel=1e-9)
    bwd = [i for i in prog.ranks[0].instrs() if i.op == "compute" and i.phase == "bwd"]   # one chunk each
    by_mb = {i.microbatch: cm.compute_time(i, work=work) for i in bwd}
    assert sorted(by_mb) == [0, 1, 2, 3]
    for mb in (1, 2, 3):
        assert by_mb[mb] == pytest.approx(by_mb[0] + whole, rel=1e-9)
    off = cm.replace(grad_accum_traffic=0.0)
    assert off.compute_time(bwd[1], work=work) == pytest.approx(by_mb[0], rel=1e-9)
    # one device, no overlap: the step grows by three micro-batches' accumulation of the whole model
    t_on = simulate(prog, A100, cm, model=SPEC).step_time
    t_off = simulate(prog, A100, off, model=SPEC).step_time
    assert t_on - t_off == pytest.approx(3 * whole, rel=1e-6)


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_2_and_3_buckets_pay_no_gradient_accumulation(zero):
    """ZeRO-2/3 give every micro-batch a fresh gradient bucket that its reduce-scatter adds into the shard:
    no later micro-batch reads an earlier one's gradients, so nothing is accumulated at full size (a
    doubled batch once cost more than twice the step on ZeRO-3, tests/test_sim_physics.py)."""
    s = Strategy.parse(f"dp=2,zero={zero}")
    cm = CostModel.for_cluster(A100)
    assert Workload.of(SPEC, s, 1024).grad_accum(cm, "layer") == 0.0
    assert Workload.of(SPEC, s.replace(zero=1), 1024).grad_accum(cm, "layer") > 0
    prog = compile(SPEC, s, global_batch=8, seq_len=1024)
    off = cm.replace(grad_accum_traffic=0.0)
    assert simulate(prog, A100, cm, model=SPEC).step_time == simulate(prog, A100, off, model=SPEC).step_time
