"""The single-device forward DAG of a preset model, built without torch.

Regions in model order: ``embed``, per layer ``layers.{i}.attn`` then ``layers.{i}.mlp`` (dense) or
``layers.{i}.moe.route`` / ``.moe.experts`` / ``.moe.combine`` (MoE), and ``head``. Each node carries
its forward FLOPs for one micro-batch, the parameter bytes it reads and its output shape; a torch
model annotated with :func:`parashift.region` yields the same graph (``annotate.trace``).
"""
from __future__ import annotations

from ..models import ModelSpec
from .graph import DATA, Graph

__all__ = ["model_graph", "region_flops", "region_param_bytes"]


def region_flops(model: ModelSpec, kind: str, tokens: int, seq_len: int) -> float:
    """Forward FLOPs of one region for ``tokens`` tokens (single device)."""
    h = model.hidden
    mats = 3 if model.gated else 2
    if kind == "attn":
        return model.attn_flops(tokens, seq_len)
    if kind == "mlp":
        return model.mlp_flops(tokens)
    if kind == "moe.route":
        return float(2 * tokens * h * model.experts + 2 * tokens * mats * h * model.shared_ffn)
    if kind == "moe.experts":
        return float(2 * tokens * model.top_k * mats * h * model.expert_ffn)
    if kind == "moe.combine":
        return float(2 * tokens * model.top_k * h)
    if kind == "head":
        return model.head_flops(tokens)
    return 0.0


def core_attention_flops(model: ModelSpec, tokens: int, seq_len: int) -> float:
    """FLOPs of QK^T and AV (what selective recomputation re-runs)."""
    return model.core_flops(tokens, seq_len)


def region_param_bytes(model: ModelSpec) -> dict[tuple[int, str], int]:
    """(layer, region kind) -> parameter bytes on a single device."""
    out: dict[tuple[int, str], int] = {}
    for t in model.tensors:
        if t.region == "moe":
            kind = "moe.experts" if ".experts." in t.name else "moe.route"
        else:
            kind = t.region
        key = (t.layer, kind)
        out[key] = out.get(key, 0) + t.nbytes
        if t.tied:
            out[(model.layers, "head")] = out.get((model.layers, "head"), 0) + t.nbytes
    return out


def region_kinds(model: ModelSpec) -> tuple[str, ...]:
    """Region kinds of one transformer layer, in order."""
    return ("attn", "moe.route", "moe.experts", "moe.combine") if model.is_moe else ("attn", "mlp")


def model_graph(model: ModelSpec, *, mbs: int = 1, seq_len: int | None = None) -> Graph:
    """Forward DAG of one micro-batch of ``mbs`` sequences on a single device (a chain of regions)."""
    s = seq_len or model.seq_len
    tokens = mbs * s
    pbytes = region_param_bytes(model)
    g = Graph()
    shape = (mbs, s, model.hidden)

    def add(region: str, kind: str, layer: int, out_shape: tuple[int, ...]) -> int:
        return g.add(op="compute", phase="fwd", region=region, kind=kind, layer=layer,
                     flops=region_flops(model, kind, tokens, s), params=pbytes.get((layer, kind), 0),
                     shape=out_shape)

    prev = add("embed", "embed", -1, shape)
    for i in range(model.layers):
        for kind in region_kinds(model):
            n = add(f"layers.{i}.{kind}", kind, i, shape)
            g.edge(prev, n, DATA)
            prev = n
    n = add("head", "head", model.layers, (mbs, s, model.vocab))
    g.edge(prev, n, DATA)
    return g
