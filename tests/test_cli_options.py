"""Shared CLI options: counts must be positive integers, a search that finds nothing says why,
and a replay names the events its job never reached."""
import argparse
import json

import pytest

from parashift import ir
from parashift.cli import main
from parashift.cli import replay as replay_cli
from parashift.errors import StrategyError


@pytest.mark.parametrize("argv", [
    ["simulate", "--model", "tiny-gpt", "--cluster", "cpu-local", "--strategy", "dp=1", "--global-batch", "8",
     "--seq-len", "0"],
    ["search", "--model", "tiny-gpt", "--cluster", "cpu-local", "--global-batch", "-8", "--seq-len", "32"],
    ["replay", "bamboo/p3-trace.csv", "--max-events", "0"],
])
def test_counts_must_be_positive(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "must be >= 1" in err[0]


def test_compile_rejects_a_zero_sequence_length():
    with pytest.raises(StrategyError, match="seq_len=0 must be positive"):
        ir.compile("tiny-gpt", "dp=1", global_batch=8, seq_len=0)


def test_search_without_a_feasible_strategy_says_why(capsys):
    # all 5 devices: dp=5 does not divide the batch, tp=5 not the heads, pp=5 not the layers
    assert main(["search", "--model", "tiny-gpt", "--cluster", "cpu-local", "--devices", "5", "--global-batch", "8",
                 "--seq-len", "32", "--trials", "4", "--seed", "0", "--json", "--no-progress", "--all-devices"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["best"] is None and out["reasons"]
    assert sum(r["trials"] for r in out["reasons"]) <= 4 and all(r["reason"] for r in out["reasons"])


def test_replay_names_events_it_did_not_reach(capsys):
    ev = {"time": 1.0, "trace_time": 60.0, "event": "preempt", "devices": 2, "step": None, "pause_seconds": 0.0,
          "lost_seconds": 0.0, "strategy": "dp=2", "switched": False, "applied": False}
    result = {"model": "tiny-gpt", "trace": "t.csv", "policy": "best", "time_scale": 60.0, "devices_per_node": 1,
              "steps": 3, "duration": 2.0, "initial_devices": 4, "initial_strategy": "dp=4", "events": [ev],
              "losses": [5.0, 4.9, 4.8], "static_losses": [5.0, 4.9, 4.8], "max_loss_rel_diff": 0.0,
              "state_difference": {"param": 0.0}, "lost_seconds": 0.0}
    replay_cli.render(result, argparse.Namespace(max_steps=3))
    out = capsys.readouterr().out
    assert "(not reached)" in out and "1 event(s) not reached before the job stopped" in out
    replay_cli.render({**result, "events": [{**ev, "applied": True, "step": 2}]}, argparse.Namespace(max_steps=3))
    assert "not reached" not in capsys.readouterr().out


@pytest.mark.parametrize("extra", [[], ["--live"], ["--live", "--endpoint", "127.0.0.1:1"]])
def test_device_cuda_without_gpus_says_so(extra, capsys, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["run", "--model", "tiny-gpt", "--strategy", "dp=1", "--steps", "1", "--device", "cuda",
                 "--json", *extra]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device cuda needs CUDA GPUs" in err[0] and "--device cpu" in err[0]


def test_device_auto_follows_the_machine(monkeypatch):
    import torch
    from parashift.cli.options import resolve_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(argparse.Namespace(device="auto")) == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device(argparse.Namespace(device="auto")) == "cuda"
    assert resolve_device(argparse.Namespace(device="cpu")) == "cpu"


def test_a_cuda_host_needs_a_gpu_per_process(monkeypatch):
    import torch
    from parashift.exec.job.endpoint import check_local_gpus
    check_local_gpus("cpu", 8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_local_gpus("cuda", 2)
    with pytest.raises(StrategyError, match="has 2 GPU.*use --nprocs 2 here"):
        check_local_gpus("cuda", 4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(StrategyError, match="no CUDA GPU.*--device cpu"):
        check_local_gpus("cuda", 1)


def test_static_run_on_cpu_by_choice(capsys):
    assert main(["run", "--model", "tiny-gpt", "--strategy", "dp=1", "--steps", "1", "--device", "cpu",
                 "--json", "--force"]) == 0
    assert len(json.loads(capsys.readouterr().out)["losses"]) == 1


def test_a_multi_host_job_refuses_overlap_param(capsys, monkeypatch):
    monkeypatch.setenv("PARASHIFT_JOB_SECRET", "s" * 32)
    for argv in (["--strategy", "dp=2,zero=1,overlap_param"],
                 ["--strategy", "dp=2,zero=1", "--strategy-for", "4:dp=4,zero=1,overlap_param"]):
        assert main(["run", "--model", "tiny-gpt", "--live", "--endpoint", "127.0.0.1:1", "--steps", "2",
                     "--json", *argv]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "drop overlap_param" in err[0], err
