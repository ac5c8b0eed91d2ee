"""With profiling off the runtime takes its fast path (receives posted at the start of the step,
sends nothing waits for reaped at its end, one direct wait when a single transfer blocks every
stream) and still trains exactly like one process."""
from __future__ import annotations

import pytest

from test_exec_equivalence import check

FAST = [
    ("tiny-gpt", "pp=4,schedule=1f1b"),
    ("tiny-gpt", "dp=2,pp=2,vpp=2,zero=2,schedule=interleaved-1f1b"),
    ("tiny-gpt", "tp=2,pp=2,schedule=zb-h1,recompute=full"),
    ("tiny-gpt", "pp=2,vpp=2,schedule=dualpipev"),
    ("tiny-moe", "dp=2,ep=2,pp=2,vpp=2,schedule=dualpipev"),
]


@pytest.mark.parametrize("model,strategy", FAST, ids=[f"{m}:{s}" for m, s in FAST])
def test_fast_path_matches_single_process(model: str, strategy: str) -> None:
    check(model, strategy, profile=False)
