"""The directive recipe of one training step of a preset model, shared by every compile front end.

:func:`directives` lists the graph rewrites a strategy asks for (see :mod:`parashift.ir.compile` for
the pipeline), :func:`distributed_graph` applies them to the model's region graph, and
:func:`planning_costs` gives the F/I/W durations a list-scheduled schedule plans with.
:mod:`parashift.ir.compile`, :mod:`~parashift.ir.compile_graph` (traced models) and
:mod:`~parashift.ir.compile_directives` (user directives) build their Programs from these.
"""
from __future__ import annotations

from .. import models as _models
from ..errors import StrategyError
from ..cluster import Cluster
from ..models import ModelSpec
from ..strategy import Strategy
from .directives import TP_BWD_KINDS, Fuse, Order, Place, Recompute, Replicate, Shard, Split, Stream, apply_all
from .fp8 import amax_directives
from .graph import Graph
from .memory import (OPTIM_FLOPS_PER_ELEMENT, chunk_params, fp8_params, gather_bytes, optimizer_elements,
                     recompute_bytes, region_activation, region_state_bytes)
from .model_graph import core_attention_flops, model_graph
from .costs import estimate_costs
from .schedules import ScheduleCosts, get_schedule, schedule_order

__all__ = ["directives", "distributed_graph", "planning_costs", "check_size", "base_graph", "model_and_strategy",
           "step_costs", "MAX_MICROBATCHES", "MAX_CELLS"]

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


def model_and_strategy(model: "str | ModelSpec", strategy: "str | Strategy") -> tuple[ModelSpec, Strategy]:
    """The ModelSpec and Strategy that a preset name (or spec) and a strategy text (or Strategy) stand for."""
    return _models.get(model), Strategy.parse(strategy)


def step_costs(spec: ModelSpec, s: Strategy, seq_len: int, costs: "ScheduleCosts | Cluster | str | None") -> ScheduleCosts:
    """The durations the list-scheduled recipes plan with (given, or estimated for a cluster)."""
    if isinstance(costs, ScheduleCosts):
        return costs
    return estimate_costs(spec, s, seq_len, costs)


def planning_costs(spec: ModelSpec, s: Strategy, seq_len: int,
                   costs: "ScheduleCosts | Cluster | str | None" = None) -> "ScheduleCosts | None":
    """The durations :func:`~parashift.ir.compile.compile` plans ``s``'s schedule with, or None for a fixed recipe.

    The schedule's registry record decides: ``costs="always"`` (the list-scheduled zb-h1, zb-2p, zb-v,
    dualpipev) plans with durations, ``"given"`` only with durations the caller passes."""
    mode = get_schedule(s.schedule).costs
    if mode == "always" or (mode == "given" and costs is not None):
        return step_costs(spec, s, seq_len, costs)
    return None


def directives(model: "str | ModelSpec", strategy: "str | Strategy", *, global_batch: int, seq_len: int,
               order: "Order | None" = None, costs: "ScheduleCosts | Cluster | str | None" = None) -> list:
    """The directive recipe for ``strategy`` (pass ``order`` to replace the schedule's Order;
    ``costs``: durations for zb-h1/dualpipev, or the cluster to estimate them for, see :func:`~parashift.ir.compile.compile`)."""
    spec, s = model_and_strategy(model, strategy)
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
    kv_block = tokens * spec.kv_width // s.tp * db
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
    gb = spec.kind_bytes("grad")
    grad_dense = cp.dense if s.ep > 1 else cp.total()
    f8 = fp8_params(spec, s)
    dense, dense8 = (cp.dense, f8.dense) if s.ep > 1 else (cp.total(), f8.total())
    expert, expert8 = (cp.expert, f8.expert) if s.ep > 1 else (cp.expert * 0, f8.expert * 0)
    out.append(Replicate(s.zero_ways, s.zero, tuple(gather_bytes(spec, s, int(x), int(y)) for x, y in zip(dense, dense8)),
                         tuple(gather_bytes(spec, s, int(x), int(y)) for x, y in zip(expert, expert8)),
                         tuple(int(x) * gb for x in grad_dense), tuple(int(x) * gb for x in cp.expert),
                         ep=s.ep, tied_bytes=cp.tied * gb, axis=s.zero_axis, overlap=s.overlap_grad,
                         buckets=region_state_bytes(spec, s) if s.zero_stage.grad_buckets or s.overlap_param else (),
                         replicas=s.dp_replicas, overlap_param=s.overlap_param))
    out += amax_directives(spec, s)
    if sched.hides_ep_comm and s.ep > 1:
        out.append(Stream("comm", ops=("all_to_all",), tag_prefix="ep."))
    out.append(order if order is not None else schedule_order(s, m, planning_costs(spec, s, seq_len, costs)))
    if s.tp == 1 and s.ep == 1 and s.cp == 1 and not ((s.zero_stage.grad_buckets or s.overlap_param) and not spec.is_moe):
        # ZeRO-2/3 and overlap_param: region buckets
        out.append(Fuse())
    return out


def distributed_graph(model: "str | ModelSpec", strategy: "str | Strategy", *, global_batch: int, seq_len: int,
                      order: "Order | None" = None, costs: "ScheduleCosts | Cluster | str | None" = None) -> Graph:
    """The ordered distributed DAG (before lowering), for inspection."""
    spec, s = model_and_strategy(model, strategy)
    g = base_graph(spec, s, seq_len)
    check_size(len(g), s.num_microbatches(global_batch), s, global_batch)
    return apply_all(g, directives(spec, s, global_batch=global_batch, seq_len=seq_len, order=order, costs=costs))


def base_graph(spec: ModelSpec, s: Strategy, seq_len: int) -> Graph:
    """The model's region graph with each region's activation and message bytes under ``s``."""
    g = model_graph(spec, mbs=s.mbs, seq_len=seq_len)
    c = g.cols
    for i in range(len(g)):
        c["act"][i] = region_activation(spec, c["kind"][i], mbs=s.mbs, seq_len=seq_len, tp=s.tp,
                                        recompute=s.recompute, sp=s.sp, cp=s.cp)
        c["nbytes"][i] = int(c["params"][i] // s.tp + 2 * s.mbs * seq_len // s.cp * spec.hidden * spec.dtype_bytes)
    return g
