"""Models from a local Hugging Face ``config.json`` (nothing is downloaded).

``hf:DIR`` or ``hf:PATH/config.json`` names one; the families read are Llama (3.x), Mistral, Qwen2/2.5,
Qwen3 (dense and ``qwen3_moe``), Mixtral, DeepSeek-V2/V3 (MLA, shared experts, dense first layers,
node-limited routing, MTP) and GPT-OSS (alternating sliding windows, biases, attention sinks). A config
key whose value describes something the ModelSpec cannot is a one-line :class:`ModelError` naming it.
The spec's name is ``hf:`` plus the config's absolute path, so a Program compiled from it names a model
that :func:`parashift.models.get` rebuilds.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Mapping

from ..errors import ModelError
from .spec import ModelSpec, gpt, moe

__all__ = ["load_hf", "from_hf_config", "hf_config", "FAMILIES", "SEQ_LEN_CAP"]

#: The training sequence length a spec gets: the config's context length, capped (a config states
#: what the model can attend to, not what it is trained on; the simulator's options override it).
SEQ_LEN_CAP = 4096


_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


class _Cfg:
    """A config dict whose reads name the key and file on failure."""

    def __init__(self, d: Mapping[str, Any], where: str) -> None:
        self.d, self.where = d, where

    def need(self, key: str) -> Any:
        if self.d.get(key) is None:
            raise ModelError(f"{self.where}: {self.d.get('model_type')} config lacks {key!r}; add it to config.json")
        return self.d[key]

    def int(self, key: str, default: int | None = None) -> int:
        v = self.d.get(key, default) if default is not None else self.need(key)
        if v is None:
            v = default
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ModelError(f"{self.where}: {key}={v!r} must be a whole number")
        return v

    def get(self, key: str, default: Any = None) -> Any:
        v = self.d.get(key, default)
        return default if v is None else v

    def only(self, key: str, allowed: tuple, default: Any = None, why: str = "") -> Any:
        """The key's value, which must be one of ``allowed`` (else a ModelError naming it)."""
        v = self.d.get(key, default)
        if v not in allowed:
            raise ModelError(f"{self.where}: unsupported {key}={v!r} (parashift reads "
                             f"{' or '.join(repr(a) for a in allowed)}{'; ' + why if why else ''})")
        return v


