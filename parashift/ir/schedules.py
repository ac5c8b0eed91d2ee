"""Pipeline schedules as data: each recipe returns every stage's order of actions, which
:class:`~parashift.ir.directives.Order` applies to the graph, and each schedule is one
:class:`~parashift.schedules.Schedule` record in the registry of :mod:`parashift.schedules` (chunks per
stage, V shape, split backward, the rules it checks, its published bubble formula), which names its
recipe here (:data:`BUILTIN_RECIPES`) or carries it: a new schedule is one :func:`register` call.

- ``gpipe``: all forwards, then all backwards.
- ``1f1b``: stage s runs ``pp - s - 1`` warm-up forwards, alternates one forward and one backward,
  then drains the backwards (Megatron-LM / torch.distributed.pipelining order).
- ``interleaved-1f1b``: Megatron's interleaved schedule over ``vpp`` chunks per stage (chunk c on
  stage ``c % pp``).
- ``zb-h1``: zero-bubble H1: backward split into input-grad (I) and weight-grad (W); I has priority,
  forwards keep 1F1B's in-flight bound (``pp - s``), and every stage defers up to ``pp - 1``
  weight-grads, which fill the cool-down bubbles (the last stages' deferred W's let the
  input-grads reach the first stage early: the bubble is ZB-H1's ``(p-1)(F+I-W)``).
- ``zb-2p``: zero-bubble with twice 1F1B's activation memory (ZB-H2's bound: stage s keeps up to
  ``2(pp - s) - 1`` micro-batches in flight, ``2 pp - 1`` weight-grads deferred); its extra warm-up
  forwards fill the start, deferred weight-grads the end: no bubble within a stage's span when F = I = W.
- ``zb-v``: ZB-V, the V placement with split backward and 1F1B's activation memory (``2 pp`` chunk
  forwards in flight per stage); no bubble within a stage's span when F = I = W.
- ``dualpipev``: V-shaped placement (stage s holds chunks s and 2*pp-1-s), split backward, and a
  forward of one micro-batch overlapped with the input-grad backward of another when both are ready
  (``&`` steps), so one's all-to-alls and p2p hide behind the other's compute.

zb-h1, zb-2p, zb-v and dualpipev are produced by a deterministic list scheduler that plays the stages forward in
time with per-chunk F/I/W durations and a p2p latency (:class:`ScheduleCosts`; unit costs F = I = W = 1
by default, ``ir.compile`` passes an estimate from FLOPs and TP communication), so weight-grads fill
the time a stage would otherwise wait; write your own schedule as text (``"0F0 0F1 0B0 ..."``) and pass
``Order({stage: text})``.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable

from ..errors import StrategyError
from ..schedules import Schedule, get_schedule, register, schedule_names
from ..strategy import Strategy
from .actions import Action, Step
from .directives import Order

__all__ = ["gpipe", "one_f_one_b", "interleaved_1f1b", "zb_h1", "zb_2p", "zb_v", "dualpipev", "RECIPES", "schedule_steps",
           "schedule_order", "ScheduleCosts", "Schedule", "register", "get_schedule", "schedule_names",
           "split_backward", "BUILTIN_RECIPES"]

Orders = dict[int, list[Step]]


def _one(acts: list[Action]) -> list[Step]:
    return [(a,) for a in acts]


def gpipe(pp: int, m: int) -> Orders:
    """All forwards then all backwards (micro-batches in order), one chunk per stage."""
    return {s: _one([Action(s, "F", i) for i in range(m)] + [Action(s, "B", i) for i in range(m)])
            for s in range(pp)}


def one_f_one_b(pp: int, m: int) -> Orders:
    """Canonical 1F1B (PipeDream-flush)."""
    out: Orders = {}
    for s in range(pp):
        w = min(pp - s - 1, m)
        acts = [Action(s, "F", i) for i in range(w)]
        for i in range(m - w):
            acts += [Action(s, "F", w + i), Action(s, "B", i)]
        acts += [Action(s, "B", i) for i in range(m - w, m)]
        out[s] = _one(acts)
    return out


def interleaved_1f1b(pp: int, vpp: int, m: int) -> Orders:
    """Megatron-LM's interleaved 1F1B; ``m`` must be a multiple of ``pp``."""
    if m % pp:
        raise StrategyError(f"interleaved-1f1b needs the micro-batch count ({m}) to be a multiple of pp={pp}")
    total = m * vpp
    group = pp * vpp

    def act(k: int, s: int, fwd: bool) -> Action:
        kg = k % group
        local = kg // pp
        if not fwd:
            local = vpp - 1 - local
        mb = (k // group) * pp + kg % pp
        return Action(local * pp + s, "F" if fwd else "B", mb)

    out: Orders = {}
    for s in range(pp):
        warm = total if m == pp else min((pp - s - 1) * 2 + (vpp - 1) * pp, total)
        acts = [act(k, s, True) for k in range(warm)]
        for k in range(total - warm):
            acts += [act(warm + k, s, True), act(k, s, False)]
        acts += [act(k, s, False) for k in range(total - warm, total)]
        out[s] = _one(acts)
    return out


@dataclass(frozen=True)
class ScheduleCosts:
    """Durations the list scheduler plans with: per chunk, its forward (``f``), input-grad (``i``) and
    weight-grad (``w``) backward, plus the latency of a p2p hand-off between stages (``p2p``). Any
    time unit works; only ratios matter."""

    f: tuple[float, ...]
    i: tuple[float, ...]
    w: tuple[float, ...]
    p2p: float = 0.0

    def __post_init__(self) -> None:
        if not (len(self.f) == len(self.i) == len(self.w)) or not self.f:
            raise StrategyError("ScheduleCosts needs one F, I and W duration per chunk (equal, non-empty lengths)")
        if min(self.f + self.i + self.w) <= 0 or self.p2p < 0:
            raise StrategyError("ScheduleCosts durations must be positive and p2p non-negative")

    @classmethod
    def unit(cls, chunks: int) -> "ScheduleCosts":
        """F = I = W = 1 for every chunk, free hand-offs (the classic unit-cost schedule)."""
        return cls((1.0,) * chunks, (1.0,) * chunks, (1.0,) * chunks, 0.0)

    @classmethod
    def uniform(cls, chunks: int, f: float, i: float, w: float, p2p: float = 0.0) -> "ScheduleCosts":
        """The same F/I/W durations for every chunk."""
        return cls((float(f),) * chunks, (float(i),) * chunks, (float(w),) * chunks, float(p2p))

    def of(self, a: Action) -> float:
        """Duration of one action (a full backward ``B`` takes I + W)."""
        if a.type == "B":
            return self.i[a.chunk] + self.w[a.chunk]
        return (self.f if a.type == "F" else self.i if a.type == "I" else self.w)[a.chunk]


def _f_first(a: Action) -> tuple[int, int]:
    """Forward priority: the deepest chunk first, then the oldest micro-batch."""
    return -a.chunk, a.mb


def _b_first(a: Action) -> tuple[int, int]:
    """Backward priority: the oldest micro-batch first, then the deepest chunk."""
    return a.mb, -a.chunk


def _list_schedule(pp: int, m: int, chunk_stage: list[int], limit: Callable[[int], int],
                   wlimit: Callable[[int], int], overlap: bool, costs: "ScheduleCosts | None" = None) -> Orders:
    """Greedy list scheduler with split backward, simulated in time with ``costs`` (unit costs by
    default). A free stage runs a W first when more than ``wlimit(s)`` weight-grads are pending, else
    a ready I, then a ready F (at most ``limit(s)`` forwards awaiting their I), then a W: weight-grads
    only fill time the stage would otherwise spend waiting for a neighbour.

    A filler is not started when what it would delay arrives sooner than half its length: an F waits
    for an input-grad due before ``t + F/2``, a W for an input-grad or forward due before ``t + W/2``
    (with p2p latency those arrive just after the stage frees up; starting the filler would delay
    the critical chain by nearly its whole length). With free hand-offs this never waits.

    Event-driven: a stage is looked at only when it frees up or when an action it depends on
    completes (its output arrives), so planning costs O(actions), not O(actions x stages)."""
    chunks = len(chunk_stage)
    cost = costs or ScheduleCosts.unit(chunks)
    if len(cost.f) != chunks:
        raise StrategyError(f"ScheduleCosts has {len(cost.f)} chunks, the schedule {chunks}; pass one duration per chunk")
    eps = 1e-9 * max(cost.f + cost.i + cost.w)
    p2p = cost.p2p
    inf = float("inf")
    # done[typ][c][i]: when (c, typ, i) finished; arrival on another stage adds the p2p latency
    done = {typ: [[inf] * m for _ in range(chunks)] for typ in "FIW"}
    nxt = {typ: [0] * chunks for typ in "FIW"}
    lim = [limit(s) for s in range(pp)]
    wlim = [wlimit(s) for s in range(pp)]
    busy = [0.0] * pp
    inflight = [0] * pp
    pending_w = [0] * pp
    out: Orders = {s: [] for s in range(pp)}
    mine = {s: [c for c in range(chunks) if chunk_stage[c] == s] for s in range(pp)}
    first = {s: min(mine[s]) for s in range(pp)}
    # who waits on an action's output: (stage, extra latency) per (type, chunk)
    waiters: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for c in range(chunks):
        here = chunk_stage[c]
        nbrs = {"F": [c] + ([c + 1] if c + 1 < chunks else []), "I": [c] + ([c - 1] if c > 0 else []), "W": []}
        for typ, cs in nbrs.items():
            waiters[(typ, c)] = sorted({(chunk_stage[d], p2p if chunk_stage[d] != here else 0.0) for d in cs})
    remaining = 3 * chunks * m
    # (time, stage); stage -1 marks a bare time point (a p2p arrival), which only anchors the
    # eps-window of simultaneous events
    events: list[tuple[float, int]] = [(0.0, s) for s in range(pp)]
    heapq.heapify(events)
    rounds = 0

    def arrived(typ: str, c: int, i: int, s: int, t: float) -> bool:
        d = done[typ][c][i]
        return (d + p2p if chunk_stage[c] != s else d) <= t + eps

    def ready(c: int, typ: str, i: int, s: int, t: float) -> bool:
        if typ == "F":
            return c == 0 or arrived("F", c - 1, i, s, t)
        if typ == "I":
            return arrived("F", c, i, s, t) and (c == chunks - 1 or arrived("I", c + 1, i, s, t))
        return arrived("I", c, i, s, t)

    def arrival(typ: str, c: int, i: int, s: int) -> float:
        d = done[typ][c][i]
        return d + p2p if chunk_stage[c] != s else d

    def eta_i(s: int) -> float:
        """When this stage's next input-grad could start (inf: a dependency is not scheduled yet)."""
        out = inf
        for c in mine[s]:
            i = nxt["I"][c]
            if i < m:
                out = min(out, max(arrival("F", c, i, s), arrival("I", c + 1, i, s) if c < chunks - 1 else 0.0))
        return out

    def eta_f(s: int) -> float:
        """When this stage's next forward could start, within the in-flight bound."""
        out = inf
        for c in mine[s]:
            i = nxt["F"][c]
            if 0 < c and i < m and (inflight[s] < lim[s] or c > first[s]):
                out = min(out, arrival("F", c - 1, i, s))
        return out

    while remaining:
        t, s0 = heapq.heappop(events)
        todo = {s0}
        while events and events[0][0] <= t + eps:
            todo.add(heapq.heappop(events)[1])
        todo.discard(-1)
        queue = sorted(todo)
        heapq.heapify(queue)
        seen = set(queue)
        while queue:
            s = heapq.heappop(queue)
            if busy[s] > t + eps:
                continue
            cand: dict[str, list[Action]] = {"F": [], "I": [], "W": []}
            for c in mine[s]:
                for typ in "FIW":
                    i = nxt[typ][c]
                    if i < m and ready(c, typ, i, s, t):
                        cand[typ].append(Action(c, typ, i))
            # past the bound, only forwards that continue a micro-batch this stage already holds (the
            # V's second chunk) may run: they lead to its input-grads, so the bound cannot deadlock
            fl = [a for a in cand["F"] if inflight[s] < lim[s] or a.chunk > first[s]]
            f0 = min(fl, key=_f_first) if fl else None
            i0 = min(cand["I"], key=_b_first) if cand["I"] else None
            w0 = min(cand["W"], key=_b_first) if cand["W"] else None
            step: tuple[Action, ...]
            if w0 is not None and pending_w[s] > wlim[s]:
                step = (w0,)
            elif overlap and f0 is not None and i0 is not None and f0.chunk != i0.chunk:
                step = (f0, i0)
            elif i0 is not None:
                step = (i0,)
            elif f0 is not None and eta_i(s) >= t + cost.of(f0) / 2:
                step = (f0,)
            elif f0 is None and w0 is not None and min(eta_i(s), eta_f(s)) >= t + cost.of(w0) / 2:
                step = (w0,)
            else:
                continue   # what is on its way matters more than a filler that would delay it
            end = t + sum(cost.of(a) for a in step)
            busy[s] = end
            heapq.heappush(events, (end, s))
            if p2p:
                heapq.heappush(events, (end + p2p, -1))
            for a in step:
                done[a.type][a.chunk][a.mb] = end
                nxt[a.type][a.chunk] += 1
                inflight[s] += 1 if a.type == "F" else -1 if a.type == "I" else 0
                pending_w[s] += 1 if a.type == "I" else -1 if a.type == "W" else 0
                remaining -= 1
                for st, lat in waiters[(a.type, a.chunk)]:
                    if st > s and st not in seen and end + lat <= t + eps:
                        heapq.heappush(queue, st)  # ready within this instant: the stage loop reaches it
                        seen.add(st)
                    elif st != s:
                        heapq.heappush(events, (end + lat, st))
            out[s].append(step)
        rounds += 1
        if remaining and (not events or rounds > 100 * (3 * chunks * m + pp)):  # pragma: no cover
            raise StrategyError("the list scheduler made no progress; report this schedule as a bug")
    return out


def zb_h1(pp: int, m: int, costs: "ScheduleCosts | None" = None) -> Orders:
    """Zero-bubble H1: 1F1B's in-flight bound, backward split, weight-grads fill the bubbles
    (planned with ``costs``, unit costs by default)."""
    return _list_schedule(pp, m, list(range(pp)), lambda s: pp - s, lambda s: pp - 1, overlap=False,
                          costs=costs)


def zb_2p(pp: int, m: int, costs: "ScheduleCosts | None" = None) -> Orders:
    """Zero-bubble 2p: ZB-H2's bound (stage s keeps up to ``2(pp - s) - 1`` micro-batches awaiting their
    input-grad and ``2 pp - 1`` weight-grads pending: about twice zb-h1's activations), so the extra warm-up
    forwards fill the start and the deferred weight-grads the end (planned with ``costs``, unit by default)."""
    return _list_schedule(pp, m, list(range(pp)), lambda s: 2 * (pp - s) - 1, lambda s: 2 * pp - 1, overlap=False,
                          costs=costs)


def _v_stages(pp: int) -> list[int]:
    """Stage of each of the 2*pp chunks of a V: down the stages, then back up."""
    return [c if c < pp else 2 * pp - 1 - c for c in range(2 * pp)]


def zb_v(pp: int, m: int, costs: "ScheduleCosts | None" = None) -> Orders:
    """ZB-V: the V placement (stage s holds chunks s and 2*pp-1-s), split backward and 1F1B's activation
    memory (at most ``2 * pp`` chunk forwards awaiting their input-grad on every stage, i.e. ``pp`` whole
    micro-batches), weight-grads deferred to fill the bubbles (planned with ``costs``, unit by default)."""
    return _list_schedule(pp, m, _v_stages(pp), lambda s: 2 * pp, lambda s: 2 * pp, overlap=False, costs=costs)


def dualpipev(pp: int, m: int, costs: "ScheduleCosts | None" = None) -> Orders:
    """DualPipeV: stage s holds chunks s and 2*pp-1-s; forwards overlap input-grad backwards
    (planned with ``costs``, unit costs by default)."""
    return _list_schedule(pp, m, _v_stages(pp), lambda s: 2 * pp, lambda s: pp, overlap=True, costs=costs)


# ---- the recipes behind the registry's records (parashift.schedules) --------------------------------
Recipe = Callable[[Strategy, int, "ScheduleCosts | None"], Orders]


def _interleaved(s: Strategy, m: int, costs: "ScheduleCosts | None") -> Orders:
    if s.pp == 1:
        return {0: _one([Action(c, "F", i) for i in range(m) for c in range(s.vpp)]
                        + [Action(c, "B", i) for i in range(m) for c in reversed(range(s.vpp))])}
    return interleaved_1f1b(s.pp, s.vpp, m)


BUILTIN_RECIPES: dict[str, Recipe] = {
    "gpipe": lambda s, m, c: gpipe(s.pp, m),
    "1f1b": lambda s, m, c: one_f_one_b(s.pp, m),
    "interleaved-1f1b": _interleaved,
    "zb-h1": lambda s, m, c: zb_h1(s.pp, m, c),
    "zb-2p": lambda s, m, c: zb_2p(s.pp, m, c),
    "zb-v": lambda s, m, c: zb_v(s.pp, m, c),
    "dualpipev": lambda s, m, c: dualpipev(s.pp, m, c),
}


def _order(sched: Schedule, s: Strategy, m: int, costs: "ScheduleCosts | None" = None) -> Orders:
    """Every stage's steps of ``sched`` for ``m`` micro-batches (``costs`` for list-scheduled recipes)."""
    recipe = BUILTIN_RECIPES.get(sched.recipe) if isinstance(sched.recipe, str) else sched.recipe
    if recipe is None:
        raise StrategyError(f"schedule {sched.name} names no known recipe ({sched.recipe!r}); pass a callable "
                            f"or one of {', '.join(BUILTIN_RECIPES)}")
    return recipe(s, m, costs if sched.costs != "never" else None)


class _Recipes(dict):
    """``RECIPES[name](strategy, m)``: the registry's order recipes (kept for callers of the old table)."""

    def __missing__(self, key: str):
        return lambda s, m: _order(get_schedule(key), s, m)


RECIPES: dict[str, Callable[[Strategy, int], Orders]] = _Recipes()
for _n in schedule_names():
    RECIPES[_n] = (lambda n: lambda s, m: _order(get_schedule(n), s, m))(_n)


def schedule_steps(strategy: Strategy, m: int, costs: "ScheduleCosts | None" = None) -> Orders:
    """Every stage's steps for ``strategy.schedule`` with ``m`` micro-batches; the list-scheduled
    recipes (zb-h1, zb-2p, zb-v, dualpipev) plan with ``costs`` (unit costs when None)."""
    return _order(get_schedule(strategy.schedule), strategy, m, costs)


def schedule_order(strategy: Strategy, m: int, costs: "ScheduleCosts | None" = None) -> Order:
    """The schedule as one Order directive."""
    return Order(schedule_steps(strategy, m, costs))


def split_backward(schedule: str) -> bool:
    """Whether a schedule runs input-grad and weight-grad backwards separately."""
    return get_schedule(schedule).split_backward
