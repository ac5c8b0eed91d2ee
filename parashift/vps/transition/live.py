"""Planning a live job's switch: the devices' order (placement) and the lowered switch Program.

Every process of a live job calls :func:`plan_live_switch` with the same arguments and gets the
same Program (planning is deterministic), so nothing is negotiated. The Program is all a runtime
needs: :class:`SwitchPlanned` only adds the strategies and devices it was planned for.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from ... import cluster as _cluster
from ...ir.program import Program
from ...models import ModelSpec
from ...strategy import Strategy
from ..plan import plan_switch
from ...collectives import COLLECTIVE_OPS
from ...errors import PlanError
from .lower import lower
from .meta import SwitchMeta
from .staging import budget_array, check_fit, state_buffers

__all__ = ["SwitchPlanned", "plan_live_switch", "place", "live_cluster"]


@dataclass(frozen=True, eq=False)
class SwitchPlanned:
    """A lowered live switch: the Program and what it was planned for; ``staged``: old and new
    state exceed the budget, so old state is released stage by stage."""

    program: Program
    src: Strategy
    dst: Strategy
    src_devices: tuple[int, ...]
    dst_devices: tuple[int, ...]
    seconds: float
    staged: bool = False

    @cached_property
    def meta(self) -> SwitchMeta:
        """The Program's :class:`SwitchMeta` (decoded once)."""
        return SwitchMeta.of(self.program)

    @property
    def participants(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.src_devices) | set(self.dst_devices)))

    def collective_groups(self, device: int) -> list[tuple[int, ...]]:
        """Device tuples of the promoted collectives ``device`` takes part in (program order)."""
        rp = self.program.ranks.get(device)
        out: list[tuple[int, ...]] = []
        for ins in (rp.instrs() if rp is not None else ()):
            if ins.op in COLLECTIVE_OPS and tuple(ins.group) not in out:
                out.append(tuple(ins.group))
        return out


def live_cluster(devices, hosts: "tuple[int, ...] | None" = None,
                 base: "str | _cluster.Cluster" = "cpu-local") -> "_cluster.Cluster":
    """The worker processes of a live switch as a cluster holding every device id in ``devices``:
    one node, or with ``hosts`` (the host of each device id, index = id) a node per host, so that
    placement keeps ranks on their hosts and pieces come from a holder on the receiver's host.
    ``base``: the cluster whose devices and links price the switch (``cpu-local`` for gloo
    processes, a GPU preset such as ``h100-1x8`` for a job on GPUs); its node sizes are replaced."""
    top = max(devices) + 1
    clus = _cluster.get(base)
    if hosts is None:                   # one host: one node, however many processes it runs
        return clus if (top <= clus.per_node and clus.nodes == 1 and not clus.node_map) else clus.on_hosts([0] * top)
    if len(hosts) < top:
        raise PlanError(f"the host map covers devices 0-{len(hosts) - 1} but the switch uses device {top - 1}; "
                        f"give the host of every device id")
    return clus.on_hosts(list(hosts))


def plan_live_switch(spec: ModelSpec, src: "Strategy | str", dst: "Strategy | str", src_devices: tuple[int, ...],
                     dst_devices: tuple[int, ...], *, memory_budget=None, hosts: "tuple[int, ...] | None" = None,
                     cluster: "str | _cluster.Cluster" = "cpu-local", **options: Any) -> SwitchPlanned:
    """Plan and lower the switch of ``spec``'s live state (deterministic: every rank gets the same).
    ``hosts``: the host of each device id, ``cluster``: what prices it (see :func:`live_cluster`;
    hosts None: one host). ``options`` go to :func:`.lower` (its passes, ``cost_model``)."""
    t0 = time.perf_counter()
    devs = sorted(set(src_devices) | set(dst_devices))
    clus = live_cluster(devs, hosts, cluster)
    plan = plan_switch(spec, src, dst, cluster=clus, src_devices=list(src_devices), dst_devices=list(dst_devices))
    staged = memory_budget is not None and _over_budget(plan, memory_budget, devs)
    prog = lower(plan, clus, memory_budget=memory_budget, staged=staged, **options)
    return SwitchPlanned(prog, Strategy.parse(src), Strategy.parse(dst), tuple(src_devices), tuple(dst_devices),
                         time.perf_counter() - t0, staged)


def live_fit(spec: ModelSpec, src: "Strategy | str", dst: "Strategy | str", src_devices: tuple[int, ...],
             dst_devices: tuple[int, ...], device_memory: float, memory_budget=None,
             hosts: "tuple[int, ...] | None" = None, cluster: "str | _cluster.Cluster" = "cpu-local") -> dict:
    """:func:`.check_fit` of a live switch: whether its peak fits ``device_memory`` bytes a process,
    and the staging budget to use (``memory_budget`` when given, else the device's memory when
    one stage does not fit it; ``memory_budget`` None in the result: one stage)."""
    devs = sorted(set(src_devices) | set(dst_devices))
    plan = plan_switch(spec, src, dst, cluster=live_cluster(devs, hosts, cluster), src_devices=list(src_devices),
                       dst_devices=list(dst_devices))
    fit = check_fit(plan, device_memory, memory_budget)
    if fit["budget_auto"] and not fit["stages"]:
        fit["memory_budget"] = None      # no staging fits: planned in one stage, flagged not fitting
    return fit


def place(spec: ModelSpec, src: Strategy, dst: Strategy, src_devices: tuple[int, ...],
          dst_devices: tuple[int, ...], hosts: "tuple[int, ...] | None" = None,
          cluster: "str | _cluster.Cluster" = "cpu-local") -> tuple[int, ...]:
    """``dst_devices`` reordered so that the switch keeps the most state in place, each rank on a
    device of its given device's host (``hosts``, see :func:`live_cluster`; deterministic; the
    given order when it is already best)."""
    devs = sorted(set(src_devices) | set(dst_devices))
    return plan_switch(spec, src, dst, cluster=live_cluster(devs, hosts, cluster), src_devices=list(src_devices),
                       dst_devices=list(dst_devices), placement="keep").dst_devices


def _over_budget(plan, memory_budget, devs: list[int]) -> bool:
    """Whether some device's old and new states together exceed its budget."""
    buf = state_buffers(plan)
    bud = budget_array(memory_budget, max(devs) + 1)
    need = np.bincount(buf.dev, weights=(buf.old + buf.new).astype(float), minlength=len(bud))[:len(bud)]
    return any(need[d] > bud[d] for d in devs)