def _common(c: _Cfg, name: str) -> dict[str, Any]:
    c.only("hidden_act", ("silu",), "silu", "a SwiGLU MLP")
    h, a = c.int("hidden_size"), c.int("num_attention_heads")
    kw: dict[str, Any] = dict(
        layers=c.int("num_hidden_layers"), hidden=h, heads=a, kv_heads=c.int("num_key_value_heads", a),
        vocab=c.int("vocab_size"), seq_len=min(c.int("max_position_embeddings", SEQ_LEN_CAP), SEQ_LEN_CAP),
        name=name, head_dim=c.get("head_dim") or h // a, norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        tied=bool(c.get("tie_word_embeddings", False)), pad_vocab=1, dropout=float(c.get("attention_dropout", 0.0)))
    kw["dtype"] = _DTYPES.get(c.get("torch_dtype") or c.get("dtype") or "bfloat16", "bf16")
    # transformers < 5 writes rope_theta and rope_scaling; 5 writes both into rope_parameters
    rope = {**c.get("rope_parameters", {}), **c.get("rope_scaling", {})}
    kw["rope_theta"] = float(c.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    kind = rope.get("rope_type") or rope.get("type") or "default"
    kw["rope_scaling"] = "" if kind == "default" else str(kind)
    return kw


def _llama(c: _Cfg, name: str) -> ModelSpec:
    c.only("attention_bias", (False,), False, "q/k/v/o biases: use a Qwen2 config for q/k/v biases")
    c.only("mlp_bias", (False,), False)
    kw = _common(c, name)
    return gpt(kw.pop("layers"), kw.pop("hidden"), kw.pop("heads"), ffn=c.int("intermediate_size"), **kw)


def _mistral(c: _Cfg, name: str) -> ModelSpec:
    kw = _common(c, name)
    return gpt(kw.pop("layers"), kw.pop("hidden"), kw.pop("heads"), ffn=c.int("intermediate_size"),
               sliding_window=c.int("sliding_window", 0), **kw)


def _qwen(c: _Cfg, name: str) -> dict[str, Any]:
    c.only("use_sliding_window", (False,), False, "per-layer windows from max_window_layers")
    return _common(c, name)


def _qwen2(c: _Cfg, name: str) -> ModelSpec:
    kw = _qwen(c, name)
    return gpt(kw.pop("layers"), kw.pop("hidden"), kw.pop("heads"), ffn=c.int("intermediate_size"), qkv_bias=True,
               **kw)


def _qwen3(c: _Cfg, name: str) -> ModelSpec:
    c.only("attention_bias", (False,), False)
    kw = _qwen(c, name)
    return gpt(kw.pop("layers"), kw.pop("hidden"), kw.pop("heads"), ffn=c.int("intermediate_size"), qk_norm=True,
               **kw)


def _qwen3_moe(c: _Cfg, name: str) -> ModelSpec:
    c.only("attention_bias", (False,), False)
    c.only("decoder_sparse_step", (1,), 1, "every layer an MoE layer")
    if c.get("mlp_only_layers"):
        raise ModelError(f"{c.where}: unsupported mlp_only_layers={c.get('mlp_only_layers')!r} (parashift reads "
                         f"dense layers only as the first n, as DeepSeek's first_k_dense_replace)")
    kw = _qwen(c, name)
    experts = c.int("num_experts") if "num_experts" in c.d else c.int("num_local_experts")   # transformers 5's name
    return moe(kw.pop("layers"), kw.pop("hidden"), kw.pop("heads"), qk_norm=True, experts=experts,
               top_k=c.int("num_experts_per_tok"), expert_ffn=c.int("moe_intermediate_size"),
               norm_topk=bool(c.get("norm_topk_prob", False)), **kw)


def _mixtral(c: _Cfg, name: str) -> ModelSpec:
    kw = _common(c, name)
    return moe(kw.pop("layers"), kw.pop("hidden"), kw.pop("heads"), experts=c.int("num_local_experts"),
               top_k=c.int("num_experts_per_tok"), expert_ffn=c.int("intermediate_size"), norm_topk=True,
               sliding_window=c.int("sliding_window", 0), **kw)


def _deepseek(c: _Cfg, name: str) -> ModelSpec:
    c.only("moe_layer_freq", (1,), 1, "every layer after first_k_dense_replace an MoE layer")
    c.only("attention_bias", (False,), False)
    kw = _common(c, name)
    nope, rope, v = c.int("qk_nope_head_dim"), c.int("qk_rope_head_dim"), c.int("v_head_dim")
    kw.update(head_dim=nope + rope, kv_heads=kw["heads"])
    routed = c.get("n_routed_experts")
    scoring = c.only("scoring_func", ("softmax", "sigmoid"), "softmax")
    arch = dict(attention="mla", q_lora=c.int("q_lora_rank", 0), kv_lora=c.int("kv_lora_rank"), rope_dim=rope,
                v_head_dim=v, mtp_layers=c.int("num_nextn_predict_layers", 0))
    if not routed:
        return gpt(kw.pop("layers"), kw.pop("hidden"), kw.pop("heads"), ffn=c.int("intermediate_size"), **kw, **arch)
    f = c.int("moe_intermediate_size")
    groups = c.int("n_group", 0)
    return moe(kw.pop("layers"), kw.pop("hidden"), kw.pop("heads"), ffn=c.int("intermediate_size"),
               experts=c.int("n_routed_experts"), top_k=c.int("num_experts_per_tok"), expert_ffn=f,
               shared_ffn=c.int("n_shared_experts", 0) * f, shared_gate=False, router=scoring,
               dense_layers=c.int("first_k_dense_replace", 0), expert_groups=groups if groups > 1 else 0,
               norm_topk=bool(c.get("norm_topk_prob", False)),
               group_top_k=c.int("topk_group", 0) if groups > 1 else 0, **kw, **arch)


def _gpt_oss(c: _Cfg, name: str) -> ModelSpec:
    c.only("attention_bias", (True,), True, "GPT-OSS has q/k/v/o biases")
    kw = _common(c, name)
    window = c.int("sliding_window", 0)
    layers = kw["layers"]
    types = c.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    want = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if list(types) != want:
        raise ModelError(f"{c.where}: unsupported layer_types (parashift reads sliding and full attention "
                         f"alternating, sliding first)")
    return moe(kw.pop("layers"), kw.pop("hidden"), kw.pop("heads"), experts=c.int("num_local_experts"),
               top_k=c.int("num_experts_per_tok", c.int("experts_per_token", 4)),
               expert_ffn=c.int("intermediate_size"), bias=True, attn_sinks=True, sliding_window=window, norm_topk=True,
               full_every=2, **kw)


#: model_type -> builder.
FAMILIES: dict[str, Callable[[_Cfg, str], ModelSpec]] = {
    "llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3, "qwen3_moe": _qwen3_moe,
    "mixtral": _mixtral, "deepseek_v2": _deepseek, "deepseek_v3": _deepseek, "gpt_oss": _gpt_oss,
}


def from_hf_config(config: Mapping[str, Any], name: str, where: str = "config.json") -> ModelSpec:
    """A ModelSpec from a Hugging Face config dict (``where`` names it in errors)."""
    if not isinstance(config, Mapping):
        raise ModelError(f"{where} must hold one JSON object")
    c = _Cfg(config, where)
    kind = config.get("model_type")
    if kind not in FAMILIES:
        raise ModelError(f"{where}: unsupported model_type={kind!r}; parashift reads {', '.join(FAMILIES)}")
    return FAMILIES[kind](c, name)


def config_path(path: str) -> str:
    """The absolute path of ``config.json`` given it or its folder."""
    p = os.path.abspath(os.path.expanduser(path.strip()))
    return os.path.join(p, "config.json") if os.path.isdir(p) else p


def load_hf(path: str) -> ModelSpec:
    """The spec of the Hugging Face config at ``path`` (a folder holding ``config.json`` or the file)."""
    from ..validate import read_json
    p = config_path(path)
    if not os.path.isfile(p):
        raise ModelError(f"hf:{path}: no config.json there; give hf:DIR of a Hugging Face model or hf:PATH/config.json")
    return from_hf_config(read_json(p, "Hugging Face config"), f"hf:{p}", p)


def hf_config(spec: ModelSpec) -> dict[str, Any]:
    """The Hugging Face ``config.json`` of ``spec`` (Llama, Qwen2, Qwen3, Qwen3-MoE, Mistral or Mixtral,
    whichever describes it exactly); ModelError when none does. ``from_hf_config`` reads it back to ``spec``."""
    def no(why: str) -> ModelError:
        return ModelError(f"model {spec.name!r} has no exact Hugging Face config ({why}); export the weights of a "
                          f"Llama, Qwen2/3, Qwen3-MoE, Mistral or Mixtral-shaped model")
    if spec.attention != "gqa" or spec.norm != "rms" or spec.pos_emb != "rope" or not spec.gated or spec.bias:
        raise no("it needs grouped-query attention, RMSNorm, RoPE, a SwiGLU MLP and no biases but q/k/v's")
    if spec.rope_scaling:
        raise no(f"its rope scaling {spec.rope_scaling!r} has parameters the spec does not keep")
    if spec.attn_sinks or spec.full_every or spec.mtp_layers or spec.dense_layers or spec.shared_ffn:
        raise no("attention sinks, alternating windows, MTP, dense first layers or shared experts")
    if spec.qkv_bias and (spec.qk_norm or spec.is_moe or spec.sliding_window):
        raise no("q/k/v biases come only with Qwen2's plain dense layers")
    if spec.sliding_window and (spec.qk_norm or (spec.is_moe and not spec.norm_topk)):
        raise no("a sliding window comes only with Mistral or Mixtral")
    if spec.is_moe and (spec.router != "softmax" or (not spec.qk_norm and not spec.norm_topk)):
        raise no("its router is neither Qwen3-MoE's nor Mixtral's")
    rows = spec.tensor("embed.word").shape[0]
    if rows != spec.vocab:
        raise no(f"its embedding is padded to {rows} rows for a vocabulary of {spec.vocab}")
    dtype = {v: k for k, v in _DTYPES.items()}[spec.dtype]
    c: dict[str, Any] = dict(
        vocab_size=spec.vocab, hidden_size=spec.hidden, num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim,
        max_position_embeddings=spec.seq_len, rms_norm_eps=spec.norm_eps, rope_theta=spec.rope_theta,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta}, hidden_act="silu",
        tie_word_embeddings=spec.tied, attention_dropout=spec.dropout, torch_dtype=dtype, dtype=dtype,
        initializer_range=0.02, use_cache=True)
    if spec.is_moe and spec.qk_norm:
        family, arch = "qwen3_moe", "Qwen3MoeForCausalLM"
        c.update(num_experts=spec.experts, num_experts_per_tok=spec.top_k, moe_intermediate_size=spec.expert_ffn,
                 intermediate_size=spec.ffn or spec.expert_ffn, norm_topk_prob=spec.norm_topk, decoder_sparse_step=1,
                 mlp_only_layers=[], attention_bias=False, use_sliding_window=False)
    elif spec.is_moe:
        family, arch = "mixtral", "MixtralForCausalLM"
        c.update(num_local_experts=spec.experts, num_experts_per_tok=spec.top_k, intermediate_size=spec.expert_ffn,
                 sliding_window=spec.sliding_window or None)
    elif spec.sliding_window:
        family, arch = "mistral", "MistralForCausalLM"
        c.update(intermediate_size=spec.ffn, sliding_window=spec.sliding_window)
    elif spec.qkv_bias:
        family, arch = "qwen2", "Qwen2ForCausalLM"
        c.update(intermediate_size=spec.ffn, use_sliding_window=False)
    elif spec.qk_norm:
        family, arch = "qwen3", "Qwen3ForCausalLM"
        c.update(intermediate_size=spec.ffn, attention_bias=False, use_sliding_window=False)
    else:
        family, arch = "llama", "LlamaForCausalLM"
        c.update(intermediate_size=spec.ffn, attention_bias=False, mlp_bias=False)
    return {"architectures": [arch], "model_type": family, **c}
