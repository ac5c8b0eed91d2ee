"""The learning-rate schedule against hand-computed values and torch.optim.lr_scheduler; the decay rule."""
import math

import pytest
import torch

from parashift import models
from parashift.errors import InputError
from parashift.train import LRSchedule, decays


def test_megatron_warmup_then_cosine_by_hand():
    s = LRSchedule(lr=1.0, warmup_steps=4, decay="cosine", min_lr=0.1, decay_steps=12)
    # warmup: k/W of the way from 0; step 0 trains at 0 (Megatron's init_lr), step W at the peak
    assert [s.at(k) for k in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    # decay over steps 4..12: ratio (k-4)/8, lr = 0.1 + 0.9 * (1 + cos(pi * ratio)) / 2
    assert s.at(6) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2, rel=1e-15)
    assert s.at(8) == pytest.approx(0.55, rel=1e-15)
    assert s.at(12) == pytest.approx(0.1, rel=1e-15)
    assert s.at(13) == s.at(500) == 0.1


def test_megatron_linear_constant_and_warmup_init_by_hand():
    lin = LRSchedule(lr=2.0, warmup_steps=0, decay="linear", min_lr=0.0)
    assert lin.rates(5) == pytest.approx([2.0, 1.6, 1.2, 0.8, 0.4], rel=1e-15)   # decay_steps = the run's 5 steps
    const = LRSchedule(lr=3e-4, warmup_steps=2, decay="constant", warmup_init=1e-4)
    assert const.rates(4) == pytest.approx([1e-4, 2e-4, 3e-4, 3e-4], rel=1e-15)


def test_torchtitan_convention_by_hand():
    s = LRSchedule(lr=1.0, warmup_steps=4, decay="linear", min_lr=0.2, convention="torchtitan")
    # warmup (k+1)/W; step W holds the peak; then (k-W)/(T-W) of the way to min_lr; T = 10 steps
    want = [0.25, 0.5, 0.75, 1.0, 1.0, 1.0 - 0.8 / 6, 1.0 - 1.6 / 6, 1.0 - 2.4 / 6, 1.0 - 3.2 / 6, 1.0 - 4.0 / 6]
    assert s.rates(10) == pytest.approx(want, rel=1e-14)
    assert LRSchedule(lr=1.0, decay="cosine", convention="torchtitan").rates(3) == pytest.approx(
        [1.0, 0.75, 0.25])


def _torch_rates(sched_factory, steps):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = sched_factory(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("decay", ["cosine", "linear"])
def test_megatron_convention_matches_torch_schedulers(decay):
    """torch's LambdaLR warmup followed by CosineAnnealingLR / LinearLR: the same curve up to decay_steps."""
    lr, lo, w, d = 3e-4, 3e-5, 5, 25
    ours = LRSchedule(lr=lr, warmup_steps=w, decay=decay, min_lr=lo, decay_steps=d).rates(d + 1)
    tail = (lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=d - w, eta_min=lo)) if decay == "cosine" \
        else (lambda o: torch.optim.lr_scheduler.LinearLR(o, 1.0, lo / lr, total_iters=d - w))

    def make(o):
        for g in o.param_groups:
            g["lr"] = lr
        warm = torch.optim.lr_scheduler.LambdaLR(o, lambda k: k / w)
        return torch.optim.lr_scheduler.SequentialLR(o, [warm, tail(o)], milestones=[w])
    theirs = _torch_rates(make, d + 1)
    assert ours == pytest.approx(theirs, rel=1e-6, abs=1e-12)


def test_torchtitan_constant_matches_torch_linear_warmup():
    ours = LRSchedule(lr=1.0, warmup_steps=4, decay="constant", convention="torchtitan").rates(8)
    theirs = _torch_rates(lambda o: torch.optim.lr_scheduler.LinearLR(o, 0.25, 1.0, total_iters=3), 8)
    assert ours == pytest.approx(theirs, rel=1e-12)


@pytest.mark.parametrize("kw,match", [
    (dict(lr=0.0), "positive"),
    (dict(lr=1.0, decay="step"), "not one of"),
    (dict(lr=1.0, min_lr=2.0), "between 0 and --lr"),
    (dict(lr=1.0, warmup_steps=5, decay="cosine", decay_steps=5), "must exceed --lr-warmup-steps"),
    (dict(lr=1.0, warmup_init=0.1, convention="torchtitan"), "megatron convention"),
])
def test_bad_schedules_are_input_errors(kw, match):
    with pytest.raises(InputError, match=match):
        LRSchedule(**kw)


def test_decay_needs_a_length_and_dict_round_trip():
    s = LRSchedule(lr=1.0, warmup_steps=2, decay="cosine")
    with pytest.raises(InputError, match="total_steps"):
        s.at(3)
    with pytest.raises(InputError, match="total steps 2 must exceed"):
        s.at(1, total_steps=2)
    assert LRSchedule.from_dict(s.to_dict()) == s
    with pytest.raises(InputError, match="unknown"):
        LRSchedule.from_dict({"lr": 1.0, "warmup": 3})


def test_decay_rule_on_matrices_and_embeddings_not_norms_or_biases():
    gpt = models.get("gpt3-1.3b")
    got = {t.name: decays(t.name, t.shape) for t in gpt.tensors if t.layer in (-1, 0) or ".0." in t.name}
    assert got["embed.word"] and got["embed.pos"] and got["layers.0.attn.qkv.weight"]
    assert not got["layers.0.attn.norm.weight"] and not got["layers.0.attn.norm.bias"]
    assert not got["layers.0.attn.qkv.bias"] and not got["layers.0.mlp.fc1.bias"]
    moe = models.get("tiny-moe")
    assert all(decays(t.name, t.shape) == (len(t.shape) >= 2 and "norm" not in t.name) for t in moe.tensors)
    assert decays("layers.0.moe.experts.fc1", (8, 128, 64))
    # the same rule on Hugging Face names, 2-D biases of experts included
    assert decays("model.embed_tokens.weight", (32, 8)) and decays("lm_head.weight", (32, 8))
    assert not decays("model.layers.0.input_layernorm.weight", (8,))
    assert not decays("model.layers.0.self_attn.q_norm.weight", (4,))
    assert not decays("model.layers.0.mlp.experts.gate_up_proj_bias", (4, 16))
    # matches nanoGPT's dim() >= 2 on a real torch module without biases in 2-D
    m = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 4))
    assert {n: decays(n, p.shape) for n, p in m.named_parameters()} == {
        n: p.dim() >= 2 for n, p in m.named_parameters()}
