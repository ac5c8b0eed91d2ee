"""Model specifications: the tensor inventory and the architecture numbers the cost model needs."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from ..errors import LimitError, StrategyError

__all__ = ["TensorSpec", "ModelSpec", "gpt", "moe", "DTYPE_BYTES", "REGIONS", "MAX_LAYERS"]

#: The most layers a model may have: 78x the deepest published LLM (Megatron's 1T GPT: 128 layers); one
#: step of it simulates in seconds, while a million layers take minutes and gigabytes before any check.
MAX_LAYERS = 10_000

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
#: Regions a transformer is cut into, in model order within a layer.
REGIONS = ("embed", "attn", "mlp", "moe", "head")


@dataclass(frozen=True)
class TensorSpec:
    """One parameter tensor of the model.

    ``layer``: transformer layer index; ``-1`` for the embedding (first stage) and ``layers``
    for the final norm and output head (last stage). ``region``: one of REGIONS.
    ``tp_dim``: dimension tensor parallelism shards evenly (None: replicated over TP).
    ``ep_dim``: dimension indexing experts, which expert parallelism shards (None: dense).
    ``tied``: the tensor is also used by the head (tied embeddings), so the last stage holds it too.
    """

    name: str
    shape: tuple[int, ...]
    layer: int
    region: str
    tp_dim: int | None = None
    ep_dim: int | None = None
    dtype: str = "bf16"
    tied: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer (dense or MoE): tensors plus architecture numbers."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    seq_len: int
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    gated: bool = True          # SwiGLU (3 matrices) vs GELU (2)
    bias: bool = False          # linear biases (GPT-style)
    qkv_bias: bool = False
    norm: str = "rms"           # rms | ln
    qk_norm: bool = False
    pos_emb: str = "rope"       # rope | learned
    tied: bool = False
    dtype: str = "bf16"
    flash_attention: bool = True  # fused attention: no s*s score activations are stored
    dropout: float = 0.1        # hidden and attention dropout (Megatron GPT's 0.1); 0: no masks are stashed
    tensors: tuple[TensorSpec, ...] = field(default=(), repr=False, compare=False)

    # ---- inventory ---------------------------------------------------------------------------
    @cached_property
    def params(self) -> int:
        """Parameter count (each tensor once, tied embeddings once)."""
        return int(sum(t.numel for t in self.tensors))

    @cached_property
    def active_params(self) -> int:
        """Parameters one token touches (top-k of the routed experts)."""
        n = 0
        for t in self.tensors:
            n += t.numel * self.top_k // self.experts if t.ep_dim is not None else t.numel
        return int(n)

    @cached_property
    def index(self) -> dict[str, int]:
        return {t.name: i for i, t in enumerate(self.tensors)}

    def tensor(self, name: str) -> TensorSpec:
        return self.tensors[self.index[name]]

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def state_kinds(self) -> tuple[str, ...]:
        """VPS kinds: fp32 training keeps no separate master copy."""
        if self.dtype == "fp32":
            return ("param", "grad", "exp_avg", "exp_avg_sq")
        return ("param", "grad", "master", "exp_avg", "exp_avg_sq")

    def kind_bytes(self, kind: str) -> int:
        """Bytes per element of a state kind."""
        return self.dtype_bytes if kind in ("param", "grad") else 4

    # ---- FLOPs -------------------------------------------------------------------------------
    def attn_flops(self, tokens: int, seq_len: int | None = None) -> float:
        """Forward FLOPs of one layer's attention block for ``tokens`` tokens."""
        s = seq_len or self.seq_len
        h, d = self.hidden, self.head_dim
        q, kv = self.heads * d, self.kv_heads * d
        proj = 2 * tokens * h * (q + 2 * kv) + 2 * tokens * q * h
        core = 2 * 2 * tokens * s * q  # QK^T and AV (full, no causal saving, as Megatron counts)
        return float(proj + core)

    def mlp_flops(self, tokens: int) -> float:
        """Forward FLOPs of one layer's MLP or MoE block (routed top-k + shared + router)."""
        mats = 3 if self.gated else 2
        if not self.is_moe:
            return float(2 * tokens * mats * self.hidden * self.ffn)
        routed = 2 * tokens * self.top_k * mats * self.hidden * self.expert_ffn
        shared = 2 * tokens * mats * self.hidden * self.shared_ffn
        router = 2 * tokens * self.hidden * self.experts
        return float(routed + shared + router)

    def head_flops(self, tokens: int) -> float:
        return float(2 * tokens * self.hidden * self.vocab)

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward = 3x forward), no recomputation."""
        fwd = self.layers * (self.attn_flops(1, seq_len) + self.mlp_flops(1)) + self.head_flops(1)
        return 3.0 * fwd

    def __str__(self) -> str:
        return f"{self.name} ({self.params / 1e9:.2f}B params)"


def _inventory(spec: ModelSpec) -> tuple[TensorSpec, ...]:
    """The tensors of a decoder built from ``spec``'s numbers, in model order."""
    h, d, dt = spec.hidden, spec.head_dim, spec.dtype
    q, kv = spec.heads * d, spec.kv_heads * d
    T: list[TensorSpec] = []

    def add(name: str, shape: tuple[int, ...], layer: int, region: str, tp_dim: int | None = None,
            ep_dim: int | None = None, tied: bool = False) -> None:
        T.append(TensorSpec(name, tuple(int(x) for x in shape), layer, region, tp_dim, ep_dim, dt, tied))

    def norm(prefix: str, layer: int, region: str, width: int = h) -> None:
        add(f"{prefix}.weight", (width,), layer, region)
        if spec.norm == "ln":
            add(f"{prefix}.bias", (width,), layer, region)

    add("embed.word", (spec.vocab, h), -1, "embed", tp_dim=0, tied=spec.tied)
    if spec.pos_emb == "learned":
        add("embed.pos", (spec.seq_len, h), -1, "embed")
    mats_in = 2 if spec.gated else 1
    for i in range(spec.layers):
        p = f"layers.{i}"
        norm(f"{p}.attn.norm", i, "attn")
        # fused QKV, grouped per KV head so an even TP split keeps whole groups
        add(f"{p}.attn.qkv.weight", (q + 2 * kv, h), i, "attn", tp_dim=0)
        if spec.bias or spec.qkv_bias:
            add(f"{p}.attn.qkv.bias", (q + 2 * kv,), i, "attn", tp_dim=0)
        if spec.qk_norm:
            add(f"{p}.attn.q_norm.weight", (d,), i, "attn")
            add(f"{p}.attn.k_norm.weight", (d,), i, "attn")
        add(f"{p}.attn.out.weight", (h, q), i, "attn", tp_dim=1)
        if spec.bias:
            add(f"{p}.attn.out.bias", (h,), i, "attn")
        if not spec.is_moe:
            norm(f"{p}.mlp.norm", i, "mlp")
            add(f"{p}.mlp.fc1.weight", (mats_in * spec.ffn, h), i, "mlp", tp_dim=0)
            if spec.bias:
                add(f"{p}.mlp.fc1.bias", (mats_in * spec.ffn,), i, "mlp", tp_dim=0)
            add(f"{p}.mlp.fc2.weight", (h, spec.ffn), i, "mlp", tp_dim=1)
            if spec.bias:
                add(f"{p}.mlp.fc2.bias", (h,), i, "mlp")
        else:
            norm(f"{p}.moe.norm", i, "moe")
            add(f"{p}.moe.router.weight", (spec.experts, h), i, "moe")
            e, f = spec.experts, spec.expert_ffn
            add(f"{p}.moe.experts.fc1", (e, mats_in * f, h), i, "moe", tp_dim=1, ep_dim=0)
            add(f"{p}.moe.experts.fc2", (e, h, f), i, "moe", tp_dim=2, ep_dim=0)
            if spec.shared_ffn:
                add(f"{p}.moe.shared.fc1", (mats_in * spec.shared_ffn, h), i, "moe", tp_dim=0)
                add(f"{p}.moe.shared.fc2", (h, spec.shared_ffn), i, "moe", tp_dim=1)
                add(f"{p}.moe.shared.gate", (1, h), i, "moe")
    norm("head.norm", spec.layers, "head")
    if not spec.tied:
        add("head.out", (spec.vocab, h), spec.layers, "head", tp_dim=0)
    return tuple(T)


