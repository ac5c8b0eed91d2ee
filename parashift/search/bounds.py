"""Cheap bounds that let the search skip simulations it provably does not need.

- :func:`peak_memory_lower_bound`: model states (:mod:`.memory`) plus the most activation
  bytes the schedule's order keeps alive at once on a stage. Above the device budget, the
  strategy is infeasible without being compiled or simulated.
- :func:`step_time_lower_bound`: the schedule's order replayed with compute only, at the cost
  model's best efficiency (:func:`replay`). Its tokens/s is an upper bound; a strategy whose
  upper bound is below the best simulated one so far cannot win (branch and bound).

Both replay the very order the compiler gives the strategy (zb-h1 planned with the same
estimated durations, see ``ir.compile.planning_costs``), per-region FLOPs and activation bytes
(``ir.schedules``, ``ir.model_graph``, ``ir.memory``) and err on the safe side; tests check
them against the simulator.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

from ..models import ModelSpec
from ..strategy import Strategy
from .memory import state_bytes_per_stage

__all__ = ["chunk_activation_bytes", "peak_memory_lower_bound", "chunk_forward_flops", "step_time_lower_bound",
           "replay"]


@lru_cache(maxsize=4096)
def _layer_act(model: ModelSpec, mbs: int, seq_len: int, tp: int, recompute: str, sp: bool = False,
               cp: int = 1) -> tuple[int, int]:
    from ..ir.memory import region_activation
    from ..ir.model_graph import region_kinds
    kw = dict(mbs=mbs, seq_len=seq_len, tp=tp, recompute=recompute, sp=sp, cp=cp)
    layer = sum(region_activation(model, k, **kw) for k in region_kinds(model))
    head = region_activation(model, "head", **kw)
    return layer, head


def _layers_per_chunk(model: ModelSpec, s: Strategy) -> np.ndarray:
    return np.bincount(s.layer_stages(model.layers), minlength=s.stages)


def chunk_activation_bytes(model: ModelSpec, s: Strategy, seq_len: int) -> np.ndarray:
    """Activation bytes one micro-batch leaves on a rank per chunk (``[pp * vpp]``)."""
    layer, head = _layer_act(model, s.mbs, seq_len, s.tp, s.recompute, s.sp, s.cp)
    out = _layers_per_chunk(model, s).astype(np.float64) * layer
    out[-1] += head
    return out


def peak_memory_lower_bound(model: ModelSpec, s: Strategy, *, global_batch: int, seq_len: int) -> float:
    """A lower bound of the simulated peak bytes of the busiest device."""
    _, act_peak = _replay_unit(model, s, global_batch, seq_len)
    return float((state_bytes_per_stage(model, s) + act_peak).max())


@lru_cache(maxsize=4096)
def _layer_flops(model: ModelSpec, tokens: int, seq_len: int) -> tuple[float, float]:
    from ..ir.model_graph import region_flops, region_kinds
    kinds = region_kinds(model)
    # routed experts run wherever the router sends tokens: leave them out of a per-rank bound
    layer = sum(region_flops(model, k, tokens, seq_len) for k in kinds if k != "moe.experts")
    return layer, region_flops(model, "head", tokens, seq_len)


def chunk_forward_flops(model: ModelSpec, s: Strategy, seq_len: int) -> np.ndarray:
    """Forward FLOPs of one micro-batch per chunk on one rank (TP shares them; ``[pp * vpp]``)."""
    layer, head = _layer_flops(model, s.mbs * seq_len, seq_len)
    out = _layers_per_chunk(model, s).astype(np.float64) * layer
    out[-1] += head
    return out / s.tp / s.cp


def step_time_lower_bound(model: ModelSpec, s: Strategy, *, global_batch: int, seq_len: int,
                          cost_model: Any) -> float:
    """Seconds a step takes at least: the schedule's compute alone, at the best efficiency the
    cost model allows, with communication free (see :func:`replay`)."""
    rate = cost_model.best_rate()
    makespan, _ = _replay_unit(model, s, global_batch, seq_len)
    return makespan / rate


@lru_cache(maxsize=8192)
def _replay_unit(model: ModelSpec, s: Strategy, global_batch: int, seq_len: int) -> tuple[float, np.ndarray]:
    """:func:`replay` at one FLOP/s (durations scale with ``1 / rate``), memoized."""
    return replay(model, s, global_batch=global_batch, seq_len=seq_len, rate=1.0)


#: stage orders by (schedule, pp, vpp, m, planning costs), shared between strategies (read-only)
_STEPS: dict[tuple, Any] = {}


def _steps(model: ModelSpec, s: Strategy, m: int, seq_len: int) -> tuple[tuple, Any]:
    """The stage order ``ir.compile`` gives ``s`` (list-scheduled recipes planned with the same
    estimated durations) and its cache key, memoized: strategies differing only in dp/zero/...
    share it."""
    from ..ir.compile import planning_costs
    from ..ir.schedules import schedule_steps
    key = (s.schedule, s.pp, s.vpp, m, planning_costs(model, s, seq_len))
    hit = _STEPS.get(key)
    if hit is None:
        if len(_STEPS) >= 1024:
            _STEPS.pop(next(iter(_STEPS)))
        hit = _STEPS[key] = schedule_steps(s, m, key[-1])
    return key, hit


def replay(model: ModelSpec, s: Strategy, *, global_batch: int, seq_len: int, rate: float) -> tuple[float, np.ndarray]:
    """Run the per-stage order ``ir.compile`` gives ``s`` with compute only.

    Each action takes its chunk's forward FLOPs over ``rate`` (backward twice that, split
    halves once each); under full recomputation a backward first re-runs the forward, which
    needs no gradient. An action waits for the one before it on its stage and for its data:
    the previous chunk's forward, the next chunk's backward (input gradient), its own input
    gradient for a weight gradient. With
    communication free and every duration no longer than the simulator's, completion times can
    only be earlier than simulated (a max-plus system is monotone), so the makespan is a lower
    bound. Also returns each stage's peak of live activation bytes (allocated by a forward,
    freed by the backward that ends the micro-batch: ``B`` or ``W``).
    """
    m = s.num_microbatches(global_batch)
    fwd = chunk_forward_flops(model, s, seq_len) / rate
    act = chunk_activation_bytes(model, s, seq_len)
    key, steps = _steps(model, s, m, seq_len)
    return _replay_steps(key, steps, s.schedule, s.stages, s.pp, s.recompute == "full", fwd, act)


#: :func:`_replay_steps` results by everything they depend on (strategies differing only in
#: fields the replay ignores, e.g. ZeRO stage, share one)
_REPLAYS: dict[tuple, tuple[float, np.ndarray]] = {}


def _replay_steps(order_key: tuple, steps: Any, schedule: str, stages: int, pp: int, full_recompute: bool,
                  fwd: np.ndarray, act: np.ndarray) -> tuple[float, np.ndarray]:
    """The replay loop of :func:`replay` over ``steps``, memoized by its inputs."""
    key = (order_key, stages, full_recompute, fwd.tobytes(), act.tobytes())
    hit = _REPLAYS.get(key)
    if hit is None:
        if len(_REPLAYS) >= 8192:
            _REPLAYS.pop(next(iter(_REPLAYS)))
        hit = _REPLAYS[key] = _run_replay(steps, fwd, act, full_recompute, schedule, stages, pp)
    return hit[0], hit[1].copy()


def _run_replay(steps: Any, fwd: np.ndarray, act: np.ndarray, full_recompute: bool, schedule: str, stages: int,
                pp: int) -> tuple[float, np.ndarray]:
    from ..ir.schedules import split_backward
    rc = fwd if full_recompute else 0.0 * fwd
    dur = {"F": fwd, "B": 2.0 * fwd, "I": fwd, "W": fwd}
    frees = "W" if split_backward(schedule) else "B"
    last = stages - 1
    done: dict[tuple[int, str, int], float] = {}
    ptr, free_at = [0] * pp, [0.0] * pp
    alive, peak = np.zeros(pp), np.zeros(pp)
    pending = sum(len(v) for v in steps.values())
    while pending:
        moved = False
        for st in range(pp):
            order = steps[st]
            while ptr[st] < len(order):
                block = order[ptr[st]]
                ready = []
                for a in block:
                    c, t, i = a
                    if t == "F":
                        dep = (c - 1, "F", i) if c > 0 else None
                    elif t == "W":
                        dep = (c, "G", i)
                    else:
                        dep = (c + 1, "G", i) if c < last else (c, "F", i)
                    if dep is not None and dep not in done:
                        break
                    ready.append(done[dep] if dep is not None else 0.0)
                else:
                    t0, busy = free_at[st], 0.0
                    ends = []
                    for a, r in zip(block, ready):
                        pre = float(rc[a.chunk]) if a.type in "BI" else 0.0  # recompute needs no gradient
                        core = float(dur[a.type][a.chunk])
                        done[(a.chunk, "G" if a.type in "BI" else a.type, a.mb)] = max(t0 + pre, r) + core
                        ends.append(done[(a.chunk, "G" if a.type in "BI" else a.type, a.mb)])
                        busy += pre + core
                    end = max([t0 + busy] + ends)
                    free_at[st] = end
                    for a in block:  # frees first, then allocations (the smaller peak)
                        if a.type == frees:
                            alive[st] -= act[a.chunk]
                    for a in block:
                        if a.type == "F":
                            alive[st] += act[a.chunk]
                    peak[st] = max(peak[st], alive[st])
                    ptr[st] += 1
                    pending -= 1
                    moved = True
                    continue
                break
        if not moved:  # an order the compiler would reject: no bound
            return 0.0, np.zeros(pp)
    return float(max(free_at)), peak
