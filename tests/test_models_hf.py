"""Hugging Face configs -> ModelSpec: published parameter counts, MLA / shared experts in the cost
model, one-line errors for what a spec cannot hold, and `parashift simulate --model hf:...`."""
import json
from pathlib import Path

import pytest

from hf_configs import CONFIGS, PUBLISHED
from parashift import models
from parashift.cli import main
from parashift.errors import ModelError
from parashift.models.hf import from_hf_config


def _count(spec, active: bool, skip=lambda name: False) -> float:
    n = 0
    for t in spec.tensors:
        if skip(t.name):
            continue
        n += t.numel * spec.top_k // spec.experts if active and t.ep_dim is not None else t.numel
    return n / 1e9


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_published_parameter_counts(name):
    spec = from_hf_config(CONFIGS[name], name)
    total, active = PUBLISHED[name]
    mtp = lambda n: n.startswith("mtp.")                         # noqa: E731
    assert abs(_count(spec, False, mtp) / total - 1) < 0.01, spec.params
    if active is not None:
        skip = (lambda n: n == "embed.word") if name.startswith("gpt-oss") else mtp
        assert abs(_count(spec, True, skip) / active - 1) < 0.02, spec.active_params


def test_families_read_their_architecture():
    ds = from_hf_config(CONFIGS["deepseek-v3"], "ds")
    assert (ds.attention, ds.q_lora, ds.kv_lora, ds.rope_dim, ds.head_dim, ds.v_dim) == ("mla", 1536, 512, 64, 192, 128)
    assert (ds.dense_layers, ds.shared_ffn, ds.shared_gate, ds.router, ds.expert_groups, ds.group_top_k,
            ds.mtp_layers) == (3, 2048, False, "sigmoid", 8, 4, 1)
    assert "layers.2.moe.dense.fc1.weight" in ds.index and "layers.3.moe.experts.fc1" in ds.index
    assert "mtp.0.moe.experts.fc1" in ds.index and ds.tensor("mtp.0.moe.experts.fc1").layer == ds.layers
    oss = from_hf_config(CONFIGS["gpt-oss-120b"], "oss")
    assert (oss.sliding_window, oss.full_every, oss.bias, oss.attn_sinks) == (128, 2, True, True)
    assert [oss.is_sliding(i) for i in range(4)] == [True, False, True, False]
    q2 = from_hf_config(CONFIGS["qwen2.5-7b"], "q2")
    assert q2.qkv_bias and not q2.bias and q2.norm_eps == 1e-6 and q2.rope_theta == 1e6
    assert from_hf_config(CONFIGS["qwen3-8b"], "q3").qk_norm
    assert from_hf_config(CONFIGS["llama3.2-1b"], "l").tied


def test_presets_equal_their_configs():
    for name in ("llama3-8b", "llama3-70b", "mixtral-8x7b", "deepseek-v3", "gpt-oss-120b", "qwen3-30b-a3b"):
        a, b = models.get(name), from_hf_config(CONFIGS[name], name)
        assert [(t.name, t.shape) for t in a.tensors] == [(t.name, t.shape) for t in b.tensors], name


def test_mla_and_shared_experts_reach_the_flops():
    ds = models.get("deepseek-v3")
    h, a = 7168, 128
    proj = 2 * (1536 * h + a * 192 * 1536 + 576 * h + a * 256 * 512 + h * a * 128)
    assert ds.attn_flops(1, 4096) == proj + 2 * 4096 * a * (192 + 128)
    # dense layers (ffn 18432) and MoE layers (8 routed + 1 shared of 2048, router) averaged
    moe_layer = 2 * 3 * h * 2048 * 9 + 2 * h * 256
    assert ds.mlp_flops(1) == pytest.approx((3 * 2 * 3 * h * 18432 + 58 * moe_layer) / 61)
    # published: DeepSeek-V3 trains at about 6 x 37B + attention FLOPs per token; the MTP module adds a block
    assert 6 * 37e9 < ds.flops_per_token(4096) < 6 * 37e9 * 1.35
    oss = models.get("gpt-oss-120b")    # half the layers attend to 128 keys
    assert oss.attn_keys(4096) == (18 * 128 + 18 * 4096) / 36


