"""parashift: explore, tune, deploy and hot-switch distributed training strategies.

``import parashift as ps`` reaches what notebooks need; heavy dependencies (torch,
optuna) load only when their subpackages are used.
"""
from __future__ import annotations

from . import cluster, fp8, gpus, models
from .cluster import Cluster
from .errors import (ClusterError, DeadlockError, DeviceListError, MemoryBudgetError, ParashiftError,
                     PlanError, ProgramError, RuntimeFailure, StrategyError, SwitchAborted,
                     TraceFormatError, UnknownGPUError, UnknownPresetError)
from .models import ModelSpec, TensorSpec
from .strategy import Strategy

__version__ = "0.1.0"

__all__ = [
    "cluster", "fp8", "gpus", "models", "Cluster", "ModelSpec", "TensorSpec", "Strategy",
    "ParashiftError", "UnknownPresetError", "UnknownGPUError", "StrategyError", "ClusterError", "DeviceListError",
    "PlanError", "MemoryBudgetError", "ProgramError", "DeadlockError", "TraceFormatError",
    "RuntimeFailure", "SwitchAborted", "region",
]

_LAZY = {"vps", "ir", "sim", "search", "exec", "replay", "traces", "calibrate", "demo", "explore", "plots",
         "directives"}


def __getattr__(name: str):
    import importlib
    if name in _LAZY:
        return importlib.import_module(f".{name}", __name__)
    if name == "region":
        from .ir.annotate import region
        return region
    raise AttributeError(f"module 'parashift' has no attribute {name!r}")
