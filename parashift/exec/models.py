"""tiny-gpt / tiny-moe in torch: deterministic initial values and the layers the regions use.

Global tensor layouts (the TensorSpecs of ``parashift.models`` are the source of truth for
names and shapes; these are the conventions for what the rows mean):

* ``attn.qkv.weight`` ``[q + 2*kv, h]``: grouped per KV head; group ``g`` holds ``r = heads/kv_heads``
  query heads, then its key head, then its value head (``(r + 2) * head_dim`` rows). An even TP
  split along dim 0 keeps whole groups.
* ``mlp.fc1.weight`` ``[2*ffn, h]`` (and ``moe.experts.fc1`` ``[E, 2*f, h]``, ``moe.shared.fc1``):
  gate and up rows interleaved (row ``2j`` = gate ``j``, row ``2j+1`` = up ``j``), so any even TP
  split keeps matching pairs.

Parameters do not require grad: a :class:`Tape` records each parameter use (input and output
of a linear or a scale) and the weight gradient is computed from the output gradient. This is
what makes split backward cheap (zb-h1, dualpipev): ``bwd_input`` keeps the output gradients,
``bwd_weight`` turns them into weight gradients with one matmul each, and the graph is never
walked twice. A full backward of a single-graph chunk (tp = 1, dense) hands the linears to
autograd instead: their forward uses *gradient leaves* (aliases of the parameters that require
grad, each ``.grad`` the parameter's gradient accumulator, listed in ``Tape.leaves``), so the
engine accumulates those weight gradients in place as it goes, with no Python per use; the norms'
follow from the output gradients the same backward keeps (autograd would stash the normalized input).
"""
from __future__ import annotations

import functools
import math
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from ..errors import StrategyError
from ..models import ModelSpec, TensorSpec
from ..strategy import Strategy

if TYPE_CHECKING:  # pragma: no cover
    from .fp8 import Fp8Gemms

__all__ = ["check_supported", "init_tensor", "Tape", "rms_norm", "rope_tables", "apply_rope", "swiglu",
           "INIT_STD"]

INIT_STD = 0.02
NORM_EPS = 1e-5


def check_supported(spec: ModelSpec, strategy: "Strategy | None" = None) -> None:
    """Raise StrategyError when ``spec`` uses a feature the runtime's torch model does not implement
    (``strategy``: checked by the strategy itself)."""
    bad = []
    for key, value, ok in (("attention", spec.attention, "gqa"), ("sliding_window", spec.sliding_window, 0),
                           ("attn_sinks", spec.attn_sinks, False), ("dense_layers", spec.dense_layers, 0),
                           ("mtp_layers", spec.mtp_layers, 0), ("router", spec.router, "softmax"),
                           ("expert_groups", spec.expert_groups, 0), ("rope_scaling", spec.rope_scaling, "")):
        if value != ok:
            bad.append(f"{key}={value!r} (use {ok!r})")
    if spec.shared_ffn and not spec.shared_gate:
        bad.append("an ungated shared expert (use shared_gate=True)")
    if spec.norm != "rms":
        bad.append(f"norm={spec.norm!r} (use 'rms')")
    if spec.pos_emb != "rope":
        bad.append(f"pos_emb={spec.pos_emb!r} (use 'rope')")
    if not spec.gated:
        bad.append("gated=False (use SwiGLU, gated=True)")
    if spec.bias:
        bad.append("linear biases beyond q/k/v (use bias=False; qkv_bias=True is supported)")
    if spec.tied and (spec.is_moe or (strategy is not None and strategy.pp > 1)):
        bad.append("tied embeddings with pp > 1 or experts (use tied=False)")
    if bad:
        raise StrategyError(f"the runtime cannot execute model {spec.name!r}: it uses " + ", ".join(bad)
                            + "; describe it with parashift.models.gpt/moe defaults or use tiny-gpt / tiny-moe")


def init_tensor(t: TensorSpec, layers: int, seed: int = 0) -> torch.Tensor:
    """Deterministic initial value of one global tensor (fp32), the same in every process.

    Norm weights are ones; output projections use std/sqrt(2*layers) (GPT-2 style); the rest N(0, std).
    """
    if t.name.endswith("norm.weight"):
        return torch.ones(t.shape)
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(t.name.encode())) % (2 ** 63))
    std = INIT_STD
    if t.name.endswith(("attn.out.weight", "fc2.weight", "experts.fc2", "shared.fc2")):
        std = INIT_STD / math.sqrt(2 * layers)
    return torch.randn(t.shape, generator=g) * std


@dataclass
class _Use:
    key: tuple[str, int | None]
    kind: str  # "lin" | "scale" | "bias" | "norm" (x: the norm's input; the normalized input is x * r)
    x: torch.Tensor
    y: torch.Tensor
    r: torch.Tensor | None = None   # "norm": the per-token reciprocal RMS ``[..., 1]``
    q: Callable[[torch.Tensor], torch.Tensor] | None = None   # FP8: the output gradient's cast (E5M2)


_NO_Y = torch.empty(0)


