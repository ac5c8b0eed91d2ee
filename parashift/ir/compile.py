"""``ir.compile``: model + strategy -> one validated-by-construction training-step Program.

The pipeline is a list of directives (see :func:`directives`), each a pure graph rewrite:
``Split(m)`` -> ``Split(backward)`` (zero-bubble schedules) -> ``Place`` -> ``Split(backward, keep_action)``
(``tp_async``: the weight halves the backward TP reduction overlaps) -> ``Shard(tp)`` (with
``sp``: reduce-scatter/all-gather) -> ``Shard(cp)`` (K/V ring) -> ``Shard(ep)`` -> ``Recompute`` -> ``Replicate(dp, zero)`` -> ``Stream`` (dualpipev: EP all-to-alls on
"comm") -> ``Order`` (the schedule) -> ``Fuse`` (tp == ep == 1), then :func:`scheduler.lower`.
The exact Program conventions are in :mod:`parashift.ir.conventions`.
"""
from __future__ import annotations

from typing import Callable

from ..errors import StrategyError
from ..cluster import Cluster
from ..models import ModelSpec
from ..strategy import Strategy
from .compile_directives import compile_preset
from .compile_graph import compile_graph
from .directives import Order
from .graph import Graph, paused_gc
from .memory import static_memory
from .program import Program
from .recipe import (MAX_CELLS, MAX_MICROBATCHES, check_size, directives, distributed_graph,
                     model_and_strategy, planning_costs, step_costs)
from .scheduler import lower
from .schedules import ScheduleCosts
from .step_meta import StepMeta

__all__ = ["compile", "directives", "distributed_graph", "planning_costs", "check_size", "MAX_MICROBATCHES",
           "MAX_CELLS"]


def compile(model: "str | ModelSpec | Graph", strategy: "str | Strategy", *, global_batch: int, seq_len: int | None = None,
            order: "Order | Callable[[Strategy, int], Order] | None" = None, validate: bool = False,
            costs: "ScheduleCosts | Cluster | str | None" = None, directives: "tuple | list" = ()) -> Program:
    """Compile one training step of ``model`` under ``strategy`` into a Program.

    ``model``: a preset name, a ModelSpec, or a traced region Graph (``annotate.trace``; see
    :mod:`parashift.ir.compile_graph`). ``global_batch``: sequences per step (``dp * mbs * m``);
    ``seq_len`` defaults to the model's.
    ``order``: a custom Order directive (or a function ``(strategy, m) -> Order``) replacing the
    schedule recipe. ``validate=True`` also runs :meth:`Program.validate`.
    ``costs``: the F/I/W durations zb-h1 and dualpipev are planned with (a
    :class:`~parashift.ir.schedules.ScheduleCosts`), or a cluster (name or Cluster) to estimate them
    for; None estimates them for :data:`~parashift.ir.costs.REFERENCE_CLUSTER`.
    ``directives``: the user's directives refining ``strategy`` (``parashift.directives``; see
    :mod:`parashift.ir.compile_directives`).
    """
    if isinstance(model, Graph):
        return compile_graph(model, strategy, global_batch=global_batch, order=order, validate=validate,
                             directives=directives)
    if directives:
        if order is not None:
            raise StrategyError("give the order as an Order directive in directives=, not also order=")
        return compile_preset(model, strategy, directives, global_batch=global_batch, seq_len=seq_len, costs=costs,
                              validate=validate)
    with paused_gc():
        return _compile(model, strategy, global_batch=global_batch, seq_len=seq_len, order=order, validate=validate,
                        costs=costs)


def _compile(model: "str | ModelSpec", strategy: "str | Strategy", *, global_batch: int, seq_len: int | None,
             order: "Order | Callable[[Strategy, int], Order] | None", validate: bool,
             costs: "ScheduleCosts | Cluster | str | None") -> Program:
    spec, s = model_and_strategy(model, strategy)
    s.validate(spec)
    seq = spec.seq_len if seq_len is None else seq_len
    m = s.num_microbatches(global_batch)
    if callable(order) and not isinstance(order, Order):
        order = order(s, m)
    g = distributed_graph(spec, s, global_batch=global_batch, seq_len=seq, order=order, costs=costs)
    meta = StepMeta.build(spec, s, global_batch=global_batch, seq_len=seq, microbatches=m).encode()
    # with communication on the compute stream FLOPs misjudge step times: order p2p pairs by durations
    timing = step_costs(spec, s, seq, costs).of if s.tp > 1 or s.ep > 1 or s.cp > 1 else None
    prog = lower(g, s, static_memory=static_memory(spec, s), meta=meta, step_time=timing)
    if validate:
        prog.validate()
    return prog
