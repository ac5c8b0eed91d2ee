"""The strategy space of one (model, device count): its axes, validity and canonical forms.

A point of the space is a choice on every axis: ``tp``, ``pp``, ``cp`` (``dp`` is derived as
``devices // (tp * pp * cp)``), ``sp``, ``ep`` (MoE models only), ``zero``, ``mbs``, ``schedule``,
``vpp`` (the schedule registry says which: free for interleaved-1f1b, two for dualpipev, one for
the rest), ``recompute``, ``overlap_param`` (with zero 1 or 2), ``tp_async`` (with tp > 1) and
``grad_fusion``. ``sp``, ``cp``, ``overlap_param``, ``tp_async`` and ``grad_fusion`` are off unless
the caller offers choices.

Equivalent points are folded onto one *canonical* strategy, so that the search never
simulates the same training step twice under two names:

- with one pipeline stage (``pp == 1``) every schedule runs the same per-rank order as 1F1B
  (GPipe only holds more activations), so the schedule is ``1f1b`` and ``vpp`` is 1;
- with one data-parallel replica (``dp * cp == 1``) ZeRO has nothing to shard, so ``zero`` is 0;
- ``overlap_param`` only where there is a parameter gather to overlap (zero 1 or 2);
- ``sp`` and ``tp_async`` only where there is a TP group (tp > 1).

With ``all_devices=False`` a strategy may leave devices idle: for each point ``dp`` is the
largest degree with ``dp * tp * pp * cp <= devices`` that makes a valid strategy.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..cluster import Cluster, get as get_cluster
from ..errors import StrategyError
from ..models import ModelSpec, get as get_model
from ..ir.schedules import get_schedule, schedule_names
from ..states import ZERO_LEVELS
from ..strategy import RECOMPUTE, Strategy

if TYPE_CHECKING:  # pragma: no cover
    import optuna

__all__ = ["Space", "make_space", "enumerate_space", "canonical", "divisors", "neighbor", "params_of"]

#: the on/off axes after ``sp``, in the order of :meth:`Space.points` (each suggested only when offered)
_SWITCHES = ("overlap_param", "tp_async", "grad_fusion")


def _sched_vpp(schedules: "tuple[str, ...]", vpps: "tuple[int, ...]") -> list[tuple[str, int]]:
    """Every (schedule, vpp) pair the registry allows."""
    return [(sc, v) for sc in schedules for v in get_schedule(sc).vpp_choices(vpps)]


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in ascending order."""
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def canonical(strategy: Strategy) -> Strategy:
    """The canonical form of ``strategy`` (see the module docstring)."""
    s = strategy
    if s.pp == 1 and (s.schedule != "1f1b" or s.vpp != 1):
        s = s.replace(schedule="1f1b", vpp=1)
    if s.dpcp == 1 and s.zero_stage.sharded:
        s = s.replace(zero=0, overlap_param=False)
    return s


