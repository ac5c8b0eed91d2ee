"""Trace-aware planning: which strategy to run as a cluster's device count moves over time.

For every distinct device count of the trace the search finds the best strategies; every
change of count gets a switch cost; three policies then run over the same trace:

- ``checkpoint-restart``: the per-count best strategy, each change by save, restart and load;
- ``hot-switch``: the per-count best strategy, each change by an in-memory hot switch;
- ``switch-aware``: per segment the strategy of a dynamic program that maximizes the tokens
  trained over the whole trace, counting switch time as lost time (so a short dip or spike
  may be ridden out on a strategy that fits both device counts).

Strategies of world ``w`` run on the first ``w`` devices; a count ``n`` may run any candidate
of world ``<= n`` (the per-count top-K plus the best of every smaller count in the trace).
See :mod:`parashift.search.policies` for the accounting.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import pandas as pd

from ..cluster import Cluster, get as get_cluster
from ..errors import LimitError, StrategyError, TraceFormatError
from ..models import ModelSpec, get as get_model
from ..strategy import Strategy
from .evaluate import CachedEvaluator, Evaluator, SimEvaluator
from .exhaustive import exhaustive
from .plots import pyplot
from .policies import IDLE, PathResult, best_path, greedy_path, run_path
from .result import Candidate, rank_key
from .space import make_space
from .switch_cost import HotSwitchCost, RestartCost, SwitchCost
from .tune import tune

__all__ = ["plan_trace", "TracePlan", "plot_trace_plan", "trace_segments", "plan_work", "POLICIES", "MAX_PATH_STEPS"]

#: the most label steps (segments x (candidates + 1)^2) one switch-aware path may take (about a minute here)
MAX_PATH_STEPS = 50_000_000


def plan_work(segments: int, counts: int, max_candidates: int) -> dict:
    """What planning a trace of ``segments`` constant-count segments and ``counts`` distinct device
    counts costs: searches (one per count), path steps of the switch-aware dynamic program, and a
    bound on the memory its labels take."""
    steps = int(segments) * (int(max_candidates) + 1) ** 2
    return {"segments": int(segments), "device_counts": int(counts), "searches": int(counts),
            "path_steps": steps, "path_bytes": int(segments) * (int(max_candidates) + 1) * 240}

POLICIES = ("checkpoint-restart", "hot-switch", "switch-aware")
SwitchFn = Callable[[Strategy, Strategy], SwitchCost]


# ---- the trace as segments ----------------------------------------------------------------------------
def trace_segments(trace: pd.DataFrame, *, devices_per_node: int | None = None, per_node: int = 1,
                   max_devices: int | None = None, end: float | None = None) -> pd.DataFrame:
    """Segments of constant device count: columns ``start``, ``end``, ``duration``, ``devices``.

    Accepts a normalized trace of :mod:`parashift.traces` (``available`` counts nodes; it
    starts from ``attrs['initial']`` and runs to ``attrs['duration']``), a scaled one from
    ``traces.scale`` (a ``devices`` column), or a hand-built step curve with columns ``time`` and
    ``available`` or ``devices`` (each row holds until the next; the last row's time ends the
    trace unless ``end`` is given). ``available`` is multiplied by ``devices_per_node``, which
    defaults to ``per_node`` for normalized traces and 1 for hand-built curves. Counts above
    ``max_devices`` are clipped to it.
    """
    if not isinstance(trace, pd.DataFrame) or "time" not in trace.columns:
        raise TraceFormatError("a trace is a DataFrame with a 'time' column and 'available' or 'devices'; "
                               "load one with parashift.traces.load(path) or build (time, devices) rows")
    normalized = "event" in trace.columns
    if normalized:
        from .. import traces
        col = "devices" if "devices" in trace.columns else "available"
        if col == "available":
            curve = traces.availability(trace)
            t, n = curve["time"].to_numpy(np.float64), curve["available"].to_numpy(np.int64)
            factor = per_node if devices_per_node is None else devices_per_node
        else:
            t = np.concatenate([[0.0], trace["time"].to_numpy(np.float64)])
            n = np.concatenate([[int(trace.attrs.get("initial_devices", trace["devices"].iloc[0]))],
                                trace["devices"].to_numpy(np.int64)])
            dur = float(trace.attrs.get("duration", t[-1]))
            if dur > t[-1]:
                t, n = np.append(t, dur), np.append(n, n[-1])
            factor = 1
        horizon = float(t[-1]) if end is None else float(end)
    else:
        col = "devices" if "devices" in trace.columns else "available"
        if col not in trace.columns:
            raise TraceFormatError("a hand-built trace needs a 'devices' (or 'available') column next to 'time'")
        t = trace["time"].to_numpy(np.float64)
        n = trace[col].to_numpy()
        factor = 1 if (col == "devices" or devices_per_node is None) else devices_per_node
        horizon = float(t[-1]) if end is None else float(end)
    if len(t) == 0:
        raise TraceFormatError("the trace is empty; give at least a start and an end row")
    if np.any(np.diff(t) < 0) or not np.all(np.isfinite(t)):
        i = int(np.flatnonzero(~(np.diff(t) >= 0))[0]) + 1 if np.any(np.diff(t) < 0) else 0
        raise TraceFormatError(f"trace row {i + 1}: times must be finite and sorted; sort the rows by time")
    n = np.asarray(n, dtype=np.float64)
    if np.any(n < 0) or np.any(n != np.round(n)):
        raise TraceFormatError("device counts must be non-negative integers")
    dev = n.astype(np.int64) * int(factor)
    if max_devices is not None:
        dev = np.minimum(dev, max_devices)
    t_end = np.append(t[1:], max(horizon, t[-1]))
    t_end = np.minimum(t_end, horizon)
    keep = t_end > t
    if not keep.any():
        raise TraceFormatError(f"the trace covers no time (it ends at {horizon:g} s); pass end= past its "
                               "last row or add a closing row")
    s, e, d = t[keep], t_end[keep], dev[keep]
    new = np.ones(len(d), dtype=bool)
    new[1:] = d[1:] != d[:-1]
    starts = s[new]
    ends = np.maximum.reduceat(e, np.flatnonzero(new))
    out = pd.DataFrame({"start": starts, "end": ends, "duration": ends - starts, "devices": d[new]})
    out.attrs.update(devices_per_node=int(factor))
    return out


# ---- the result ------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class TracePlan:
    """Plans of the three policies over one trace.

    ``segments``: start, end, duration (s), devices; ``candidates``: every strategy considered
    (ids index it); ``options[i]``: candidate ids allowed in segment i; ``per_count``: the best
    strategy per device count; ``transitions``: per change of count, the per-count bests' hot
    switch and checkpoint-restart seconds; ``results``: policy -> :class:`PathResult`.
    """

    model: ModelSpec
    cluster: Cluster
    global_batch: int
    seq_len: int
    segments: pd.DataFrame = field(repr=False)
    candidates: tuple[Candidate, ...] = field(repr=False)
    options: tuple[tuple[int, ...], ...] = field(repr=False)
    per_count: pd.DataFrame = field(repr=False)
    transitions: pd.DataFrame = field(repr=False)
    results: Mapping[str, PathResult] = field(repr=False)
    plan_seconds: float = 0.0
    policies: tuple[str, ...] = POLICIES

    def summary(self) -> pd.DataFrame:
        """One row per policy: tokens, lost_seconds (reconfiguration), idle_seconds, switches,
        tokens_per_s (over the trace) and tokens relative to the switch-aware plan."""
        span = float(self.segments["end"].iloc[-1] - self.segments["start"].iloc[0])
        ref = self.results["switch-aware"].total_tokens
        rows = [{"policy": p, "tokens": r.total_tokens, "lost_seconds": r.total_lost,
                 "idle_seconds": float(r.idle_seconds.sum()), "switches": r.switches,
                 "tokens_per_s": r.total_tokens / span if span > 0 else float("nan"),
                 "vs_switch_aware": r.total_tokens / ref if ref > 0 else float("nan")}
                for p, r in self.results.items()]
        return pd.DataFrame(rows).set_index("policy")

    def policy_frame(self, policy: str) -> pd.DataFrame:
        """Per segment of ``policy``: start, end, devices, strategy, world, tokens_per_s,
        switch_seconds, lost_seconds, tokens."""
        if policy not in self.results:
            raise StrategyError(f"unknown policy {policy!r}; use one of {', '.join(self.results)}")
        r = self.results[policy]
        strat = [str(self.candidates[j].strategy) if j >= 0 else None for j in r.path]
        return pd.DataFrame({
            "start": self.segments["start"].to_numpy(), "end": self.segments["end"].to_numpy(),
            "devices": self.segments["devices"].to_numpy(), "strategy": strat,
            "world": [self.candidates[j].world if j >= 0 else 0 for j in r.path],
            "tokens_per_s": [self.candidates[j].tokens_per_s if j >= 0 else 0.0 for j in r.path],
            "switch_seconds": r.switch_seconds, "lost_seconds": r.lost_seconds, "tokens": r.tokens})

    def to_frame(self) -> pd.DataFrame:
        """Every policy's segments stacked, with a ``policy`` column first."""
        frames = [self.policy_frame(p).assign(policy=p) for p in self.results]
        df = pd.concat(frames, ignore_index=True)
        return df[["policy"] + [c for c in df.columns if c != "policy"]]

    def cumulative_tokens(self, policy: str) -> tuple[np.ndarray, np.ndarray]:
        """Times and cumulative tokens of ``policy`` (piecewise linear: flat while switching)."""
        f = self.policy_frame(policy)
        t: list[float] = [float(f["start"].iloc[0])]
        y: list[float] = [0.0]
        for r in f.itertuples():
            ready = min(r.end, r.start + r.lost_seconds)
            t += [ready, r.end]
            y += [y[-1], y[-1] + r.tokens]
        return np.asarray(t), np.asarray(y)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: per policy its totals and per count the best strategy."""
        s = self.summary()
        return {
            "policies": {p: {"tokens": float(s.loc[p, "tokens"]), "lost_seconds": float(s.loc[p, "lost_seconds"]),
                             "idle_seconds": float(s.loc[p, "idle_seconds"]), "switches": int(s.loc[p, "switches"])}
                         for p in s.index},
            "per_count": self.per_count.to_dict(orient="records"),
            "transitions": self.transitions.to_dict(orient="records"),
            "segments": int(len(self.segments)), "plan_seconds": self.plan_seconds,
            "switch_aware_path": self.policy_frame("switch-aware")[["start", "devices", "strategy"]]
            .to_dict(orient="records")}

    def plot(self, path: str) -> str:
        """Device count and the switch-aware strategy over time; cumulative tokens per policy."""
        return plot_trace_plan(self, path)


# ---- planning ----------------------------------------------------------------------------------------------
def plan_trace(trace: pd.DataFrame, model: "str | ModelSpec", cluster: "str | Cluster", *, global_batch: int,
               seq_len: int, devices_per_node: int | None = None, max_devices: int | None = None,
               end: float | None = None, top_k: int = 2, max_candidates: int = 4, trials: int | None = None,
               exhaustive_limit: int = 600, seed: int | None = 0, cost_model: Any = None, storage: Any = None,
               space_options: Mapping[str, Any] | None = None, evaluate: Evaluator | None = None,
               switch_cost: SwitchFn | None = None, restart_cost: SwitchFn | None = None,
               all_devices: bool = False, progress: Callable[[str], None] | None = None) -> TracePlan:
    """Plan ``model`` on ``cluster`` over ``trace`` and compare the three policies (module doc).

    Per device count the space is enumerated and solved exactly (:func:`exhaustive`) when it
    has at most ``exhaustive_limit`` strategies (and ``trials`` is None), else searched by TPE for
    ``trials`` trials (200 by default); the ``top_k`` feasible strategies are kept, plus the best
    of each smaller count, at most ``max_candidates`` per count. ``storage``: the
    checkpoint-restart parameters (``sim.StorageModel``). ``evaluate``, ``switch_cost`` and
    ``restart_cost`` replace the simulator-backed defaults (for tests and what-if studies).
    As in :func:`tune`, a count's space holds strategies on any device count up to it (idle
    devices allowed) unless ``all_devices``.
    """
    t0 = time.perf_counter()
    m, c = get_model(model), get_cluster(cluster)
    limit = c.devices if max_devices is None else min(int(max_devices), c.devices)
    seg = trace_segments(trace, devices_per_node=devices_per_node, per_node=c.per_node, max_devices=limit, end=end)
    say = progress or (lambda msg: None)
    ev = CachedEvaluator(evaluate or SimEvaluator(m, c, global_batch=global_batch, seq_len=seq_len,
                                                  cost_model=cost_model))
    counts = sorted({int(n) for n in seg["devices"] if n > 0})
    work = plan_work(len(seg), len(counts), max_candidates)
    if work["path_steps"] > MAX_PATH_STEPS:
        raise LimitError(f"the trace has {len(seg):,} segments of constant device count: planning its path takes "
                         f"{work['path_steps']:,} steps, over the limit of {MAX_PATH_STEPS:,}; plan a window of it "
                         f"(--from/--to, or parashift.traces.window) or lower --max-candidates")
    say(f"{len(seg):,} segments, {len(counts)} device counts: {len(counts)} searches and {work['path_steps']:,} "
        f"path steps (about {work['path_bytes'] / 2**20:.0f} MiB)")
    tops: dict[int, list[Candidate]] = {}
    for i, w in enumerate(counts):   # progress: count done and time left (from the mean so far)
        spent = time.perf_counter() - t0
        left = f", about {spent / i * (len(counts) - i):.0f} s left" if i else ""
        say(f"searching strategies for {w} devices ({i + 1}/{len(counts)}{left})")
        tops[w] = _world_candidates(m, c, w, global_batch, seq_len, ev, top_k, trials, exhaustive_limit, seed,
                                    {"all_devices": all_devices, **(space_options or {})})
    # candidates per count: its own top-K, then the best of every smaller count
    ids: dict[str, int] = {}
    cands: list[Candidate] = []
    per: dict[int, list[int]] = {}
    for n in counts:
        pool = list(tops[n]) + [tops[w][0] for w in counts if w < n and tops[w]]
        pool = sorted({str(p.strategy): p for p in pool}.values(), key=lambda p: -p.tokens_per_s)[:max_candidates]
        per[n] = []
        for p in pool:
            key = str(p.strategy)
            if key not in ids:
                ids[key] = len(cands)
                cands.append(p)
            per[n].append(ids[key])
    options = tuple(tuple(per.get(int(n), ())) for n in seg["devices"])
    tps = [p.tokens_per_s for p in cands]

    hot = _memo(switch_cost or HotSwitchCost(m, c, cost_model, RestartCost(m, c, storage)))
    restart = _memo(restart_cost or RestartCost(m, c, storage))

    def cost_of(fn: Callable[[Strategy, Strategy], SwitchCost]) -> Callable[[int, int], float]:
        def cost(prev: int, cur: int) -> float:
            if prev == IDLE:  # resuming after a gap: the state comes back from a checkpoint
                return restart(cands[cur].strategy, cands[cur].strategy).seconds
            return fn(cands[prev].strategy, cands[cur].strategy).seconds
        return cost

    start, stop = seg["start"].to_numpy(), seg["end"].to_numpy()
    greedy = greedy_path(options, tps)
    say("planning the switch-aware path")
    aware = best_path(start, stop, options, tps, cost_of(hot))
    results = {"checkpoint-restart": run_path(start, stop, greedy, tps, cost_of(restart)),
               "hot-switch": run_path(start, stop, greedy, tps, cost_of(hot)),
               "switch-aware": run_path(start, stop, aware, tps, cost_of(hot))}
    per_count = pd.DataFrame([{"devices": n, "strategy": str(cands[per[n][0]].strategy) if per[n] else None,
                               "world": cands[per[n][0]].world if per[n] else 0,
                               "tokens_per_s": cands[per[n][0]].tokens_per_s if per[n] else 0.0,
                               "step_time": cands[per[n][0]].step_time if per[n] else float("nan"),
                               "peak_memory": cands[per[n][0]].peak_memory if per[n] else float("nan"),
                               "candidates": [str(cands[j].strategy) for j in per[n]]} for n in counts])
    transitions = _transitions(seg, per, cands, hot, restart)
    return TracePlan(m, c, int(global_batch), int(seq_len), seg, tuple(cands), options, per_count, transitions,
                     results, time.perf_counter() - t0)


def _world_candidates(m: ModelSpec, c: Cluster, w: int, global_batch: int, seq_len: int, ev: CachedEvaluator,
                      top_k: int, trials: int | None, exhaustive_limit: int, seed: int | None,
                      space_options: dict) -> list[Candidate]:
    """The ``top_k`` feasible strategies on at most ``w`` devices, best first ([] when none runs)."""
    space = make_space(m, c, devices=w, global_batch=global_batch, seq_len=seq_len, **space_options)
    points = space.enumerate()
    if not points:
        return []
    if trials is None and len(points) <= exhaustive_limit:
        return sorted(exhaustive(space, ev, top_k=top_k).top, key=rank_key)
    res = tune(m, c, devices=w, global_batch=global_batch, seq_len=seq_len, n_trials=trials or 200, seed=seed,
               space=space, evaluate=ev.evaluate, cache=ev.cache)
    return res.top(top_k)


def _memo(fn: SwitchFn) -> SwitchFn:
    cache: dict[tuple[str, str], SwitchCost] = {}

    def call(src: Strategy, dst: Strategy) -> SwitchCost:
        key = (str(src), str(dst))
        if key not in cache:
            cache[key] = fn(src, dst)
        return cache[key]
    return call


def _transitions(seg: pd.DataFrame, per: dict[int, list[int]], cands: list[Candidate], hot: SwitchFn,
                 restart: SwitchFn) -> pd.DataFrame:
    rows, seen = [], set()
    d = seg["devices"].to_numpy()
    for a, b in zip(d[:-1], d[1:]):
        a, b = int(a), int(b)
        if (a, b) in seen or not per.get(a) or not per.get(b):
            continue
        seen.add((a, b))
        src, dst = cands[per[a][0]].strategy, cands[per[b][0]].strategy
        h = hot(src, dst) if src != dst else SwitchCost(0.0, "no change")
        r = restart(src, dst) if src != dst else SwitchCost(0.0, "no change")
        rows.append({"src_devices": a, "dst_devices": b, "src": str(src), "dst": str(dst),
                     "switch_seconds": h.seconds, "method": h.method, "bytes_moved": h.bytes_moved,
                     "restart_seconds": r.seconds})
    cols = ["src_devices", "dst_devices", "src", "dst", "switch_seconds", "method", "bytes_moved", "restart_seconds"]
    return pd.DataFrame(rows, columns=cols)


def plot_trace_plan(plan: "TracePlan", path: str) -> str:
    """Device count and the switch-aware plan's strategy over time (top), cumulative tokens per
    policy (bottom)."""
    plt = pyplot()
    seg = plan.segments
    span = float(seg["end"].iloc[-1] - seg["start"].iloc[0])
    unit, scale = ("hours", 3600.0) if span >= 3 * 3600 else (("minutes", 60.0) if span >= 180 else ("seconds", 1.0))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 7), sharex=True, gridspec_kw={"height_ratios": [1, 1.2]})
    t = np.append(seg["start"].to_numpy(), seg["end"].to_numpy()[-1:]) / scale
    avail = np.append(seg["devices"].to_numpy(), seg["devices"].to_numpy()[-1:])
    ax1.step(t, avail, where="post", color="black", lw=1.5, label="available devices")
    path_df = plan.policy_frame("switch-aware")
    names = list(dict.fromkeys(path_df["strategy"].dropna()))
    cmap = plt.get_cmap("tab10")
    for _, r in path_df.iterrows():
        if r["strategy"] is None or not isinstance(r["strategy"], str):
            continue
        k = names.index(r["strategy"])
        ax1.fill_between([r["start"] / scale, r["end"] / scale], 0, r["world"], step="post",
                         color=cmap(k % 10), alpha=0.45, lw=0)
    for k, n in enumerate(names):
        ax1.fill_between([], [], color=cmap(k % 10), alpha=0.45, label=f"switch-aware: {n}")
    ax1.set_ylabel("devices")
    ax1.set_ylim(0, max(1, float(avail.max())) * 1.1)
    ax1.legend(loc="lower left", fontsize=7, ncol=2)
    for pol in plan.policies:
        ct, ctok = plan.cumulative_tokens(pol)
        ax2.plot(ct / scale, ctok, label=f"{pol} ({plan.summary().loc[pol, 'tokens']:.3g} tokens)")
    ax2.set_xlabel(f"time ({unit})")
    ax2.set_ylabel("tokens trained")
    ax2.legend(loc="upper left", fontsize=8)
    fig.suptitle(f"{plan.model.name} on {plan.cluster.name}: trace plan")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
