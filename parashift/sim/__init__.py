"""Discrete-event simulation of Programs: time, memory, bubbles and timelines.

``simulate(program, cluster)`` interprets the same Program the runtime executes on a modeled
cluster (:class:`CostModel`); ``simulate_switch`` scores a switch Program;
``estimate_checkpoint_restart`` gives the checkpoint-reshard baseline.
"""
from .checkpoint import CheckpointRestart, StorageModel, estimate_checkpoint_restart
from ..cost import ALGORITHMS, LINK_CLASSES, CostModel, CostModelError, Phase, link_class, region_units, topology
from .result import TIMELINE_COLUMNS, SimResult, write_chrome_trace
from .simulate import SwitchSimResult, simulate, simulate_switch

__all__ = [
    "simulate", "simulate_switch", "SimResult", "SwitchSimResult", "TIMELINE_COLUMNS", "CostModel",
    "CostModelError", "Phase", "LINK_CLASSES", "ALGORITHMS", "link_class", "topology", "region_units",
    "estimate_checkpoint_restart", "StorageModel", "CheckpointRestart", "write_chrome_trace",
]
