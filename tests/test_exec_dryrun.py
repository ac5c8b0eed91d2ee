"""Dry runs at full scale: every distinct rank program of a 64-rank job executes one step on
torch's ``fake`` process-group backend (collectives are no-ops), in this one process."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parashift.exec.launch import RankContext
from parashift.exec.runtime import Runtime, compile_program, world_keys

fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")

CASES = ["dp=8,tp=2,pp=4,zero=3,schedule=zb-h1,recompute=full", "dp=16,tp=2,pp=2,vpp=2,zero=2,schedule=dualpipev",
         "dp=16,pp=4,zero=1,schedule=gpipe"]


@pytest.mark.parametrize("strategy", CASES)
def test_every_rank_class_executes_at_64_ranks(strategy: str) -> None:
    program = compile_program("tiny-gpt", strategy, global_batch=64, seq_len=16)
    assert program.world == 64
    keys = world_keys(program)
    for ranks in program.classes().values():
        r = ranks[0]
        dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=r, world_size=program.world)
        try:
            rt = Runtime(program, RankContext(r, program.world, "fake", torch.device("cpu")), timeout=30)
            assert set(rt.worlds.members()) == {k for k in keys}   # every group made once, cached by members
            rt.step()
            executed = sorted(row[4] for row in rt.profiler.rows)
            assert executed == sorted(i.id for i in program.ranks[r].instrs())
        finally:
            dist.destroy_process_group()
