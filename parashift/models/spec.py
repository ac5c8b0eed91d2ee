"""Model specifications: the tensor inventory and the architecture numbers the cost model needs."""
from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from functools import cached_property
from typing import Any, Mapping

import numpy as np

from ..errors import LimitError, ProgramError, StrategyError

__all__ = ["TensorSpec", "ModelSpec", "gpt", "moe", "DTYPE_BYTES", "REGIONS", "MAX_LAYERS"]

#: The most layers a model may have: 78x the deepest published LLM (Megatron's 1T GPT: 128 layers); one
#: step of it simulates in seconds, while a million layers take minutes and gigabytes before any check.
MAX_LAYERS = 10_000

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
NORMS = ("rms", "ln", "ln1p")      # ln1p: LayerNorm with a zero-centred gain (Megatron's apply_layernorm_1p)
ATTENTIONS = ("gqa", "mla")
ROUTERS = ("softmax", "sigmoid")
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

    def to_json(self) -> dict:
        """Every field, JSON-able (tuples as lists); :meth:`from_json` inverts it."""
        return _encode(self)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "TensorSpec":
        return _decode(cls, obj)


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
    norm: str = "rms"           # rms | ln | ln1p
    qk_norm: bool = False
    pos_emb: str = "rope"       # rope | learned
    tied: bool = False
    dtype: str = "bf16"
    flash_attention: bool = True  # fused attention: no s*s score activations are stored
    dropout: float = 0.1        # hidden and attention dropout (Megatron GPT's 0.1); 0: no masks are stashed
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: str = ""      # a Hugging Face rope_scaling type (llama3, yarn, ...); "": plain rotary
    # multi-head latent attention (DeepSeek-V2/V3): head_dim is the q/k width (nope + rope_dim)
    attention: str = "gqa"      # gqa | mla
    q_lora: int = 0             # MLA query compression rank (0: a plain query projection)
    kv_lora: int = 0            # MLA key/value compression rank
    rope_dim: int = 0           # MLA decoupled rotary part of head_dim
    v_head_dim: int = 0         # value head width (0: head_dim)
    sliding_window: int = 0     # tokens a sliding-window layer attends to (0: none)
    full_every: int = 0         # with a window: every n-th layer attends fully (0: every layer slides)
    attn_sinks: bool = False    # a learned sink logit per head (GPT-OSS)
    dense_layers: int = 0       # MoE: the first n layers have a dense MLP of width ffn (DeepSeek)
    shared_gate: bool = True    # MoE: the shared expert's output has a sigmoid gate (Qwen-MoE)
    router: str = "softmax"     # softmax | sigmoid (DeepSeek-V3, with a per-expert score bias)
    norm_topk: bool = False     # the top-k routing weights are rescaled to sum to one (Mixtral)
    expert_groups: int = 0      # node-limited routing: experts in n groups ...
    group_top_k: int = 0        # ... of which each token reaches at most this many
    mtp_layers: int = 0         # multi-token prediction modules on the last stage
    tensors: tuple[TensorSpec, ...] = field(default=(), repr=False, compare=False)

    # ---- codec -------------------------------------------------------------------------------
    def to_json(self) -> dict:
        """Every field (tensors included), JSON-able; :meth:`from_json` inverts it losslessly.
        Built from the dataclass fields, so a field added later is carried without more code."""
        return _encode(self)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "ModelSpec":
        """The spec :meth:`to_json` wrote (a field it lacks takes its default: a newer parashift reads an
        older spec; a field this version does not know is refused)."""
        return _decode(cls, obj)

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

    # ---- attention shapes ---------------------------------------------------------------------
    @property
    def v_dim(self) -> int:
        """Width of one value head."""
        return self.v_head_dim or self.head_dim

    def attn_matrices(self) -> tuple[tuple[int, int, int | None], ...]:
        """One layer's attention projections as ``(out, in, tp_dim)`` per token; ``tp_dim``: which of
        out (0) or in (1) tensor parallelism splits (None: replicated)."""
        h, a = self.hidden, self.heads
        if self.attention == "mla":
            nope = self.head_dim - self.rope_dim
            q = ((self.q_lora, h, None), (a * self.head_dim, self.q_lora, 0)) if self.q_lora else \
                ((a * self.head_dim, h, 0),)
            return q + ((self.kv_lora + self.rope_dim, h, None), (a * (nope + self.v_dim), self.kv_lora, 0),
                        (h, a * self.v_dim, 1))
        q, kv = a * self.head_dim, self.kv_heads * self.head_dim
        return ((q + 2 * kv, h, 0), (h, q, 1))

    @property
    def kv_width(self) -> int:
        """Key plus value elements per token of one layer as the attention core reads them (MLA:
        decompressed per head)."""
        if self.attention == "mla":
            return self.heads * (self.head_dim + self.v_dim)
        return 2 * self.kv_heads * self.head_dim

    def attn_stash(self, tp: int = 1) -> float:
        """Elements per token one attention layer keeps for its backward beyond its normalized input
        (GEMM inputs and the core's q, k, v, out) on one of ``tp`` ranks."""
        if self.attention == "mla":
            lat = 2 * self.q_lora + 2 * self.kv_lora + self.rope_dim   # latents before/after their norms
            return lat + self.heads * (2 * self.head_dim + 2 * self.v_dim) / tp
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return (2 * q + 2 * kv) / tp

    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` attends through a sliding window."""
        return bool(self.sliding_window) and not (self.full_every and layer % self.full_every == self.full_every - 1)

    def attn_keys(self, seq_len: int) -> float:
        """Keys one query attends to, averaged over layers (sliding windows shorten some)."""
        if not self.sliding_window:
            return float(seq_len)
        slide = sum(self.is_sliding(i) for i in range(self.layers))
        return (slide * min(seq_len, self.sliding_window) + (self.layers - slide) * seq_len) / self.layers

    def core_flops(self, tokens: int, seq_len: int | None = None) -> float:
        """Forward FLOPs of one layer's QK^T and AV (full, no causal saving, as Megatron counts)."""
        keys = self.attn_keys(seq_len or self.seq_len)
        return float(2 * tokens * keys * self.heads * (self.head_dim + self.v_dim))

    # ---- FLOPs -------------------------------------------------------------------------------
    def attn_flops(self, tokens: int, seq_len: int | None = None) -> float:
        """Forward FLOPs of one layer's attention block for ``tokens`` tokens."""
        proj = sum(2 * tokens * o * i for o, i, _ in self.attn_matrices())
        return float(proj) + self.core_flops(tokens, seq_len)

    def _dense_mlp_flops(self, tokens: int) -> float:
        return float(2 * tokens * (3 if self.gated else 2) * self.hidden * self.ffn)

    def _moe_flops(self, tokens: int) -> float:
        mats = 3 if self.gated else 2
        routed = 2 * tokens * self.top_k * mats * self.hidden * self.expert_ffn
        shared = 2 * tokens * mats * self.hidden * self.shared_ffn
        router = 2 * tokens * self.hidden * self.experts
        return float(routed + shared + router)

    def mlp_flops(self, tokens: int) -> float:
        """Forward FLOPs of one layer's MLP or MoE block (routed top-k + shared + router), averaged
        over the layers when the first ``dense_layers`` are dense."""
        if not self.is_moe:
            return self._dense_mlp_flops(tokens)
        k = min(self.dense_layers, self.layers)
        return (k * self._dense_mlp_flops(tokens) + (self.layers - k) * self._moe_flops(tokens)) / self.layers

    def head_flops(self, tokens: int) -> float:
        """The output layer's forward FLOPs, with each multi-token-prediction module (its input
        projection, one block and a second pass through the shared head)."""
        out = 2 * tokens * self.hidden * self.vocab
        block = self.attn_flops(tokens) + (self._moe_flops(tokens) if self.is_moe else self._dense_mlp_flops(tokens))
        mtp = self.mtp_layers * (4 * tokens * self.hidden * self.hidden + block + out)
        return float(out + mtp)

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward = 3x forward), no recomputation."""
        fwd = self.layers * (self.attn_flops(1, seq_len) + self.mlp_flops(1)) + self.head_flops(1)
        return 3.0 * fwd

    def __str__(self) -> str:
        return f"{self.name} ({self.params / 1e9:.2f}B params)"


def _encode(obj: Any) -> dict:
    out: dict[str, Any] = {}
    for f in fields(obj):
        v = getattr(obj, f.name)
        if f.name == "tensors":
            v = [t.to_json() for t in v]
        elif isinstance(v, tuple):
            v = list(v)
        out[f.name] = v
    return out


def _decode(cls: type, obj: Mapping[str, Any]) -> Any:
    what = cls.__name__
    if not isinstance(obj, Mapping):
        raise ProgramError(f"a {what} is stored as a JSON object, got {type(obj).__name__}; recompile the plan")
    known = {f.name: f for f in fields(cls)}
    extra = sorted(set(obj) - set(known))
    if extra:
        raise ProgramError(f"{what} field(s) {', '.join(map(repr, extra))} are unknown to this parashift (written "
                           f"by a newer one); upgrade parashift or recompile the plan with this one")
    kw: dict[str, Any] = {}
    for name, f in known.items():
        if name not in obj:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ProgramError(f"{what} lacks field {name!r}; recompile the plan")
            continue
        v = obj[name]
        if name == "tensors":
            v = tuple(TensorSpec.from_json(t) for t in v)
        elif isinstance(v, list):
            v = tuple(v)
        kw[name] = v
    return cls(**kw)


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
        if spec.norm != "rms":
            add(f"{prefix}.bias", (width,), layer, region)

    def attn(p: str, i: int, region: str) -> None:
        norm(f"{p}.attn.norm", i, region)
        if spec.attention == "mla":
            names = (("q_a", "q_b") if spec.q_lora else ("q",)) + ("kv_a", "kv_b", "out")
            for n, (o, k, tdim) in zip(names, spec.attn_matrices()):
                add(f"{p}.attn.{n}.weight", (o, k), i, region, tp_dim=tdim)
                if n in ("q_a", "kv_a"):
                    norm(f"{p}.attn.{n}_norm", i, region, spec.q_lora if n == "q_a" else spec.kv_lora)
            return
        # fused QKV, grouped per KV head so an even TP split keeps whole groups
        add(f"{p}.attn.qkv.weight", (q + 2 * kv, h), i, region, tp_dim=0)
        if spec.bias or spec.qkv_bias:
            add(f"{p}.attn.qkv.bias", (q + 2 * kv,), i, region, tp_dim=0)
        if spec.qk_norm:
            add(f"{p}.attn.q_norm.weight", (d,), i, region)
            add(f"{p}.attn.k_norm.weight", (d,), i, region)
        if spec.attn_sinks:
            add(f"{p}.attn.sinks", (spec.heads,), i, region, tp_dim=0)
        add(f"{p}.attn.out.weight", (h, q), i, region, tp_dim=1)
        if spec.bias:
            add(f"{p}.attn.out.bias", (h,), i, region)

    def mlp(p: str, i: int, region: str, ffn: int) -> None:
        norm(f"{p}.norm", i, region)
        add(f"{p}.fc1.weight", (mats_in * ffn, h), i, region, tp_dim=0)
        if spec.bias:
            add(f"{p}.fc1.bias", (mats_in * ffn,), i, region, tp_dim=0)
        add(f"{p}.fc2.weight", (h, ffn), i, region, tp_dim=1)
        if spec.bias:
            add(f"{p}.fc2.bias", (h,), i, region)

    def moe(p: str, i: int, region: str) -> None:
        norm(f"{p}.moe.norm", i, region)
        e, f = spec.experts, spec.expert_ffn
        add(f"{p}.moe.router.weight", (e, h), i, region)
        if spec.bias or spec.router == "sigmoid":   # a router bias, or DeepSeek-V3's score-correction bias
            add(f"{p}.moe.router.bias", (e,), i, region)
        add(f"{p}.moe.experts.fc1", (e, mats_in * f, h), i, region, tp_dim=1, ep_dim=0)
        if spec.bias:
            add(f"{p}.moe.experts.fc1_bias", (e, mats_in * f), i, region, tp_dim=1, ep_dim=0)
        add(f"{p}.moe.experts.fc2", (e, h, f), i, region, tp_dim=2, ep_dim=0)
        if spec.bias:
            add(f"{p}.moe.experts.fc2_bias", (e, h), i, region, ep_dim=0)
        if spec.shared_ffn:
            add(f"{p}.moe.shared.fc1", (mats_in * spec.shared_ffn, h), i, region, tp_dim=0)
            add(f"{p}.moe.shared.fc2", (h, spec.shared_ffn), i, region, tp_dim=1)
            if spec.shared_gate:
                add(f"{p}.moe.shared.gate", (1, h), i, region)

    add("embed.word", (spec.vocab, h), -1, "embed", tp_dim=0, tied=spec.tied)
    if spec.pos_emb == "learned":
        add("embed.pos", (spec.seq_len, h), -1, "embed")
    mats_in = 2 if spec.gated else 1
    for i in range(spec.layers):
        p = f"layers.{i}"
        attn(p, i, "attn")
        if not spec.is_moe:
            mlp(f"{p}.mlp", i, "mlp", spec.ffn)
        elif i < spec.dense_layers:   # a dense layer of an MoE model: priced with the route region
            mlp(f"{p}.moe.dense", i, "moe", spec.ffn)
        else:
            moe(p, i, "moe")
    norm("head.norm", spec.layers, "head")
    if not spec.tied:
        add("head.out", (spec.vocab, h), spec.layers, "head", tp_dim=0)
    for k in range(spec.mtp_layers):   # DeepSeek-V3 MTP: norms of h and of the next token's embedding,
        p = f"mtp.{k}"                  # their joint projection, one block; embedding and head are shared
        norm(f"{p}.hnorm", spec.layers, "head")
        norm(f"{p}.enorm", spec.layers, "head")
        add(f"{p}.proj.weight", (h, 2 * h), spec.layers, "head", tp_dim=1)
        attn(p, spec.layers, "head")
        if spec.is_moe:
            moe(p, spec.layers, "head")
        else:
            mlp(f"{p}.mlp", spec.layers, "head", spec.ffn)
        norm(f"{p}.norm", spec.layers, "head")
    return tuple(T)


def _pad(n: int, multiple: int = 128) -> int:
    return -(-n // multiple) * multiple


def _whole(name: str, **nums: int) -> None:
    for k, v in nums.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise StrategyError(f"model {name!r}: {k}={v!r} must be a whole number >= 0 (0: none)")


def _check(name: str, **nums: int) -> None:
    for k, v in nums.items():
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise StrategyError(f"model {name!r}: {k}={v!r} must be a positive integer")


def gpt(layers: int, hidden: int, heads: int, kv_heads: int | None = None, ffn: int | None = None,
        vocab: int = 50257, seq_len: int = 2048, *, name: str = "custom-gpt", head_dim: int | None = None,
        gated: bool = True, bias: bool = False, qkv_bias: bool = False, norm: str = "rms",
        qk_norm: bool = False, pos_emb: str = "rope", tied: bool = False, dtype: str = "bf16",
        pad_vocab: int = 128, flash_attention: bool = True, dropout: float = 0.1, norm_eps: float = 1e-5,
        rope_theta: float = 10000.0, attention: str = "gqa", q_lora: int = 0, kv_lora: int = 0, rope_dim: int = 0,
        v_head_dim: int = 0, sliding_window: int = 0, full_every: int = 0, attn_sinks: bool = False,
        mtp_layers: int = 0, rope_scaling: str = "") -> ModelSpec:
    """A dense decoder. ``ffn`` defaults to 4*hidden, ``head_dim`` to hidden/heads (then ``heads`` must
    divide ``hidden``); the vocabulary is padded to ``pad_vocab``. ``attention="mla"`` is DeepSeek's
    latent attention (``kv_lora``, optional ``q_lora``, ``rope_dim`` of ``head_dim``, ``v_head_dim``)."""
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
    _whole(name, q_lora=q_lora, kv_lora=kv_lora, rope_dim=rope_dim, v_head_dim=v_head_dim,
           sliding_window=sliding_window, full_every=full_every, mtp_layers=mtp_layers)
    for key, v, ok in (("norm", norm, NORMS), ("attention", attention, ATTENTIONS)):
        if v not in ok:
            raise StrategyError(f"model {name!r}: {key}={v!r} is not one of {', '.join(ok)}")
    if attention == "mla":
        if not kv_lora or not 0 < rope_dim < head_dim or kv_heads != heads:
            raise StrategyError(f"model {name!r}: MLA needs kv_lora > 0, 0 < rope_dim < head_dim={head_dim} and "
                                f"kv_heads = heads; got kv_lora={kv_lora}, rope_dim={rope_dim}, kv_heads={kv_heads}")
    elif q_lora or kv_lora or rope_dim:
        raise StrategyError(f"model {name!r}: q_lora, kv_lora and rope_dim describe MLA; add attention='mla'")
    if not (float(norm_eps) > 0 and float(rope_theta) > 0):
        raise StrategyError(f"model {name!r}: norm_eps={norm_eps!r} and rope_theta={rope_theta!r} must be positive")
    spec = ModelSpec(name, layers, hidden, heads, kv_heads, head_dim, ffn, _pad(vocab, pad_vocab), seq_len,
                     gated=gated, bias=bias, qkv_bias=qkv_bias, norm=norm, qk_norm=qk_norm,
                     pos_emb=pos_emb, tied=tied, dtype=dtype, flash_attention=flash_attention,
                     dropout=float(dropout), norm_eps=float(norm_eps), rope_theta=float(rope_theta),
                     attention=attention, q_lora=q_lora, kv_lora=kv_lora, rope_dim=rope_dim, v_head_dim=v_head_dim,
                     sliding_window=sliding_window, full_every=full_every, attn_sinks=bool(attn_sinks),
                     mtp_layers=mtp_layers, rope_scaling=str(rope_scaling))
    return _with_tensors(spec)


def moe(layers: int, hidden: int, heads: int, kv_heads: int | None = None, ffn: int | None = None,
        vocab: int = 50257, seq_len: int = 2048, *, experts: int, top_k: int, expert_ffn: int,
        shared_ffn: int = 0, name: str = "custom-moe", dense_layers: int = 0, shared_gate: bool = True,
        router: str = "softmax", expert_groups: int = 0, group_top_k: int = 0, norm_topk: bool = False,
        **kw: object) -> ModelSpec:
    """A mixture-of-experts decoder: every layer's MLP is ``experts`` routed experts (top-k) plus
    an optional shared expert of width ``shared_ffn`` (gated by a sigmoid when ``shared_gate``),
    except the first ``dense_layers``, whose MLP is dense of width ``ffn``. ``expert_groups`` /
    ``group_top_k``: node-limited routing (each token's experts lie in at most that many groups);
    ``norm_topk``: a token's top-k routing weights are rescaled to sum to one."""
    _check(name, experts=experts, top_k=top_k, expert_ffn=expert_ffn)
    _whole(name, dense_layers=dense_layers, expert_groups=expert_groups, group_top_k=group_top_k)
    if router not in ROUTERS:
        raise StrategyError(f"model {name!r}: router={router!r} is not one of {', '.join(ROUTERS)}")
    if expert_groups and (experts % expert_groups or not 0 < group_top_k <= expert_groups):
        raise StrategyError(f"model {name!r}: expert_groups={expert_groups} must divide experts={experts} and "
                            f"group_top_k={group_top_k} lie in 1..{expert_groups}")
    if dense_layers and ffn is None:
        raise StrategyError(f"model {name!r}: dense_layers={dense_layers} needs ffn=... (the dense layers' width)")
    if isinstance(shared_ffn, bool) or not isinstance(shared_ffn, (int, np.integer)) or shared_ffn < 0:
        raise StrategyError(f"model {name!r}: shared_ffn={shared_ffn!r} must be a whole number >= 0 (0: no shared "
                            f"expert)")
    if top_k > experts:
        raise StrategyError(f"model {name!r}: top_k={top_k} exceeds experts={experts}")
    base = gpt(layers, hidden, heads, kv_heads, expert_ffn if ffn is None else ffn, vocab, seq_len, name=name, **kw)  # type: ignore[arg-type]
    spec = ModelSpec(**{**_fields(base), "experts": experts, "top_k": top_k, "expert_ffn": expert_ffn,
                        "shared_ffn": shared_ffn, "dense_layers": dense_layers, "shared_gate": bool(shared_gate),
                        "router": router, "expert_groups": expert_groups, "group_top_k": group_top_k,
                        "norm_topk": bool(norm_topk)})
    return _with_tensors(spec)


def _fields(spec: ModelSpec) -> dict:
    from dataclasses import fields as dc_fields
    return {f.name: getattr(spec, f.name) for f in dc_fields(spec) if f.name != "tensors"}


def _with_tensors(spec: ModelSpec) -> ModelSpec:
    object.__setattr__(spec, "tensors", _inventory(spec))
    return spec
