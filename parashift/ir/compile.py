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

from .. import models as _models
from ..errors import StrategyError
from ..cluster import Cluster
from ..models import ModelSpec
from ..strategy import Strategy
from .directives import TP_BWD_KINDS, Fuse, Order, Place, Recompute, Replicate, Shard, Split, Stream, apply_all
from .graph import Graph, paused_gc
from .memory import (OPTIM_FLOPS_PER_ELEMENT, chunk_params, optimizer_elements, recompute_bytes, region_activation,
                     region_state_bytes, static_memory)
from .model_graph import core_attention_flops, model_graph
from .program import Program
from .scheduler import lower
from .costs import estimate_costs
from .schedules import ScheduleCosts, get_schedule, schedule_order

__all__ = ["compile", "directives", "distributed_graph", "planning_costs", "MAX_MICROBATCHES", "MAX_CELLS"]

#: Micro-batches one step may have per pipeline: 32x the most a published LLM recipe accumulates
#: (Megatron's 1T GPT: 512); beyond it a Program takes minutes to build and says nothing new.
MAX_MICROBATCHES = 65_536
#: Region x micro-batch cells one step may have (Megatron's 1T GPT: 130 x 512 = 66,560, 7 s to compile).
MAX_CELLS = 1_000_000


def check_size(regions: int, m: int, s: Strategy, global_batch: int) -> None:
    """Refuse a step too large to compile in reasonable time (:data:`MAX_MICROBATCHES`, :data:`MAX_CELLS`),
    naming the fix, before any work."""
    fix = f"lower the global batch ({global_batch:,}) or raise mbs ({s.mbs}) or dp ({s.dp})"
    if m > MAX_MICROBATCHES:
        raise StrategyError(f"{m:,} micro-batches per step exceed the limit of {MAX_MICROBATCHES:,}; {fix}")
    if regions * m > MAX_CELLS:
        raise StrategyError(f"{regions} regions x {m:,} micro-batches = {regions * m:,} cells exceed the limit of "
                            f"{MAX_CELLS:,}; {fix}")


def _resolve(model: "str | ModelSpec", strategy: "str | Strategy") -> tuple[ModelSpec, Strategy]:
    return _models.get(model), Strategy.parse(strategy)


def _costs(spec: ModelSpec, s: Strategy, seq_len: int, costs: "ScheduleCosts | Cluster | str | None") -> ScheduleCosts:
    """The durations the list-scheduled recipes plan with (given, or estimated for a cluster)."""
    if isinstance(costs, ScheduleCosts):
        return costs
    return estimate_costs(spec, s, seq_len, costs)


def planning_costs(spec: ModelSpec, s: Strategy, seq_len: int,
                   costs: "ScheduleCosts | Cluster | str | None" = None) -> "ScheduleCosts | None":
    """The durations :func:`compile` plans ``s``'s schedule with, or None for a fixed recipe.

    The schedule's registry record decides: ``costs="always"`` (zb-h1) plans with durations,
    ``"given"`` (dualpipev, whose F&I pairing already hides the communication the estimate would
    weigh) only with durations the caller passes."""
    mode = get_schedule(s.schedule).costs
    if mode == "always" or (mode == "given" and costs is not None):
        return _costs(spec, s, seq_len, costs)
    return None