@dataclass
class Tape:
    """Parameter uses of one region forward; turns output gradients into weight gradients."""

    uses: list[_Use] = field(default_factory=list)
    leaves: list[torch.Tensor] = field(default_factory=list)   # the gradient leaves its linears used

    def linear(self, x: torch.Tensor, w: torch.Tensor, name: str, index: int | None = None,
               fp8: "Fp8Gemms | None" = None) -> torch.Tensor:
        """``x @ w.T`` (``w`` a gradient leaf: a backward that accumulates into leaves takes its gradient);
        in FP8 when ``fp8`` covers ``name`` (the weight gradient then multiplies the E5M2 output gradient
        with the FP8 input)."""
        if fp8 is not None and fp8.covers(name):
            y, xq = fp8.linear(x, w, name)
            self.uses.append(_Use((name, index), "lin", xq, y, q=lambda dy: fp8.cast(dy, name, 2)))
        else:
            y = torch.matmul(x, w.t())
            self.uses.append(_Use((name, index), "lin", x, y))
        if w.requires_grad:
            self.leaves.append(w)
        return y

    def scale(self, x: torch.Tensor, w: torch.Tensor, name: str) -> torch.Tensor:
        y = x * w
        self.uses.append(_Use((name, None), "scale", x, y))
        return y

    def norm(self, h: torch.Tensor, w: torch.Tensor, name: str, eps: float = NORM_EPS) -> torch.Tensor:
        """``rms_norm(h) * w`` keeping only ``h`` and its per-token reciprocal RMS for the weight
        gradient (as fused norms do: the normalized input is rebuilt from them in the backward, not stashed)."""
        r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        y = (h * r) * w
        self.uses.append(_Use((name, None), "norm", h, y, r.detach()))
        return y

    def bias(self, x: torch.Tensor, b: torch.Tensor, name: str) -> torch.Tensor:
        """``x + b`` (``b`` a gradient leaf: as :meth:`linear`); its gradient is the output gradient summed."""
        y = x + b
        self.uses.append(_Use((name, None), "bias", _NO_Y, y))
        if b.requires_grad:
            self.leaves.append(b)
        return y

    def record(self, x: torch.Tensor, name: str, index: int | None = None) -> None:
        """A linear use computed outside the tape (its output gradient is supplied to :meth:`weight_grads`)."""
        self.uses.append(_Use((name, index), "lin", x, torch.empty(0, requires_grad=True)))

    def outputs(self) -> list[torch.Tensor]:
        """Tensors whose gradients the backward must capture (those that are part of the graph)."""
        return [u.y for u in self.uses if u.y.requires_grad]

    def weight_grads(self, dys: list[torch.Tensor | None],
                     acc: Callable[[str, int | None], torch.Tensor], fused: bool = True) -> None:
        """Accumulate each parameter's gradient (from the captured output gradients) into ``acc(name, index)``
        (``fused``: see :func:`weight_grad`)."""
        live = [u for u in self.uses if u.y.requires_grad]
        for u, dy in zip(live, dys):
            weight_grad(u, dy, acc, fused)

    def hook_weight_grads(self, acc: Callable[[str, int | None], torch.Tensor], fired: list[int],
                          skip: torch.Tensor | None = None, fused: bool = True) -> int:
        """Have the next backward through this tape accumulate each parameter's gradient the moment
        its output gradient is computed (while it is in cache; it is not kept), except ``skip``'s;
        ``fired[0]`` counts the hooks that ran. Returns how many it set."""
        def hook(grads: tuple, use: _Use, k: int) -> None:
            fired[0] += 1
            weight_grad(use, grads[k], acc, fused)
        n = 0
        for u in self.uses:
            y = u.y
            if y.requires_grad and y is not skip:     # the hook holds a copy of the use without ``y`` (no cycle)
                y.grad_fn.register_prehook(functools.partial(hook, use=_Use(u.key, u.kind, u.x, _NO_Y, u.r, u.q),
                                                             k=y.output_nr))
                n += 1
        return n

    def clear(self) -> None:
        self.uses.clear()
        self.leaves.clear()


def weight_grad(u: _Use, dy: torch.Tensor | None, acc: Callable[[str, int | None], torch.Tensor],
                fused: bool = True) -> None:
    """Accumulate one parameter use's weight gradient from its output gradient ``dy``. ``fused``
    (the strategy's ``grad_fusion``): a linear's GEMM accumulates into the gradient buffer (``addmm_``);
    False: the GEMM writes a fresh gradient and a second pass adds it in."""
    if dy is None or dy.numel() == 0:
        return
    x = u.x.detach()
    g = acc(*u.key)
    if u.q is not None:
        dy = u.q(dy)
    if u.kind == "lin":
        accumulate_linear_grad(g, dy, x, fused)
    elif u.kind == "norm":
        g.add_((x * u.r).mul_(dy).reshape(-1, dy.shape[-1]).sum(0))
    elif u.kind == "bias":
        g.add_(dy.reshape(-1, dy.shape[-1]).sum(0))
    else:
        g.add_((dy * x).reshape(-1, dy.shape[-1]).sum(0))


def accumulate_linear_grad(g: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, fused: bool) -> None:
    """``g += dy^T x`` over every token: in the GEMM (``fused``) or as a GEMM then an add (always when
    ``g`` is an fp32 accumulator of a bf16 model)."""
    d2, x2 = dy.reshape(-1, dy.shape[-1]).t(), x.reshape(-1, x.shape[-1])
    if fused and g.dtype == d2.dtype:
        g.addmm_(d2, x2)
    else:
        g.add_(torch.mm(d2, x2))


def rms_norm(x: torch.Tensor, eps: float = NORM_EPS) -> torch.Tensor:
    """RMS-normalized ``x`` (no weight; the weight is a Tape scale)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope_tables(seq: int, dim: int, theta: float = 10000.0, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[seq, dim]`` for rotary embeddings (rotate-half form)."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    ang = torch.outer(torch.arange(seq, dtype=torch.float32, device=device), inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [b, heads, s, d]`` by position."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """SwiGLU of interleaved gate/up features ``[..., 2f] -> [..., f]``."""
    y = y.unflatten(-1, (-1, 2))
    return F.silu(y[..., 0]) * y[..., 1]
