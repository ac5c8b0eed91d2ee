"""Hugging Face weights <-> parashift tensors for the Llama family (Llama, Mistral, Qwen2, Qwen3 dense
and MoE, Mixtral).

One table, :data:`LAYER` (per layer; :data:`MLP` or :data:`MOE` by the model) and :data:`GLOBAL`, names
each Hugging Face parameter and the parashift tensor it becomes, with the part it fills: parashift fuses
q/k/v into ``attn.qkv`` grouped per KV head (``r`` query heads, then the key head, then the value head)
and gate/up into ``fc1`` with their rows interleaved (see :mod:`parashift.exec.models`). Experts are
read in transformers 5's fused layout (``experts.gate_up_proj`` ``[E, 2f, h]``, gate rows first); the
per-expert names of the Hub's checkpoints (Qwen3-MoE's ``experts.{e}.gate_proj``, Mixtral's
``block_sparse_moe.experts.{e}.w1``) are fused first. :func:`to_parashift` and :func:`to_hf` are exact
inverses; :func:`load_hf_weights` reads ``*.safetensors`` from a local folder.
"""
from __future__ import annotations

import glob
import os
from typing import Mapping

import torch

from ..errors import ModelError
from ..models import ModelSpec

__all__ = ["LAYER", "MLP", "MOE", "GLOBAL", "to_parashift", "to_hf", "load_hf_weights", "check_convertible",
           "weights_folder"]

_A, _M = "model.layers.{i}.self_attn", "model.layers.{i}.mlp"
#: (Hugging Face name, parashift name, part) per layer ``{i}``; part: None (the whole tensor), q/k/v
#: (rows of the grouped QKV) or gate/up (interleaved rows of fc1).
LAYER: tuple[tuple[str, str, str | None], ...] = (
    ("model.layers.{i}.input_layernorm.weight", "layers.{i}.attn.norm.weight", None),
    (f"{_A}.q_proj.weight", "layers.{i}.attn.qkv.weight", "q"),
    (f"{_A}.k_proj.weight", "layers.{i}.attn.qkv.weight", "k"),
    (f"{_A}.v_proj.weight", "layers.{i}.attn.qkv.weight", "v"),
    (f"{_A}.q_proj.bias", "layers.{i}.attn.qkv.bias", "q"),
    (f"{_A}.k_proj.bias", "layers.{i}.attn.qkv.bias", "k"),
    (f"{_A}.v_proj.bias", "layers.{i}.attn.qkv.bias", "v"),
    (f"{_A}.q_norm.weight", "layers.{i}.attn.q_norm.weight", None),
    (f"{_A}.k_norm.weight", "layers.{i}.attn.k_norm.weight", None),
    (f"{_A}.o_proj.weight", "layers.{i}.attn.out.weight", None),
)
MLP: tuple[tuple[str, str, str | None], ...] = (
    ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.mlp.norm.weight", None),
    (f"{_M}.gate_proj.weight", "layers.{i}.mlp.fc1.weight", "gate"),
    (f"{_M}.up_proj.weight", "layers.{i}.mlp.fc1.weight", "up"),
    (f"{_M}.down_proj.weight", "layers.{i}.mlp.fc2.weight", None),
)
MOE: tuple[tuple[str, str, str | None], ...] = (
    ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.moe.norm.weight", None),
    (f"{_M}.gate.weight", "layers.{i}.moe.router.weight", None),
    (f"{_M}.experts.gate_up_proj", "layers.{i}.moe.experts.fc1", "gate_up"),
    (f"{_M}.experts.down_proj", "layers.{i}.moe.experts.fc2", None),
)
#: Per-expert names (gate, up, down, router) of the Hub's checkpoints, fused into :data:`MOE`'s.
_PER_EXPERT = (("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                "mlp.experts.{e}.down_proj.weight", "mlp.gate.weight"),
               ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight",
                "block_sparse_moe.experts.{e}.w2.weight", "block_sparse_moe.gate.weight"))
GLOBAL: tuple[tuple[str, str, str | None], ...] = (
    ("model.embed_tokens.weight", "embed.word", None),
    ("model.norm.weight", "head.norm.weight", None),
    ("lm_head.weight", "head.out", None),
)


def check_convertible(spec: ModelSpec) -> None:
    """Raise ModelError unless ``spec`` is a Llama-family decoder the table covers."""
    if spec.attention != "gqa" or spec.bias or spec.norm != "rms" or spec.pos_emb != "rope" or not spec.gated \
            or (spec.is_moe and (spec.shared_ffn or spec.dense_layers or spec.router != "softmax")):
        raise ModelError(f"model {spec.name!r}: Hugging Face weights are read for Llama, Mistral, Qwen2, Qwen3 (dense "
                         f"and MoE) and Mixtral models; this one is not such a model")


def _rows(spec: ModelSpec) -> dict[str, list[tuple[str, dict[str, str | None]]]]:
    """parashift name -> [(Hugging Face name, part)] for every tensor of ``spec``."""
    out: dict[str, list] = {}
    for i in range(spec.layers):
        for hf, ps, part in LAYER + (MOE if spec.is_moe else MLP):
            out.setdefault(ps.format(i=i), []).append((hf.format(i=i), part))
    for hf, ps, part in GLOBAL:
        out.setdefault(ps, []).append((hf, part))
    return {k: v for k, v in out.items() if k in spec.index}


