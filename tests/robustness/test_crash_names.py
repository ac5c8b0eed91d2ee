"""A crash names the rank that died, not a survivor's broken connection."""
import os
import signal
import time

import pytest

from parashift.errors import RuntimeFailure
from parashift.exec import launch_local


def _one_rank_dies(ctx):
    import torch
    import torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)          # everyone is connected
    if ctx.rank == 2:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(t)          # the survivors lose their peer here
    return float(t)


def test_the_dead_rank_is_named_first():
    with pytest.raises(RuntimeFailure) as e:
        launch_local(_one_rank_dies, 3, timeout=60)
    first = str(e.value).splitlines()[0]
    assert first.startswith("rank 2 died"), first
    assert "SIGKILL" in first or "-9" in first, first
