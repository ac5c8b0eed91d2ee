"""Model presets matching public models' parameter counts, plus tiny CPU models."""
from __future__ import annotations

from typing import Callable

from ..errors import UnknownPresetError
from .parse import parse_model
from .spec import ModelSpec, gpt, moe

__all__ = ["get", "names", "PUBLIC_PARAMS"]

_PRESETS: dict[str, Callable[[], ModelSpec]] = {
    # GPT-3 family (Brown et al. 2020): GELU MLP, LayerNorm with biases, learned positions, tied embeddings.
    "gpt3-1.3b": lambda: gpt(24, 2048, 16, ffn=8192, vocab=50257, seq_len=2048, name="gpt3-1.3b",
                             gated=False, bias=True, norm="ln", pos_emb="learned", tied=True),
    "gpt3-175b": lambda: gpt(96, 12288, 96, ffn=49152, vocab=50257, seq_len=2048, name="gpt3-175b",
                             gated=False, bias=True, norm="ln", pos_emb="learned", tied=True),
    # LLaMA-2 (Touvron et al. 2023): SwiGLU, RMSNorm, RoPE, untied head.
    "llama2-7b": lambda: gpt(32, 4096, 32, ffn=11008, vocab=32000, seq_len=4096, name="llama2-7b"),
    "llama2-13b": lambda: gpt(40, 5120, 40, ffn=13824, vocab=32000, seq_len=4096, name="llama2-13b"),
    "llama2-70b": lambda: gpt(80, 8192, 64, kv_heads=8, ffn=28672, vocab=32000, seq_len=4096, name="llama2-70b"),
    # Qwen MoE family (config.json of the public checkpoints).
    "qwen1.5-moe-a2.7b": lambda: moe(24, 2048, 16, vocab=151936, seq_len=8192, experts=60, top_k=4,
                                     expert_ffn=1408, shared_ffn=5632, qkv_bias=True, name="qwen1.5-moe-a2.7b"),
    "qwen3-30b-a3b": lambda: moe(48, 2048, 32, kv_heads=4, vocab=151936, seq_len=4096, experts=128, top_k=8,
                                 expert_ffn=768, head_dim=128, qk_norm=True, name="qwen3-30b-a3b"),
    "qwen3-235b-a22b": lambda: moe(94, 4096, 64, kv_heads=4, vocab=151936, seq_len=4096, experts=128, top_k=8,
                                   expert_ffn=1536, head_dim=128, qk_norm=True, name="qwen3-235b-a22b"),
    # Llama 3 (config.json of the public checkpoints): GQA, 128K vocabulary, rope theta 5e5.
    "llama3-8b": lambda: gpt(32, 4096, 32, kv_heads=8, ffn=14336, vocab=128256, seq_len=8192, name="llama3-8b",
                             rope_theta=500000.0),
    "llama3-70b": lambda: gpt(80, 8192, 64, kv_heads=8, ffn=28672, vocab=128256, seq_len=8192, name="llama3-70b",
                              rope_theta=500000.0),
    # Mixtral 8x7B: 8 experts of Mistral-7B's MLP, top-2.
    "mixtral-8x7b": lambda: moe(32, 4096, 32, kv_heads=8, vocab=32000, seq_len=4096, experts=8, top_k=2,
                                expert_ffn=14336, rope_theta=1e6, norm_topk=True, name="mixtral-8x7b"),
    # DeepSeek-V3: MLA, 3 dense layers, 1 shared + 256 routed experts (top-8 within 4 of 8 groups), one MTP module.
    "deepseek-v3": lambda: moe(61, 7168, 128, ffn=18432, vocab=129280, seq_len=4096, experts=256, top_k=8,
                               expert_ffn=2048, shared_ffn=2048, shared_gate=False, router="sigmoid", dense_layers=3,
                               expert_groups=8, group_top_k=4, head_dim=192, attention="mla", q_lora=1536,
                               kv_lora=512, rope_dim=64, v_head_dim=128, mtp_layers=1, name="deepseek-v3"),
    # GPT-OSS 120B: sliding-window (128) and full attention alternating, sinks, biases, 128 experts top-4.
    "gpt-oss-120b": lambda: moe(36, 2880, 64, kv_heads=8, vocab=201088, seq_len=4096, experts=128, top_k=4,
                                expert_ffn=2880, head_dim=64, bias=True, attn_sinks=True, sliding_window=128,
                                full_every=2, rope_theta=150000.0, name="gpt-oss-120b"),
    # Tiny CPU models that the runtime trains for real (fp32, no dropout, as the runtime trains).
    "tiny-gpt": lambda: gpt(4, 64, 4, kv_heads=2, ffn=128, vocab=256, seq_len=32, name="tiny-gpt",
                            dtype="fp32", pad_vocab=8, dropout=0.0),
    "tiny-moe": lambda: moe(4, 64, 4, kv_heads=2, vocab=256, seq_len=32, experts=8, top_k=2, expert_ffn=64,
                            shared_ffn=64, name="tiny-moe", dtype="fp32", pad_vocab=8, dropout=0.0),
}

#: Published parameter counts the presets are checked against (within 1%).
PUBLIC_PARAMS = {
    "gpt3-1.3b": 1.3156e9,   # GPT-3 XL as counted on its open replicas (1,315,575,808)
    "gpt3-175b": 175e9,
    "llama2-7b": 6.74e9,
    "llama2-13b": 13.0e9,
    "llama2-70b": 69.0e9,
    "qwen1.5-moe-a2.7b": 14.3e9,
    "qwen3-30b-a3b": 30.5e9,
    "qwen3-235b-a22b": 235e9,
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.6e9,
    "mixtral-8x7b": 46.7e9,
    "deepseek-v3": 685e9,    # the checkpoint: 671B main model + 14B MTP (whose embedding and head copies it shares)
    "gpt-oss-120b": 116.83e9,
}

_CACHE: dict[str, ModelSpec] = {}


def names() -> list[str]:
    return list(_PRESETS)


def get(name: "str | ModelSpec") -> ModelSpec:
    """A preset by name, a JSON file of ``ModelSpec`` fields or an inline ``gpt:``/``moe:`` spec
    (see :mod:`parashift.models.parse`); an unknown name lists the valid ones."""
    if isinstance(name, ModelSpec):
        return name
    key = str(name).strip().lower()
    if key not in _PRESETS:
        if ":" not in key or key.startswith("hf:"):  # a file may change between calls: read it each time
            return parse_model(str(name).strip(), _PRESETS)
        if key not in _CACHE:
            _CACHE[key] = parse_model(str(name).strip(), _PRESETS)
        return _CACHE[key]
    if key not in _CACHE:
        _CACHE[key] = _PRESETS[key]()
    return _CACHE[key]
