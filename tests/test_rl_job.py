"""Live jobs with RL phases: weights switch to the rollout layout and back every iteration (gloo)."""
from __future__ import annotations

import json

import pytest

from parashift.cli import main
from parashift.exec.rl.job import RLOptions, reference_rl, run_rl


def test_cli_rollout_job_generates_like_one_process_and_trains_like_no_switch(capsys):
    argv = ["run", "--model", "tiny-gpt", "--strategy", "dp=2,tp=2,zero=1", "--rollout", "tp=2",
            "--rollout-tokens", "5", "--iterations", "2", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rollout"] == "dp=1,tp=2,pp=1" and out["released_training_weights"] is True
    assert len(out["iterations"]) == 2
    for it in out["iterations"]:
        assert it["generated_equal_reference"] is True
        assert abs(it["loss"] - it["reference_loss"]) < 1e-5
        assert it["rollout_switch_seconds"] > 0 and it["train_switch_seconds"] > 0 and it["bytes_moved"] > 0
    assert out["iterations"][0]["loss"] != out["iterations"][1]["loss"]
    assert main(argv[:-1] + ["--rollout-keep-weights", "--json"]) == 0
    kept = json.loads(capsys.readouterr().out)
    assert kept["released_training_weights"] is False
    assert [it["loss"] for it in kept["iterations"]] == [it["loss"] for it in out["iterations"]]


@pytest.mark.parametrize("model,train,rollout,dtype", [
    ("tiny-moe", "dp=4,ep=2,zero=1", "tp=2", "bf16"),       # rollout on 2 of 4 devices, bf16 copy
    ("tiny-gpt", "dp=2,pp=2", "tp=2,dp=2", "fp32"),        # pipeline training, TP replicas for the rollout
    pytest.param("tiny-gpt", "dp=2,tp=2,zero=3", "tp=2,dp=2", "fp32", marks=pytest.mark.slow),   # sharded weights
    pytest.param("tiny-moe", "dp=2,ep=2,tp=2", "tp=2", "fp32", marks=pytest.mark.slow),          # EP x TP experts
])
def test_rollout_layouts_dtypes_and_fewer_devices_keep_losses_exact(model, train, rollout, dtype):
    res = run_rl(model, train, rollout, iterations=2, rollout_tokens=4, dtype=dtype)
    for it in res.iterations:
        assert it["generated_equal_reference"] is True
        assert abs(it["loss"] - it["reference_loss"]) < 1e-5
    tl = res.timeline()
    assert {"rollout-switch", "rollout", "train-switch", "train"} <= set(tl["stream"])
    n = {"tp=2": 2, "tp=2,dp=2": 4}[rollout]
    assert set(tl[tl["op"] == "generate"]["device"]) == set(range(n))
    assert set(tl[tl["op"] == "idle"]["device"]) == set(range(n, 4))


def test_reference_changes_with_the_rollout_dtype_only_through_the_weights():
    a = reference_rl("tiny-gpt", 1, RLOptions(rollout_tokens=3, prompts=2, prompt_len=4))
    b = reference_rl("tiny-gpt", 1, RLOptions(rollout_tokens=3, prompts=2, prompt_len=4, dtype="bf16"))
    assert len(a[1][0]) == 2 and len(a[1][0][0]) == 7
    assert a[1][0][0][:4] == b[1][0][0][:4]


def test_bad_rollout_requests_fail_in_one_line(capsys):
    assert main(["run", "--strategy", "dp=2", "--rollout", "pp=2", "--json"]) != 0
    assert "rollout layout" in capsys.readouterr().err
    assert main(["run", "--strategy", "dp=2", "--rollout", "tp=2", "--global-batch", "3", "--json"]) != 0
    assert "split" in capsys.readouterr().err
