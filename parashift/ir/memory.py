"""Bytes a training step holds: static states per rank (ZeRO-aware) and activations per micro-batch.

Static memory is derived from the tensor inventory: TP shards along ``tp_dim``, EP shards experts,
ZeRO shards each stage's flat buffer over the ``dp x cp`` ranks (experts: ``dp / ep``), padded to a
multiple of the group size, exactly as :mod:`parashift.vps.layout` lays the buffers out (a test
checks both agree; neither imports the other: the state kinds live in :mod:`parashift.states`).
What ZeRO-2/3 hold beyond their shards during a step (a micro-batch's gradient bucket until its
reduce-scatter, ZeRO-3's gathered region parameters) are Program buffers sized by
:func:`region_state_bytes`.

Activation bytes follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", section 4), per layer for 16-bit activations (scaled by ``dtype_bytes / 2``),
with ``s`` the sequence, ``b`` the micro-batch, ``h`` the hidden size, ``a`` the heads, ``t`` TP:

- no recomputation: ``sbh(10 + 24/t + 5as/(ht))`` (``34sbh/t + 5as^2b/t`` with sequence
  parallelism, which shards the norms', dropouts' and block inputs' ``10sbh`` over TP too); a model
  without dropout (``ModelSpec.dropout == 0``) stashes no masks and no dropout outputs: ``2sbh``
  (the attention and MLP output masks) and ``3as^2b/t`` (the probabilities' mask and dropout output) less;
- selective recomputation: the same without the ``5as^2b/t`` attention scores (also dropped when the
  model uses fused/flash attention, which never stores them);
- full recomputation: only the layer input, ``2sbh`` (``2sbh/t`` with sequence parallelism).

Context parallelism divides ``s`` by ``cp`` (each rank holds ``s/cp`` tokens; its scores are
``s/cp x s``). Gated MLPs and grouped-query attention use their real widths, and so do attentions
whose ``heads x head_dim`` is not the hidden size (Q and the output projection's input are that wide). Under full
recomputation the output layer (``head``) is recomputed too and keeps its input (Megatron-LM keeps
its output layer's activations; the runtime rebuilds a chunk's recomputed regions as one graph).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..fp8 import FP8_GEMMS, get as fp8_recipe
from ..models import ModelSpec
from ..strategy import Strategy

__all__ = ["ChunkParams", "chunk_params", "fp8_params", "gather_bytes", "static_memory", "optimizer_elements", "region_activation",
           "recompute_bytes", "region_state_bytes", "grad_bucket", "OPTIM_FLOPS_PER_ELEMENT"]

OPTIM_FLOPS_PER_ELEMENT = 10.0


@dataclass(frozen=True)
class ChunkParams:
    """Per virtual stage (chunk): parameter elements one rank holds before ZeRO sharding."""

    dense: np.ndarray        # [chunks] elements of dense tensors (TP shard)
    expert: np.ndarray       # [chunks] elements of expert tensors (TP and EP shard)
    tied: int                # elements of the tied word embedding's TP shard (0 when untied)

    def total(self) -> np.ndarray:
        return self.dense + self.expert


def chunk_params(model: ModelSpec, strategy: Strategy) -> ChunkParams:
    """Elements per chunk on one rank: embedding in chunk 0, head (and a tied embedding copy) in the last."""
    s = strategy
    layer_chunk = s.layer_stages(model.layers)
    dense = np.zeros(s.stages, np.int64)
    expert = np.zeros(s.stages, np.int64)
    tied = 0
    for t in model.tensors:
        n = t.numel
        if t.tp_dim is not None:
            n //= s.tp
        if t.ep_dim is not None:
            n //= s.ep
        if t.layer < 0:
            chunks = [0]
            if t.tied and s.stages > 1:
                chunks.append(s.stages - 1)
                tied = n
        elif t.layer >= model.layers:
            chunks = [s.stages - 1]
        else:
            chunks = [int(layer_chunk[t.layer])]
        for c in chunks:
            (expert if t.ep_dim is not None else dense)[c] += n
    return ChunkParams(dense, expert, tied)


def fp8_params(model: ModelSpec, strategy: Strategy) -> ChunkParams:
    """Per chunk, the elements of one rank's GEMM weights an fp8 recipe casts (:data:`parashift.fp8.FP8_GEMMS`;
    TP and EP shards, before ZeRO): all zero without a recipe."""
    s = strategy
    layer_chunk = s.layer_stages(model.layers)
    dense = np.zeros(s.stages, np.int64)
    expert = np.zeros(s.stages, np.int64)
    if s.fp8 != "none":
        for t in model.tensors:
            if 0 <= t.layer < model.layers and t.name.endswith(FP8_GEMMS):
                n = t.numel // (s.tp if t.tp_dim is not None else 1) // (s.ep if t.ep_dim is not None else 1)
                (expert if t.ep_dim is not None else dense)[int(layer_chunk[t.layer])] += n
    return ChunkParams(dense, expert, 0)


def gather_bytes(model: ModelSpec, strategy: Strategy, elements: int, fp8_elements: int) -> int:
    """Bytes a ZeRO parameter all-gather moves for ``elements`` parameters of which ``fp8_elements`` are FP8
    GEMM weights: those at one byte under ``fp8_gather``, everything else in the parameter dtype."""
    pb = model.kind_bytes("param")
    n8 = fp8_elements if strategy.fp8_gather else 0
    return int((elements - n8) * pb + n8)


def grad_bucket(tensor: str) -> str:
    """The atomic region (gradient bucket) a dense model's tensor belongs to: ``layers.3.mlp.fc1.weight``
    -> ``layers.3.mlp``, ``embed.word`` -> ``embed``, ``head.out`` -> ``head``."""
    parts = tensor.split(".")
    return ".".join(parts[:3]) if parts[0] == "layers" else parts[0]


def region_state_bytes(model: ModelSpec, strategy: Strategy) -> tuple[tuple[str, int, int], ...]:
    """Per atomic region of a dense model (``embed``, ``layers.<l>.attn``, ``layers.<l>.mlp``,
    ``head``): (region, parameter bytes, gradient bytes) of its parameters on one rank (TP shard), in
    model order: the ZeRO-2/3 gradient buckets and ZeRO-3 gather units. Empty for MoE models (their
    parameters and gradients move per chunk)."""
    if model.is_moe:
        return ()
    gb = model.kind_bytes("grad")
    out: dict[str, int] = {}
    f8: dict[str, int] = {}
    for t in model.tensors:
        region = grad_bucket(t.name)
        n = t.numel // strategy.tp if t.tp_dim is not None else t.numel
        out[region] = out.get(region, 0) + n
        if strategy.fp8 != "none" and t.layer >= 0 and t.name.endswith(FP8_GEMMS):
            f8[region] = f8.get(region, 0) + n
    return tuple((r, gather_bytes(model, strategy, n, f8.get(r, 0)), n * gb) for r, n in out.items())


def _shard(n: int, ways: int) -> int:
    return -(-n // ways)


def _groups(s: Strategy) -> tuple[int, int]:
    """Ranks that ZeRO-shard dense and expert parameters: dp x cp, and dp x cp / ep (hybrid sharding:
    the shard group, ``shard`` dp ranks, for both)."""
    return (s.shard, s.shard) if s.shard else (s.dpcp, s.dpcp // s.ep)


def static_memory(model: ModelSpec, strategy: Strategy) -> list[dict[str, int]]:
    """Per pipeline stage: {"param", "grad", "master", "optim"} bytes one rank of that stage holds
    (ZeRO buffers with their padding, as :func:`parashift.vps.layout` lays them out); under an fp8 recipe
    also "fp8": the FP8 copies of its GEMM weights (and their transposes, where the recipe keeps them,
    with their scales), ZeRO-3-sharded as the parameters are."""
    s = strategy
    cp = chunk_params(model, s)
    stage_of = np.asarray(s.chunk_rank_stage(np.arange(s.stages)))
    pb, gb = model.kind_bytes("param"), model.kind_bytes("grad")
    master = 0 if model.dtype == "fp32" else 4
    dense_g, expert_g = _groups(s)
    recipe, f8 = fp8_recipe(s.fp8), fp8_params(model, s)
    out = []
    for st in range(s.pp):
        mask = stage_of == st
        dense, exp_ = int(cp.dense[mask].sum()), int(cp.expert[mask].sum())

        def z(n: int, ways: int, kind: str) -> int:
            return _shard(n, ways) if s.zero_stage.shards(kind) else n

        elems = {k: z(dense, dense_g, k) + z(exp_, expert_g, k) for k in ("param", "grad", "master")}
        out.append({"param": elems["param"] * pb, "grad": elems["grad"] * gb,
                    "master": elems["master"] * master, "optim": elems["master"] * 8})
        if recipe is not None:
            n8 = z(int(f8.dense[mask].sum()), dense_g, "param") + z(int(f8.expert[mask].sum()), expert_g, "param")
            out[-1]["fp8"] = int(n8 * (2 if recipe.transpose else 1) + 2 * recipe.scale_bytes(n8))
    return out


def optimizer_elements(model: ModelSpec, strategy: Strategy) -> list[int]:
    """Per stage: parameter elements whose optimizer states one rank updates."""
    s = strategy
    cp = chunk_params(model, s)
    stage_of = np.asarray(s.chunk_rank_stage(np.arange(s.stages)))
    dense_g, expert_g = _groups(s)
    out = []
    for st in range(s.pp):
        mask = stage_of == st
        d, e = int(cp.dense[mask].sum()), int(cp.expert[mask].sum())
        out.append(_shard(d, dense_g) + _shard(e, expert_g) if s.zero_stage.shards_optim else d + e)
    return out


def _terms(model: ModelSpec, kind: str, *, mbs: int, seq_len: int, tp: int, sp: bool, cp: int) -> tuple[float, float]:
    """(stash without scores, attention scores) of one region, in 16-bit bytes, no recomputation."""
    s, b, h, t = seq_len / cp, mbs, model.hidden, tp
    a = model.heads
    sbh = s * b * h
    rep = sbh / t if sp else sbh      # what SP shards along the sequence: norms, dropouts, block inputs
    mats_in = 2 if model.gated else 1
    mask = 1 if model.dropout > 0 else 0   # a dropout mask: one byte per element
    scores = 0.0
    if kind == "attn":  # norm in 2sbh, QKV in 2sbh, mask sbh; Q, K, V, out-proj in: 2sb(q + 2 kv + q)/t (MLA:
        v = (4 + mask) * rep + 2 * s * b * model.attn_stash(t)   # its latents and per-head q, k, v too)
        scores = (2 + 3 * mask) * a * s * seq_len * b / t   # softmax out; with dropout its mask and output too
    elif kind == "mlp":  # norm in, fc1 in, mask: 5sbh; fc1 out and activation out
        v = (4 + mask) * rep + 2 * s * b * model.ffn * (mats_in + 1) / t
    elif kind == "moe.route":
        v = (4 + mask) * rep + 2 * s * b * model.shared_ffn * (mats_in + 1) / t + 4 * s * b * model.experts
    elif kind == "moe.experts":
        k = model.top_k
        v = 2 * s * b * k * h + 2 * s * b * k * model.expert_ffn * (mats_in + 1) / t
    elif kind == "moe.combine":
        v = 2 * s * b * model.top_k * h
    elif kind == "head":
        v = 4 * rep + 4 * s * b * model.vocab / t / (model.dtype_bytes / 2)
    else:  # embed
        v = 0.0
    return v, scores


def region_activation(model: ModelSpec, kind: str, *, mbs: int, seq_len: int, tp: int, recompute: str,
                      sp: bool = False, cp: int = 1) -> int:
    """Activation bytes one region stashes for its backward, per micro-batch on one rank (see the
    module docstring). Under full recomputation the attention region keeps the layer input, the rest
    of the layer nothing, and the output layer its input."""
    scale = model.dtype_bytes / 2
    if recompute == "full" and kind != "embed":
        sbh = seq_len / cp * mbs * model.hidden
        return int(2 * (sbh / tp if sp else sbh) * scale) if kind in ("attn", "head") else 0
    v, scores = _terms(model, kind, mbs=mbs, seq_len=seq_len, tp=tp, sp=sp, cp=cp)
    if recompute == "none" and not model.flash_attention:
        v += scores
    return int(v * scale)


def recompute_bytes(model: ModelSpec, kind: str, *, mbs: int, seq_len: int, tp: int, recompute: str,
                    sp: bool = False, cp: int = 1) -> int:
    """Bytes a recompute of one region materializes until its backward frees them: the attention
    scores (selective, unless flash attention never stores them) or what the region would stash
    without recomputation beyond what it keeps (full)."""
    if recompute == "none":
        return 0
    kw = dict(mbs=mbs, seq_len=seq_len, tp=tp, sp=sp, cp=cp)
    if recompute == "selective":
        if kind != "attn" or model.flash_attention:
            return 0
        return int(_terms(model, kind, **kw)[1] * model.dtype_bytes / 2)
    return max(0, region_activation(model, kind, recompute="none", **kw)
               - region_activation(model, kind, recompute="full", **kw))
