"""ir.compile: every small strategy validates, JSON round-trips, and the Program says what it should."""
from __future__ import annotations

import itertools
import json
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parashift import Strategy, models
from parashift.errors import StrategyError, UnknownPresetError
from parashift.ir import Program, compile
from parashift.ir.memory import region_state_bytes, static_memory
from parashift.ir.model_graph import model_graph
from parashift.ir.schedules import get_schedule, schedule_names
from parashift.sim import simulate

SEQ = 16


def small_strategies(model: str, schedules=(("1f1b", 1),)):
    spec = models.get(model)
    for dp, tp, pp in itertools.product([1, 2, 4, 8], [1, 2, 4], [1, 2, 4]):
        if dp * tp * pp > 8:
            continue
        for ep, zero, (sched, vpp) in itertools.product([1, 2, 4, 8], range(4), schedules):
            try:
                s = Strategy(dp=dp, tp=tp, pp=pp, ep=ep, zero=zero, vpp=vpp, schedule=sched)
                s.validate(spec)
            except StrategyError:
                continue
            yield s


def check_memory_effects(prog: Program) -> None:
    """Every buffer is allocated once and freed once, later on the same stream order."""
    for rp in {id(p): p for p in prog.ranks.values()}.values():
        allocs = Counter(n for i in rp.instrs() for n, _ in i.alloc)
        frees = Counter(n for i in rp.instrs() for n in i.free)
        assert allocs == frees
        assert all(v == 1 for v in allocs.values())


@pytest.mark.parametrize("model", ["tiny-gpt", "tiny-moe"])
def test_every_small_combination_validates(model):
    n = 0
    for s in small_strategies(model):
        m = 2 * s.pp
        prog = compile(model, s, global_batch=s.dp * s.mbs * m, seq_len=SEQ).validate()
        check_memory_effects(prog)
        assert len(prog.classes()) == s.pp  # one shared program per stage
        n += 1
    assert n > 100 if model == "tiny-moe" else n > 40


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("strategy", ["dp=2,tp=2,pp=2", "dp=1,tp=1,pp=2", "dp=2,tp=2,pp=1,ep=2",
                                      "tp=2,sp,cp=2,pp=2"])
def test_flops_add_up(strategy, recompute):
    """Every rank's share times tp x cp adds up to the model's FLOPs; full recompute re-runs every
    region, selective only core attention."""
    model = "tiny-moe" if "ep" in strategy else "tiny-gpt"
    spec = models.get(model)
    s = Strategy.parse(strategy).replace(recompute=recompute)
    m = 3
    prog = compile(model, s, global_batch=s.dp * m, seq_len=SEQ).validate()
    g = model_graph(spec, mbs=1, seq_len=SEQ)
    fwd = sum(g.col("flops"))
    got = Counter()
    for st in range(s.pp):
        rp = prog.ranks[int(s.rank(pp=st))]
        for i in rp.instrs():
            if i.op == "compute" and i.phase != "optim":
                got[i.phase] += i.flops * s.tp * s.cp
    assert got["fwd"] == pytest.approx(m * fwd)
    assert got["bwd"] == pytest.approx(2 * m * fwd)
    if recompute == "full":
        assert got["recompute"] == pytest.approx(m * fwd)
    elif recompute == "selective":
        core = 4 * SEQ * SEQ * spec.heads * spec.head_dim * spec.layers
        assert got["recompute"] == pytest.approx(m * core)
    else:
        assert got["recompute"] == 0


