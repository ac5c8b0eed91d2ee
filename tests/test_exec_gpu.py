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


# ---- the GPU path of issue 20 (item 6): streams, device checksums, switches with state on the GPU ----
def _cuda(n: int = 1) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs (NCCL runs one process per GPU), found {torch.cuda.device_count()}")


@pytest.mark.gpu
def test_cuda_streams_order_lanes_by_events_and_time_with_cuda_events():
    from parashift.exec.streams import CudaBackend, Streams
    _cuda()
    dev = torch.device("cuda", torch.cuda.current_device())
    s = Streams(CudaBackend(dev), default=("compute",), profile=True)
    s.begin()
    x = torch.randn(2048, 2048, device=dev)
    with s.enter("compute"):
        y = x @ x
    s.mark("compute", "y")
    t0 = s.stamp("comm")
    with s.enter("comm", ["y"]):          # a lane of its own, after y
        z = y * 2
    s.mark("comm", "z")
    t1 = s.stamp("comm")
    with s.enter("compute", ["z"]):
        w = z + 1
    s.finish()
    assert s.handle("comm") != torch.cuda.current_stream(dev)
    torch.testing.assert_close(w, (x @ x) * 2 + 1)
    a, b = s.seconds([t0, t1])
    assert 0 <= a <= b


@pytest.mark.gpu
def test_device_checksums_depend_on_bytes_only_and_catch_a_flipped_byte():
    from parashift.exec.switch.wire import checksum_device, resolve
    _cuda()
    raw = torch.randint(0, 256, (1 << 16) + 13, dtype=torch.uint8, device="cuda")
    base = checksum_device(raw[:-5])
    off = torch.empty((1 << 16) + 16, dtype=torch.uint8, device="cuda")
    off[3:3 + raw.numel() - 5].copy_(raw[:-5])
    bad = raw[:-5].clone()
    bad[777] ^= 1
    a, b, c = resolve([base, checksum_device(off[3:3 + raw.numel() - 5]), checksum_device(bad)])
    assert a == b and a != c


@pytest.mark.gpu
def test_profiling_on_cuda_times_instructions_with_events_without_a_synchronize_each(monkeypatch):
    import torch.distributed as dist
    from parashift.exec.launch import RankContext
    from parashift.exec.runtime import Runtime, compile_program
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    _cuda()
    program = compile_program("tiny-gpt", "dp=1", global_batch=4, seq_len=16)
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=1)
    try:
        rt = Runtime(program, RankContext(0, 1, "fake", torch.device("cuda", torch.cuda.current_device())), timeout=60)
        calls = []
        real = torch.cuda.synchronize
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
        rt.step()
        rows = rt.profiler.rows
        assert len(rows) == len(list(program.ranks[0].instrs()))
        assert all(0 <= r[8] <= r[9] for r in rows)
        assert len(calls) <= 2          # the step's stamps once, the runtime's end of step once
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("ordered", [False, True], ids=["gloo-driver", "ordered-driver"])
def test_switch_of_processes_sharing_one_gpu_moves_device_state_bit_exactly(ordered: bool):
    from parashift.exec.switch.check import switch_check
    from test_switch_live import GPT
    _cuda()
    out = switch_check(GPT, "dp=2,tp=2,zero=1", "tp=4", transport="gloo-pinned", ordered=ordered, timeout=120)
    assert out["ok"], out["mismatches"]
    assert out["placed_on"][0].startswith("cuda") and out["bytes_moved"] > 0


@pytest.mark.gpu
def test_switch_over_nccl_moves_device_state_bit_exactly():
    from parashift.exec.switch.check import switch_check
    from test_switch_live import GPT
    _cuda(2)
    for src, dst in (("dp=2,zero=1", "tp=2"), ("tp=2", "dp=1")):
        out = switch_check(GPT, src, dst, (0, 1), (0, 1) if dst != "dp=1" else (1,), transport="nccl", timeout=120)
        assert out["ok"] and out["ordered"], out


@pytest.mark.gpu
def test_live_job_on_cuda_trains_switches_and_matches_the_static_job():
    from parashift.exec.switch import run_live
    from test_switch_live import GPT, check_switches
    _cuda(2)
    res = run_live(GPT, "dp=2", steps=4, switches=[(2, "tp=2", None)], device="cuda", export=True, timeout=300)
    static = run_live(GPT, "dp=2", steps=4, device="cuda", timeout=300)
    assert [s.get("aborted") for s in res.switches] == [None]
    assert check_switches(GPT, res) == 1
    assert max(abs(a - b) for a, b in zip(res.losses, static.losses)) < 1e-5
