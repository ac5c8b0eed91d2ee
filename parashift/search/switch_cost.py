"""What changing strategy costs: a simulated hot switch, or a checkpoint-restart estimate.

Both are callables ``cost(src, dst) -> SwitchCost`` on strategies; a strategy of world ``w``
runs on the cluster's first ``w`` devices (a shrink drops the highest device ids; a hot switch
may reorder them within each node), which is how the trace planner places every candidate.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..cluster import Cluster, get as get_cluster
from ..errors import MemoryBudgetError
from ..models import ModelSpec, get as get_model
from ..strategy import Strategy

__all__ = ["SwitchCost", "HotSwitchCost", "RestartCost"]


@dataclass(frozen=True)
class SwitchCost:
    """Seconds a change of strategy stops training, how they were obtained, and bytes moved."""

    seconds: float
    method: str
    bytes_moved: float = float("nan")


class RestartCost:
    """Checkpoint-restart: save under ``src``, restart the job, load under ``dst``
    (``sim.estimate_checkpoint_restart`` with its explicit storage and restart parameters)."""

    def __init__(self, model: "str | ModelSpec", cluster: "str | Cluster", storage: Any = None) -> None:
        self.model, self.cluster, self.storage = get_model(model), get_cluster(cluster), storage

    def __call__(self, src: Strategy, dst: Strategy) -> SwitchCost:
        from .. import sim
        kw = {} if self.storage is None else {"storage": self.storage}
        est = sim.estimate_checkpoint_restart(self.model, src, dst, self.cluster, **kw)
        return SwitchCost(float(est.total_seconds), "checkpoint-restart estimate", float(est.bytes_read))


class HotSwitchCost:
    """A hot switch in memory: ``vps.plan_switch`` -> ``vps.transition.lower`` -> ``sim.simulate_switch``.

    A switch whose staging cannot fit in memory falls back to ``fallback`` (checkpoint-restart
    by default). ``placement``: ``"keep"`` (as a live job does) orders the destination devices
    within each node to keep the most state in place; ``"given"``: rank i on device i.
    """

    def __init__(self, model: "str | ModelSpec", cluster: "str | Cluster", cost_model: Any = None,
                 fallback: "RestartCost | None" = None, placement: str = "keep") -> None:
        self.model, self.cluster, self.cost_model = get_model(model), get_cluster(cluster), cost_model
        self.fallback = fallback or RestartCost(self.model, self.cluster)
        self.placement = placement

    def __call__(self, src: Strategy, dst: Strategy) -> SwitchCost:
        from .. import sim, vps
        from ..vps.transition import lower
        src_dev, dst_dev = tuple(range(src.world)), tuple(range(dst.world))
        try:
            plan = vps.plan_switch(self.model, src, dst, cluster=self.cluster, src_devices=src_dev,
                                   dst_devices=dst_dev, placement=self.placement)
        except MemoryBudgetError as e:
            return self._fallback(src, dst, e)
        moved = float(plan.stats()["bytes_moved"])
        cm = self.cost_model or sim.CostModel.for_cluster(self.cluster)
        try:
            prog = lower(plan, self.cluster, cost_model=cm, memory_budget=cm.memory_capacity - cm.memory_reserved)
        except MemoryBudgetError as e:
            return self._fallback(src, dst, e)
        res = sim.simulate_switch(prog, self.cluster, cm)
        return SwitchCost(float(res.switch_time), "simulated switch program", moved)

    def _fallback(self, src: Strategy, dst: Strategy, why: Exception) -> SwitchCost:
        c = self.fallback(src, dst)
        return SwitchCost(c.seconds, f"{c.method} (hot switch does not fit in memory: {why})", c.bytes_moved)

