"""The simulator behaves physically on random models, clusters and strategies (hypothesis).

Each example draws a small dense or MoE model (odd shapes included: one layer, GQA, tied or untied,
unfused attention, fp32), a cluster preset with overrides and a valid strategy over every axis, then
checks one law: results are finite and in range; a faster link (or more NICs, or less latency), HBM or
peak never slows a step; recomputation, sequence parallelism, the micro-batch size, the attention's
width and the ZeRO stage move memory the right way; a doubled batch at most doubles the step; the same
inputs give the same simulation.
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

import parashift as ps
from parashift.errors import StrategyError
from parashift.ir import compile
from parashift.ir.schedules import get_schedule, schedule_names
from parashift.sim import simulate

_S = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
_GPUS = ("a800", "a100", "h100", "h200")
_REL = 1e-9   # float noise between two runs of one law (event order, sums in another order)


# ---- what the examples draw ---------------------------------------------------------------------
@st.composite
def models(draw, moe: "bool | None" = None) -> tuple[ps.ModelSpec, str]:
    """A small decoder and the call that builds it: 1-6 layers, 1-8 heads (GQA), widths that are not
    powers of two, any options."""
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    kv = draw(st.sampled_from([d for d in (1, 2, 4, 8) if heads % d == 0]))
    head_dim = draw(st.sampled_from([16, 24, 32, 64]))
    hidden = draw(st.sampled_from([heads * head_dim, 64 * draw(st.integers(1, 8))]))
    kw = dict(kv_heads=kv, head_dim=head_dim, ffn=32 * draw(st.integers(1, 24)), vocab=draw(st.integers(50, 3000)),
              seq_len=draw(st.sampled_from([32, 64, 96, 128, 256, 512])), gated=draw(st.booleans()),
              bias=draw(st.booleans()), qkv_bias=draw(st.booleans()), norm=draw(st.sampled_from(["rms", "ln"])),
              qk_norm=draw(st.booleans()), pos_emb=draw(st.sampled_from(["rope", "learned"])), tied=draw(st.booleans()),
              dtype=draw(st.sampled_from(["bf16", "bf16", "fp16", "fp32"])), flash_attention=draw(st.booleans()),
              dropout=draw(st.sampled_from([0.0, 0.1])))
    layers = draw(st.integers(1, 6))
    if moe is None:
        moe = draw(st.booleans())
    if moe:
        experts = draw(st.sampled_from([2, 4, 8]))
        kw.update(experts=experts, top_k=draw(st.integers(1, min(4, experts))),
                  expert_ffn=32 * draw(st.integers(1, 12)), shared_ffn=draw(st.sampled_from([0, 64, 128])))
    build = ps.models.moe if moe else ps.models.gpt
    call = f"{build.__name__}({layers}, {hidden}, {heads}, " + ", ".join(f"{k}={v!r}" for k, v in kw.items()) + ")"
    return build(layers, hidden, heads, **kw), call


def _tp_choices(m: ps.ModelSpec) -> list[int]:
    sizes = [m.heads, m.kv_heads, m.ffn, m.vocab] + ([m.expert_ffn] + [m.shared_ffn] * bool(m.shared_ffn)
                                                     if m.is_moe else [])
    return [t for t in (1, 2, 4, 8) if all(n % t == 0 for n in sizes)]


@st.composite
def strategies(draw, m: ps.ModelSpec, **fixed) -> tuple[ps.Strategy, int]:
    """A valid strategy for ``m`` and its micro-batch count; ``fixed`` pins fields (``pp=2``, ``tp=(2, 4)``:
    a tuple is a choice)."""
    def pick(name, default):
        v = fixed.get(name, default)
        return draw(st.sampled_from(list(v))) if isinstance(v, (tuple, list)) else v

    tp = pick("tp", tuple(_tp_choices(m)))
    pp = pick("pp", tuple(range(1, min(4, m.layers) + 1)))
    names = [n for n in schedule_names() if pp > 1 or not get_schedule(n).chunked] if pp > 1 else ["1f1b", "gpipe"]
    schedule = pick("schedule", tuple(names))
    sch = get_schedule(schedule)
    vpp = 1 if sch.chunks == 1 else sch.chunks or draw(st.sampled_from([2, 3]))
    dp = pick("dp", (1, 2, 4))
    ep = pick("ep", tuple(e for e in (1, 2, 4) if dp % e == 0 and m.is_moe and m.experts % e == 0) or (1,))
    cp = pick("cp", (1, 2) if ep == 1 and m.seq_len % 4 == 0 else (1,))
    zero = pick("zero", (0, 1, 2, 3))
    shard = pick("shard", tuple(n for n in (0, 1, 2) if n == 0 or (zero and cp == 1 and ep == 1 and dp % n == 0
                                                                      and n < dp)))
    s = ps.Strategy(dp=dp, tp=tp, pp=pp, ep=ep, zero=zero, vpp=vpp, mbs=pick("mbs", (1, 2)), schedule=schedule,
                    recompute=pick("recompute", ("none", "selective", "full")), cp=cp,
                    sp=pick("sp", (False, True) if tp > 1 else (False,)),
                    overlap_grad=pick("overlap_grad", (False, True)), shard=shard,
                    overlap_param=pick("overlap_param", (False, True) if zero in (1, 2) else (False,)),
                    tp_async=pick("tp_async", (False, True) if tp > 1 else (False,)),
                    grad_fusion=pick("grad_fusion", (False, True)))
    assume(not s.problems(m))
    k = pick("micro", (1, 2, 3))
    mult = pp if sch.microbatches_multiple_of_pp and pp > 1 else 1
    return s, k * mult


@st.composite
def clusters(draw, world: int) -> ps.Cluster:
    """A preset of enough devices (1-8 per node) with some of its numbers overridden (0.25-4x)."""
    gpu = draw(st.sampled_from(_GPUS))
    per = draw(st.sampled_from([1, 2, 4, 8]))
    nodes = -(-world // per) + draw(st.integers(0, 1))
    base = ps.cluster.get(f"{gpu}-{nodes}x{per}")
    over = {}
    for key, now in (("nic_bw", base.nic_bw), ("nvlink_bw", base.gpu.intra_bw), ("hbm_bw", base.gpu.hbm_bw),
                     ("peak_flops", base.gpu.peak_flops)):
        if draw(st.booleans()):
            over[key] = repr(now * draw(st.sampled_from([0.25, 0.5, 2.0, 4.0])))
    if draw(st.booleans()):
        over["nics_per_node"] = str(draw(st.sampled_from([1, 2, 4, 8])))
    if not over:
        return base
    return ps.cluster.get(f"{gpu}-{nodes}x{per}:" + ",".join(f"{k}={v}" for k, v in over.items()))


class Case(tuple):
    """(model, strategy, micro-batches, cluster), shown as the calls that rebuild it."""

    def __new__(cls, m, s, micro, cluster, call):
        out = super().__new__(cls, (m, s, micro, cluster))
        out.call = call
        return out

    def __repr__(self) -> str:
        return f"Case({self.call}, {str(self[1])!r}, micro={self[2]}, cluster={self[3].name!r})"


@st.composite
def cases(draw, moe: "bool | None" = None, **fixed) -> Case:
    """A drawn model, a valid strategy for it with its micro-batch count, and a cluster that holds it."""
    m, call = draw(models(moe))
    s, micro = draw(strategies(m, **fixed))
    return Case(m, s, micro, draw(clusters(s.world)), call)


def _run(m, s, micro, cluster, batch_factor: int = 1):
    """Compile ``micro * batch_factor`` micro-batches of ``s`` and simulate them on ``cluster``."""
    try:
        program = compile(m, s, global_batch=s.dp * s.mbs * micro * batch_factor)
    except StrategyError as e:   # a schedule that refuses this micro-batch count: not this law's business
        assume(False, str(e))
    return simulate(program, cluster, model=m)


def _faster(cluster: ps.Cluster, what: str, k: float) -> ps.Cluster:
    """``cluster`` with one resource ``k`` times as fast (NICs: ``k`` times as many; latency: 1/k)."""
    if what == "nic_bw":
        return replace(cluster, nic_bw=cluster.nic_bw * k)
    if what == "nics":
        return replace(cluster, nics_per_node=int(cluster.nics_per_node * k))
    if what == "latency":
        g = cluster.gpu
        return replace(cluster, gpu=replace(g, intra_latency=g.intra_latency / k, inter_latency=g.inter_latency / k))
    field = {"nvlink_bw": "intra_bw", "hbm_bw": "hbm_bw", "peak_flops": "peak_flops"}[what]
    return replace(cluster, gpu=replace(cluster.gpu, **{field: getattr(cluster.gpu, field) * k}))


# ---- the laws ----------------------------------------------------------------------------------
@_S
@given(cases())
def test_results_are_finite_and_in_range(case):
    res = _run(*case)
    assert math.isfinite(res.step_time) and res.step_time > 0
    assert math.isfinite(res.tokens_per_s) and res.tokens_per_s > 0
    assert math.isfinite(res.mfu) and 0 < res.mfu <= 1, res.mfu
    assert 0 <= res.bubble_fraction < 1, res.bubble_fraction
    assert res.peak_memory and all(math.isfinite(v) and v > 0 for v in res.peak_memory.values())
    assert set(res.peak_memory) == set(res.peak_activations) == set(range(case[1].world))
    assert all(0 <= res.peak_activations[d] <= p for d, p in res.peak_memory.items())
    if case[1].zero <= 1:   # no ZeRO buffers: what a device holds beyond its states is its activations
        df = res.memory_frame().set_index("device")
        states = df[["param", "grad", "master", "optim", "other_static"]].sum(axis=1)
        assert all(df.loc[d, "peak"] - states[d] == pytest.approx(a, abs=1) for d, a in res.peak_activations.items())


@_S
@given(cases(), st.sampled_from(["nic_bw", "nics", "nvlink_bw", "latency", "hbm_bw", "peak_flops"]),
       st.sampled_from([1.5, 2.0, 8.0]))
def test_a_faster_resource_never_slows_the_step(case, what, k):
    m, s, micro, cluster = case
    slow = _run(m, s, micro, cluster)
    fast = _run(m, s, micro, _faster(cluster, what, k))
    assert fast.step_time <= slow.step_time * (1 + _REL), (what, k, slow.step_time, fast.step_time)


@_S
@given(cases(recompute="none"))
def test_recomputation_never_holds_more_activations(case):
    """none >= selective and none >= full; full <= selective too, unless the schedule splits the backward:
    a weight-gradient pass needs its GEMMs' inputs, so a full recompute's activations wait for the
    deferred W as a stored stash would, and full keeps what selective drops (the scores) as well."""
    m, s, micro, cluster = case
    none, sel, full = [max(_run(m, s.replace(recompute=r), micro, cluster).peak_activations.values())
                       for r in ("none", "selective", "full")]
    assert none >= sel and none >= full, (none, sel, full)
    if not get_schedule(s.schedule).split_backward:
        assert sel >= full, (none, sel, full)


@_S
@given(cases(tp=(2, 4, 8), sp=False))
def test_sequence_parallelism_never_holds_more_activations(case):
    m, s, micro, cluster = case
    off = _run(m, s, micro, cluster).peak_activations
    on = _run(m, s.replace(sp=True), micro, cluster).peak_activations
    assert all(on[d] <= off[d] for d in off), (off, on)


@_S
@given(cases(mbs=1, micro=(2, 4)))
def test_a_larger_micro_batch_never_holds_less(case):
    """A micro-batch of 2 stashes at least what one of 1 does, and at the same micro-batch count the
    step holds at least as much (at the same global batch it may hold less: fewer micro-batches in flight)."""
    m, s, micro, cluster = case
    small = _run(m, s, micro, cluster)
    big = _run(m, s.replace(mbs=2), micro // 2, cluster)    # the same global batch
    per_mb = [max(_act_buffers(r.program).values()) for r in (small, big)]
    assert per_mb[1] >= per_mb[0], per_mb
    same_m = _run(m, s.replace(mbs=2), micro, cluster)
    assert all(same_m.peak_activations[d] >= v for d, v in small.peak_activations.items())


@_S
@given(cases(moe=False, recompute=("none", "selective"), tp=1, cp=1, sp=False), st.sampled_from(["head_dim", "kv_heads"]))
def test_a_wider_attention_stashes_more(case, what):
    """Doubling the head width (at the same hidden size) or the KV heads (GQA towards MHA) makes the
    stored Q, K, V and output-projection input larger, so every micro-batch stashes more."""
    m, s, micro, cluster = case
    assume(what == "head_dim" or m.kv_heads * 2 <= m.heads)
    wide = ps.models.gpt(m.layers, m.hidden, m.heads, **{**_gpt_kw(m), what: 2 * getattr(m, what)})
    narrow = _act_buffers(compile(m, s, global_batch=s.dp * s.mbs * micro))
    wider = _act_buffers(compile(wide, s, global_batch=s.dp * s.mbs * micro))
    assert all(wider[k] > v for k, v in narrow.items()), (narrow, wider)


def _gpt_kw(m: ps.ModelSpec) -> dict:
    """The keyword arguments that rebuild dense model ``m`` with :func:`parashift.models.gpt`."""
    return dict(kv_heads=m.kv_heads, head_dim=m.head_dim, ffn=m.ffn, vocab=m.vocab, seq_len=m.seq_len, gated=m.gated,
                bias=m.bias, qkv_bias=m.qkv_bias, norm=m.norm, qk_norm=m.qk_norm, pos_emb=m.pos_emb, tied=m.tied,
                dtype=m.dtype, pad_vocab=1, flash_attention=m.flash_attention, dropout=m.dropout)


def _act_buffers(program) -> dict[tuple[int, int], int]:
    """(rank, micro-batch) -> activation bytes its stage allocates for that micro-batch."""
    out: dict[tuple[int, int], int] = {}
    for r, rp in program.ranks.items():
        for ins in rp.instrs():
            for name, b in ins.alloc:
                if name.startswith("act."):
                    key = (r, ins.microbatch)
                    out[key] = out.get(key, 0) + b
    return out


@_S
@given(cases(zero=0))
def test_state_memory_never_grows_with_the_zero_stage(case):
    m, s, micro, cluster = case
    states = []
    for z in (0, 1, 2, 3):
        res = _run(m, s.replace(zero=z), micro, cluster)
        df = res.memory_frame()
        states.append(df[["param", "grad", "master", "optim"]].sum(axis=1).to_numpy())
    for a, b in zip(states, states[1:]):
        assert (b <= a).all(), states


@_S
@given(cases())
def test_a_doubled_batch_at_most_doubles_the_step(case):
    """Twice the micro-batches never lower throughput: the fill and drain of a pipeline, the gradient
    sync and the optimizer are paid once a step. zb-h1 and dualpipev are list-scheduled with estimated
    durations, so their order for 2m is not two orders for m and may lose a little (within 1%). The
    bubble share need not fall: an unbalanced pipeline's idle stages and a ZeRO-3 gather exposed on
    every micro-batch idle more as the step grows."""
    m, s, micro, cluster = case
    one = _run(m, s, micro, cluster)
    two = _run(m, s, micro, cluster, batch_factor=2)
    tol = 1e-2 if get_schedule(s.schedule).costs != "never" else 1e-6
    assert two.step_time >= one.step_time * (1 - _REL)
    assert two.step_time <= 2 * one.step_time * (1 + tol), (one.step_time, two.step_time)
    assert two.tokens_per_s >= one.tokens_per_s / (1 + tol)


@_S
@given(cases())
def test_the_simulation_is_deterministic(case):
    a, b = _run(*case), _run(*case)
    sa, sb = a.summary(), b.summary()
    sa.pop("sim_seconds"), sb.pop("sim_seconds")
    assert sa == sb
    assert a.event_log() == b.event_log()
    assert a.peak_activations == b.peak_activations and a.link_bytes == b.link_bytes
