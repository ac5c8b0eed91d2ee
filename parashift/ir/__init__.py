"""The programmable half of parashift: training DAG, directives, schedules, scheduler, Program.

Importing ``parashift.ir`` never imports torch (``annotate`` loads it inside its functions).
"""
from __future__ import annotations

from .actions import Action, format_order, parse_order, stage_orders
from .compile import compile, directives, distributed_graph
from .compile_graph import compile_graph
from .directives import Fuse, Order, Place, Recompute, Replicate, Shard, Split, Stream, apply_all
from .graph import DATA, ORDER, SAVED, Graph
from .model_graph import model_graph
from .program import COMM_OPS, PHASES, Instr, Program, RankProgram
from .scheduler import lower
from .schedules import RECIPES, schedule_order, schedule_steps

__all__ = [
    "Action", "format_order", "parse_order", "stage_orders", "compile", "compile_graph", "directives", "distributed_graph",
    "Fuse", "Order", "Place", "Recompute", "Replicate", "Shard", "Split", "Stream", "apply_all",
    "DATA", "ORDER", "SAVED", "Graph", "model_graph", "COMM_OPS", "PHASES", "Instr", "Program",
    "RankProgram", "lower", "RECIPES", "schedule_order", "schedule_steps", "region", "annotate", "trace",
]


def __getattr__(name: str):
    if name in ("region", "annotate", "trace"):
        from . import annotate as _a
        return getattr(_a, name)
    raise AttributeError(f"module 'parashift.ir' has no attribute {name!r}")
