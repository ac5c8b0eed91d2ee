"""Models from text: a preset name, a JSON file of ``ModelSpec`` fields, or an inline spec.

``hf:DIR`` or ``hf:PATH/config.json`` reads a local Hugging Face config (:mod:`parashift.models.hf`).
Inline specs read ``gpt:layers=96,hidden=12288,heads=96,vocab=51200`` or ``moe:...,experts=8,top_k=2,
expert_ffn=...``; keys are the keyword arguments of :func:`~parashift.models.gpt` /
:func:`~parashift.models.moe`. A spec without ``name=`` is named by its own canonical text, so a
Program compiled from it names a model that :func:`parse_model` rebuilds exactly.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

from ..errors import ModelError, UnknownPresetError
from .spec import ATTENTIONS, NORMS, ROUTERS, ModelSpec, gpt, moe

__all__ = ["parse_model", "model_from_dict", "KINDS", "inline_text"]

KINDS = ("gpt", "moe")
_INT = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len", "head_dim", "pad_vocab", "experts",
        "top_k", "expert_ffn", "shared_ffn", "q_lora", "kv_lora", "rope_dim", "v_head_dim", "sliding_window",
        "full_every", "mtp_layers", "dense_layers", "expert_groups", "group_top_k")
_BOOL = ("gated", "bias", "qkv_bias", "qk_norm", "tied", "flash_attention", "attn_sinks", "shared_gate", "norm_topk")
_STR = ("name", "norm", "pos_emb", "dtype", "attention", "router", "rope_scaling")
_FLOAT = ("dropout", "norm_eps", "rope_theta")
_CHOICES = {"norm": NORMS, "pos_emb": ("rope", "learned"), "dtype": ("bf16", "fp16", "fp32"),
            "attention": ATTENTIONS, "router": ROUTERS}
_REQUIRED = ("layers", "hidden", "heads")
_MOE_ONLY = ("experts", "top_k", "expert_ffn", "shared_ffn", "dense_layers", "shared_gate", "router", "expert_groups",
             "group_top_k", "norm_topk")


ModelSpecError = ModelError   # the name this module used before ModelError covered every model source


def _value(kind: str, key: str, raw: Any) -> Any:
    if key in _INT:
        if isinstance(raw, bool):
            raise ModelSpecError(f"{kind} model key {key}={raw!r} must be an integer")
        try:
            v = int(raw) if not isinstance(raw, str) else int(raw.replace("_", ""))
            if isinstance(raw, float) and v != raw:
                raise ValueError(raw)
        except (TypeError, ValueError, OverflowError):
            raise ModelSpecError(f"{kind} model key {key}={raw!r} must be an integer, e.g. {key}=4096") from None
        return v
    if key in _FLOAT:
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise ModelSpecError(f"{kind} model key {key}={raw!r} must be a number, e.g. {key}=0.1") from None
    if key in _BOOL:
        if isinstance(raw, bool):
            return raw
        text = str(raw).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ModelSpecError(f"{kind} model key {key}={raw!r} must be true or false")
    v = str(raw)
    if key in _CHOICES and v not in _CHOICES[key]:
        raise ModelSpecError(f"{kind} model key {key}={v!r} must be one of {', '.join(_CHOICES[key])}")
    return v


def model_from_dict(fields: Mapping[str, Any], kind: str | None = None) -> ModelSpec:
    """Build a model from ``ModelSpec`` fields (``kind`` gpt/moe; by default moe when ``experts`` > 0)."""
    d = dict(fields)
    d.pop("format", None)
    if d.get("name", "") is None:   # a JSON null: no name given
        d.pop("name")
    experts = _value(kind or "moe", "experts", d["experts"]) if d.get("experts") is not None else 0
    kind = kind or d.pop("kind", None) or ("moe" if experts > 0 else "gpt")
    d.pop("kind", None)
    if kind not in KINDS:
        raise ModelSpecError(f"unknown model kind {kind!r}; write gpt:... or moe:...")
    known = set(_INT) | set(_BOOL) | set(_STR) | set(_FLOAT)
    if kind == "gpt":
        if experts == 0:
            for k in _MOE_ONLY:
                d.pop(k, None)
        known -= set(_MOE_ONLY)
    for k in list(d):
        if k not in known:
            raise ModelSpecError(f"unknown {kind} model key {k!r}; keys are {', '.join(sorted(known))}")
    missing = [k for k in _REQUIRED if k not in d]
    if kind == "moe":
        missing += [k for k in ("experts", "top_k", "expert_ffn") if k not in d]
    if missing:
        raise ModelSpecError(f"{kind} model lacks {', '.join(missing)}; e.g. "
                             f"{kind}:layers=24,hidden=2048,heads=16" + (",experts=8,top_k=2,expert_ffn=1408"
                                                                        if kind == "moe" else ""))
    kw = {k: _value(kind, k, v) for k, v in d.items()}
    layers, hidden, heads = kw.pop("layers"), kw.pop("hidden"), kw.pop("heads")
    kw.setdefault("name", inline_text(kind, {"layers": layers, "hidden": hidden, "heads": heads, **kw}))
    build = gpt if kind == "gpt" else moe
    return build(layers, hidden, heads, **kw)


def inline_text(kind: str, kw: Mapping[str, Any]) -> str:
    """Canonical inline text of a spec (keys in a fixed order)."""
    order = [k for k in _INT + _FLOAT + _BOOL + _STR if k in kw and k != "name"]
    def fmt(v: Any) -> str:
        return ("true" if v else "false") if isinstance(v, bool) else str(v)
    return f"{kind}:" + ",".join(f"{k}={fmt(kw[k])}" for k in order)


def _inline(text: str) -> ModelSpec:
    kind, _, body = text.partition(":")
    kind = kind.strip().lower()
    d: dict[str, str] = {}
    for part in body.replace(" ", "").split(","):
        if not part:
            continue
        if "=" not in part:
            raise ModelSpecError(f"model item {part!r} in {text!r} is not key=value; write e.g. {kind}:layers=24,...")
        k, v = part.split("=", 1)
        if k in d:
            raise ModelSpecError(f"model key {k!r} given twice in {text!r}")
        d[k] = v
    return model_from_dict(d, kind)


def _json_file(path: str) -> ModelSpec:
    from ..validate import read_json
    obj = read_json(path, "model file")   # size, encoding and nesting checked
    if not isinstance(obj, dict):
        raise ModelSpecError(f"model file {path} must hold one JSON object of ModelSpec fields")
    return model_from_dict(obj)


def parse_model(text: "str | ModelSpec", presets: Mapping[str, Any]) -> ModelSpec:
    """A model from a preset name (looked up in ``presets``), a ``.json`` path or inline text."""
    if isinstance(text, ModelSpec):
        return text
    raw = str(text).strip()
    if raw[:3].lower() == "hf:":
        from .hf import load_hf
        return load_hf(raw[3:])
    if raw.split(":", 1)[0].strip().lower() in KINDS and ":" in raw:
        return _inline(raw)
    if raw.lower().endswith(".json") or os.path.sep in raw:
        if not os.path.exists(raw):
            raise ModelSpecError(f"model file {raw} does not exist; give a preset, a JSON file or gpt:layers=...")
        return _json_file(raw)
    raise UnknownPresetError(f"unknown model {text!r}; presets are {', '.join(presets)}, or give a JSON file of "
                             f"ModelSpec fields, hf:DIR (a Hugging Face config.json) or an inline spec such as "
                             f"gpt:layers=24,hidden=2048,heads=16")