def _pad(n: int, multiple: int = 128) -> int:
    return -(-n // multiple) * multiple


def _check(name: str, **nums: int) -> None:
    for k, v in nums.items():
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise StrategyError(f"model {name!r}: {k}={v!r} must be a positive integer")


def gpt(layers: int, hidden: int, heads: int, kv_heads: int | None = None, ffn: int | None = None,
        vocab: int = 50257, seq_len: int = 2048, *, name: str = "custom-gpt", head_dim: int | None = None,
        gated: bool = True, bias: bool = False, qkv_bias: bool = False, norm: str = "rms",
        qk_norm: bool = False, pos_emb: str = "rope", tied: bool = False, dtype: str = "bf16",
        pad_vocab: int = 128, flash_attention: bool = True, dropout: float = 0.1) -> ModelSpec:
    """A dense decoder. ``ffn`` defaults to 4*hidden, ``head_dim`` to hidden/heads (then ``heads`` must
    divide ``hidden``); the vocabulary is padded to ``pad_vocab``."""
    if not str(name).strip():
        raise StrategyError("a model's name must not be empty; give name=... or leave it out")
    _check(name, layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq_len=seq_len, pad_vocab=pad_vocab,
           **{k: v for k, v in (("kv_heads", kv_heads), ("ffn", ffn), ("head_dim", head_dim)) if v is not None})
    if layers > MAX_LAYERS:
        raise LimitError(f"model {name!r}: layers={layers} exceeds the limit of {MAX_LAYERS:,} layers; "
                         f"describe a shallower model")
    kv_heads = heads if kv_heads is None else kv_heads
    if heads % kv_heads:
        raise StrategyError(f"model {name!r}: kv_heads={kv_heads} must divide heads={heads}")
    if head_dim is None and hidden % heads:
        raise StrategyError(f"model {name!r}: heads={heads} must divide hidden={hidden} (or give head_dim=...)")
    ffn = 4 * hidden if ffn is None else ffn
    head_dim = hidden // heads if head_dim is None else head_dim
    if dtype not in DTYPE_BYTES:
        raise StrategyError(f"model {name!r}: dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    if not 0.0 <= dropout < 1.0:
        raise StrategyError(f"model {name!r}: dropout={dropout!r} must be in [0, 1)")
    spec = ModelSpec(name, layers, hidden, heads, kv_heads, head_dim, ffn, _pad(vocab, pad_vocab), seq_len,
                     gated=gated, bias=bias, qkv_bias=qkv_bias, norm=norm, qk_norm=qk_norm,
                     pos_emb=pos_emb, tied=tied, dtype=dtype, flash_attention=flash_attention,
                     dropout=float(dropout))
    return _with_tensors(spec)


def moe(layers: int, hidden: int, heads: int, kv_heads: int | None = None, ffn: int | None = None,
        vocab: int = 50257, seq_len: int = 2048, *, experts: int, top_k: int, expert_ffn: int,
        shared_ffn: int = 0, name: str = "custom-moe", **kw: object) -> ModelSpec:
    """A mixture-of-experts decoder: every layer's MLP is ``experts`` routed experts (top-k) plus
    an optional shared expert of width ``shared_ffn``."""
    _check(name, experts=experts, top_k=top_k, expert_ffn=expert_ffn)
    if isinstance(shared_ffn, bool) or not isinstance(shared_ffn, (int, np.integer)) or shared_ffn < 0:
        raise StrategyError(f"model {name!r}: shared_ffn={shared_ffn!r} must be a whole number >= 0 (0: no shared "
                            f"expert)")
    if top_k > experts:
        raise StrategyError(f"model {name!r}: top_k={top_k} exceeds experts={experts}")
    base = gpt(layers, hidden, heads, kv_heads, expert_ffn if ffn is None else ffn, vocab, seq_len, name=name, **kw)  # type: ignore[arg-type]
    spec = ModelSpec(**{**_fields(base), "experts": experts, "top_k": top_k, "expert_ffn": expert_ffn,
                        "shared_ffn": shared_ffn})
    return _with_tensors(spec)


def _fields(spec: ModelSpec) -> dict:
    from dataclasses import fields as dc_fields
    return {f.name: getattr(spec, f.name) for f in dc_fields(spec) if f.name != "tensors"}


def _with_tensors(spec: ModelSpec) -> ModelSpec:
    object.__setattr__(spec, "tensors", _inventory(spec))
    return spec