def test_tp_and_ep_communication():
    prog = compile("tiny-moe", "dp=4,tp=2,pp=1,ep=2", global_batch=8, seq_len=SEQ).validate()
    spec = models.get("tiny-moe")
    ins = list(prog.ranks[0].instrs())
    m = 2
    ar = [i for i in ins if i.op == "all_reduce" and i.group == "tp"]
    # per micro-batch: embed fwd, per layer combine fwd + attn fwd/bwd + route bwd, head bwd
    assert len(ar) == m * (1 + 4 * spec.layers + 1)
    assert sum(1 for i in ins if i.op == "all_gather" and i.key == "ce_stats") == m
    a2a = [i for i in ins if i.op == "all_to_all"]
    assert len(a2a) == m * spec.layers * 4
    assert {i.tag.split(".")[4] for i in a2a} == {"dispatch", "combine"}
    assert "ep.layers.0.moe.dispatch.fwd.m0" in {i.tag for i in a2a}
    assert "tp.layers.1.attn.bwd.m1" in {i.tag for i in ar}
    assert all(i.stream == "compute" for i in ar + a2a)
    # compute regions are not fused when communication sits between them
    regions = [i.region for i in prog.ranks[0].streams["compute"] if i.op == "compute" and i.phase == "fwd"]
    assert regions[:5] == ["embed", "layers.0.attn", "layers.0.moe.route", "layers.0.moe.experts",
                           "layers.0.moe.combine"]
    syncs = {i.tag: i.group for i in ins if i.tag and ".grad." in i.tag}
    assert syncs == {"dp.grad.c0": "dp", "edp.grad.c0": "edp"}  # experts replicated over dp/ep = 2
    p2 = compile("tiny-moe", "dp=2,tp=2,pp=1,ep=2", global_batch=4, seq_len=SEQ).validate()
    assert {i.tag for i in p2.ranks[0].instrs() if i.tag and ".grad." in i.tag} == {"dp.grad.c0"}


def test_fused_regions_without_tp():
    prog = compile("tiny-gpt", "dp=1,pp=2", global_batch=2, seq_len=SEQ).validate()
    r0 = {i.region for i in prog.ranks[0].instrs() if i.op == "compute" and i.phase == "fwd"}
    r1 = {i.region for i in prog.ranks[1].instrs() if i.op == "compute" and i.phase == "fwd"}
    assert r0 == {"embed+layers.0-1"} and r1 == {"layers.2-3+head"}


