"""Virtual parameter space: layouts of strategies as boxes, and switch plans between them."""
from . import boxes, placement
from .layout import Layout, Regions, layout
from .plan import DEFAULT_KINDS, SwitchPlan, plan_switch
from .tensors import KINDS, ZERO_STAGE

__all__ = ["boxes", "placement", "transition", "Layout", "Regions", "layout", "SwitchPlan", "plan_switch",
           "DEFAULT_KINDS", "KINDS", "ZERO_STAGE"]


def __getattr__(name: str):
    if name == "transition":  # the transition engine loads on first use
        import importlib
        return importlib.import_module(".transition", __name__)
    raise AttributeError(f"module 'parashift.vps' has no attribute {name!r}")
