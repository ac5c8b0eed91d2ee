"""Layouts against a brute-force reference that follows DESIGN.md element by element.

The reference (``reference_holdings``) shares no code with ``parashift.vps``: it slices index
arrays with ``np.split`` for TP/EP, concatenates them into real flat buffers for ZeRO, pads
and splits those, and records which global elements every rank holds of every kind.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from parashift import Strategy, models, vps
from parashift.errors import PlanError, StrategyError, UnknownPresetError
from parashift.ir.schedules import get_schedule, schedule_names

ZERO_STAGE = {"param": 3, "grad": 2, "master": 1, "exp_avg": 1, "exp_avg_sq": 1}


# ---- the reference ------------------------------------------------------------------------------
def _stage_of_tensors(model, s: Strategy) -> list[set[int]]:
    stages = s.pp * s.vpp
    base, extra = divmod(model.layers, stages)
    chunk_of_layer = [c for c in range(stages) for _ in range(base + (1 if c < extra else 0))]

    def stage(c: int) -> int:
        if get_schedule(s.schedule).vshape:
            lap, pos = divmod(c, s.pp)
            return pos if lap % 2 == 0 else s.pp - 1 - pos
        return c % s.pp

    out = []
    for t in model.tensors:
        c = 0 if t.layer < 0 else stages - 1 if t.layer >= model.layers else chunk_of_layer[t.layer]
        held = {stage(c)}
        if t.tied:
            held.add(stage(stages - 1))
        out.append(held)
    return out


def reference_holdings(model, s: Strategy) -> dict[tuple[int, int, str], np.ndarray]:
    """(rank, tensor index, kind) -> sorted global flat indices the rank holds."""
    stages = _stage_of_tensors(model, s)
    out: dict[tuple[int, int, str], np.ndarray] = {}
    for rank in range(s.world):
        tp, cp = rank % s.tp, (rank // s.tp) % s.cp             # Megatron order: tp, cp, dp, pp
        dp, pp = (rank // (s.tp * s.cp)) % s.dp, rank // (s.tp * s.cp * s.dp)
        ep, edp = dp % s.ep, dp // s.ep
        local = {}
        for i, t in enumerate(model.tensors):
            if pp not in stages[i]:
                continue
            g = np.arange(t.numel).reshape(t.shape)
            if t.tp_dim is not None:
                g = np.split(g, s.tp, axis=t.tp_dim)[tp]
            if t.ep_dim is not None:
                g = np.split(g, s.ep, axis=t.ep_dim)[ep]
            local[i] = g.ravel()
        for kind in model.state_kinds:
            if s.zero < ZERO_STAGE[kind]:
                for i, g in local.items():
                    out[(rank, i, kind)] = np.sort(g)
                continue
            # ZeRO shards over the data-parallel group with context parallelism (dp x cp, cp fastest);
            # hybrid sharding (shard=N, cp=ep=1): over N consecutive dp ranks, replicated dp/N times
            n = s.shard or s.dp
            groups = ((False, n * s.cp, (dp % n) * s.cp + cp), (True, s.edp * s.cp, edp * s.cp + cp)) if not s.shard \
                else ((False, n, dp % n), (True, n, dp % n))
            for is_expert, parts, me in groups:
                ids = [i for i in local if (model.tensors[i].ep_dim is not None) == is_expert]
                if not ids:
                    continue
                owner = np.concatenate([np.full(len(local[i]), i) for i in ids])
                index = np.concatenate([local[i] for i in ids])
                pad = -len(owner) % parts
                owner = np.concatenate([owner, np.full(pad, -1)])
                index = np.concatenate([index, np.full(pad, -1)])
                mine = slice(me * len(owner) // parts, (me + 1) * len(owner) // parts)
                for i in ids:
                    sel = owner[mine] == i
                    if sel.any():
                        out[(rank, i, kind)] = np.sort(index[mine][sel])
    return out


def layout_holdings(lay) -> dict[tuple[int, int, str], np.ndarray]:
    """The same map built from ``Layout.regions()`` (raises on an element listed twice)."""
    acc: dict[tuple[int, int, str], list[np.ndarray]] = {}
    reg = lay.regions()
    for r, t, k, lo, hi in zip(reg.rank, reg.tensor, reg.kind, reg.lo, reg.hi):
        spec = lay.model.tensors[t]
        g = np.arange(spec.numel).reshape(spec.shape)
        box = tuple(slice(a, b) for a, b in zip(lo[:len(spec.shape)], hi[:len(spec.shape)]))
        assert (lo[len(spec.shape):] == 0).all() and (hi[len(spec.shape):] == 1).all()
        acc.setdefault((int(r), int(t), lay.kinds[k]), []).append(g[box].ravel())
    out = {}
    for key, parts in acc.items():
        idx = np.sort(np.concatenate(parts))
        assert (np.diff(idx) > 0).all(), f"{key} lists an element twice"
        out[key] = idx
    return out


# ---- generators shared with the plan tests ------------------------------------------------------------
@st.composite
def tiny_models(draw, moe: bool | None = None):
    is_moe = draw(st.booleans()) if moe is None else moe
    layers = draw(st.integers(2, 4))
    kv = draw(st.sampled_from([1, 2, 4]))
    dtype = draw(st.sampled_from(["bf16", "fp32"]))
    tied = draw(st.booleans())
    if is_moe:
        return models.moe(layers, 8, 4, kv_heads=kv, vocab=16, seq_len=8, experts=4, top_k=2, expert_ffn=8,
                          shared_ffn=draw(st.sampled_from([0, 8])), name="h-moe", dtype=dtype, pad_vocab=8,
                          tied=tied)
    ln = draw(st.booleans())
    return models.gpt(layers, 8, 4, kv_heads=kv, ffn=16, vocab=16, seq_len=8, name="h-gpt", dtype=dtype,
                      pad_vocab=8, tied=tied, norm="ln" if ln else "rms", bias=ln,
                      pos_emb="learned" if ln else "rope")


@st.composite
def strategies_for(draw, model, max_world: int = 16):
    tp = draw(st.sampled_from([t for t in (1, 2, 4) if model.kv_heads % t == 0]))
    vpp = draw(st.sampled_from([1, 2] if model.layers >= 2 else [1]))
    pp = draw(st.integers(1, max(1, model.layers // vpp)))
    schedule = "1f1b" if vpp == 1 else draw(st.sampled_from([n for n in schedule_names() if get_schedule(n).vpp_choices((2,)) == (2,)]))
    dp = draw(st.integers(1, max(1, min(4, max_world // (tp * pp)))))
    eps = [e for e in (1, 2, 4) if dp % e == 0 and (model.experts % e == 0 if model.experts else e == 1)]
    ep = draw(st.sampled_from(eps))
    zero = draw(st.integers(0, 3))
    cp = 1 if ep > 1 or tp * pp * dp * 2 > max_world else draw(st.sampled_from([1, 2]))
    sp = tp > 1 and draw(st.booleans())
    shard = draw(st.sampled_from([n for n in range(1, dp) if dp % n == 0] or [0])) \
        if zero >= 1 and ep == 1 and cp == 1 and draw(st.booleans()) else 0
    s = Strategy(dp=dp, tp=tp, pp=pp, ep=ep, zero=zero, vpp=vpp, schedule=schedule, cp=cp, sp=sp, shard=shard)
    assert not s.problems(model), s.problems(model)
    return s


# ---- tests ------------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.data())
def test_layout_matches_the_reference(data):
    model = data.draw(tiny_models())
    s = data.draw(strategies_for(model))
    lay = vps.layout(model, s)
    ref = reference_holdings(model, s)
    got = layout_holdings(lay)
    assert got.keys() == ref.keys()
    for key in ref:
        assert np.array_equal(got[key], ref[key]), key


@pytest.mark.parametrize("name,strategy", [
    ("tiny-gpt", "dp=2,tp=2,pp=2,zero=1"), ("tiny-gpt", "dp=3,pp=2,vpp=2,zero=3"),
    ("tiny-moe", "dp=4,tp=2,ep=2,zero=2"), ("tiny-moe", "dp=2,pp=2,vpp=2,ep=2,schedule=dualpipev,zero=1"),
    ("tiny-gpt", "dp=2,cp=2,tp=2,sp,zero=1"), ("tiny-gpt", "cp=2,pp=2,zero=3"), ("tiny-moe", "dp=2,cp=2,zero=2"),
    ("tiny-gpt", "dp=4,tp=2,zero=1,shard=2"), ("tiny-moe", "dp=4,pp=2,zero=1,shard=2"),
])
def test_presets_match_the_reference(name, strategy):
    model = models.get(name)
    s = Strategy.parse(strategy)
    ref = reference_holdings(model, s)
    got = layout_holdings(vps.layout(model, s))
    assert got.keys() == ref.keys() and all(np.array_equal(got[k], ref[k]) for k in ref)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_each_element_is_held_the_expected_number_of_times(data):
    model = data.draw(tiny_models())
    s = data.draw(strategies_for(model))
    lay = vps.layout(model, s)
    reg = lay.regions()
    counts = {}
    for t, k, n in zip(reg.tensor, reg.kind, reg.numel):
        counts[(int(t), int(k))] = counts.get((int(t), int(k)), 0) + int(n)
    last, first = s.chunk_rank_stage(s.stages - 1), 0
    for t, spec in enumerate(model.tensors):
        copies = 2 if spec.tied and last != first else 1
        for k, kind in enumerate(lay.kinds):
            replicas = s.dp_replicas if s.zero >= ZERO_STAGE[kind] else \
                (s.edp if spec.ep_dim is not None else s.dp) * s.cp
            replicas *= 1 if spec.tp_dim is not None else s.tp     # TP ranks all hold untouched tensors
            assert counts[(t, k)] == spec.numel * copies * replicas, (spec.name, kind)


def test_bytes_per_rank_and_frame():
    model = models.get("tiny-moe")
    lay = vps.layout(model, "dp=2,tp=2,ep=2,zero=1")
    df = lay.to_frame()
    assert list(df.columns) == ["rank", "tensor", "kind", "lo", "hi", "nbytes"]
    per = df.groupby("rank")["nbytes"].sum()
    assert (lay.bytes_per_rank() == per.reindex(range(lay.world)).to_numpy()).all()
    assert (lay.bytes_per_rank("param") == df[df.kind == "param"].groupby("rank")["nbytes"].sum().to_numpy()).all()
    assert (lay.bytes_per_rank(padded=True) >= lay.bytes_per_rank()).all()
    row = df[(df.tensor == "layers.0.moe.experts.fc1") & (df.kind == "param") & (df["rank"] == 3)].iloc[0]
    # rank 3: tp=1, dp=1 -> ep=1 of 2: experts 4..7 of 8, second half of the TP dim (2*64/2 = 64 rows)
    assert row.lo == (4, 64, 0) and row.hi == (8, 128, 64)
    assert "master" not in set(df.kind)  # fp32 model: no master copy
    buf = lay.buffers_frame(0)
    assert set(buf.slot) == {"dense", "experts", "zero_dense", "zero_experts"}
    z = buf[buf.slot == "zero_dense"]
    z2 = lay.buffers_frame(2)                      # rank 2: tp=0, dp=1, the other half of the buffer
    z2 = z2[z2.slot == "zero_dense"]
    n = int((z.stop - z.start).sum() + (z2.stop - z2.start).sum())
    assert (z.offset.diff().dropna() > 0).all() and z.buffer_size.iloc[0] == -(-n // 2)
    assert (z.stop - z.start).sum() == z.buffer_size.iloc[0]   # the first shard is full, the padding is last


def test_bf16_model_has_master_and_sizes_add_up():
    model = models.get("llama2-7b")
    lay = vps.layout(model, "dp=4,tp=2,pp=2,zero=1")
    total = lay.bytes_per_rank().sum()
    n = sum(t.numel * (1 if t.tp_dim is not None else 2) for t in model.tensors)  # norms on both TP ranks
    assert total == n * 2 * 4 + n * 2 * 4 + n * 12  # param + grad replicated over dp=4, 12 B/elem sharded
    with pytest.raises(PlanError, match="kinds are"):
        lay.bytes_per_rank("momentum")


def test_layout_rejects_bad_strategies():
    with pytest.raises(StrategyError, match="tp=3 must divide"):
        vps.layout("tiny-gpt", "tp=3")
    with pytest.raises(StrategyError, match="exceeds the 4 layers"):
        vps.layout("tiny-gpt", "pp=8")
    with pytest.raises(UnknownPresetError, match="presets are"):
        vps.layout("gpt-5", "dp=1")
