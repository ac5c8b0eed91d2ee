"""Weights in and out through the VPS: each rank reads only its layout's boxes of a Hugging Face checkpoint,
``export_hf`` writes sharded safetensors that transformers loads with the same logits, and a DCP checkpoint
resumes in another strategy on the same loss curve."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from parashift import models                                                # noqa: E402
from parashift.errors import ModelError                                      # noqa: E402
from parashift.exec import compile_program, run_program                      # noqa: E402
from parashift.exec.checkpoint import CheckpointOptions                      # noqa: E402
from parashift.exec.hf import load_hf_weights                                # noqa: E402
from parashift.exec.reference import OptimConfig, reference_logits   # noqa: E402
from parashift.exec.switch.stores import full_from_arrays, store_arrays     # noqa: E402
from parashift.exec.weights import load_store                                # noqa: E402
from parashift.models.hf import from_hf_config, hf_config                    # noqa: E402
from parashift.strategy import Strategy                                      # noqa: E402
from parashift.vps.layout import layout                                      # noqa: E402

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL, rope_theta=500000.0),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL, rope_theta=1e6),
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(**SMALL, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=24, norm_topk_prob=False),
}
GB, SEQ = 4, 16
OPT = OptimConfig(lr=1e-2)


def _save(kind: str, path, **kw):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[kind]()).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, **kw)
    return model, models.get(f"hf:{path}")


class _Counting:
    """safetensors.safe_open that counts the bytes every slice read returns."""

    read = 0
    elements = 0

    def __init__(self, inner):
        self.inner = inner

    def __enter__(self):
        self.fh = self.inner.__enter__()
        return self

    def __exit__(self, *a):
        return self.inner.__exit__(*a)

    def keys(self):
        return self.fh.keys()

    def get_slice(self, key):
        sl = self.fh.get_slice(key)
        outer = self

        class Slice:
            def get_shape(self):
                return sl.get_shape()

            def __getitem__(self, idx):
                t = sl[idx]
                type(outer).read += t.numel() * t.element_size()
                type(outer).elements += t.numel()
                return t
        return Slice()


@pytest.mark.parametrize("kind,strategies", [("llama", ["tp=2,pp=2", "dp=2,zero=3"]),
                                             ("qwen3-moe", ["tp=2,ep=2,dp=2,zero=3", "pp=2,dp=2,zero=1"])])
def test_each_rank_reads_only_its_boxes(kind, strategies, tmp_path, monkeypatch):
    """Every rank's bytes read equal its layout's parameter bytes, and the ranks together hold the checkpoint."""
    import safetensors
    _, spec = _save(kind, tmp_path, max_shard_size="20KB")          # several files and an index
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    want = load_hf_weights(spec, str(tmp_path))
    real = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: _Counting(real(*a, **k)))
    total = sum(v.numel() * 4 for v in want.values())
    for st in strategies:
        s = Strategy.parse(st)
        per_rank = layout(spec, s).bytes_per_rank("param")
        arrays = {}
        for r in range(s.world):
            _Counting.read = 0
            arrays[r] = store_arrays(load_store(spec, s, r, torch.device("cpu"), str(tmp_path)))
            assert _Counting.read == per_rank[r], (st, r)
            assert _Counting.read < total
        full = full_from_arrays(spec, s, arrays)
        for name, v in want.items():
            assert np.array_equal(full[(name, "param")], v.numpy()), (st, name)


@pytest.mark.parametrize("model,strategy", [("tiny-gpt", "tp=2,pp=2"), ("tiny-gpt", "dp=2,zero=3"),
                                            ("qwen3-moe", "ep=2,dp=2,zero=1")])
def test_export_loads_in_transformers_with_equal_logits(model, strategy, tmp_path):
    torch.set_num_threads(1)
    spec = models.get(model) if model.startswith("tiny") else _save(model, tmp_path / "src")[1]
    out = tmp_path / "out"
    prog = compile_program(spec, strategy, global_batch=GB, seq_len=SEQ)
    res = run_program(prog, steps=2, optim=OPT, params=True, model=spec, timeout=120,
                      checkpoint=CheckpointOptions(export_hf=str(out)))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    assert len(files) == Strategy.parse(strategy).world          # one file per writing rank
    assert (out / "config.json").exists() and (out / "generation_config.json").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    tokens = torch.randint(0, spec.vocab, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference_logits(spec, res.params, tokens)
        got = loaded(tokens).logits
    assert float((got - want).abs().max()) < 1e-5


def test_hf_config_reads_back_to_the_spec():
    for name in ("tiny-gpt",):
        spec = models.get(name)
        back = from_hf_config(hf_config(spec), spec.name)
        assert back == spec
    with pytest.raises(ModelError, match="shared experts"):
        hf_config(models.get("tiny-moe"))


@pytest.mark.parametrize("first,then", [("dp=2,zero=1", "tp=2,pp=2"), ("tp=2,pp=2", "dp=2,zero=3"),
                                        ("pp=2,dp=2,zero=3", "dp=4")])
def test_resume_in_another_strategy_continues_the_loss_curve(first, then, tmp_path):
    """6 steps static = its checkpoint of step 3 + 3 steps resumed under another strategy (losses within 1e-5)."""
    torch.set_num_threads(1)
    run = lambda st, steps, ck=None: run_program(compile_program("tiny-gpt", st, global_batch=GB, seq_len=SEQ),  # noqa: E731
                                                 steps=steps, optim=OPT, checkpoint=ck, timeout=120)
    static = run(first, 6, CheckpointOptions(save=str(tmp_path / "ck"), save_every=3)).losses   # saving is read-only
    assert sorted(os.listdir(tmp_path / "ck")) == ["step3", "step6"]
    rec = json.loads((tmp_path / "ck" / "step3" / "rank0.json").read_text())
    assert rec["step"] == 3 and rec["strategy"] == str(Strategy.parse(first)) and rec["optim"]["lr"] == OPT.lr
    shutil.rmtree(tmp_path / "ck" / "step6")             # resume from step 3
    resumed = run(then, 6, CheckpointOptions(resume=str(tmp_path / "ck")))
    assert resumed.first_step == 3 and len(resumed.losses) == 3
    for a, b in zip(resumed.losses, static[3:]):
        assert abs(a - b) <= 1e-5 * abs(b), (resumed.losses, static)


def test_cli_save_resume_export(tmp_path, capsys):
    """`run --save DIR --save-every 2`, then `run --resume DIR --export-hf OUT` under another strategy."""
    from parashift.cli import main
    base = ["run", "--model", "tiny-gpt", "--global-batch", str(GB), "--seq-len", str(SEQ), "--json", "--force"]
    assert main(base + ["--strategy", "dp=2", "--steps", "4"]) == 0
    static = json.loads(capsys.readouterr().out)["losses"]
    ck, out = str(tmp_path / "ck"), tmp_path / "hf"
    assert main(base + ["--strategy", "dp=2", "--steps", "2", "--save", ck, "--save-every", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["saved"]["step"] == 2
    assert main(base + ["--strategy", "tp=2", "--steps", "4", "--resume", ck, "--export-hf", str(out)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["resumed"]["step"] == 2 and got["first_step"] == 2 and got["export_hf"] == str(out)
    assert got["losses"] == pytest.approx(static[2:], rel=1e-5)
    assert transformers.AutoConfig.from_pretrained(out).model_type == "llama"


@pytest.mark.parametrize("extra,needle", [
    (["--model", "tiny-moe", "--export-hf", "X"], "no exact Hugging Face config"),
    (["--resume"], "--resume needs the checkpoint folder"),
    (["--save-every", "2"], "--save-every needs --save"),
    (["--resume", "NOPE"], "no such folder"),
    (["--save", "X", "--switch-at", "1:dp=1"], "static run"),
])
def test_cli_checkpoint_errors_are_one_line(extra, needle, tmp_path, capsys, monkeypatch):
    from parashift.cli import main
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--steps", "3", "--force"] + extra) != 0
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err


def test_bf16_ranks_read_their_params_and_master_boxes(tmp_path, monkeypatch):
    """A bf16 checkpoint: each rank reads its param boxes and its (ZeRO-sharded) fp32 master boxes, no more."""
    import safetensors
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(CONFIGS["llama"]()).to(torch.bfloat16).save_pretrained(tmp_path)
    spec = models.get(f"hf:{tmp_path}")
    assert spec.dtype == "bf16"
    want = load_hf_weights(spec, str(tmp_path))
    real = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: _Counting(real(*a, **k)))
    s = Strategy.parse("tp=2,dp=2,zero=1")
    lay = layout(spec, s)
    arrays = {}
    for r in range(s.world):
        _Counting.elements = 0
        store = load_store(spec, s, r, torch.device("cpu"), str(tmp_path))
        arrays[r] = {fam: {"master": b.master.clone().numpy()} for fam, b in store.buffers.items()}
        for name, p in store.pieces.items():        # the bf16 parameters: the file's values
            assert torch.equal(store.param(name), want[name][p.box()].to(torch.bfloat16))
        assert _Counting.elements == (lay.bytes_per_rank("param")[r] // 2 + lay.bytes_per_rank("master")[r] // 4)
    full = full_from_arrays(spec, s, arrays)
    for name, v in want.items():
        assert np.array_equal(full[(name, "master")], v.numpy()), name


def test_cli_resume_with_data_and_schedule_continues_exactly(tmp_path, capsys):
    """With --data, warmup + cosine and clipping: 4 static steps = 2 + save + 2 resumed under another strategy,
    the same samples, rates and losses; the data position is in the checkpoint and checked on resume."""
    from test_run_data import TRAIN, write_tokens
    from parashift.cli import main
    toks = write_tokens(tmp_path / "t.bin", np.random.default_rng(1).integers(0, 256, 32 * 20 + 1), 256)
    base = ["run", "--model", "tiny-gpt", "--global-batch", "8", "--seq-len", "32", "--json", "--force", "--steps", "4",
            "--data", str(toks), *TRAIN, "--lr-decay-steps", "4"]
    ck = str(tmp_path / "ck")
    assert main(base + ["--strategy", "dp=2,zero=1", "--save", ck, "--save-every", "2"]) == 0
    static = json.loads(capsys.readouterr().out)
    shutil.rmtree(tmp_path / "ck" / "step4")
    rec = json.loads((tmp_path / "ck" / "step2" / "rank0.json").read_text())
    assert rec["data_position"]["consumed"] == 16 and rec["optim"]["schedule"]["decay"] == "cosine"
    assert main(base + ["--strategy", "tp=2,pp=2", "--resume", ck]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["samples"] == static["samples"][2:] and got["lr"] == pytest.approx(static["lr"][2:], rel=1e-12)
    assert got["losses"] == pytest.approx(static["losses"][2:], rel=1e-5)
    assert main(base + ["--strategy", "dp=2", "--resume", ck, "--global-batch", "4"]) != 0   # would skip samples
    assert "global batch 8" in capsys.readouterr().err
