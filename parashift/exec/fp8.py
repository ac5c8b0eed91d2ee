"""FP8 GEMM numerics of a recipe (:mod:`parashift.fp8`) in the runtime.

On CPU a GEMM runs as quantize-dequantize: each operand is scaled, cast to ``torch.float8_e4m3fn``
(inputs and weights) or ``float8_e5m2`` (output gradients, backward) with saturation, cast back and
unscaled, and the product is taken in the working dtype; so the loss is the one FP8 tensor cores give
up to their accumulation order. On a GPU the forward runs through ``torch._scaled_mm`` on the FP8
operands with their inverse scales.

Delayed scaling: a tensor's scale is ``fp8_max / max(amax history)`` (1 before any history); every use
in a step records its amax, the Program's ``fp8.amax.c<chunk>`` all-reduce (:func:`reduce_amax`) takes
the chunk's amaxes to their MAX over its pipeline stage (TP shards and DP replicas then hold the global
amax, as a single process has), and :meth:`Fp8Gemms.end_step` pushes them into the history. One scale per
tensor and role (input, weight, output gradient); a stacked expert tensor shares one.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..errors import StrategyError
from ..fp8 import FP8_GEMMS, FP8_MAX, get as get_recipe
from ..models import ModelSpec
from ..strategy import Strategy
from .comm import Flight

__all__ = ["Fp8Gemms", "qdq", "reduce_amax", "DTYPES", "fp8_tensors"]

#: torch dtype of each FP8 format.
DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_ROLES = ("input", "weight", "grad")


def fp8_tensors(spec: ModelSpec) -> list[str]:
    """Names of the model's tensors whose GEMMs a recipe runs in FP8, in model order."""
    return [t.name for t in spec.tensors if 0 <= t.layer < spec.layers and t.name.endswith(FP8_GEMMS)]


def qdq(t: torch.Tensor, scale: float, fmt: str) -> torch.Tensor:
    """``t`` scaled, cast to FP8 ``fmt`` (saturating at its largest finite value), cast back and unscaled."""
    m = FP8_MAX[fmt]
    q = (t * scale).clamp_(-m, m).to(DTYPES[fmt])
    return q.to(t.dtype) * (1.0 / scale)


class Fp8Gemms:
    """One rank's FP8 GEMMs under ``recipe`` (scales, the step's amaxes, the amax history)."""

    def __init__(self, recipe: str, spec: ModelSpec, strategy: "Strategy | None" = None) -> None:
        """``strategy``: where the chunks' amax rows are (None: one chunk holds every layer)."""
        r = get_recipe(recipe)
        if r is None:
            raise StrategyError("Fp8Gemms needs an fp8 recipe, not 'none'")
        if not r.delayed:
            raise StrategyError(f"the runtime runs fp8=delayed; fp8={recipe} is priced by the simulator only "
                                f"(its per-cast amax reductions are not in the Program); use fp8=delayed to run it")
        self.recipe = r
        names = fp8_tensors(spec)
        self.index = {n: i for i, n in enumerate(names)}
        self.amax = torch.zeros(len(self.index), len(_ROLES), dtype=torch.float32)   # this step's, per use
        chunk = (strategy or Strategy()).layer_stages(spec.layers)
        layer = {t.name: t.layer for t in spec.tensors}
        self.rows: dict[int, tuple[int, int]] = {}            # chunk -> its rows of ``amax`` (model order)
        for i, n in enumerate(names):
            c = int(chunk[layer[n]])
            lo, _ = self.rows.get(c, (i, i))
            self.rows[c] = (lo, i + 1)
        self.history: list[torch.Tensor] = []

    def covers(self, name: str) -> bool:
        return name in self.index

    def scale(self, name: str, role: int) -> float:
        """The scale of ``name``'s ``role`` operand in this step (1 before any history, or for an amax of 0)."""
        if not self.history:
            return 1.0
        a = max(float(h[self.index[name], role]) for h in self.history)
        fmt = self.recipe.backward if role == 2 else self.recipe.forward
        return FP8_MAX[fmt] / a if a > 0 else 1.0

    def cast(self, t: torch.Tensor, name: str, role: int) -> torch.Tensor:
        """``t`` quantized and dequantized at its scale; its amax recorded for the next steps."""
        i = self.index[name]
        a = float(t.detach().abs().max()) if t.numel() else 0.0
        if a > self.amax[i, role]:
            self.amax[i, role] = a
        fmt = self.recipe.backward if role == 2 else self.recipe.forward
        return qdq(t.detach(), self.scale(name, role), fmt)

    def linear(self, x: torch.Tensor, w: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(y, xq)``: ``y = x @ w.T`` in FP8 (its backward casts the output gradient to E5M2 for both
        the input and, when ``w`` requires grad, the weight gradient) and the dequantized input a
        separate weight-gradient pass multiplies with."""
        xq, wq = self.cast(x, name, 0), self.cast(w, name, 1)
        return _Fp8Linear.apply(x, w, xq, wq, self, name), xq

    def end_step(self) -> None:
        """Push this step's amaxes (reduced by then) into the history and start the next step's."""
        self.history = (self.history + [self.amax.clone()])[-self.recipe.amax_history:]
        self.amax.zero_()


def reduce_amax(it: Any, p: Any) -> Flight:
    """The Program's ``fp8.amax.c<chunk>`` all-reduce: the chunk's amax rows to their MAX over the group."""
    lo, hi = it.fp8.rows[p.tag.chunk]
    w = dist.all_reduce(it.fp8.amax[lo:hi], op=dist.ReduceOp.MAX, group=p.group, async_op=True)
    return Flight(p.ins, p.ins.stream, [w])


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, xq, wq, g8: Fp8Gemms, name: str):  # type: ignore[override]
        ctx.g8, ctx.name = g8, name
        ctx.save_for_backward(xq, wq)
        if x.is_cuda:
            return _scaled_mm(x, w, g8, name)
        return torch.matmul(xq, wq.t())

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        xq, wq = ctx.saved_tensors
        g = ctx.g8.cast(dy, ctx.name, 2)
        dx = torch.matmul(g, wq) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dw = g.reshape(-1, g.shape[-1]).t() @ xq.reshape(-1, xq.shape[-1])
        return dx, dw, None, None, None, None


def _scaled_mm(x: torch.Tensor, w: torch.Tensor, g8: Fp8Gemms, name: str) -> torch.Tensor:
    """The forward GEMM on FP8 tensor cores: both operands cast at their scales, ``torch._scaled_mm``
    multiplies them and applies the inverse scales (dimensions multiples of 16, as the kernels need)."""
    fmt, m = DTYPES[g8.recipe.forward], FP8_MAX[g8.recipe.forward]
    sx, sw = g8.scale(name, 0), g8.scale(name, 1)
    x2 = x.detach().reshape(-1, x.shape[-1])
    a = (x2 * sx).clamp(-m, m).to(fmt)
    b = (w.detach() * sw).clamp(-m, m).to(fmt)
    inv = lambda s: torch.tensor(1.0 / s, dtype=torch.float32, device=x.device)  # noqa: E731
    y = torch._scaled_mm(a, b.t(), scale_a=inv(sx), scale_b=inv(sw), out_dtype=x.dtype)
    return y.reshape(*x.shape[:-1], w.shape[0])
