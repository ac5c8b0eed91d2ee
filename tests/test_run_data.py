"""`parashift run --data`: every step trains on the sampler's global batch, the same under any strategy
and across hot switches; the trainer options reach the run JSON, the metrics file and a deploy plan."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from parashift import models
from parashift.cli import main
from parashift.exec.reference import reference_train
from parashift.exec.train import TokenData
from parashift.cli.train_options import optim_config

STEPS, GB, SEQ = 4, 8, 32
TRAIN = ["--lr", "1e-2", "--lr-warmup-steps", "1", "--lr-decay", "cosine", "--min-lr", "1e-3", "--clip-grad", "0.2"]


def write_tokens(path: Path, ids: np.ndarray, vocab: int) -> Path:
    """A token file in `parashift data prepare`'s format (one document)."""
    ids = np.asarray(ids, dtype="<u2")
    path.write_bytes(ids.tobytes())
    meta = {"format": "parashift-tokens", "version": 1, "dtype": "uint16", "byteorder": "little",
            "tokens": int(ids.size), "bytes": int(ids.nbytes), "sha256": hashlib.sha256(ids.tobytes()).hexdigest(),
            "vocab_size": vocab, "eos_id": 0, "doc_offsets": [0, int(ids.size)]}
    path.with_suffix(".json").write_text(json.dumps(meta))
    return path


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    # 20 sequences: the 4 steps of 8 cross an epoch boundary at step 2
    ids = np.random.default_rng(1).integers(0, 256, SEQ * 20 + 1)
    return write_tokens(tmp_path_factory.mktemp("tok") / "toks.bin", ids, 256)


