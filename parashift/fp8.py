"""FP8 training recipes (TransformerEngine's and torchao's): what runs in FP8, how it is scaled, what
it costs in memory, and which GPUs can run it. Plain data below ``strategy``, ``cost``, ``ir`` and
``exec``; every layer reads these records.

A recipe runs the transformer's GEMMs (QKV, attention output, MLP fc1/fc2, expert GEMMs; not the
attention core, the embedding or the head) in FP8 in the *hybrid* format: activations and weights
in E4M3 forward, gradients in E5M2 backward; everything else stays BF16 and the master weights and
optimizer states FP32. Scaling:

* ``delayed`` (TransformerEngine's ``DelayedScaling``): a tensor's scale for step ``t`` is
  ``fp8_max / max(amax history)``, the history holding the amaxes of the ``amax_history`` steps
  before ``t`` (scale 1 before any); each step's amaxes are max-reduced over the ranks that share
  the stage's tensors (the TP group, and the data-parallel ranks so all replicas quantize alike) by
  one small all-reduce per chunk at the end of the step.
* ``current`` (``Float8CurrentScaling``, torchao's tensorwise): the scale comes from the tensor's own
  amax as it is cast (an extra read of the tensor; a TP-sharded tensor's amax is max-reduced over
  the TP group before its cast).
* ``mx`` (``MXFP8BlockScaling``): one power-of-two scale per 32 consecutive elements, which only
  Blackwell tensor cores (B200, GB200) apply in the GEMM; no amax reduction.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import ClusterError, StrategyError
from .gpus import GPU, GPUS

__all__ = ["Fp8Recipe", "RECIPES", "NAMES", "FP8_MAX", "get", "check_gpu", "fp8_gpus", "FP8_GEMMS"]

#: Largest finite value of each FP8 format (OCP FP8: E4M3 without infinities, E5M2 IEEE-like).
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}

#: The linear layers a recipe runs in FP8 (weight-name suffixes of ``parashift.models`` tensors).
FP8_GEMMS = ("attn.qkv.weight", "attn.out.weight", "mlp.fc1.weight", "mlp.fc2.weight",
             "experts.fc1", "experts.fc2", "shared.fc1", "shared.fc2")


@dataclass(frozen=True)
class Fp8Recipe:
    """One FP8 recipe. ``block``: elements per scale (0: one scale per tensor); ``amax_history``: steps of
    amax a delayed scale looks back over (0: current scaling); ``transpose``: whether the GEMMs keep a
    transposed FP8 copy of each operand for the backward (Hopper's FP8 tensor cores take only the
    row-major layout, so weight and input are cast twice; MX casts both ways as well, each with its own
    block scales); ``needs``: the GPU rate the recipe requires (``fp8``, ``fp4`` for Blackwell's MX units)."""

    name: str
    forward: str = "e4m3"
    backward: str = "e5m2"
    block: int = 0
    amax_history: int = 0
    transpose: bool = True
    needs: str = "fp8"

    @property
    def delayed(self) -> bool:
        return self.amax_history > 0

    @property
    def reduces_amax(self) -> bool:
        """Whether the step all-reduces amaxes (per-tensor scaling; MX's block scales are local)."""
        return self.block == 0

    def scale_bytes(self, elements: float) -> float:
        """Bytes of the scales of an FP8 tensor of ``elements`` (one E8M0 byte per block; per tensor: 4)."""
        return elements / self.block if self.block else 4.0


#: The recipes by the name a strategy's ``fp8`` key takes.
RECIPES: dict[str, Fp8Recipe] = {r.name: r for r in (
    Fp8Recipe("delayed", amax_history=16),
    Fp8Recipe("current"),
    Fp8Recipe("mx", block=32, needs="fp4"),
)}
NAMES = ("none",) + tuple(RECIPES)


def get(name: str) -> "Fp8Recipe | None":
    """The recipe named ``name`` (None for ``none``)."""
    if name == "none":
        return None
    r = RECIPES.get(name)
    if r is None:
        raise StrategyError(f"unknown fp8 recipe {name!r}; use one of {', '.join(NAMES)} (bare 'fp8' is delayed)")
    return r


def fp8_gpus(needs: str = "fp8") -> list[str]:
    """GPU kinds whose records have ``needs`` units (``fp8``; ``fp4``: the Blackwell parts with MX scaling)."""
    return [name for name, g in GPUS.items() if name != "cpu" and g.has(needs)]


def check_gpu(name: str, gpu: GPU) -> None:
    """Raise when recipe ``name`` cannot run on ``gpu`` (no FP8 tensor cores; MX without Blackwell's)."""
    r = get(name)
    if r is None or gpu.has(r.needs) or gpu.family == "cpu":
        return
    what = "MX (32-element block) scaling" if r.block else "FP8 GEMMs"
    raise ClusterError(f"fp8={name}: {gpu.name} has no {what}; run it on {', '.join(fp8_gpus(r.needs))}"
                       + (", or use fp8=delayed|current" if r.block and gpu.has("fp8") else ", or drop fp8"))