def _ancestors(rp, iid: int) -> set[int]:
    """Instructions ``iid`` waits for: its deps and its stream predecessors, transitively."""
    before = {i.id: [p.id for p in seq[:k][-1:]] + list(i.deps) for seq in rp.streams.values()
              for k, i in enumerate(seq)}
    out, todo = set(), [iid]
    while todo:
        for d in before[todo.pop()]:
            if d not in out:
                out.add(d)
                todo.append(d)
    return out


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_stages(zero):
    prog = compile("tiny-gpt", f"dp=2,pp=2,zero={zero}", global_batch=8, seq_len=SEQ).validate()
    ins = list(prog.ranks[0].instrs())
    ops = Counter((i.op, (i.tag or "").split(".")[0] + "." + (i.tag or ".").split(".")[1]) for i in ins
                  if i.stream == "comm")
    m = 4   # micro-batches per DP rank
    regions = ["embed", "layers.0.attn", "layers.0.mlp", "layers.1.attn", "layers.1.mlp"]   # stage 0's buckets
    if zero == 0:
        assert ops == {("all_reduce", "dp.grad"): 1}
    elif zero == 1:
        assert ops == {("reduce_scatter", "dp.grad"): 1, ("all_gather", "dp.param"): 1}
    elif zero == 2:
        assert ops == {("reduce_scatter", "dp.grad"): m * len(regions), ("all_gather", "dp.param"): 1}
    else:
        assert ops == {("reduce_scatter", "dp.grad"): m * len(regions), ("all_gather", "z3.param"): 2 * m * len(regions)}
        gathers = [i for i in ins if i.op == "all_gather"]     # per region, before its forward and its backward
        assert {i.alloc[0][0] for i in gathers} == {f"z3.c0.{ph}.m{k}.{r}" for ph in ("fwd", "bwd")
                                                    for k in range(m) for r in regions}
    if zero >= 2:   # each region's gradient per micro-batch: allocated by its backward, freed by its reduce-scatter
        spec, s = models.get("tiny-gpt"), Strategy(dp=2, pp=2)
        grads = {r: g for r, _, g in region_state_bytes(spec, s)}
        assert sum(grads[r] for r in regions) == static_memory(spec, s)[0]["grad"]
        rs = {i.tag: i for i in ins if i.op == "reduce_scatter"}
        assert set(rs) == {f"dp.grad.c0.m{k}.{r}" for k in range(m) for r in regions}
        bwd = {(i.microbatch, i.region): i for i in ins if i.phase == "bwd" and i.op == "compute"}
        for (k, r), node in bwd.items():
            assert node.alloc == ((f"zg.c0.m{k}.{r}", grads[r]),)
            assert rs[f"dp.grad.c0.m{k}.{r}"].free == (f"zg.c0.m{k}.{r}",)
        order = [i for i in ins if i.phase == "bwd" and i.op == "compute"]
        for a, b in zip(order, order[2:]):    # two buckets live: a backward waits for the reduce-scatter two before
            assert rs[f"dp.grad.c0.m{a.microbatch}.{a.region}"].id in _ancestors(prog.ranks[0], b.id)
    mem = prog.ranks[0].static_memory
    full = static_memory(models.get("tiny-gpt"), Strategy(dp=2, pp=2))[0]
    assert mem["optim"] == (full["optim"] // 2 if zero >= 1 else full["optim"])
    assert mem["grad"] == (full["grad"] // 2 if zero >= 2 else full["grad"])
    assert mem["param"] == (full["param"] // 2 if zero >= 3 else full["param"])


@pytest.mark.parametrize("strategy", ["dp=2,pp=2,schedule=zb-h1", "dp=2,pp=2,vpp=2,schedule=dualpipev"])
def test_split_backward_buckets_live_from_the_weight_gradient_node(strategy):
    """Under split backwards an input-gradient node writes no gradient: a region's ZeRO-2/3 bucket is
    allocated by its weight-gradient node and reduce-scattered right after it, a ZeRO-3 copy of the
    backward is freed by the region's input-gradient node, and so ZeRO-2 and ZeRO-3 hold less than ZeRO-1."""
    peaks = {}
    for zero in (1, 2, 3):
        prog = compile("tiny-gpt", f"{strategy},zero={zero}", global_batch=8, seq_len=SEQ).validate()
        peaks[zero] = simulate(prog, "a100-1x8").peak_memory
        if zero == 1:
            continue
        for rp in {id(r): r for r in prog.ranks.values()}.values():
            ins = list(rp.instrs())
            comp = {(i.phase, i.chunk, i.microbatch, i.region): i for i in ins if i.op == "compute"}
            rs = [i for i in ins if i.op == "reduce_scatter"]
            assert rs
            for r in rs:
                (name,) = r.free
                w = comp[("bwd_weight", r.chunk, r.microbatch, name.split(".", 3)[3])]
                assert [n for n, _ in w.alloc if n.startswith("zg.")] == [name]
                assert w.id in _ancestors(rp, r.id)
                assert not any(n.startswith("zg.") for i in ins if i.phase == "bwd_input" for n, _ in i.alloc)
            if zero == 3:
                for i in ins:
                    for n in i.free:
                        if n.startswith("z3.") and ".bwd." in n:
                            assert i.phase in ("bwd_input", "recompute"), (n, i)
    for r in peaks[1]:
        assert peaks[3][r] <= peaks[2][r] < peaks[1][r], (r, peaks)


def test_unfused_regions_hold_their_own_activation_buffers():
    """Where a chunk's regions are separate instructions each region's stash is its own buffer, from
    its forward to its last backward (under split backwards its weight-gradient node)."""
    for strategy, last in (("tp=2,pp=2", "bwd"), ("tp=2,pp=2,schedule=zb-h1", "bwd_weight")):
        prog = compile("tiny-gpt", strategy, global_batch=8, seq_len=SEQ).validate()
        ins = [i for i in prog.ranks[0].instrs() if i.op == "compute" and i.phase != "optim"]
        for i in ins:
            acts = [n for n, _ in i.alloc if n.startswith("act.")]
            if i.phase == "fwd" and i.region != "embed":
                assert acts == [f"act.c{i.chunk}.m{i.microbatch}.{i.region}"]
            freed = [n for n in i.free if n.startswith("act.")]
            assert freed == ([f"act.c{i.chunk}.m{i.microbatch}.{i.region}"] if i.phase == last
                             and i.region != "embed" else [])


def test_static_memory_covers_the_model():
    spec = models.get("tiny-gpt")
    s = Strategy(tp=2, pp=2)
    mem = static_memory(spec, s)
    per_rank = sum(t.numel // (2 if t.tp_dim is not None else 1) for t in spec.tensors) * spec.dtype_bytes
    assert sum(m["param"] for m in mem) == per_rank  # TP shards along tp_dim, replicates the rest
    assert all(m["master"] == 0 for m in mem)  # fp32 keeps no master copy
    big = static_memory(models.get("llama2-70b"), Strategy(dp=32, tp=8, pp=4, zero=1))
    total = sum(m["param"] for m in big) * 8
    assert total == pytest.approx(models.get("llama2-70b").params * 2, rel=1e-3)  # norms replicated over TP


def test_tied_embedding_sync():
    tied = models.gpt(4, 64, 4, ffn=128, vocab=256, seq_len=SEQ, name="tied", tied=True, dtype="fp32", pad_vocab=8)
    prog = compile(tied, "dp=2,pp=2,zero=1", global_batch=4, seq_len=SEQ).validate()
    for r in (0, 2):
        comm = prog.ranks[r].streams["comm"]
        tags = [i.tag for i in comm]
        assert "embed.grad" in tags
        assert tags.index("embed.grad") < tags.index(f"dp.grad.c{r // 2}")
    assert prog.strategy.group(0, "embed") == (0, 2)
    # embedding and head on one rank (pp=1, or dualpipev's V): no tied all-reduce
    for strat in ("dp=2,pp=1", "dp=1,pp=2,vpp=2,schedule=dualpipev"):
        p = compile(tied, strat, global_batch=4, seq_len=SEQ).validate()
        assert not any(i.tag == "embed.grad" for q in p.ranks.values() for i in q.instrs())


def test_meta_and_activation_buffers():
    prog = compile("tiny-gpt", "dp=2,pp=2,recompute=full", global_batch=8, seq_len=SEQ)
    assert prog.meta == {"model": "tiny-gpt", "strategy": "dp=2,tp=1,pp=2,recompute=full", "schedule": "1f1b",
                         "global_batch": 8, "seq_len": SEQ, "microbatches": 4, "mbs": 1, "kind": "train_step",
                         "precision": "fp32", "model_spec": models.get("tiny-gpt").to_json()}
    names = [n for i in prog.ranks[0].instrs() for n, _ in i.alloc]
    assert "act.c0.m3" in names and any(n.startswith("rc.") for n in names)


def test_json_round_trip_and_frame(tmp_path):
    prog = compile("tiny-moe", "dp=4,tp=2,pp=1,ep=2,zero=3", global_batch=8, seq_len=SEQ)
    obj = json.loads(json.dumps(prog.to_json()))
    back = Program.from_json(obj)
    assert back == prog and back.to_json() == prog.to_json()
    assert len(back.classes()) == len(prog.classes())
    path = tmp_path / "p.json"
    prog.save(str(path))
    assert Program.load(str(path)) == prog
    df = prog.to_frame(ranks=[0, 1])
    assert list(df.columns) == ["rank", "stream", "index", "id", "op", "phase", "stage", "chunk", "microbatch",
                                "peer", "group", "nbytes", "flops", "tag"]
    assert len(df) == 2 * len(prog.ranks[0])
    comp = df[df.op == "compute"]
    assert comp.stage.notna().all() and df[df.op != "compute"].stage.isna().all()
    assert (df.groupby(["rank", "stream"])["index"].apply(lambda s: list(s) == list(range(len(s))))).all()


def test_clear_errors():
    with pytest.raises(StrategyError, match="tp=3 must divide"):
        compile("tiny-gpt", "tp=3", global_batch=1, seq_len=SEQ)
    with pytest.raises(StrategyError, match="not divisible by dp\\*mbs"):
        compile("tiny-gpt", "dp=2", global_batch=3, seq_len=SEQ)
    with pytest.raises(UnknownPresetError, match="unknown model"):
        compile("gpt-5", "dp=1", global_batch=1, seq_len=SEQ)


@st.composite
def strategies(draw):
    model = draw(st.sampled_from(["tiny-gpt", "tiny-moe"]))
    spec = models.get(model)
    tp = draw(st.sampled_from([1, 2]))  # the tiny models have 2 KV heads
    pp = draw(st.sampled_from([1, 2, 4]))
    dp = draw(st.sampled_from([1, 2, 4]))
    ep = draw(st.sampled_from([d for d in (1, 2, 4) if dp % d == 0 and (spec.is_moe or d == 1)]))
    sched = draw(st.sampled_from(schedule_names()))
    vpp = get_schedule(sched).vpp_choices((2,))[0]
    if pp * vpp > spec.layers:
        vpp, sched = 1, "1f1b"
    s = Strategy(dp=dp, tp=tp, pp=pp, ep=ep, zero=draw(st.integers(0, 3)), vpp=vpp, schedule=sched,
                 mbs=draw(st.sampled_from([1, 2])), recompute=draw(st.sampled_from(["none", "selective", "full"])))
    m = draw(st.integers(1, 3)) * pp
    return model, s, s.dp * s.mbs * m


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(strategies())
def test_random_strategies_validate_and_round_trip(case):
    model, s, gb = case
    prog = compile(model, s, global_batch=gb, seq_len=SEQ).validate()
    check_memory_effects(prog)
    back = Program.from_json(json.loads(json.dumps(prog.to_json())))
    assert back == prog
    assert back.strategy == s
    back.validate()


@pytest.mark.parametrize("model,strategy", [
    ("tiny-gpt", "dp=2,tp=2,pp=2,zero=1"), ("tiny-moe", "dp=4,pp=2,ep=2,zero=2"),
    ("tiny-moe", "dp=4,tp=2,ep=4,zero=3"), ("tiny-gpt", "dp=2,pp=2,vpp=2,schedule=dualpipev,zero=1"),
    ("gpt3-1.3b", "dp=4,tp=2,pp=2,zero=3"), ("llama2-70b", "dp=32,tp=8,pp=4,zero=1"),
    ("qwen3-30b-a3b", "dp=8,tp=2,pp=3,ep=4,zero=1"), ("tiny-gpt", "dp=2,cp=2,tp=2,sp,zero=1"),
    ("tiny-gpt", "cp=4,pp=2,zero=3"), ("gpt3-1.3b", "dp=2,cp=2,tp=2,pp=2,zero=2")])
def test_static_memory_agrees_with_vps_layout(model, strategy):
    """ir.memory derives the bytes from the inventory; vps.layout lays out the real buffers."""
    from parashift.vps import layout
    spec, s = models.get(model), Strategy.parse(strategy)
    lay = layout(spec, s)
    per = {k: lay.bytes_per_rank(k, padded=True) for k in lay.kinds}
    zero = np.zeros(s.world, np.int64)
    for st, mem in enumerate(static_memory(spec, s)):
        for r in np.flatnonzero(np.asarray(s.coords(np.arange(s.world))["pp"]) == st):
            assert mem == {"param": int(per["param"][r]), "grad": int(per["grad"][r]),
                           "master": int(per.get("master", zero)[r]),
                           "optim": int(per["exp_avg"][r] + per["exp_avg_sq"][r])}


def test_a_step_too_large_to_compile_is_refused_at_once_with_the_fix():
    """1M micro-batches of tiny-gpt took 4 minutes to compile; now the size is checked before any work."""
    from parashift.ir.compile import MAX_CELLS, MAX_MICROBATCHES
    with pytest.raises(StrategyError, match="micro-batches per step exceed the limit of 65,536; lower the global"):
        compile("tiny-gpt", "dp=1", global_batch=MAX_MICROBATCHES + 1, seq_len=16)
    with pytest.raises(StrategyError, match="cells exceed the limit"):
        compile("gpt3-175b", "dp=1,pp=8", global_batch=MAX_CELLS // 100, seq_len=128)