def directives(model: "str | ModelSpec", strategy: "str | Strategy", *, global_batch: int, seq_len: int,
               order: "Order | None" = None, costs: "ScheduleCosts | Cluster | str | None" = None) -> list:
    """The directive recipe for ``strategy`` (pass ``order`` to replace the schedule's Order;
    ``costs``: durations for zb-h1/dualpipev, or the cluster to estimate them for, see :func:`compile`)."""
    spec, s = _resolve(model, strategy)
    m = s.num_microbatches(global_batch)
    if seq_len < 1:
        raise StrategyError(f"seq_len={seq_len} must be positive")
    if s.cp > 1 and seq_len % (2 * s.cp):
        raise StrategyError(f"cp={s.cp} needs seq_len={seq_len} to be a multiple of 2*cp={2 * s.cp}; change cp or seq_len")
    if spec.pos_emb == "learned" and seq_len > spec.seq_len:
        raise StrategyError(f"{spec.name} learns positions for {spec.seq_len} tokens and cannot take sequences of "
                            f"{seq_len}; use a sequence length of at most {spec.seq_len}")
    if s.sp and (seq_len // s.cp) % s.tp:
        raise StrategyError(f"sp splits each rank's {seq_len // s.cp} tokens of a sequence over tp={s.tp} ranks and "
                            f"needs them to be a multiple of tp; change seq_len, tp or cp, or drop sp")
    tokens = s.mbs * seq_len // s.cp            # tokens one rank holds per micro-batch
    db = spec.dtype_bytes
    act_msg = tokens * spec.hidden * db
    kv_block = 2 * tokens * spec.kv_heads * spec.head_dim // s.tp * db
    cp = chunk_params(spec, s)
    opt_el = optimizer_elements(spec, s)
    opt_bytes_per_el = spec.kind_bytes("param") + spec.kind_bytes("grad") + 2 * 3 * 4 if spec.dtype != "fp32" \
        else 4 + 4 + 2 * 2 * 4
    chunk_stage = tuple(int(x) for x in [s.chunk_rank_stage(c) for c in range(s.stages)])
    rc_bytes = {k: recompute_bytes(spec, k, mbs=s.mbs, seq_len=seq_len, tp=s.tp, recompute=s.recompute, sp=s.sp,
                                   cp=s.cp)
                for k in ("attn", "mlp", "moe.route", "moe.experts", "moe.combine", "head")}
    sched = get_schedule(s.schedule)
    out: list = [Split(microbatches=m)]
    if sched.split_backward:
        out.append(Split(backward=True))
    out.append(Place(tuple(int(x) for x in s.layer_stages(spec.layers)), chunk_stage, act_msg // (s.tp if s.sp else 1),
                     tuple((OPTIM_FLOPS_PER_ELEMENT * e, e * opt_bytes_per_el) for e in opt_el),
                     vshape=sched.vshape))
    if s.tp_async and not sched.split_backward:   # the weight gradients the TP reduction overlaps, in the B action
        out.append(Split(backward=True, kinds=TP_BWD_KINDS, keep_action=True))
    out += [
        Shard("tp", s.tp, act_msg, stats_bytes=3 * tokens * 4 * s.tp, sp=s.sp, async_bwd=s.tp_async),
        Shard("cp", s.cp, kv_block),
    ]
    if spec.is_moe:
        out.append(Shard("ep", s.ep, tokens * spec.top_k * spec.hidden * db))
    out.append(Recompute(s.recompute, core_attention_flops(spec, s.mbs * seq_len, seq_len) / s.tp / s.cp, rc_bytes))
    pb, gb = spec.kind_bytes("param"), spec.kind_bytes("grad")
    grad_dense = cp.dense if s.ep > 1 else cp.total()
    out.append(Replicate(s.zero_ways, s.zero, tuple(int(x) * pb for x in (cp.dense if s.ep > 1 else cp.total())),
                         tuple(int(x) * pb for x in (cp.expert if s.ep > 1 else cp.expert * 0)),
                         tuple(int(x) * gb for x in grad_dense), tuple(int(x) * gb for x in cp.expert),
                         ep=s.ep, tied_bytes=cp.tied * gb, axis=s.zero_axis, overlap=s.overlap_grad,
                         buckets=region_state_bytes(spec, s) if s.zero >= 2 or s.overlap_param else (),
                         replicas=s.dp_replicas, overlap_param=s.overlap_param))
    if sched.hides_ep_comm and s.ep > 1:
        out.append(Stream("comm", ops=("all_to_all",), tag_prefix="ep."))
    out.append(order if order is not None else schedule_order(s, m, planning_costs(spec, s, seq_len, costs)))
    if s.tp == 1 and s.ep == 1 and s.cp == 1 and not ((s.zero >= 2 or s.overlap_param) and not spec.is_moe):
        # ZeRO-2/3 and overlap_param: region buckets
        out.append(Fuse())
    return out


def distributed_graph(model: "str | ModelSpec", strategy: "str | Strategy", *, global_batch: int, seq_len: int,
                      order: "Order | None" = None, costs: "ScheduleCosts | Cluster | str | None" = None) -> Graph:
    """The ordered distributed DAG (before lowering), for inspection."""
    spec, s = _resolve(model, strategy)
    g = _base(spec, s, seq_len)
    check_size(len(g), s.num_microbatches(global_batch), s, global_batch)
    return apply_all(g, directives(spec, s, global_batch=global_batch, seq_len=seq_len, order=order, costs=costs))


def _base(spec: ModelSpec, s: Strategy, seq_len: int) -> Graph:
    g = model_graph(spec, mbs=s.mbs, seq_len=seq_len)
    c = g.cols
    for i in range(len(g)):
        c["act"][i] = region_activation(spec, c["kind"][i], mbs=s.mbs, seq_len=seq_len, tp=s.tp,
                                        recompute=s.recompute, sp=s.sp, cp=s.cp)
        c["nbytes"][i] = int(c["params"][i] // s.tp + 2 * s.mbs * seq_len // s.cp * spec.hidden * spec.dtype_bytes)
    return g


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
        from .compile_graph import compile_graph
        return compile_graph(model, strategy, global_batch=global_batch, order=order, validate=validate,
                             directives=directives)
    if directives:
        from .compile_directives import compile_preset
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
    spec, s = _resolve(model, strategy)
    s.validate(spec)
    seq = spec.seq_len if seq_len is None else seq_len
    m = s.num_microbatches(global_batch)
    if callable(order) and not isinstance(order, Order):
        order = order(s, m)
    g = distributed_graph(spec, s, global_batch=global_batch, seq_len=seq, order=order, costs=costs)
    meta = {"model": spec.name, "strategy": str(s), "schedule": s.schedule, "global_batch": int(global_batch),
            "seq_len": int(seq), "microbatches": m, "mbs": s.mbs, "kind": "train_step"}
    # with communication on the compute stream FLOPs misjudge step times: order p2p pairs by durations
    timing = _costs(spec, s, seq, costs).of if s.tp > 1 or s.ep > 1 or s.cp > 1 else None
    prog = lower(g, s, static_memory=static_memory(spec, s), meta=meta, step_time=timing)
    if validate:
        prog.validate()
    return prog
