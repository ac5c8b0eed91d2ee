"""Llama-family models from transformers configs: parashift's forward equals transformers' own on
the same weights (fp32, CPU), weights convert both ways exactly, and TP / SP runs train exactly like
one process."""
from __future__ import annotations

import functools
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from parashift import models                                    # noqa: E402
from parashift.errors import ModelError                          # noqa: E402
from parashift.exec import run                                   # noqa: E402
from parashift.exec.hf import load_hf_weights, to_hf, to_parashift   # noqa: E402
from parashift.exec.reference import OptimConfig, reference_logits, reference_train   # noqa: E402

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL, rope_theta=500000.0),
    "llama-tied": lambda: transformers.LlamaConfig(**SMALL, tie_word_embeddings=True),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL, rope_theta=1e6),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=16, rope_theta=1e6),
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(**SMALL, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=24, norm_topk_prob=False),
    "qwen3-moe-norm": lambda: transformers.Qwen3MoeConfig(**SMALL, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                                          moe_intermediate_size=24, norm_topk_prob=True),
    "mixtral": lambda: transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2),
}


def _save(kind: str, path) -> tuple:
    torch.manual_seed(0)
    cfg = CONFIGS[kind]()
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():            # norm weights start at one and biases at zero: move them so they count
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return model, models.get(f"hf:{path}")


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_logits_equal_transformers(kind, tmp_path):
    model, spec = _save(kind, tmp_path)
    assert spec.vocab == 96 and spec.norm_eps == 1e-6 and spec.tied == (kind == "llama-tied")
    P = load_hf_weights(spec, str(tmp_path))
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(tokens).logits
        got = reference_logits(spec, P, tokens)
    assert float((got - want).abs().max()) < 1e-5
    back = to_hf(spec, P)        # and back: the same state dict, bit for bit
    sd = {k: v for k, v in model.state_dict().items() if not (spec.tied and k == "lm_head.weight")}
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


def test_hub_per_expert_names_read_the_same(tmp_path):
    """The Hub's per-expert names (Qwen3-MoE's experts.{e}.gate_proj, Mixtral's block_sparse_moe...w1)
    give the same tensors as transformers 5's fused experts."""
    for kind, names in (("qwen3-moe", ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                                       "mlp.experts.{e}.down_proj.weight", "mlp.gate.weight")),
                        ("mixtral", ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight",
                                     "block_sparse_moe.experts.{e}.w2.weight", "block_sparse_moe.gate.weight"))):
        model, spec = _save(kind, tmp_path / kind)
        sd = dict(model.state_dict())
        for i in range(spec.layers):
            p = f"model.layers.{i}."
            gu, down = sd.pop(p + "mlp.experts.gate_up_proj"), sd.pop(p + "mlp.experts.down_proj")
            f = gu.shape[1] // 2
            for e in range(spec.experts):
                sd[p + names[0].format(e=e)], sd[p + names[1].format(e=e)] = gu[e, :f], gu[e, f:]
                sd[p + names[2].format(e=e)] = down[e]
            sd[p + names[3]] = sd.pop(p + "mlp.gate.weight")
        want = to_parashift(spec, model.state_dict())
        got = to_parashift(spec, sd)
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want), kind


def test_bad_weights_are_one_line_errors(tmp_path):
    model, spec = _save("qwen3", tmp_path)
    sd = model.state_dict()
    with pytest.raises(ModelError, match="q_norm"):
        to_parashift(spec, {k: v for k, v in sd.items() if "layers.1.self_attn.q_norm" not in k})
    with pytest.raises(ModelError, match="extra.weight"):
        to_parashift(spec, {**sd, "model.extra.weight": torch.zeros(1)})
    with pytest.raises(ModelError, match="use_sliding_window"):
        cfg = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**cfg, "use_sliding_window": True}))
        models.get(f"hf:{tmp_path}")


STEPS, GB, SEQ = 3, 4, 16
OPT = OptimConfig(lr=1e-3)


@functools.lru_cache(maxsize=None)
def _spec(kind: str, path: str):
    return _save(kind, path)[1]


@pytest.mark.parametrize("kind,strategy", [("qwen3", "tp=2"), ("qwen2", "tp=2,sp"), ("llama-tied", "dp=2,zero=1"),
                                           ("qwen3", "cp=2"), ("mixtral", "dp=2,ep=2"), ("qwen3-moe-norm", "tp=2")])
def test_parallel_runs_train_like_one_process(kind, strategy, tmp_path_factory):
    torch.set_num_threads(1)
    spec = _spec(kind, str(tmp_path_factory.mktemp(kind)))
    ref_losses, ref_params = reference_train(spec, STEPS, GB, SEQ, optim=OPT)
    res = run(spec, strategy, steps=STEPS, global_batch=GB, seq_len=SEQ, optim=OPT, params=True, timeout=120)
    for a, b in zip(res.losses, ref_losses):
        assert abs(a - b) <= 1e-5 * abs(b), (strategy, res.losses, ref_losses)
    for name, ref in ref_params.items():
        assert float((res.params[name] - ref).abs().max()) <= 0.05 * OPT.lr, (strategy, name)


@pytest.mark.parametrize("kind,strategy", [("qwen3", "tp=2,sp,pp=2"), ("llama", "tp=2,pp=2"), ("llama", "dp=2,zero=3")])
def test_runtime_from_hf_weights_matches_transformers(kind, strategy, tmp_path):
    """Started from the saved safetensors (each rank reading its own boxes), the runtime's first loss is
    transformers' loss on the same tokens."""
    from parashift.exec import compile_program, run_program
    from parashift.exec.reference import make_batch
    torch.set_num_threads(1)
    model, spec = _save(kind, tmp_path)
    tokens, targets = make_batch(spec, 0, GB, SEQ)
    with torch.no_grad():
        want = float(torch.nn.functional.cross_entropy(model(tokens).logits.reshape(-1, spec.vocab),
                                                       targets.reshape(-1)))
    prog = compile_program(spec, strategy, global_batch=GB, seq_len=SEQ)
    res = run_program(prog, steps=1, optim=OPT, model=spec, weights=str(tmp_path), timeout=120)
    assert abs(res.losses[0] - want) <= 1e-5 * want, (res.losses, want)


def test_tied_embeddings_need_one_stage(tmp_path):
    from parashift.errors import StrategyError
    _, spec = _save("llama-tied", tmp_path)
    with pytest.raises(StrategyError, match="tied"):
        run(spec, "pp=2", steps=1, global_batch=GB, seq_len=SEQ)


def test_cli_run_starts_from_the_hf_weights(tmp_path, capsys):
    """`parashift run --model hf:DIR` reads the folder's safetensors: its first loss is transformers'."""
    from parashift.cli import main
    from parashift.exec.reference import make_batch
    model, spec = _save("qwen2", tmp_path)
    tokens, targets = make_batch(spec, 0, GB, SEQ)
    with torch.no_grad():
        want = float(torch.nn.functional.cross_entropy(model(tokens).logits.reshape(-1, spec.vocab),
                                                       targets.reshape(-1)))
    assert main(["run", "--model", f"hf:{tmp_path}", "--strategy", "tp=2", "--global-batch", str(GB), "--seq-len",
                 str(SEQ), "--steps", "1", "--json", "--force"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert abs(out["losses"][0] - want) <= 1e-5 * want