def _run(capsys, argv: list[str]) -> dict:
    assert main(["run", *argv, "--json", "--steps", str(STEPS), "--global-batch", str(GB), "--seq-len", str(SEQ),
                 "--timeout", "240"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def reference(tokens):
    torch.set_num_threads(1)
    settings = {"lr": 1e-2, "lr_warmup_steps": 1, "lr_decay": "cosine", "min_lr": 1e-3, "lr_decay_steps": STEPS,
                "clip_grad": 0.2, "weight_decay": 0.1, "precision": None}
    feed = TokenData(str(tokens)).open(SEQ, GB, 256)
    ref = reference_train(models.get("tiny-gpt"), STEPS, GB, SEQ, optim=optim_config(settings), batch=feed.batch)
    return ref, [feed.indices(k) for k in range(STEPS)]


@pytest.mark.parametrize("strategy", ["dp=2,zero=1", "tp=2,pp=2"])
def test_data_runs_train_on_the_samplers_batches_like_one_process(capsys, tmp_path, tokens, reference, strategy):
    ref, samples = reference
    metrics = tmp_path / "m.jsonl"
    out = _run(capsys, ["--strategy", strategy, "--data", str(tokens), *TRAIN, "--metrics", str(metrics)])
    assert out["samples"] == samples
    epoch0 = [i for s in samples for i in s][:20]
    assert sorted(epoch0) == list(range(20))            # exactly once per epoch
    np.testing.assert_allclose(out["losses"], ref.losses, rtol=1e-5)
    np.testing.assert_allclose(out["grad_norm"], ref.grad_norms, rtol=1e-5)
    np.testing.assert_allclose(out["lr"], ref.lrs, rtol=1e-12)
    assert out["tokens"] == [GB * SEQ] * STEPS
    assert out["train"]["clip_grad"] == 0.2 and out["train"]["lr_decay_steps"] == STEPS
    assert out["data_position"]["consumed"] == STEPS * GB and out["data_position"]["epoch"] == 1
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert [r["loss"] for r in rows] == out["losses"] and [r["grad_norm"] for r in rows] == out["grad_norm"]
    assert all(r["predicted_step_seconds"] > 0 and r["tokens_per_s"] > 0 for r in rows)


@pytest.mark.parametrize("switches", [["2:tp=2"], ["1:dp=1:0", "2:dp=2,zero=1:0,1"]], ids=["reshape", "shrink-grow"])
def test_hot_switch_keeps_the_data_order_and_the_schedule(capsys, tmp_path, tokens, reference, switches):
    ref, samples = reference
    at = [a for sw in switches for a in ("--switch-at", sw)]
    metrics = tmp_path / "m.jsonl"
    out = _run(capsys, ["--strategy", "dp=2", "--data", str(tokens), *TRAIN, *at, "--switch-notice", "0",
                        "--metrics", str(metrics)])
    assert out["samples"] == samples
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert [r["loss"] for r in rows] == pytest.approx(out["losses"], rel=1e-12)
    assert [r["grad_norm"] for r in rows] == out["grad_norm"] and all(r["step_seconds"] > 0 for r in rows)
    np.testing.assert_allclose(out["losses"], ref.losses, rtol=1e-5)
    np.testing.assert_allclose(out["grad_norm"], ref.grad_norms, rtol=1e-5)
    np.testing.assert_allclose(out["lr"], ref.lrs, rtol=1e-12)


def test_bad_data_file_is_one_line_before_any_process(capsys, tmp_path, tokens):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(tokens.read_bytes()[:-2])
    bad.with_suffix(".json").write_text(tokens.with_suffix(".json").read_text())
    assert main(["run", "--strategy", "dp=2", "--data", str(bad), "--steps", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "truncated" in err[0]
    big = write_tokens(tmp_path / "big.bin", np.arange(SEQ * 9) % 300, 300)
    assert main(["run", "--data", str(big), "--steps", "1", "--seq-len", str(SEQ)]) == 1
    assert "vocabulary of 300" in capsys.readouterr().err


def test_a_deploy_plan_carries_the_trainer_settings(capsys, tmp_path):
    from parashift import Strategy, cluster, ir
    from parashift.search.result import plan_json
    spec = models.get("tiny-gpt")
    train = {"lr": 5e-3, "lr_warmup_steps": 1, "lr_decay": "linear", "min_lr": 0.0, "lr_decay_steps": None,
             "clip_grad": 0.5, "weight_decay": 0.0, "precision": None}
    prog = ir.compile(spec, Strategy.parse("dp=2"), global_batch=GB, seq_len=SEQ)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(plan_json(prog, model=spec, strategy=Strategy.parse("dp=2"), global_batch=GB,
                                         seq_len=SEQ, cluster=cluster.get("cpu-local"), devices=2, train=train)))
    assert main(["run", str(plan), "--steps", "3", "--json", "--force", "--lr", "2e-3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["train"] == {**train, "lr": 2e-3, "lr_decay_steps": 3}       # the command line wins over the plan
    assert out["lr"] == pytest.approx([0.0, 2e-3, 1e-3])


class _Term:
    def __init__(self, tty: bool) -> None:
        self.tty, self.text = tty, ""

    def isatty(self) -> bool:
        return self.tty

    def write(self, s: str) -> None:
        self.text += s

    def flush(self) -> None:
        pass


def test_metrics_log_bar_only_on_a_terminal_and_tensorboard_when_installed(tmp_path):
    from parashift.exec.metrics import MetricsLog, tensorboard_available
    for tty in (True, False):
        term = _Term(tty)
        log = MetricsLog(2, 256, path=str(tmp_path / "m.jsonl"), tensorboard=str(tmp_path / "tb"), predicted=0.5,
                         stream=term)
        log(0, 5.5, 0.25, 1.2, 1e-3)
        log(1, 5.4, 0.5, 1.1, 5e-4)
        log.close()
        assert ("2/2" in term.text and term.text.endswith("\n")) == tty
        assert bool(term.text) == tty
    rows = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert rows[0] == {"step": 0, "loss": 5.5, "grad_norm": 1.2, "lr": 1e-3, "tokens": 256, "tokens_per_s": 1024.0,
                       "step_seconds": 0.25, "predicted_step_seconds": 0.5}
    assert (tmp_path / "tb").is_dir() == tensorboard_available()
    assert bool(log.notes) != tensorboard_available()
