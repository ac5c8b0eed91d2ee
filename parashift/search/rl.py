"""Planning RL iterations: the (training layout, rollout layout) pair that makes an iteration fastest.

An iteration is: switch the weights into the rollout layout, generate ``rollout_tokens`` tokens
for ``prompts`` prompts, switch the weights back, train one step on the sequences. Its time is
``train_step + rollout + to_rollout + to_train``, each simulated: the training step by the
compiler and simulator (:class:`.evaluate.SimEvaluator`), the rollout by
:func:`parashift.sim.rollout.simulate_rollout` (prefill and decode Programs), the switches by
lowering ``vps.plan_switch(kinds=("param",))`` and :func:`parashift.sim.simulate_switch` (the way
back is free when the training weights stay in place, ``release=False``). :func:`plan_rl` scores
every rollout layout against the best training layouts (a pair fits when the rollout's weights
and key/value cache plus the training state a device keeps, optimizer state and unreleased
weights, fit in its memory) and compares the best pair with the best *single* layout used for
both phases (no switch: a training layout with ``pp=1``, ``ep=1`` and
weights not sharded by ZeRO-3 generates as it is).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..cluster import Cluster, get as get_cluster
from ..errors import StrategyError
from ..models import ModelSpec, get as get_model
from ..states import zero_stage
from ..strategy import Strategy
from .evaluate import SimEvaluator
from .space import divisors, enumerate_space

__all__ = ["RLPlan", "plan_rl", "rollout_layouts", "weight_switch_seconds"]


def rollout_layouts(model: "ModelSpec | str", devices: int, prompts: int) -> list[Strategy]:
    """Every rollout layout (``tp`` x ``dp`` replicas, ``pp=1``) on ``devices`` or fewer devices
    (a divisor of ``devices``) whose replicas split the prompts evenly."""
    spec = get_model(model)
    out = []
    for n in divisors(devices):
        for tp in divisors(n):
            s = Strategy(dp=n // tp, tp=tp)
            if prompts % s.dp or s.problems(spec):
                continue
            out.append(s)
    return out


def weight_switch_seconds(model: "ModelSpec | str", src: Strategy, dst: Strategy, cluster: "Cluster | str",
                          cost_model: Any = None) -> tuple[float, int]:
    """Simulated seconds and bytes moved of switching the weights (kind ``param``) from ``src`` on
    its devices to ``dst`` on the first ``dst.world`` devices."""
    from .. import sim
    from ..vps.plan import plan_switch
    from ..vps.transition import lower
    clus = get_cluster(cluster)
    plan = plan_switch(model, src, dst, cluster=clus, src_devices=list(range(src.world)),
                       dst_devices=list(range(dst.world)), kinds=("param",))
    cm = cost_model or sim.CostModel.for_cluster(clus)
    res = sim.simulate_switch(lower(plan, clus, cost_model=cm), clus, cm)
    return float(res.switch_time), int(plan.stats()["bytes_moved"])


@dataclass
class RLPlan:
    """Scored (training, rollout) pairs (``table``: one row per pair, fastest iteration first) and
    the best single layout for both phases (``single``: its row, or None when no training layout
    can generate as it is)."""

    model: str
    devices: int
    prompts: int
    prompt_len: int
    rollout_tokens: int
    table: Any
    single: "dict | None"

    @property
    def best(self) -> dict:
        return self.table.iloc[0].to_dict()

    @property
    def speedup(self) -> float | None:
        """Iteration time of the best single layout over the best pair's."""
        return None if self.single is None else self.single["iteration_seconds"] / self.best["iteration_seconds"]

    def to_json(self) -> dict:
        return {"model": self.model, "devices": self.devices, "prompts": self.prompts, "prompt_len": self.prompt_len,
                "rollout_tokens": self.rollout_tokens, "best": _plain(self.best),
                "single_layout": None if self.single is None else _plain(self.single),
                "speedup_over_single_layout": self.speedup,
                "pairs": [_plain(r) for r in self.table.to_dict("records")]}


def _plain(row: dict) -> dict:
    return {k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()}


