"""The equivalence tests on CUDA with NCCL (``-m gpu``; skipped without enough GPUs)."""
from __future__ import annotations

import pytest
import torch

from parashift import Strategy

from test_exec_equivalence import check

GPU_CASES = [
    ("tiny-gpt", "dp=1"),
    ("tiny-moe", "dp=1"),
    ("tiny-gpt", "dp=2,pp=2,zero=1"),
    ("tiny-gpt", "tp=2,pp=2,schedule=zb-h1"),
    ("tiny-moe", "dp=2,ep=2,zero=3"),
    ("tiny-gpt", "pp=2,vpp=2,schedule=dualpipev"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("model,strategy", GPU_CASES, ids=[f"{m}:{s}" for m, s in GPU_CASES])
def test_nccl_matches_single_process(model: str, strategy: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    world = Strategy.parse(strategy).world
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs (NCCL runs one rank per GPU), found {torch.cuda.device_count()}")
    check(model, strategy, backend="nccl")