def to_parashift(spec: ModelSpec, hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor of ``spec`` from a Hugging Face state dict (fp32 copies; tied: no ``lm_head``)."""
    check_convertible(spec)
    hf = _fuse_experts(spec, hf) if spec.is_moe else hf
    out, used = {}, set()
    for name, parts in _rows(spec).items():
        for key, _ in parts:
            if key not in hf:
                raise ModelError(f"Hugging Face weights lack {key!r} (parashift {name!r}); the checkpoint does not "
                                 f"match its config.json")
            used.add(key)
        src = {part: hf[key].detach().to(torch.float32) for key, part in parts}
        if "q" in src:     # per KV head: its r query heads, its key head, its value head
            rest = src["q"].shape[1:]
            t = torch.cat([src[p].reshape(spec.kv_heads, -1, spec.head_dim, *rest) for p in "qkv"], dim=1)
            t = t.reshape(-1, *rest)
        elif "gate" in src:
            t = torch.stack([src["gate"], src["up"]], dim=1).reshape(-1, src["gate"].shape[-1])
        elif "gate_up" in src:        # [E, 2f, h], gate rows then up rows -> interleaved
            e, f2, h = src["gate_up"].shape
            t = src["gate_up"].reshape(e, 2, f2 // 2, h).transpose(1, 2).reshape(e, f2, h)
        else:
            t = src[None]
        if tuple(t.shape) != spec.tensor(name).shape:
            raise ModelError(f"Hugging Face weight for {name!r} has shape {tuple(t.shape)}, the config says "
                             f"{spec.tensor(name).shape}")
        out[name] = t.contiguous()
    extra = sorted(k for k in hf if k not in used and not (spec.tied and k == "lm_head.weight")
                   and "rotary_emb" not in k)
    if extra:
        raise ModelError(f"Hugging Face weight {extra[0]!r} has no parashift tensor ({len(extra)} unread); the "
                         f"checkpoint holds more than its config.json describes")
    return out


def _fuse_experts(spec: ModelSpec, hf: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``hf`` with per-expert weights (the Hub's names) fused into transformers 5's layout."""
    out = dict(hf)
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        for gate, up, down, router in _PER_EXPERT:
            if p + gate.format(e=0) not in out:
                continue

            def take(key: str) -> torch.Tensor:
                if key not in out:
                    raise ModelError(f"Hugging Face weights lack {key!r}; the checkpoint does not match its "
                                     f"config.json ({spec.experts} experts)")
                return out.pop(key)
            g, u, d = ([take(p + k.format(e=e)) for e in range(spec.experts)] for k in (gate, up, down))
            out[p + "mlp.experts.gate_up_proj"] = torch.cat([torch.stack(g), torch.stack(u)], dim=1)
            out[p + "mlp.experts.down_proj"] = torch.stack(d)
            out[p + "mlp.gate.weight"] = take(p + router)
    return out


def to_hf(spec: ModelSpec, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The Hugging Face state dict of parashift tensors (the inverse of :func:`to_parashift`; of those of
    ``params``' tensors when it holds a part of the model)."""
    check_convertible(spec)
    out = {}
    r = spec.heads // spec.kv_heads
    for name, parts in _rows(spec).items():
        if name not in params:
            continue
        t = params[name]
        for key, part in parts:
            if part in ("q", "k", "v"):
                g = t.reshape(spec.kv_heads, r + 2, spec.head_dim, *t.shape[1:])
                sl = {"q": slice(0, r), "k": slice(r, r + 1), "v": slice(r + 1, r + 2)}[part]
                out[key] = g[:, sl].reshape(-1, *t.shape[1:]).contiguous()
            elif part in ("gate", "up"):
                out[key] = t.reshape(-1, 2, t.shape[-1])[:, 0 if part == "gate" else 1].contiguous()
            elif part == "gate_up":
                e, f2, h = t.shape
                out[key] = t.reshape(e, f2 // 2, 2, h).transpose(1, 2).reshape(e, f2, h).contiguous()
            else:
                out[key] = t.contiguous()
    return out


def weights_folder(path: str) -> str | None:
    """The folder of the Hugging Face model at ``path`` (its folder or ``config.json``) when it holds
    ``*.safetensors`` weights, else None."""
    from ..models.hf import config_path
    folder = os.path.dirname(config_path(path))
    return folder if glob.glob(os.path.join(folder, "*.safetensors")) else None


def load_hf_weights(spec: ModelSpec, path: str) -> dict[str, torch.Tensor]:
    """``spec``'s tensors from the ``*.safetensors`` files of the folder ``path`` (nothing downloaded)."""
    from safetensors.torch import load_file
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ModelError(f"{folder}: no *.safetensors weights; save the model with save_pretrained or start from "
                         f"initial values")
    hf: dict[str, torch.Tensor] = {}
    for f in files:
        hf.update(load_file(f))
    return to_parashift(spec, hf)