def plan_rl(model: "ModelSpec | str", cluster: "Cluster | str", *, devices: int, prompts: int, prompt_len: int,
            rollout_tokens: int, dtype: str = "bf16", release: bool = True, train_top: int = 4,
            train: "list[Strategy | str] | None" = None, rollout: "list[Strategy | str] | None" = None,
            cost_model: Any = None, progress: Callable[[str], None] | None = None) -> RLPlan:
    """Score (training, rollout) pairs for one RL iteration; see the module docstring.

    ``train``: training layouts to consider (default: the ``train_top`` fastest feasible ones of
    the search space plus the fastest that can also generate); ``rollout``: rollout layouts
    (default :func:`rollout_layouts`). ``release``: the training weights are freed during the
    rollout, so they switch back too (else only the way out costs).
    """
    import pandas as pd

    from ..sim.rollout import simulate_rollout
    spec, clus = get_model(model), get_cluster(cluster)
    if min(prompts, prompt_len, rollout_tokens, devices) < 1:
        raise StrategyError("devices, prompts, prompt_len and rollout_tokens must each be at least 1")
    seq = prompt_len + rollout_tokens
    for what, given in (("training", train), ("rollout", rollout)):
        for s in [Strategy.parse(x) for x in given or ()]:
            if s.world > devices:
                raise StrategyError(f"{what} layout {s} runs {s.world} devices but the job has {devices}; give a "
                                    f"layout of at most {devices} devices or raise --devices")
    ev = SimEvaluator(spec, clus, global_batch=prompts, seq_len=seq, cost_model=cost_model)
    cm = ev.costs()
    note = progress or (lambda msg: None)
    if train is None:
        space = enumerate_space(spec, clus, devices=devices, global_batch=prompts, seq_len=seq)
        space = [s for s in space if ev.could_fit(s)]
        space.sort(key=lambda s: -ev.throughput_bound(s))          # most promising first
        scored = []
        for s in space[:4 * train_top] + [s for s in space[4 * train_top:] if _generates(s)][:train_top]:
            o = ev(s)
            if o.ok:
                scored.append((o.step_time, s))
        if not scored:
            raise StrategyError(f"no training layout of {spec.name} fits on {devices} devices of {clus.name} with "
                                f"{prompts} sequences of {seq} tokens; use more devices or fewer prompts")
        scored.sort(key=lambda x: x[0])
        cands = [s for _, s in scored[:train_top]]
        gen = [s for _, s in scored if _generates(s)]
        if gen and gen[0] not in cands:
            cands.append(gen[0])
        steps = {str(s): t for t, s in scored}
    else:
        cands = [Strategy.parse(s) for s in train]
        steps = {}
        for s in cands:
            o = ev(s)
            if not o.ok:
                raise StrategyError(f"training layout {s} cannot run: {o.reason}")
            steps[str(s)] = o.step_time
    ros = [Strategy.parse(s) for s in rollout] if rollout is not None else rollout_layouts(spec, devices, prompts)
    gens = {}
    for r in ros:
        note(f"rollout {r}")
        gens[str(r)] = simulate_rollout(spec, r, clus, prompts=prompts, prompt_len=prompt_len,
                                        rollout_tokens=rollout_tokens, dtype=dtype, cost_model=cm)
    rows = []
    for t in cands:
        for r in ros:
            note(f"switch {t} <-> {r}")
            out, moved = weight_switch_seconds(spec, t, r, clus, cm)
            back = weight_switch_seconds(spec, r, t, clus, cm)[0] if release else 0.0
            g = gens[str(r)]
            peak = g.peak_memory + _kept_bytes(spec, t, release)
            rows.append({"train": str(t), "rollout": str(r), "train_seconds": steps[str(t)],
                         "rollout_seconds": g.seconds, "to_rollout_seconds": out, "to_train_seconds": back,
                         "iteration_seconds": steps[str(t)] + g.seconds + out + back, "bytes_moved": moved,
                         "rollout_devices": r.world, "rollout_peak_memory": peak,
                         "rollout_fits": peak + cm.memory_reserved <= cm.memory_capacity})
    table = pd.DataFrame(rows)
    table = table[table["rollout_fits"]].sort_values("iteration_seconds").reset_index(drop=True)
    if table.empty:
        raise StrategyError("no rollout layout fits in memory; use more devices or fewer prompts")
    single = None
    for t in cands:
        if not _generates(t):
            continue
        r = Strategy(dp=t.dp, tp=t.tp)
        g = simulate_rollout(spec, r, clus, prompts=prompts, prompt_len=prompt_len, rollout_tokens=rollout_tokens,
                             dtype=dtype, cost_model=cm)
        peak = g.peak_memory + _kept_bytes(spec, t, True)    # its own weights generate: no second copy
        fits = peak + cm.memory_reserved <= cm.memory_capacity
        row = {"train": str(t), "rollout": str(t), "train_seconds": steps[str(t)], "rollout_seconds": g.seconds,
               "to_rollout_seconds": 0.0, "to_train_seconds": 0.0,
               "iteration_seconds": steps[str(t)] + g.seconds, "bytes_moved": 0, "rollout_devices": t.world,
               "rollout_peak_memory": peak, "rollout_fits": fits}
        if fits and (single is None or row["iteration_seconds"] < single["iteration_seconds"]):
            single = row
    return RLPlan(spec.name, devices, prompts, prompt_len, rollout_tokens, table, single)


def _kept_bytes(spec: ModelSpec, train: Strategy, release: bool) -> float:
    """Training state a device keeps during the rollout (the largest over devices): optimizer state
    (master, moments) and, unless released, the training weights; gradients are not kept."""
    from ..vps import layout
    lay = layout(spec, train)
    kinds = [k for k in lay.kinds if k in ("master", "exp_avg", "exp_avg_sq") or (k == "param" and not release)]
    return float(sum(lay.bytes_per_rank(k, padded=True) for k in kinds).max())


def _generates(s: Strategy) -> bool:
    """Whether training layout ``s`` can generate as it is (TP shards and whole-weight replicas)."""
    return s.pp == 1 and s.ep == 1 and not zero_stage(s.zero).shards_params and getattr(s, "cp", 1) == 1 and not getattr(s, "sp", False)
