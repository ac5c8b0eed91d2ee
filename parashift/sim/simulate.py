"""Entry points: simulate a training-step Program or a switch Program."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Mapping, NamedTuple, Sequence

from ..cluster import Cluster, get as get_cluster
from ..errors import LimitError, ProgramError
from ..fp8 import check_gpu
from ..ir.graph import paused_gc
from ..ir.program import Program
from ..ir.step_meta import StepMeta, spec_of
from ..cost import CostModel
from .engine import Engine
from .result import SimResult

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from ..cost import Workload
    from ..models import ModelSpec

__all__ = ["simulate", "simulate_switch", "SwitchSimResult"]


def simulate(program: Program, cluster: "Cluster | str", cost_model: CostModel | None = None, *,
             devices: "Mapping[int, int] | Sequence[int] | None" = None, fold: bool = True,
             model: "ModelSpec | None" = None) -> SimResult:
    """Simulate one execution of ``program`` on ``cluster``.

    ``devices``: rank -> device (a mapping, or a list in rank order); rank i on device i by default.
    ``fold``: simulate symmetric ranks once (exact; turn off only to check it).
    ``model``: the program's model, for costs that need its shape (unfused attention); by default
    the model the Program carries (its :class:`~parashift.ir.step_meta.StepMeta`), if any.
    """
    if not isinstance(program, Program):
        raise ProgramError(f"simulate() needs a parashift Program, got {type(program).__name__}; "
                           f"build one with parashift.ir.compile(...)")
    cluster = get_cluster(cluster)
    s = program.strategy
    if s is not None and s.fp8 != "none":
        check_gpu(s.fp8, cluster.gpu)
    cost = cost_model if cost_model is not None else CostModel.for_cluster(cluster)
    shape = _shape(program, model)
    scores = _scores_per_layer(program, shape) if cost.attention_score_bytes else 0.0
    with paused_gc():   # millions of short-lived acyclic objects: collecting would only rescan the heap
        raw = Engine(program, cluster, cost, devices, fold, scores, _workload(program, shape)).run()
        res = SimResult.from_raw(program, cluster, cost, raw)
    if not math.isfinite(res.step_time):
        raise LimitError(f"the simulated step time is {res.step_time}: a rate of the cost model or cluster is near "
                         f"zero or a latency near infinity; check their numbers and units")
    return res


class _Shape(NamedTuple):
    model: "ModelSpec"
    seq_len: "int | None"
    mbs: "int | None"


def _shape(program: Program, model: "ModelSpec | None") -> "_Shape | None":
    """The program's model with its sequence length and micro-batch size (None when the Program
    carries no model and none is given): a training step's from its StepMeta, a rollout's spec from
    its meta; ``model`` overrides the spec."""
    step = StepMeta.maybe(program)
    if step is not None:
        spec, seq, mbs = step.model, step.seq_len, step.mbs
    else:       # a rollout or a hand-made Program: its own numbers, when it has them
        spec, seq, mbs = spec_of(program.meta), program.meta.get("seq_len"), program.meta.get("mbs")
    spec = model if model is not None else spec
    return None if spec is None else _Shape(spec, seq, mbs)


def _workload(program: Program, shape: "_Shape | None") -> "Workload | None":
    """Kernel shapes of the program's micro-batch (None without a known model or strategy, and for a
    rollout Program: a decode step attends to a cache the training shapes do not describe, so its
    instructions are priced by their own FLOPs and bytes)."""
    from ..cost import Workload
    s = program.strategy
    if program.meta.get("kind") == "rollout" or shape is None or s is None:
        return None
    model, seq, mbs = shape
    return Workload.of(model, s, seq or model.seq_len, mbs)


def _scores_per_layer(program: Program, shape: "_Shape | None") -> float:
    """Attention score elements of one layer on one rank: mbs x heads/tp x seq^2 (0 if unknown)."""
    if shape is None:
        return 0.0
    model, seq, mbs = shape
    s = program.strategy
    seq = seq or model.seq_len
    mbs = mbs or (s.mbs if s else 1)
    tp = s.tp if s else 1
    return float(mbs) * model.heads / tp * float(seq) ** 2


@dataclass(frozen=True)
class SwitchSimResult:
    """A simulated switch: its duration, bytes per link class, peak memory per device, and what
    the switch Program says it moves and keeps (its decoded ``SwitchMeta``)."""

    switch_time: float
    link_bytes: Mapping[str, float]
    peak_memory: Mapping[int, int] = field(repr=False)
    fits: bool
    sim_seconds: float
    result: SimResult = field(repr=False)
    bytes_moved: int | None = None      # None: a hand-made Program without switch metadata
    bytes_kept: int | None = None
    stages: int = 1

    @property
    def peak_memory_max(self) -> int:
        return max(self.peak_memory.values()) if self.peak_memory else 0

    @property
    def timeline(self) -> "pd.DataFrame":
        return self.result.timeline

    def summary(self) -> dict:
        return {"switch_seconds": self.switch_time, "bytes_local": self.link_bytes["local"],
                "bytes_intra": self.link_bytes["intra"], "bytes_inter": self.link_bytes["inter"],
                "peak_memory_max": self.peak_memory_max, "fits": self.fits, "sim_seconds": self.sim_seconds,
                "bytes_moved": self.bytes_moved, "bytes_kept": self.bytes_kept, "stages": self.stages}


def simulate_switch(program: Program, cluster: "Cluster | str", cost_model: CostModel | None = None, *,
                    devices: "Mapping[int, int] | Sequence[int] | None" = None) -> SwitchSimResult:
    """Simulate a switch Program (ranks are devices unless ``devices`` maps them); its time is the
    Program's plus the cost model's ``switch_overhead``. A lowered switch's metadata (read through
    its codec, ``vps.transition.SwitchMeta``) gives the bytes it moves and keeps."""
    res = simulate(program, cluster, cost_model, devices=devices)
    out = SwitchSimResult(res.step_time + res.cost_model.switch_overhead, res.link_bytes, res.peak_memory, res.fits,
                          res.sim_seconds, res)
    if program.meta.get("kind") != "switch":
        return out
    from ..vps.transition.meta import SwitchMeta
    meta = SwitchMeta.of(program)
    return replace(out, bytes_moved=meta.bytes_moved, bytes_kept=meta.bytes_kept, stages=meta.stages)
