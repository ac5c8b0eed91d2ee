"""State store: flat buffers sharded exactly as vps.layout says; AdamW identical to torch's;
region strings; the process-group cache."""
from __future__ import annotations

import pytest
import torch

from parashift import Strategy, models
from parashift.exec.interpreter import chunk_atoms, group_keys
from parashift.exec.reference import OptimConfig
from parashift.exec.regions import atomic_regions
from parashift.exec.runtime import compile_program
from parashift.exec.state import MemoryTracker, StateStore, adamw_
from parashift.vps import layout

CASES = [("tiny-gpt", "dp=2,tp=2,pp=2,zero=1"), ("tiny-gpt", "dp=4,pp=2,vpp=2,zero=3,schedule=interleaved-1f1b"),
         ("tiny-moe", "dp=4,ep=2,tp=2,zero=2"), ("tiny-moe", "dp=2,ep=2,pp=2,vpp=2,zero=0,schedule=dualpipev"),
         ("tiny-gpt", "dp=3,zero=3")]


def _mine(store: StateStore) -> set[tuple]:
    """(slot, tensor, start, stop, offset) rows the store holds, in vps.layout's terms."""
    zero = store.strategy.zero
    rows = set()
    for fam, b in store.buffers.items():
        base = "dense" if fam == "dense" else "experts"
        for p in b.pieces:
            if zero < 3:             # the kinds ZeRO leaves whole (all of them at zero 0)
                rows.add((base, p.name, 0, p.numel, p.start))
            lo, hi = max(b.lo, p.start), min(b.hi, p.start + p.numel)
            if zero >= 1 and hi > lo:
                rows.add((f"zero_{base}", p.name, lo - p.start, hi - p.start, lo - b.lo))
    return rows


@pytest.mark.parametrize("model,strategy", CASES)
def test_store_buffers_match_vps_layout(model: str, strategy: str) -> None:
    spec, s = models.get(model), Strategy.parse(strategy)
    lay = layout(spec, s)
    for rank in range(s.world):
        store = StateStore(spec, s, rank, torch.device("cpu"))
        frame = lay.buffers_frame(rank)
        want = {(r.slot, r.tensor, r.start, r.stop, r.offset) for r in frame.itertuples()}
        assert _mine(store) == want, f"rank {rank}"
        for r in frame.itertuples():
            if r.slot.startswith("zero"):
                fam = "dense" if r.slot == "zero_dense" else "expert"
                assert store.buffers[fam].q == r.buffer_size


def test_params_are_views_into_the_store() -> None:
    spec, s = models.get("tiny-gpt"), Strategy.parse("tp=2,pp=2")
    store = StateStore(spec, s, 1, torch.device("cpu"))
    w = store.param("layers.0.attn.qkv.weight")
    assert w.shape == (spec.tensor("layers.0.attn.qkv.weight").shape[0] // 2, spec.hidden)
    assert w.untyped_storage().data_ptr() == store.buffers["dense"].param.untyped_storage().data_ptr()
    store.buffers["dense"].param.zero_()
    assert float(w.abs().sum()) == 0.0


def test_zero3_needs_a_gather_before_use() -> None:
    store = StateStore(models.get("tiny-gpt"), Strategy.parse("dp=2,zero=3"), 0, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="not gathered"):
        store.param("head.out")


def test_adamw_matches_torch() -> None:
    torch.manual_seed(0)
    cfg = OptimConfig(lr=3e-3, weight_decay=0.05)
    p = torch.randn(1000)
    ref = p.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                            weight_decay=cfg.weight_decay, foreach=False)
    m, v = torch.zeros(1000), torch.zeros(1000)
    for step in range(1, 6):
        g = torch.randn(1000)
        ref.grad = g.clone()
        opt.step()
        adamw_(p, g, m, v, step, cfg)
        assert torch.equal(p, ref.detach())


def test_adamw_in_pieces_is_elementwise_exact() -> None:
    torch.manual_seed(1)
    cfg = OptimConfig(lr=3e-3, weight_decay=0.05)
    p0, m0, v0 = torch.randn(1003), torch.randn(1003), torch.rand(1003)
    runs = [(p0.clone(), m0.clone(), v0.clone()) for _ in range(2)]
    for step in range(1, 4):
        g = torch.randn(1003)
        for (p, m, v), piece in zip(runs, (1 << 16, 64)):
            adamw_(p, g, m, v, step, cfg, piece=piece)
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_memory_tracker_peak() -> None:
    mem = MemoryTracker()
    mem.alloc("a", 10)
    mem.alloc("b", 5)
    mem.free("a")
    mem.alloc("c", 7)
    assert (mem.current, mem.peak) == (12, 15)


def test_fused_regions_expand_in_model_order() -> None:
    gpt, moe = models.get("tiny-gpt"), models.get("tiny-moe")
    assert atomic_regions("embed+layers.0-1", gpt) == ["embed", "layers.0.attn", "layers.0.mlp", "layers.1.attn",
                                                       "layers.1.mlp"]
    assert atomic_regions("layers.3-3+head", moe) == ["layers.3.attn", "layers.3.moe.route", "layers.3.moe.experts",
                                                      "layers.3.moe.combine", "head"]
    atoms = chunk_atoms(gpt, Strategy.parse("pp=2,vpp=2,schedule=dualpipev"))
    assert atoms[0][0] == "embed" and atoms[-1][-1] == "head" and sum(map(len, atoms)) == 2 + 2 * gpt.layers


def test_group_keys_cover_every_collective_per_stream() -> None:
    program = compile_program("tiny-moe", "dp=2,ep=2,tp=2,zero=1", global_batch=8, seq_len=16)
    keys = group_keys(program)
    s = program.strategy
    assert all(len(m) > 1 for m, _ in keys)
    for r in range(s.world):
        assert (tuple(sorted(s.group(r, "tp"))), "compute") in keys
        assert (tuple(sorted(s.group(r, "ep"))), "compute") in keys
        assert (tuple(sorted(s.group(r, "dp"))), "comm") in keys
