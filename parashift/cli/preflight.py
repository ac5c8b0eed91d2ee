"""Checks `parashift run` makes before it starts processes, and the plan's prediction it reports after.

``preflight`` compares a Program with this machine: processes per CPU core, and the memory the
job needs (the simulator's peak per device, or the plan's predicted peak, plus a Python/torch
process each) against the memory available; it refuses with the fix unless forced.
``prediction`` reads what a deploy plan predicted and whether its cost model is the uncalibrated
default of the cluster the plan was searched for.
"""
from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

from ..errors import ParashiftError
from .limits import available_memory

if TYPE_CHECKING:  # pragma: no cover
    from ..ir.program import Program

__all__ = ["PreflightError", "preflight", "prediction", "available_memory", "MAX_PROCS_PER_CORE", "PROCESS_BYTES"]

#: processes per CPU core above which a local job is refused (gloo ranks spin while they wait)
MAX_PROCS_PER_CORE = 8
#: resident bytes of one idle worker (Python, torch and gloo loaded; measured ~290 MiB RSS, shared pages included)
PROCESS_BYTES = 256 * 2**20
#: share of the available memory a job may plan to use
MEMORY_SHARE = 0.8


class PreflightError(ParashiftError):
    """A job this machine cannot run (too many processes per core, or not enough memory)."""


def preflight(program: "Program", *, cores: int | None = None, memory: int | None = None,
              peak_per_device: float | None = None) -> dict[str, Any]:
    """Check that ``program`` can run on this machine; returns the figures, raises
    :class:`PreflightError` with the fix when it cannot. ``peak_per_device``: bytes per device
    (default: simulated on ``cpu-local``); ``cores``/``memory``: this machine's (default: measured)."""
    world = int(program.world)
    cores = int(cores or os.cpu_count() or 1)
    memory = int(memory if memory is not None else available_memory())
    if peak_per_device is None or not math.isfinite(peak_per_device):
        from ..cluster import get as get_cluster
        from ..sim import simulate
        here = get_cluster("cpu-local")
        here = here if world <= here.devices else here.with_devices(world)
        peak_per_device = float(simulate(program, here).peak_memory_max)
    need = world * (float(peak_per_device) + PROCESS_BYTES)
    out = {"processes": world, "cores": cores, "processes_per_core": world / cores,
           "memory_estimate": need, "memory_available": memory}
    from ..ir.step_meta import StepMeta
    model = StepMeta.of(program).name
    problems = []
    if world > MAX_PROCS_PER_CORE * cores:
        problems.append(f"{world} processes on {cores} cores ({world / cores:.1f} per core, limit "
                        f"{MAX_PROCS_PER_CORE})")
    if need > MEMORY_SHARE * memory:
        problems.append(f"about {_gib(need)} of memory ({world} x {_gib(peak_per_device)} simulated peak + "
                        f"{_gib(PROCESS_BYTES)} per process) with {_gib(memory)} available")
    if problems:
        raise PreflightError(
            f"this machine cannot run {model} on {world} processes: {'; '.join(problems)}; run a plan for fewer "
            f"devices (search --devices N, or --strategy with fewer ranks; --nprocs sets the count of a live "
            f"job), a smaller model (e.g. tiny-gpt), or pass --force to start anyway")
    return out


def prediction(program: "Program") -> dict[str, Any] | None:
    """What a deploy plan predicted: ``step_time`` (s), ``tokens_per_s``, ``peak_memory``, the
    ``cluster`` it was searched for and ``uncalibrated`` (its cost model is that cluster's
    datasheet default); None for a Program without a prediction."""
    deploy = program.meta.get("deploy") or {}
    pred = deploy.get("predicted") or {}
    if pred.get("step_time") is None:
        return None
    cluster = deploy.get("cluster")
    uncalibrated = None
    if cluster and isinstance(deploy.get("cost_model"), dict):
        from ..cluster import get as get_cluster
        from ..cost import CostModel
        default = CostModel.for_cluster(get_cluster(cluster)).to_json()
        uncalibrated = _same(deploy["cost_model"], default)
    return {"step_time": float(pred["step_time"]), "tokens_per_s": pred.get("tokens_per_s"),
            "peak_memory": pred.get("peak_memory"), "cluster": cluster, "uncalibrated": uncalibrated,
            "strategy": deploy.get("strategy")}


def _same(a: Any, b: Any) -> bool:
    """Equal JSON values, floats compared to 1e-9 relative."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0) or a == b
    return a == b


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"
