"""The fp8 recipe in the runtime: quantize-dequantize GEMMs on CPU that train tiny-gpt like an
independent single-process FP8 reference, under dp=2 and tp=2 (gloo, 2 processes)."""
from __future__ import annotations

import functools

import pytest
import torch

from parashift.errors import StrategyError
from parashift.exec.fp8 import Fp8Gemms, qdq
from parashift.exec.reference import OptimConfig, reference_train
from parashift.exec.runtime import run
from parashift.models import get

STEPS, GB, SEQ = 4, 4, 16
OPT = OptimConfig(lr=1e-2)


def test_qdq_equals_a_few_line_reference():
    torch.manual_seed(0)
    x = torch.randn(64, 48) * 3
    for fmt, top, dtype in (("e4m3", 448.0, torch.float8_e4m3fn), ("e5m2", 57344.0, torch.float8_e5m2)):
        scale = top / float(x.abs().max())
        want = (x * scale).to(dtype).to(torch.float32) / scale       # in range: no saturation needed
        assert torch.allclose(qdq(x, scale, fmt), want, rtol=1e-7, atol=0)
        assert not torch.equal(qdq(x, scale, fmt), x)                 # it does round
    assert float(qdq(torch.tensor([1e4]), 1.0, "e4m3")) == 448.0      # saturates instead of NaN


def test_fp8_linear_matches_scaled_matmul_in_fp32():
    torch.manual_seed(1)
    g8 = Fp8Gemms("delayed", get("tiny-gpt"))
    name = "layers.0.mlp.fc1.weight"
    x, w = torch.randn(2, 8, 16, requires_grad=True), torch.randn(32, 16, requires_grad=True)
    y, _ = g8.linear(x, w, name)
    dy = torch.randn_like(y)
    y.backward(dy)
    g8.end_step()                       # second step: scales from the first one's amaxes
    y2, _ = g8.linear(x, w, name)
    sx, sw = 448.0 / float(x.detach().abs().max()), 448.0 / float(w.detach().abs().max())
    xq = (x.detach() * sx).to(torch.float8_e4m3fn).float() / sx
    wq = (w.detach() * sw).to(torch.float8_e4m3fn).float() / sw
    assert torch.allclose(y2, xq @ wq.t(), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(y2, x @ w.t(), rtol=1e-4, atol=1e-4)   # FP8 error is visible at this scale
    sg = 57344.0 / float(dy.abs().max())
    x.grad, w.grad = None, None
    y2.backward(dy)
    g = (dy * sg).to(torch.float8_e5m2).float() / sg
    assert torch.allclose(x.grad, g @ wq, rtol=1e-6, atol=1e-6)
    assert torch.allclose(w.grad, g.reshape(-1, 32).t() @ xq.reshape(-1, 16), rtol=1e-6, atol=1e-5)


def test_runtime_refuses_recipes_it_does_not_run():
    with pytest.raises(StrategyError, match="the runtime runs fp8=delayed"):
        Fp8Gemms("current", get("tiny-gpt"))


@functools.lru_cache(maxsize=None)
def _golden(fp8: str) -> list[float]:
    return reference_train(get("tiny-gpt"), STEPS, GB, SEQ, optim=OPT, fp8=fp8)[0]


@pytest.mark.parametrize("strategy", ["dp=2,zero=1", "tp=2"])
def test_tiny_gpt_trains_under_fp8_like_the_reference(strategy):
    ref, bf = _golden("delayed"), _golden("none")
    res = run("tiny-gpt", f"{strategy},fp8", steps=STEPS, global_batch=GB, seq_len=SEQ, optim=OPT, timeout=120)
    for k, (a, b) in enumerate(zip(res.losses, ref)):
        assert abs(a - b) <= 1e-5 * abs(b), f"{strategy}: step {k} loss {a} != fp8 reference {b}"
    # the recipe is really on: from step 1 the scales come from the history and the losses leave the fp32 run's
    assert max(abs(a - b) / b for a, b in zip(res.losses[1:], bf[1:])) > 1e-4


def test_live_switch_bf16_fp8_bf16_moves_the_state_exactly():
    import numpy as np
    from test_switch_live import GPT, check_switches

    from parashift.exec.switch.session import run_live
    chain = [(1, "dp=2,zero=1,fp8", None), (3, "dp=2,zero=1", None)]
    res = run_live(GPT, "dp=2,zero=1", steps=4, switches=chain, export=True, timeout=240, switch_timeout=30)
    assert [s.get("aborted") for s in res.switches] == [None, None]
    # each switch left byte for byte the params, master weights and AdamW moments a fresh job of the new
    # recipe would hold: the recipe changes the compute, not the layout
    assert check_switches(GPT, res) == 2
    ref, _ = reference_train(GPT, 4, 8, GPT.seq_len, fp8=["none", "delayed", "delayed", "none"])
    assert np.allclose(res.losses, ref, rtol=1e-5, atol=0), (res.losses, ref)
    plain, _ = reference_train(GPT, 4, 8, GPT.seq_len)
    assert abs(res.losses[1] - plain[1]) > 1e-4 * plain[1]      # the FP8 steps really ran in FP8


@pytest.mark.gpu
def test_scaled_mm_forward_equals_the_dequantized_product_on_a_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU with FP8 tensor cores")
    torch.manual_seed(2)
    g8 = Fp8Gemms("delayed", get("tiny-gpt"))
    name = "layers.0.mlp.fc2.weight"
    x = torch.randn(4, 32, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16)
    g8.linear(x, w, name)
    g8.end_step()                       # scales from the amaxes, not 1
    y, xq = g8.linear(x, w, name)
    wq = qdq(w, g8.scale(name, 1), "e4m3")
    want = xq.float() @ wq.float().t()
    assert y.dtype == torch.bfloat16 and torch.allclose(y.float(), want, rtol=2e-2, atol=2e-2)
