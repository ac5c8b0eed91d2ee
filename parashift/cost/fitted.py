"""Cost-model knobs fitted on measurements, and how they map onto :class:`~parashift.cost.CostModel`.

``A100_VTRAIN`` was fitted by ``python benchmarks/vtrain_bench.py --fit`` on the fit half of vTrain's
1440 single-node A100 iterations (traces/vtrain-a100); that command rewrites the block below. The
presets of the ``a100`` family (A100 80GB and 40GB, A800; :mod:`parashift.gpus`) start from these
numbers, so every multi-node prediction on them uses a model fitted on one node only.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:  # pragma: no cover
    from .model import CostModel

__all__ = ["KNOBS", "A100_VTRAIN", "apply_knobs", "knobs_of"]

#: The fitted knobs: the shape model's largest-tile GEMM efficiency and short-k penalty (the sustained
#: ceiling ``gemm_sustained`` is not fitted: it comes from published A100 figures, see the A100's record in
#: :mod:`parashift.gpus`), the dispatch floor per layer
#: (split 5:3 between attention and MLP), the backward floor multiplier (a split backward's input and
#: weight halves take half of it each), the floor per micro-batch
#: (embedding + head), HBM bytes per unfused attention score element, the elementwise traffic scale,
#: and the fixed costs of an optimizer step, an NVLink ring step, a pipeline send/recv and a collective
#: (the send/recv cost is held at an earlier fit's value: one node's runs do not identify it, see
#: ``FROZEN`` in ``benchmarks/vtrain_bench.py``).
KNOBS = ("gemm_efficiency", "gemm_k_half", "layer_floor", "bwd_floor", "microbatch_floor",
         "attention_score_bytes", "elementwise_bytes", "optim_overhead", "intra_latency", "p2p_overhead",
         "comm_overhead")

# BEGIN FITTED (python benchmarks/vtrain_bench.py --fit)
A100_VTRAIN: dict[str, float] = {
    "gemm_efficiency": 0.9160777640493363,
    "gemm_k_half": 138.51245685780628,
    "layer_floor": 0.001043549368920998,
    "bwd_floor": 0.7234275617668741,
    "microbatch_floor": 0.0030547030729886518,
    "attention_score_bytes": 12.07503913021711,
    "elementwise_bytes": 0.845902269689237,
    "optim_overhead": 5e-08,
    "intra_latency": 9.891020962290635e-06,
    "p2p_overhead": 0.001641,
    "comm_overhead": 5e-08,
}
# END FITTED


def apply_knobs(base: "CostModel", knobs: Mapping[str, float]) -> "CostModel":
    """``base`` with the knobs of :data:`KNOBS` set (missing ones keep ``base``'s values)."""
    k = {**knobs_of(base), **knobs}
    layer, mb = float(k["layer_floor"]), float(k["microbatch_floor"])
    floor = {**base.region_floor, "attn": layer * 5 / 8, "mlp": layer * 3 / 8, "layer": layer,
             "embed": mb / 2, "head": mb / 2}
    return base.replace(gemm_efficiency=min(float(k["gemm_efficiency"]), 1.0), gemm_k_half=float(k["gemm_k_half"]),
                        region_floor=floor, phase_floor={**base.phase_floor, "bwd": float(k["bwd_floor"]),
                                                         "bwd_input": float(k["bwd_floor"]) / 2,
                                                         "bwd_weight": float(k["bwd_floor"]) / 2},
                        attention_score_bytes=float(k["attention_score_bytes"]),
                        elementwise_bytes=float(k["elementwise_bytes"]), optim_overhead=float(k["optim_overhead"]),
                        latency={**base.latency, "intra": float(k["intra_latency"])},
                        p2p_overhead=float(k["p2p_overhead"]), comm_overhead=float(k["comm_overhead"]))


def knobs_of(cm: "CostModel") -> dict[str, float]:
    """The values of :data:`KNOBS` in ``cm``."""
    f = cm.region_floor
    return {"gemm_efficiency": cm.gemm_efficiency, "gemm_k_half": cm.gemm_k_half,
            "layer_floor": f["attn"] + f["mlp"], "bwd_floor": cm.phase_floor["bwd"],
            "microbatch_floor": f["embed"] + f["head"], "attention_score_bytes": cm.attention_score_bytes,
            "elementwise_bytes": cm.elementwise_bytes, "optim_overhead": cm.optim_overhead,
            "intra_latency": cm.latency["intra"], "p2p_overhead": cm.p2p_overhead,
            "comm_overhead": cm.comm_overhead}
