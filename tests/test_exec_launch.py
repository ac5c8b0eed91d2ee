"""Launcher: results in rank order, progress reports, and clean failure (no process left behind)."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from parashift.errors import RuntimeFailure
from parashift.exec import launch_local
from parashift.exec.runtime import Runtime, compile_program


def _sum_ranks(ctx, scale):
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t)
    ctx.report(("pid", os.getpid()))
    return ctx.rank, float(t) * scale


def _fail_mid_step(ctx, program_json):
    from parashift.ir.program import Program
    ctx.report(("pid", os.getpid()))
    rt = Runtime(Program.from_json(program_json), ctx, timeout=60)
    rt.step()
    if ctx.rank == 1:
        calls = []
        real = rt.interp._compute

        def broken(ins):
            calls.append(ins)
            if len(calls) == 3:
                raise ValueError("injected failure in the third compute of step 2")
            return real(ins)
        rt.interp._compute = broken
    rt.step()
    return "finished"


def _hang(ctx):
    ctx.report(("pid", os.getpid()))
    time.sleep(600)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            state = next(line for line in f if line.startswith("State:"))
        return "Z" not in state.split()[1]
    except (FileNotFoundError, StopIteration):
        return False


def test_results_in_rank_order_and_reports():
    seen = []
    out = launch_local(_sum_ranks, 3, args=(2.0,), timeout=60, on_report=lambda r, p: seen.append((r, p[0])))
    assert out == [(0, 6.0), (1, 6.0), (2, 6.0)]
    assert sorted(r for r, _ in seen) == [0, 1, 2]


def test_failing_rank_ends_the_job_with_its_traceback():
    program = compile_program("tiny-gpt", "dp=2,pp=2", global_batch=8, seq_len=16)
    pids = []
    t0 = time.monotonic()
    with pytest.raises(RuntimeFailure) as err:
        launch_local(_fail_mid_step, 4, args=(program.to_json(),), timeout=60,
                     on_report=lambda r, p: pids.append(p[1]))
    elapsed = time.monotonic() - t0
    msg = str(err.value)
    assert "rank 1 failed" in msg and "injected failure in the third compute of step 2" in msg
    assert "stream 'compute'" in msg and ">>" in msg          # the instruction and its neighbours
    assert elapsed < 30, f"the failure took {elapsed:.1f} s to end the job"
    assert len(pids) == 4
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "a rank process outlived the failed job"


def test_timeout_stops_a_hung_job():
    pids = []
    t0 = time.monotonic()
    with pytest.raises(RuntimeFailure, match="did not finish within 10 s"):   # room to start under load
        launch_local(_hang, 2, timeout=10, on_report=lambda r, p: pids.append(p[1]))
    assert time.monotonic() - t0 < 30
    time.sleep(0.5)
    assert pids and not any(_alive(p) for p in pids)


@pytest.mark.slow
def test_torchrun_runs_the_same_entry_point(tmp_path):
    import json
    import shutil
    import subprocess
    import sys
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this python")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [torchrun, "--nproc_per_node", "2", "--master_port", str(port), "-m", "parashift", "run", "--model", "tiny-gpt",
           "--strategy", "dp=2", "--steps", "2", "--global-batch", "4", "--seq-len", "16", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, out.stdout                     # rank 0 prints the gathered result
    got = json.loads(lines[0])
    from parashift.exec import run
    local = run("tiny-gpt", "dp=2", steps=2, global_batch=4, seq_len=16, timeout=120)
    assert got["nprocs"] == 2 and got["losses"] == local.losses


def test_a_script_without_the_main_guard_is_told_to_add_it(tmp_path):
    """Workers start with forkserver, which imports the main script again: a script that starts a job at
    its top level gets the fix in one line, from the worker and from the launcher, instead of
    multiprocessing's bootstrapping error alone."""
    import subprocess
    import sys
    script = tmp_path / "noguard.py"
    script.write_text("from parashift.exec import compile_program, run_program\n"
                      "run_program(compile_program('tiny-gpt', 'dp=2', global_batch=4, seq_len=16), steps=1)\n")
    got = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert got.returncode != 0
    assert "a worker process started a parashift job while it imported the main script" in got.stderr
    assert got.stderr.rstrip().splitlines()[-1].endswith('calls under `if __name__ == "__main__":`)')