def test_mla_memory_and_cost_model():
    from parashift.ir.memory import region_activation
    ds = models.get("deepseek-v3")
    gqa = models.moe(61, 7168, 128, ffn=18432, vocab=129280, seq_len=4096, experts=256, top_k=8, expert_ffn=2048,
                     head_dim=192)
    kw = dict(mbs=1, seq_len=4096, tp=8, recompute="none")
    assert region_activation(ds, "attn", **kw) != region_activation(gqa, "attn", **kw)
    assert ds.kv_width == 128 * (192 + 128)


def test_unsupported_fields_are_one_line_errors():
    bad = [({**CONFIGS["qwen2.5-7b"], "use_sliding_window": True}, "use_sliding_window"),
           ({**CONFIGS["llama3-8b"], "hidden_act": "gelu"}, "hidden_act"),
           ({**CONFIGS["qwen3-30b-a3b"], "decoder_sparse_step": 2}, "decoder_sparse_step"),
           ({**CONFIGS["qwen3-30b-a3b"], "mlp_only_layers": [0]}, "mlp_only_layers"),
           ({**CONFIGS["deepseek-v3"], "moe_layer_freq": 2}, "moe_layer_freq"),
           ({**CONFIGS["gpt-oss-20b"], "layer_types": ["full_attention"] * 24}, "layer_types"),
           ({**CONFIGS["llama3-8b"], "model_type": "falcon"}, "model_type"),
           ({k: v for k, v in CONFIGS["llama3-8b"].items() if k != "hidden_size"}, "hidden_size")]
    for cfg, field in bad:
        with pytest.raises(ModelError, match=field) as e:
            from_hf_config(cfg, "x")
        assert "\n" not in str(e.value)


def test_simulate_hf_config_from_the_cli(tmp_path, capsys):
    d = tmp_path / "mixtral"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIGS["mixtral-8x7b"]))
    spec = models.get(f"hf:{d}")
    assert spec.name == f"hf:{d / 'config.json'}" and models.get(spec.name) == spec
    for target in (f"hf:{d}", f"hf:{d / 'config.json'}"):
        assert main(["simulate", "--model", target, "--cluster", "h100-1x8", "--strategy", "dp=8,ep=8,zero=1",
                     "--global-batch", "8", "--seq-len", "4096", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["step_time"] > 0 and out["model"] == spec.name
    for name, strategy in (("deepseek-v3", "dp=8,ep=8,zero=1"), ("gpt-oss-120b", "dp=2,tp=4,zero=1,sp"),
                           ("qwen3-235b-a22b", "dp=8,ep=8,zero=3")):   # MLA + MTP, windows + sinks, GQA MoE
        (tmp_path / f"{name}.json").write_text(json.dumps(CONFIGS[name]))
        assert main(["simulate", "--model", f"hf:{tmp_path / name}.json", "--cluster", "h100-1x8", "--strategy",
                     strategy, "--global-batch", "8", "--seq-len", "4096", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["step_time"] > 0 and 0 < out["mfu"] < 1, (name, out["mfu"])
    assert main(["simulate", "--model", f"hf:{tmp_path}/none", "--cluster", "h100-1x8", "--strategy", "dp=8", "--global-batch", "8",
                 "--seq-len", "4096"]) != 0
    assert "no config.json there" in capsys.readouterr().err


def test_shipped_example_configs_equal_the_fixtures():
    """examples/hf/<name>/config.json (what the README simulates) holds the fixture's fields exactly."""
    root = Path(__file__).resolve().parents[1] / "examples" / "hf"
    shipped = sorted(p.parent.name for p in root.glob("*/config.json") if p.parent.name in CONFIGS)
    assert len(shipped) >= 7
    for name in shipped:
        assert json.loads((root / name / "config.json").read_text()) == json.loads(json.dumps(CONFIGS[name])), name
        assert models.get(f"hf:{root / name}").layers == CONFIGS[name]["num_hidden_layers"]