@dataclass(frozen=True)
class Space:
    """The axes of a strategy space and the constraints every point must meet."""

    model: ModelSpec
    devices: int
    per_node: int
    global_batch: int
    seq_len: int
    tp: tuple[int, ...]
    pp: tuple[int, ...]
    ep: tuple[int, ...] = (1,)
    zero: tuple[int, ...] = ZERO_LEVELS
    mbs: tuple[int, ...] = (1, 2, 4, 8)
    schedule: tuple[str, ...] = field(default_factory=schedule_names)
    vpp: tuple[int, ...] = (2, 4)
    recompute: tuple[str, ...] = RECOMPUTE
    cp: tuple[int, ...] = (1,)
    sp: tuple[bool, ...] = (False,)
    all_devices: bool = True
    overlap_param: tuple[bool, ...] = (False,)
    tp_async: tuple[bool, ...] = (False,)
    grad_fusion: tuple[bool, ...] = (False,)
    _valid: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    # ---- points -> strategies --------------------------------------------------------------------
    def build(self, params: dict[str, Any]) -> tuple[Strategy | None, str]:
        """The canonical strategy for a point (``tp, pp, ep, zero, mbs, schedule, vpp, recompute``),
        or ``(None, reason)`` when the point is invalid; ``vpp`` may be absent unless interleaved."""
        if self.all_devices:
            return self._build_on(params, self.devices)
        tp, pp, cp = int(params["tp"]), int(params["pp"]), int(params.get("cp", 1))
        reason = f"tp*pp*cp={tp * pp * cp} exceeds the {self.devices} devices; lower tp, pp or cp"
        for dp in range(self.devices // (tp * pp * cp), 0, -1):  # the largest dp that makes a valid strategy
            s, reason = self._build_on(params, dp * tp * pp * cp)
            if s is not None:
                return s, ""
        return None, reason

    def _build_on(self, params: dict[str, Any], devices: int) -> tuple[Strategy | None, str]:
        tp, pp, cp = int(params["tp"]), int(params["pp"]), int(params.get("cp", 1))
        if devices % (tp * pp * cp):
            return None, (f"tp*pp*cp={tp * pp * cp} does not divide the {devices} devices; "
                          f"pick tp, pp and cp whose product divides {devices}")
        schedule = params["schedule"]
        try:
            sched = get_schedule(schedule)
            vpp = sched.chunks or int(params.get("vpp", 1))
            s = Strategy(dp=devices // (tp * pp * cp), tp=tp, pp=pp, ep=int(params.get("ep", 1)),
                         zero=int(params["zero"]), vpp=vpp, mbs=int(params["mbs"]), schedule=schedule,
                         recompute=params["recompute"], cp=cp, sp=bool(params.get("sp", False)) and tp > 1,
                         overlap_param=bool(params.get("overlap_param", False)) and int(params["zero"]) in (1, 2),
                         tp_async=bool(params.get("tp_async", False)) and tp > 1,
                         grad_fusion=bool(params.get("grad_fusion", False)))
        except StrategyError as e:
            return None, str(e)
        s = canonical(s)
        problems = self.problems(s)
        return (None, "; ".join(problems)) if problems else (s, "")

    def problems(self, strategy: Strategy) -> list[str]:
        """Every reason ``strategy`` cannot run in this space (empty when it can)."""
        s = strategy
        key = str(s)
        if key in self._valid:
            return list(self._valid[key])
        out = s.problems(self.model, self.devices if self.all_devices else None)
        if s.world > self.devices:
            out.append(f"the strategy's {s.world} ranks exceed the {self.devices} devices; lower dp, tp, pp or cp")
        if s.tp * s.cp > self.per_node and s.cp > 1:
            out.append(f"tp*cp={s.tp * s.cp} would span nodes of {self.per_node} devices; keep tp*cp <= {self.per_node}")
        if s.cp > 1 and self.seq_len % (2 * s.cp):
            out.append(f"cp={s.cp} needs seq_len={self.seq_len} to be a multiple of {2 * s.cp}; pick another cp")
        if s.tp > self.per_node:
            out.append(f"tp={s.tp} would span nodes of {self.per_node} devices; keep tp <= {self.per_node}")
        try:
            s.num_microbatches(self.global_batch)
        except StrategyError as e:
            out.append(str(e))
        self._valid[key] = tuple(out)
        return out

    # ---- the whole space -------------------------------------------------------------------------
    def points(self) -> "itertools.product":
        """Every raw point (before validity and canonical folding) as tuples of axis values."""
        return itertools.product(self.tp, self.pp, self.ep, self.zero, self.mbs, _sched_vpp(self.schedule, self.vpp),
                                 self.recompute, self.cp, self.sp, self.overlap_param, self.tp_async, self.grad_fusion)

    def enumerate(self) -> list[Strategy]:
        """Every distinct valid canonical strategy, in a deterministic order."""
        seen: dict[str, Strategy] = {}
        for tp, pp, ep, zero, mbs, (sc, vpp), rc, cp, sp, op, ta, gf in self.points():
            s, _ = self.build({"tp": tp, "pp": pp, "ep": ep, "zero": zero, "mbs": mbs, "schedule": sc,
                               "vpp": vpp, "recompute": rc, "cp": cp, "sp": sp, "overlap_param": op,
                               "tp_async": ta, "grad_fusion": gf})
            if s is not None:
                seen.setdefault(str(s), s)
        return list(seen.values())

    # ---- optuna ------------------------------------------------------------------------------------
    def suggest(self, trial: "optuna.trial.Trial") -> dict[str, Any]:
        """Draw a point with ``trial`` (static choices per axis; ``vpp`` only for interleaved)."""
        p: dict[str, Any] = {"tp": trial.suggest_categorical("tp", self.tp),
                             "pp": trial.suggest_categorical("pp", self.pp)}
        if len(self.ep) > 1 or self.ep != (1,):
            p["ep"] = trial.suggest_categorical("ep", self.ep)
        p["zero"] = trial.suggest_categorical("zero", self.zero)
        p["mbs"] = trial.suggest_categorical("mbs", self.mbs)
        p["schedule"] = trial.suggest_categorical("schedule", self.schedule)
        if get_schedule(p["schedule"]).chunks is None:
            p["vpp"] = trial.suggest_categorical("vpp", self.vpp)
        p["recompute"] = trial.suggest_categorical("recompute", self.recompute)
        if self.cp != (1,):
            p["cp"] = trial.suggest_categorical("cp", self.cp)
        if self.sp != (False,):
            p["sp"] = trial.suggest_categorical("sp", self.sp)
        for name in _SWITCHES:
            if getattr(self, name) != (False,):
                p[name] = trial.suggest_categorical(name, getattr(self, name))
        return p

    def describe(self) -> dict[str, Any]:
        """The axes as plain data (stored with a study so a resumed search can be checked)."""
        return {"model": self.model.name, "devices": self.devices, "global_batch": self.global_batch,
                "seq_len": self.seq_len, "tp": list(self.tp), "pp": list(self.pp), "ep": list(self.ep),
                "zero": list(self.zero), "mbs": list(self.mbs), "schedule": list(self.schedule),
                "vpp": list(self.vpp), "recompute": list(self.recompute), "cp": list(self.cp),
                "sp": list(self.sp), "overlap_param": list(self.overlap_param), "tp_async": list(self.tp_async),
                "grad_fusion": list(self.grad_fusion), "all_devices": self.all_devices}


def params_of(space: Space, s: Strategy) -> dict[str, Any] | None:
    """The point of ``space`` that builds ``s`` (None when one of its values is not an axis choice)."""
    p: dict[str, Any] = {"tp": s.tp, "pp": s.pp, "zero": s.zero, "mbs": s.mbs, "schedule": s.schedule,
                         "recompute": s.recompute}
    if len(space.ep) > 1 or space.ep != (1,):
        p["ep"] = s.ep
    if get_schedule(s.schedule).chunks is None:
        p["vpp"] = s.vpp
    if space.cp != (1,):
        p["cp"] = s.cp
    for name in ("sp",) + _SWITCHES:
        if getattr(space, name) != (False,):
            p[name] = getattr(s, name)
    axes = {"tp": space.tp, "pp": space.pp, "ep": space.ep, "zero": space.zero, "mbs": space.mbs,
            "schedule": space.schedule, "vpp": space.vpp, "recompute": space.recompute, "cp": space.cp,
            **{name: getattr(space, name) for name in ("sp",) + _SWITCHES}}
    return p if all(v in axes[k] for k, v in p.items()) else None


def neighbor(space: Space, s: Strategy, visited: "set[str]", bound: Any = None, could_fit: Any = None,
             beat: float = 0.0) -> dict[str, Any] | None:
    """The most promising unvisited neighbor of ``s`` as a point of ``space`` (None when none is left).

    Neighbors change one of zero, mbs, recompute, ep or (schedule, vpp), or trade sizes between
    two of tp, pp and dp. With ``bound`` (tokens/s upper bound), only neighbors whose bound
    exceeds ``beat`` qualify, highest bound first; ``could_fit`` drops those that cannot fit.
    """
    moves: list[Strategy] = []
    sched = _sched_vpp(space.schedule, space.vpp)
    for field_, values in (("zero", space.zero), ("mbs", space.mbs), ("recompute", space.recompute),
                           ("ep", space.ep), ("cp", space.cp), ("sp", space.sp),
                           *((name, getattr(space, name)) for name in _SWITCHES)):
        moves += [_try(s, **{field_: v}) for v in values if v != getattr(s, field_)]
    moves += [_try(s, schedule=sc, vpp=v) for sc, v in sched if (sc, v) != (s.schedule, s.vpp)]
    for tp in space.tp:
        for pp in space.pp:
            if (tp, pp) == (s.tp, s.pp) or (tp != s.tp and pp != s.pp and tp * pp != s.tp * s.pp):
                continue
            if s.world % (tp * pp * s.cp) == 0:
                moves.append(_try(s, tp=tp, pp=pp, dp=s.world // (tp * pp * s.cp), sp=s.sp and tp > 1,
                                  tp_async=s.tp_async and tp > 1))
    seen: dict[str, Strategy] = {}
    for m in moves:
        if m is None:
            continue
        m = canonical(m)
        key = str(m)
        if key in visited or key in seen or space.problems(m) or params_of(space, m) is None:
            continue
        if could_fit is not None and not could_fit(m):
            continue
        seen[key] = m
    ranked = [(float(bound(m)), k) for k, m in seen.items()] if bound is not None else [(0.0, k) for k in seen]
    ranked = [r for r in ranked if bound is None or r[0] > beat]
    if not ranked:
        return None
    ranked.sort(key=lambda r: (-r[0], r[1]))
    return params_of(space, seen[ranked[0][1]])


def _try(s: Strategy, **changes: Any) -> Strategy | None:
    try:
        if "schedule" in changes and "vpp" not in changes and get_schedule(changes["schedule"]).chunks == 1:
            changes["vpp"] = 1
        if "zero" in changes and changes["zero"] not in (1, 2):
            changes["overlap_param"] = False
        if "cp" in changes:
            changes["dp"] = s.dp * s.cp // changes["cp"] if (s.dp * s.cp) % changes["cp"] == 0 else 0
        return s.replace(**changes)
    except StrategyError:
        return None


def make_space(model: "str | ModelSpec", cluster: "str | Cluster", *, devices: int, global_batch: int,
               seq_len: int, tp: "tuple[int, ...] | None" = None, pp: "tuple[int, ...] | None" = None,
               ep: "tuple[int, ...] | None" = None, zero: tuple[int, ...] = ZERO_LEVELS,
               mbs: "tuple[int, ...] | None" = None, schedules: "tuple[str, ...] | None" = None,
               vpp: tuple[int, ...] = (2, 4), recompute: tuple[str, ...] = RECOMPUTE,
               cp: tuple[int, ...] = (1,), sp: tuple[bool, ...] = (False,), all_devices: bool = True,
               overlap_param: tuple[bool, ...] = (False,), tp_async: tuple[bool, ...] = (False,),
               grad_fusion: tuple[bool, ...] = (False,)) -> Space:
    """The space of ``model`` on ``devices`` devices of ``cluster``.

    Defaults: ``tp`` the divisors of ``devices`` up to the devices per node that the model's
    heads, KV heads, FFN and vocabulary allow; ``pp`` the divisors of ``devices`` up to the layer
    count; ``ep`` (MoE) the divisors of ``devices`` that divide the expert count; ``mbs`` the
    powers of two up to 8 that divide the global batch; ``cp`` (context parallelism) and ``sp``
    (sequence parallelism, with tp > 1) off unless choices are passed, e.g. ``cp=(1, 2), sp=(False, True)``;
    ``overlap_param`` (zero 1 or 2), ``tp_async`` (tp > 1) and ``grad_fusion`` likewise, e.g.
    ``tp_async=(False, True)``.
    ``all_devices=False``: strategies on fewer devices are points too (``tp`` and ``pp`` then also
    take the divisors of the devices per node and of the layer count).
    """
    m = get_model(model)
    c = get_cluster(cluster)
    _check_inputs(m, c, devices, global_batch, seq_len)
    divs = divisors(devices)
    if not all_devices:
        divs = sorted(set(divs) | {d for d in divisors(c.per_node) + divisors(m.layers) if d <= devices})
    if tp is None:
        tp = tuple(t for t in divs if t <= c.per_node and not _tp_problems(m, t))
    if pp is None:
        pp = tuple(p for p in divs if p <= m.layers)
    if ep is None:
        ep = tuple(e for e in divs if m.experts and m.experts % e == 0) if m.is_moe else (1,)
    if mbs is None:
        mbs = tuple(b for b in (1, 2, 4, 8) if global_batch % b == 0)
    schedules = schedule_names() if schedules is None else schedules
    for name, axis in (("tp", tp), ("pp", pp), ("ep", ep), ("zero", zero), ("mbs", mbs),
                       ("schedules", schedules), ("recompute", recompute)):
        if not axis:
            raise StrategyError(f"the {name} axis of the space for {m.name} on {devices} devices is empty; "
                                f"pass explicit {name} choices")
    bad = [s for s in schedules if s not in schedule_names()]
    if bad:
        raise StrategyError(f"unknown schedules {bad}; use some of {', '.join(schedule_names())}")
    return Space(m, devices, c.per_node, global_batch, seq_len, tuple(tp), tuple(pp), tuple(ep), tuple(zero),
                 tuple(mbs), tuple(schedules), tuple(vpp), tuple(recompute), tuple(int(x) for x in cp),
                 tuple(bool(x) for x in sp), all_devices, tuple(bool(x) for x in overlap_param),
                 tuple(bool(x) for x in tp_async), tuple(bool(x) for x in grad_fusion))


def enumerate_space(model: "str | ModelSpec", cluster: "str | Cluster", *, devices: int, global_batch: int,
                    seq_len: int, **axes: Any) -> list[Strategy]:
    """Every valid canonical strategy of ``model`` on ``devices`` devices (see :func:`make_space`
    for the axes, which ``axes`` may restrict)."""
    return make_space(model, cluster, devices=devices, global_batch=global_batch, seq_len=seq_len,
                      **axes).enumerate()


def _tp_problems(model: ModelSpec, tp: int) -> list[str]:
    return Strategy(tp=tp).problems(model)


def _check_inputs(model: ModelSpec, cluster: Cluster, devices: int, global_batch: int, seq_len: int) -> None:
    for name, v in (("devices", devices), ("global_batch", global_batch), ("seq_len", seq_len)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise StrategyError(f"{name}={v!r} must be a positive integer")
    if devices > cluster.devices:
        raise StrategyError(f"{devices} devices do not fit in {cluster.name} ({cluster.devices} devices); "
                            f"use a bigger cluster such as {cluster.with_devices(devices).name}")
