"""Shape-aware compute: a transformer region's time from its kernels' shapes.

A GEMM ``(m, n, k)`` is cut into output tiles (the best of a few shapes up to ``gemm_tile_m x
gemm_tile_n``, as a GEMM library picks one; smaller tiles run less efficiently); the tiles run in
waves of one tile per streaming multiprocessor, each wave as long as one tile's ``2 * tm * tn * k``
FLOPs at the tile's efficiency of an SM's share of the peak, stretched by ``(k + gemm_k_half) / k``
(a tile's prologue and epilogue: short reductions run below the ceiling), and never faster than
``gemm_sustained`` of the peak (the power limit: a GPU drawing its board power on dense math clocks
below the boost clock its peak is rated at). The GEMM is memory-bound
instead when reading its operands and writing its result through HBM takes longer
(``(mk + kn + mn) * dtype bytes / (hbm_bw * memory_efficiency)``), and every kernel pays
``gemm_overhead``. So small, skinny and badly quantized GEMMs (a TP shard of 1/8, a micro-batch of
one) are slower per FLOP than large ones, as measured on real GPUs.

Attention's core runs either fused (flash: ``4 * tokens * seq * heads * head_dim`` FLOPs at
``flash_efficiency`` of peak, backward 2.5x) or unfused (the two batched GEMMs of each head plus
``attention_score_bytes`` of HBM traffic per score element for scale, mask, softmax and dropout,
twice that backward). Norms, activations, dropout and residual adds stream their tensors through HBM
(``elementwise_bytes`` scales the modeled traffic); without sequence parallelism every TP rank
streams the whole ``tokens x hidden`` activations, which is what stops them shrinking with TP.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ..fp8 import get as fp8_recipe
from ..states import zero_stage

if TYPE_CHECKING:  # pragma: no cover
    from ..models import ModelSpec

__all__ = ["Workload", "ShapeKnobs", "gemm_time", "tiles", "KINDS", "TILE_FRACTIONS"]


class ShapeKnobs(Protocol):
    """The knobs the shape model reads: a :class:`~parashift.cost.model.CostModel` has them all, read-only (the
    cost model sits above this module and hands itself in)."""

    @property
    def peak_flops(self) -> float: ...
    @property
    def hbm_bw(self) -> float: ...
    @property
    def sms(self) -> int: ...
    @property
    def memory_efficiency(self) -> float: ...
    @property
    def gemm_efficiency(self) -> float: ...
    @property
    def gemm_sustained(self) -> float: ...
    @property
    def gemm_tile_m(self) -> int: ...
    @property
    def gemm_tile_n(self) -> int: ...
    @property
    def gemm_k_half(self) -> float: ...
    @property
    def gemm_overhead(self) -> float: ...
    @property
    def flash_efficiency(self) -> float: ...
    @property
    def attention_score_bytes(self) -> float: ...
    @property
    def elementwise_bytes(self) -> float: ...
    @property
    def grad_accum_traffic(self) -> float: ...
    def peak(self, dtype: str) -> float: ...


#: Region kinds the shape model knows (others fall back to FLOPs at ``gemm_efficiency``).
KINDS = ("embed", "attn", "mlp", "head", "layer")


#: The tile shapes a GEMM library picks among, as fractions of the largest (gemm_tile_m x gemm_tile_n).
TILE_FRACTIONS = ((1, 1), (2, 1), (2, 2), (4, 2))


def tiles(cm: ShapeKnobs) -> tuple[tuple[int, int, float], ...]:
    """Candidate tiles ``(tm, tn, efficiency)``: a smaller tile reuses each operand byte less, so it
    reaches ``gemm_efficiency`` times the square root of its arithmetic intensity over the largest's."""
    big_m, big_n = cm.gemm_tile_m, cm.gemm_tile_n
    top = big_m * big_n / (big_m + big_n)
    out = []
    for fm, fn in TILE_FRACTIONS:
        tm, tn = max(1, big_m // fm), max(1, big_n // fn)
        out.append((tm, tn, cm.gemm_efficiency * math.sqrt(tm * tn / (tm + tn) / top)))
    return tuple(out)


def _waves_time(cm: ShapeKnobs, batch: float, m: float, n: float, k: float, peak: float) -> float:
    """Compute-bound seconds of ``batch`` GEMMs ``(m, n, k)`` in one kernel, best tile of :func:`tiles`,
    at most ``gemm_sustained`` of ``peak`` on the FLOPs it does."""
    sms = max(1, cm.sms)
    best = math.inf
    for tm, tn, eff in tiles(cm):
        waves = math.ceil(batch * math.ceil(m / tm) * math.ceil(n / tn) / sms)
        best = min(best, waves * 2.0 * tm * tn * k / (peak / sms * eff) * (k + cm.gemm_k_half) / k)
    return max(best, batch * 2.0 * m * n * k / (peak * cm.gemm_sustained))


def gemm_time(cm: ShapeKnobs, m: float, n: float, k: float, dtype_bytes: int = 2, peak: float | None = None) -> float:
    """Seconds of one ``(m x k) @ (k x n)`` GEMM under ``cm``'s shape parameters."""
    return _batched_gemm(cm, 1, m, n, k, dtype_bytes, peak or cm.peak_flops)


def _batched_gemm(cm: ShapeKnobs, batch: float, m: float, n: float, k: float, db: int, peak: float) -> float:
    """A batch of equal GEMMs launched as one kernel: the tiles of all of them share the waves; the
    kernel is memory-bound instead when moving its operands and results through HBM takes longer."""
    if batch <= 0 or m <= 0 or n <= 0 or k <= 0:
        return 0.0
    t_mem = batch * (m * k + k * n + m * n) * db / (cm.hbm_bw * cm.memory_efficiency)
    return max(_waves_time(cm, batch, m, n, k, peak), t_mem) + cm.gemm_overhead


@dataclass
class Workload:
    """Per-region kernel times of one rank's micro-batch: ``model`` at ``mbs`` sequences of
    ``seq_len`` tokens under ``tp``-way tensor parallelism (``sp``: sequence parallelism shards the
    norms and dropouts over the TP group; ``cp``: context parallelism splits the sequence).
    ``recompute``: the strategy's recomputation; a ``selective`` recompute re-runs only the core
    attention's forward (Megatron-LM's selective recomputation), and nothing under ``cp > 1``,
    whose attention backward re-runs the core itself (TransformerEngine's context-parallel
    attention; this runtime's too). ``grad_fusion``: weight-gradient GEMMs accumulate into the gradient
    buffer (no separate accumulation pass, see :meth:`grad_accum`); so does ``zero`` >= 2, whose
    micro-batches each write a fresh gradient bucket. ``column_wgrad``
    (:attr:`~parashift.strategy.Strategy.column_wgrad`): an attention or MLP ``bwd_weight`` is only the
    column-parallel GEMM's weight gradient; ``bwd_input`` also computes the row-parallel one's."""

    model: "ModelSpec"
    tp: int
    mbs: int
    seq_len: int
    sp: bool = False
    cp: int = 1
    recompute: str = "full"
    grad_fusion: bool = False
    column_wgrad: bool = False
    zero: int = 0
    fp8: str = "none"
    _cache: dict = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, model: "ModelSpec", strategy: object, seq_len: int, mbs: int | None = None) -> "Workload":
        """The workload of a strategy (duck-typed: ``tp``, ``mbs``, optional ``sp``/``cp``/``recompute``/
        ``grad_fusion``/``column_wgrad``/``zero``)."""
        sp = getattr(strategy, "sp", False)
        return cls(model, int(getattr(strategy, "tp", 1)), int(mbs or getattr(strategy, "mbs", 1)), int(seq_len),
                   bool(sp) if not isinstance(sp, str) else sp not in ("", "0", "false", "none"),
                   int(getattr(strategy, "cp", 1) or 1), str(getattr(strategy, "recompute", "full") or "full"),
                   bool(getattr(strategy, "grad_fusion", False)), bool(getattr(strategy, "column_wgrad", False)),
                   int(getattr(strategy, "zero", 0) or 0), str(getattr(strategy, "fp8", "none") or "none"))

    @property
    def selective(self) -> bool:
        """Whether a recompute re-runs only the core attention (see the class docstring)."""
        return self.recompute == "selective"

    def time(self, cm: ShapeKnobs, kind: str, phase: str) -> float | None:
        """Seconds of one region of ``kind`` in ``phase`` (fwd, bwd, bwd_input, bwd_weight,
        recompute); None for a kind the shape model does not know (MoE)."""
        key = (id(cm), kind, phase)
        v = self._cache.get(key)
        if v is None and key not in self._cache:
            v = self._cache[key] = self._time(cm, kind, phase)
        return v

    # ---- internals ---------------------------------------------------------------------------
    def _time(self, cm: ShapeKnobs, kind: str, phase: str) -> float | None:
        if kind == "layer":
            if self.model.is_moe:
                return None
            a, b = self._time(cm, "attn", phase), self._time(cm, "mlp", phase)
            return None if a is None or b is None else a + b
        if kind not in KINDS or (kind == "mlp" and self.model.is_moe):
            return None
        gemms, core, ew = self._parts(cm, kind)
        if phase == "recompute" and self.selective:
            return core[0] if kind == "attn" and self.cp == 1 else 0.0
        dt = self._gemm_dt(cm, kind)
        cast_in, cast_dy = self._casts(cm, kind, gemms)
        if phase in ("fwd", "recompute"):
            return sum(gemm_time(cm, m, n, k, *dt) for m, n, k in gemms) + core[0] + ew + cast_in
        dgrad = sum(gemm_time(cm, m, k, n, *dt) for m, n, k in gemms)
        wgrads = [gemm_time(cm, n, k, m, *dt) for m, n, k in gemms]
        wgrad = sum(wgrads)
        early = sum(wgrads[1:]) if self.column_wgrad and kind in ("attn", "mlp") else 0.0   # row-parallel
        if phase == "bwd_weight":
            return wgrad - early
        rest = dgrad + cast_dy + core[1] + 2.0 * ew + early
        return rest if phase == "bwd_input" else rest + wgrad

    def grad_accum(self, cm: ShapeKnobs, kind: str) -> float:
        """Seconds of adding one micro-batch's weight gradients of a ``kind`` region into the step's
        gradient buffer (``grad_accum_traffic`` x dtype bytes per parameter on this rank, through HBM);
        0 under ``grad_fusion`` (the GEMM accumulates as it writes) and under ZeRO-2/3 (each micro-batch's
        gradients go to a bucket of their own, which its reduce-scatter adds into the rank's shard)."""
        if self.grad_fusion or zero_stage(self.zero).grad_buckets:
            return 0.0
        if kind == "layer":
            return self.grad_accum(cm, "attn") + self.grad_accum(cm, "mlp")
        md, tp = self.model, self.tp
        if kind == "mlp" and md.is_moe:
            return 0.0
        h = md.hidden
        attn = sum(o * i / (1 if split is None else tp) for o, i, split in md.attn_matrices())
        params = {"attn": attn, "mlp": (3 if md.gated else 2) * h * md.ffn / tp,
                  "head": md.vocab * h / tp, "embed": md.vocab * h / tp}.get(kind, 0)
        return params * cm.grad_accum_traffic * md.dtype_bytes / (cm.hbm_bw * cm.memory_efficiency)

    def fp8_weight_cast(self, cm: ShapeKnobs, kind: str) -> float:
        """Seconds of casting a ``kind`` region's FP8 GEMM weights on this rank, once per step (the first
        micro-batch's forward; later ones reuse the copies): read the BF16 weight, write its FP8 copy and
        transposed copy (current scaling reads it once more for its amax); 0 without an fp8 recipe."""
        r = fp8_recipe(self.fp8)
        if r is None:
            return 0.0
        if kind == "layer":
            return self.fp8_weight_cast(cm, "attn") + self.fp8_weight_cast(cm, "mlp")
        md, tp = self.model, self.tp
        if kind == "attn":
            n = sum(o * i / (1 if split is None else tp) for o, i, split in md.attn_matrices())
        elif kind == "mlp" and not md.is_moe:
            n = (3 if md.gated else 2) * md.hidden * md.ffn / tp
        else:
            return 0.0
        return n * self._cast_bytes(r) / (cm.hbm_bw * cm.memory_efficiency)

    def fp8_share(self, units: tuple) -> float:
        """The fraction of a region's FLOPs (``units``: kinds and counts) an fp8 recipe runs in FP8: the
        attention projections, dense MLPs, routed and shared experts; not the attention core, router, head
        or embedding (for the FLOPs rule, which prices what the shape model does not: MoE)."""
        if self.fp8 == "none":
            return 0.0
        md = self.model
        mats = 3 if md.gated else 2
        attn8 = sum(2 * o * i for o, i, _ in md.attn_matrices())
        if md.is_moe:
            mlp8 = 2 * mats * md.hidden * (md.top_k * md.expert_ffn + md.shared_ffn)
        else:
            mlp8 = 2 * mats * md.hidden * md.ffn
        attn, mlp = md.attn_flops(1, self.seq_len), md.mlp_flops(1)
        parts = {"attn": (attn8, attn), "mlp": (mlp8, mlp), "moe": (mlp8, mlp), "layer": (attn8 + mlp8, attn + mlp),
                 "head": (0.0, md.head_flops(1)), "embed": (0.0, 0.0)}
        f8 = sum(parts.get(k, (0.0, 0.0))[0] * n for k, n in units)
        total = sum(parts.get(k, (0.0, 0.0))[1] * n for k, n in units)
        return min(1.0, f8 / total) if total else 0.0

    def fp8_flops_casts(self, cm: ShapeKnobs, units: tuple, phase: str) -> float:
        """Seconds of the FP8 casts of the regions the FLOPs rule prices (MoE blocks, and the attention of a
        MoE model's whole layers): each expert GEMM's input forward (routed ones see ``top_k`` copies of
        each token, balanced over the EP ranks) and output gradient backward (input-gradient phase)."""
        md = self.model
        if self.fp8 == "none" or not md.is_moe or phase == "bwd_weight":
            return 0.0
        T = self.mbs * self.seq_len / self.cp
        gi = 2 if md.gated else 1
        per = self._cast_bytes(fp8_recipe(self.fp8)) / (cm.hbm_bw * cm.memory_efficiency)
        fwd = phase in ("fwd", "recompute")
        t = 0.0
        for k, n in units:
            if k in ("moe", "layer"):
                for tokens, f in ((T * md.top_k, md.expert_ffn / self.tp), (T, md.shared_ffn / self.tp)):
                    if f:
                        t += n * tokens * ((md.hidden + f) if fwd else (gi * f + md.hidden)) * per
            if k == "layer":
                cast_in, cast_dy = self._casts(cm, "attn", self._parts(cm, "attn")[0])
                t += n * (cast_in if fwd else cast_dy)
        return t

    def _fp8_kind(self, kind: str) -> bool:
        """Whether a region's GEMMs run in FP8 (attention projections and MLPs; never embedding or head)."""
        return self.fp8 != "none" and kind in ("attn", "mlp")

    def _gemm_dt(self, cm: ShapeKnobs, kind: str) -> tuple[int, float]:
        """(operand bytes, peak FLOP/s) of a region's GEMMs: FP8 under a recipe, else the model's dtype."""
        return (1, cm.peak("fp8")) if self._fp8_kind(kind) else self._dt(cm)

    def _cast_bytes(self, r) -> float:
        """HBM bytes per element of one FP8 cast of a 16-bit tensor: read it, write the FP8 copy (and the
        transposed one where the recipe keeps it); current scaling reads it once more for its amax."""
        return 2 + 1 + (1 if r.transpose else 0) + (2 if not r.delayed and not r.block else 0)

    def _casts(self, cm: ShapeKnobs, kind: str, gemms: list) -> tuple[float, float]:
        """Seconds of the FP8 casts of one micro-batch's GEMM inputs (forward) and output gradients
        (backward, E5M2) in a ``kind`` region; (0, 0) when its GEMMs are not FP8."""
        if not self._fp8_kind(kind):
            return 0.0, 0.0
        r = fp8_recipe(self.fp8)
        per = self._cast_bytes(r) / (cm.hbm_bw * cm.memory_efficiency)
        return sum(m * k for m, n, k in gemms) * per, sum(m * n for m, n, k in gemms) * per

    def _dt(self, cm: ShapeKnobs) -> tuple[int, float]:
        db = self.model.dtype_bytes
        return db, (cm.peak_flops if db == 2 else cm.peak_flops / 2)

    def _parts(self, cm: ShapeKnobs, kind: str) -> tuple[list, tuple[float, float], float]:
        """GEMM shapes ``(m, n, k)``, attention core (fwd, bwd) seconds and elementwise seconds."""
        md, tp = self.model, self.tp
        s = self.seq_len / self.cp
        T = self.mbs * s
        h, d = md.hidden, md.head_dim
        q, kv = md.heads * d, md.kv_heads * d
        db, peak = self._dt(cm)
        hbm = cm.hbm_bw * cm.memory_efficiency * 1.0
        row = T * h * db / (tp if self.sp else 1)         # one activation tensor per rank
        norm = 2 * row                                     # read x, write y
        bda = 3 * row + row / db                           # bias-dropout-add: 2 reads, 1 write, a byte mask
        ew_scale = cm.elementwise_bytes
        if kind == "attn":
            gemms = [(T, o / tp if split == 0 else o, i / tp if split == 1 else i) for o, i, split in md.attn_matrices()]
            heads = md.heads / tp
            if md.flash_attention:
                f = md.core_flops(T, self.seq_len) / tp / (peak * cm.flash_efficiency)
                core = (f, 2.5 * f)
            else:
                b = self.mbs * heads
                g = _batched_gemm(cm, b, s, self.seq_len, d, db, peak) + _batched_gemm(cm, b, s, d, self.seq_len, db, peak)
                sc = b * s * self.seq_len * cm.attention_score_bytes / hbm
                core = (g + sc, 2 * g + 2 * sc)
            rope = 0.0 if md.pos_emb != "rope" else 2 * T * (q + kv) / tp * db
            return gemms, core, ew_scale * (norm + bda + rope) / hbm
        if kind == "mlp":
            mats_in = 2 if md.gated else 1
            f = md.ffn / tp
            gemms = [(T, mats_in * f, h), (T, h, f)]
            act = T * f * db * (3 if md.gated else 2)
            return gemms, (0.0, 0.0), ew_scale * (norm + bda + act) / hbm
        if kind == "embed":
            return [], (0.0, 0.0), ew_scale * (T * h * db * (3 if md.pos_emb == "learned" else 2) + row / db) / hbm
        # head: final norm, the vocabulary GEMM and a fused cross-entropy over fp32 logits
        v = md.vocab / tp
        return [(T, v, h)], (0.0, 0.0), ew_scale * (norm + T * v * 4 * 2) / hbm
