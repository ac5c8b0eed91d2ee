"""Measured runtime memory peaks (the state store's accounting of buffers and stashed activations,
gloo, CPU) against the simulator's predicted peaks for the same Program."""
from __future__ import annotations

import pytest
import torch

from parashift.exec import run
from parashift.ir import compile
from parashift.sim import simulate

GB, SEQ = 8, 32


@pytest.mark.parametrize("strategy", ["pp=2", "tp=2,recompute=selective",
                                      pytest.param("dp=2", marks=pytest.mark.slow),
                                      pytest.param("tp=2", marks=pytest.mark.slow)])
def test_measured_peaks_match_the_simulation(strategy):
    torch.set_num_threads(1)
    res = run("tiny-gpt", strategy, steps=1, global_batch=GB, seq_len=SEQ, timeout=120)
    prog = compile("tiny-gpt", strategy, global_batch=GB, seq_len=SEQ)
    predicted = simulate(prog, "a100-1x8").peak_memory
    for rank, measured in enumerate(res.peak_memory):
        assert abs(predicted[rank] - measured) <= 0.10 * measured, (strategy, rank, predicted[rank], measured)
