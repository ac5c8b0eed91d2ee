"""The trainer's features across layouts: the global gradient norm counts every element once (tp, pp,
dp, cp, ep, ZeRO-1/2/3, hybrid sharding), clipping and the LR schedule train exactly like a
single-process torch.optim.AdamW loop with ``clip_grad_norm_``, and weight decay skips norms."""
from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st
import torch

from parashift import Strategy, models
from parashift.exec import run
from parashift.exec.reference import OptimConfig, param_groups, reference_train
from parashift.exec.train import coverage
from parashift.exec.state import StateStore
from parashift.train import LRSchedule

STEPS, GB, SEQ = 4, 8, 32
#: clipping at 0.05 is active on every step (the norms are ~0.9-1.3); warmup + cosine to 1e-3
OPT = OptimConfig(lr=1e-2, clip_grad=0.05,
                  schedule=LRSchedule(1e-2, warmup_steps=2, decay="cosine", min_lr=1e-3, decay_steps=STEPS))

LAYOUTS = [
    ("tiny-gpt", "dp=2"), ("tiny-gpt", "tp=2"), ("tiny-gpt", "pp=2"), ("tiny-gpt", "dp=2,zero=1"),
    ("tiny-gpt", "dp=2,zero=2"), ("tiny-gpt", "dp=2,zero=3"), ("tiny-gpt", "cp=2,zero=1"),
    ("tiny-gpt", "tp=2,pp=2,zero=1"), ("tiny-gpt", "dp=4,zero=1,shard=2"), ("tiny-gpt", "pp=2,vpp=2,dp=2,zero=3"),
    ("tiny-moe", "dp=2,ep=2"), ("tiny-moe", "dp=4,ep=2,zero=2"), ("tiny-moe", "dp=2,ep=2,tp=2,zero=1"),
]


@pytest.mark.parametrize("model,strategy", LAYOUTS, ids=[f"{m}:{s}" for m, s in LAYOUTS])
def test_every_element_counts_once_in_the_global_norm(model: str, strategy: str) -> None:
    counts = coverage(models.get(model), Strategy.parse(strategy))
    for name, c in counts.items():
        assert (c == 1).all(), f"{strategy}: {name} counted {c.min()}..{c.max()} times"


def test_coverage_catches_a_double_count() -> None:
    """Counting every rank's whole optimizer gradient counts DP replicas twice, and so do TP-replicated
    norms; ZeRO shards stay single."""
    def everything(store):
        return {fam: [(0, b.opt_grad().numel())] for fam, b in store.buffers.items()}
    dp = coverage(models.get("tiny-gpt"), Strategy.parse("dp=2"), owned=everything)
    assert all((c == 2).all() for c in dp.values())
    tp = coverage(models.get("tiny-gpt"), Strategy.parse("tp=2"), owned=everything)
    assert tp["head.norm.weight"].max() == 2 and tp["head.out"].max() == 1
    z = coverage(models.get("tiny-gpt"), Strategy.parse("dp=2,zero=1"), owned=everything)
    assert all((c == 1).all() for c in z.values())


def test_weight_decay_skips_norms_in_the_store_and_the_reference() -> None:
    spec = models.get("tiny-gpt")
    store = StateStore(spec, Strategy.parse("dp=1"), 0, torch.device("cpu"), init=False)
    b = store.buffers["dense"]
    segs = b.decay_segments()
    assert segs[0][0] == 0 and segs[-1][1] == b.padded
    assert all(x[1] == y[0] for x, y in zip(segs, segs[1:]))
    for p in b.pieces:
        flags = {d for a, e, d in segs if a < p.start + p.numel and e > p.start}
        assert flags == {not p.name.endswith("norm.weight")}, p.name
    P = {t.name: torch.zeros(t.shape) for t in spec.tensors}
    groups = param_groups(spec, P, 0.1)
    assert all(v.dim() >= 2 for v in groups[0]["params"]) and groups[1]["weight_decay"] == 0.0
    assert len(groups[1]["params"]) == sum(1 for t in spec.tensors if t.name.endswith("norm.weight"))


#: a Qwen-like model: q/k/v biases and per-head q/k norms (neither split nor decayed), tied embeddings
QWENISH = models.gpt(2, 64, 4, kv_heads=2, ffn=128, vocab=256, seq_len=SEQ, name="qwenish", dtype="fp32",
                     pad_vocab=8, dropout=0.0, tied=True, qkv_bias=True, qk_norm=True)


def _spec(model: str):
    return QWENISH if model == "qwenish" else models.get(model)


@functools.lru_cache(maxsize=None)
def golden(model: str):
    torch.set_num_threads(1)
    return reference_train(_spec(model), STEPS, GB, SEQ, optim=OPT)


RUNS = [
    ("tiny-gpt", "dp=2,zero=1"), ("tiny-gpt", "tp=2,pp=2"), ("tiny-gpt", "dp=2,zero=3"),
    ("tiny-gpt", "cp=2,dp=2,zero=2"), ("tiny-moe", "dp=2,ep=2,zero=1"), ("tiny-moe", "tp=2,dp=2,ep=2"),
    ("qwenish", "tp=2,dp=2,zero=1"),
]


@pytest.mark.parametrize("model,strategy", RUNS, ids=[f"{m}:{s}" for m, s in RUNS])
def test_clipped_scheduled_training_matches_the_reference(model: str, strategy: str) -> None:
    ref = golden(model)
    assert all(n > 2 * OPT.clip_grad for n in ref.grad_norms)     # the clip bites on every step
    res = run(_spec(model) if model == "qwenish" else model, strategy, steps=STEPS, global_batch=GB, seq_len=SEQ,
              optim=OPT, timeout=180)
    np.testing.assert_allclose(res.grad_norms, ref.grad_norms, rtol=1e-5)
    np.testing.assert_allclose(res.losses, ref.losses, rtol=1e-5)
    np.testing.assert_allclose(res.lrs, ref.lrs, rtol=1e-12)
    js = res.to_json()
    assert js["grad_norm"] == res.grad_norms and js["tokens"] == [GB * SEQ] * STEPS


def test_bf16_keeps_fp32_master_moments_and_gradient_accumulation() -> None:
    """Updates far below bf16's resolution accumulate in the fp32 master; the bf16 parameters follow it."""
    from parashift.exec.train import with_precision
    spec = with_precision(models.get("tiny-gpt"), "bf16")
    store = StateStore(spec, Strategy.parse("dp=1"), 0, torch.device("cpu"))
    b = store.buffers["dense"]
    assert b.param.dtype == torch.bfloat16 and b.master.dtype == torch.float32
    assert b.exp_avg.dtype == b.grad_buffer().dtype == torch.float32
    start = b.master.clone()
    cfg = OptimConfig(lr=1e-4, weight_decay=0.0)
    for _ in range(3):
        b.grad_buffer().fill_(1e-3)
        b.optimizer_step(cfg)
    moved = b.master - start
    assert torch.allclose(moved[:b.numel], torch.full((b.numel,), -3e-4), rtol=1e-3)   # Adam steps of ~lr each
    assert torch.equal(b.param, b.master.to(torch.bfloat16))
    assert not torch.equal(b.master, b.master.to(torch.bfloat16).float())   # the master holds more than bf16


@pytest.mark.parametrize("model,strategy", [("tiny-gpt", "dp=2,zero=1"), ("tiny-moe", "dp=2,ep=2,zero=2")])
def test_bf16_training_tracks_fp32(model: str, strategy: str) -> None:
    from parashift.exec.train import with_precision
    ref = golden(model)
    res = run(with_precision(models.get(model), "bf16"), strategy, steps=STEPS, global_batch=GB, seq_len=SEQ,
              optim=OPT, timeout=180)
    np.testing.assert_allclose(res.losses, ref.losses, rtol=3e-4)
    np.testing.assert_allclose(res.grad_norms, ref.grad_norms, rtol=2e-2)
    assert max(abs(a - b) / b for a, b in zip(res.losses, ref.losses)) > 1e-7   # it did run in bf16


@settings(max_examples=40, deadline=None)
@given(model=st.sampled_from(["tiny-gpt", "tiny-moe"]), dp=st.sampled_from([1, 2, 4]), tp=st.sampled_from([1, 2]),
       pp=st.sampled_from([1, 2]), cp=st.sampled_from([1, 2]), ep=st.sampled_from([1, 2, 4]),
       zero=st.integers(0, 3), vpp=st.sampled_from([1, 2]), shard=st.sampled_from([0, 2]))
def test_any_valid_layout_counts_every_element_once(model, dp, tp, pp, cp, ep, zero, vpp, shard) -> None:
    from parashift.errors import StrategyError
    spec = models.get(model)
    try:
        s = Strategy(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep if spec.is_moe else 1, zero=zero, vpp=vpp,
                     shard=shard if zero else 0)
        s.validate(spec)
    except StrategyError:
        assume(False)
    for name, c in coverage(spec, s).items():
        assert (c == 1).all(), f"{s}: {name} counted {c.min()}..{c.max()} times"
