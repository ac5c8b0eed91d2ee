"""Scoring one strategy: the evaluator protocol, the simulator-backed evaluator and its cache.

An *evaluator* is any callable ``evaluate(strategy) -> Outcome``; it may also offer
``throughput_bound(strategy) -> float``, an upper bound of its tokens/s that lets the search
skip strategies that cannot beat the best so far. The search only talks to this protocol, so
tests can inject a small analytic evaluator and the benchmark can share one cache between
runs. :class:`SimEvaluator` is the real one: a memory lower bound first (model states plus the
activations the schedule must hold exceed the device: infeasible, nothing compiled), then
``ir.compile`` (a strategy the compiler rejects is invalid, never simulated), then
``sim.simulate``.
"""
from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from ..cluster import Cluster, get as get_cluster
from ..errors import ParashiftError, StrategyError
from ..models import ModelSpec, get as get_model
from ..strategy import Strategy
from .bounds import peak_memory_lower_bound, step_time_lower_bound

if TYPE_CHECKING:  # pragma: no cover
    from ..ir.program import Program

__all__ = ["Outcome", "Evaluator", "SimEvaluator", "CachedEvaluator", "STATUSES", "step_breakdown"]

#: ok: simulated and fits; infeasible: does not fit in memory; invalid: cannot run at all
STATUSES = ("ok", "infeasible", "invalid")
NAN = float("nan")


@dataclass(frozen=True)
class Outcome:
    """What scoring a strategy found.

    ``peak_memory``: the largest per-device peak in bytes (for an infeasible strategy rejected
    before simulation, the lower bound that ruled it out); ``memory_budget``: the bytes a device
    may use. ``seconds``: wall time the evaluation took; ``simulated``: whether the simulator ran.
    ``compute``, ``exposed_comm``, ``bubble``: the step time split (seconds, means over devices,
    summing to ``step_time``; see :func:`step_breakdown`).
    """

    status: str
    reason: str = ""
    step_time: float = NAN
    tokens_per_s: float = NAN
    peak_memory: float = NAN
    mfu: float = NAN
    bubble_fraction: float = NAN
    seconds: float = 0.0
    simulated: bool = False
    memory_budget: float = NAN
    compute: float = NAN
    exposed_comm: float = NAN
    bubble: float = NAN

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"outcome status {self.status!r} is not one of {STATUSES}")

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Outcome":
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        return cls(**{k: (NAN if v is None else v) for k, v in known.items()})


Evaluator = Callable[[Strategy], Outcome]


class SimEvaluator:
    """Scores strategies of one (model, cluster, batch) with the compiler and the simulator."""

    def __init__(self, model: "str | ModelSpec", cluster: "str | Cluster", *, global_batch: int, seq_len: int,
                 cost_model: Any = None, precheck: bool = True) -> None:
        self.model = get_model(model)
        self.cluster = get_cluster(cluster)
        self.global_batch = int(global_batch)
        self.seq_len = int(seq_len)
        self.cost_model = cost_model
        self.precheck = precheck
        self._budget: float | None = None

    def costs(self) -> Any:
        """The cost model in use (the cluster's defaults unless one was given)."""
        if self.cost_model is None:
            from ..sim import CostModel
            self.cost_model = CostModel.for_cluster(self.cluster)
        return self.cost_model

    def budget(self) -> float:
        """Bytes a device may use: the cost model's capacity less its reserve."""
        if self._budget is None:
            cm = self.costs()
            self._budget = float(cm.memory_capacity - cm.memory_reserved)
        return self._budget

    def size_problem(self, strategy: Strategy) -> "str | None":
        """Why the compiler refuses ``strategy``'s step for its size or batch split (checked first: the
        memory bound replays every micro-batch), or None."""
        from ..ir.compile import check_size
        try:
            check_size(0, strategy.num_microbatches(self.global_batch), strategy, self.global_batch)
        except StrategyError as e:
            return f"the compiler rejects it: {e}"
        return None

    def could_fit(self, strategy: Strategy) -> bool:
        """False when the step is over the compiler's size limit or the memory lower bound already exceeds the
        budget."""
        if self.size_problem(strategy) is not None:
            return False
        need = peak_memory_lower_bound(self.model, strategy, global_batch=self.global_batch, seq_len=self.seq_len)
        return need * (1 - 1e-9) <= self.budget()

    def throughput_bound(self, strategy: Strategy) -> float:
        """Tokens/s ``strategy`` cannot exceed (from :func:`.bounds.step_time_lower_bound`)."""
        t = step_time_lower_bound(self.model, strategy, global_batch=self.global_batch, seq_len=self.seq_len,
                                  cost_model=self.costs())
        return self.global_batch * self.seq_len / t if t > 0 else float("inf")

    def program(self, strategy: Strategy) -> "Program":
        """The training-step Program the simulator scores (and ``parashift run`` executes)."""
        from .. import ir
        return ir.compile(self.model, strategy, global_batch=self.global_batch, seq_len=self.seq_len)

    def __call__(self, strategy: Strategy) -> Outcome:
        t0 = time.perf_counter()
        problem = self.size_problem(strategy)
        if problem is not None:
            return Outcome("invalid", problem, seconds=time.perf_counter() - t0)
        if self.precheck:
            need, have = peak_memory_lower_bound(self.model, strategy, global_batch=self.global_batch,
                                                 seq_len=self.seq_len), self.budget()
            if need * (1 - 1e-9) > have:
                return Outcome("infeasible", f"model states and the activations the schedule holds need at "
                               f"least {need / 2**30:.1f} GiB per device, over the {have / 2**30:.1f} GiB "
                               "available", peak_memory=need, seconds=time.perf_counter() - t0, memory_budget=have)
        with _collector_paused():  # the Program and the simulation are freed before it resumes
            figures = self._simulate(strategy)
        if isinstance(figures, str):
            return Outcome("invalid", figures, seconds=time.perf_counter() - t0)
        step, tps, peak, mfu, bubble, fits, split = figures
        status, reason = "ok", ""
        if not fits:
            status = "infeasible"
            reason = f"peak memory {peak / 2**30:.1f} GiB per device exceeds the {self.budget() / 2**30:.1f} GiB available"
        return Outcome(status, reason, step, tps, peak, mfu, bubble, time.perf_counter() - t0, True, self.budget(),
                       *split)

    def _simulate(self, strategy: Strategy) -> "tuple | str":
        """Compile and simulate: (step time, tokens/s, peak bytes, MFU, bubble, fits, (compute,
        exposed comm, bubble seconds)), or why the compiler rejects the strategy."""
        from .. import sim
        try:
            prog = self.program(strategy)
        except StrategyError as e:
            return f"the compiler rejects it: {e}"
        r = sim.simulate(prog, self.cluster, self.costs())
        return (float(r.step_time), float(r.tokens_per_s), float(max(_values(r.peak_memory))), float(r.mfu),
                float(r.bubble_fraction), bool(r.fits), step_breakdown(r))


def step_breakdown(result: Any) -> tuple[float, float, float]:
    """(compute, exposed communication, bubble) seconds of a simulated step, means over devices.

    ``compute``: time the device's compute stream is busy; ``exposed_comm``: time a collective
    (stream ``comm``) runs while nothing computes; ``bubble``: the rest of the step (waiting on
    pipeline neighbours, point-to-point transfers, idling). The three sum to the step time.
    """
    raw = result.raw
    step = float(result.step_time)
    members = raw.folding.members
    spans: dict[int, dict[bool, list[tuple[float, float]]]] = {r: {True: [], False: []} for r in members}
    for r, stream, _ins, a, b in raw.records:
        if b > a and (stream == "compute" or stream == "comm"):
            spans[r][stream == "compute"].append((a, b))
    world = sum(len(m) for m in members.values())
    comp = comm = 0.0
    for r, m in members.items():
        busy = _union(spans[r][True])
        comp += _length(busy) * len(m)
        comm += (_length(_union(spans[r][True] + spans[r][False])) - _length(busy)) * len(m)
    comp, comm = comp / world, comm / world
    return comp, comm, max(0.0, step - comp - comm)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


class CachedEvaluator:
    """Memoizes an evaluator by strategy string; shareable between searches of the same setting."""

    def __init__(self, evaluate: Evaluator, cache: "dict[str, Outcome] | None" = None) -> None:
        self.evaluate = evaluate
        self.cache: dict[str, Outcome] = {} if cache is None else cache
        self.calls = 0  # evaluations actually run (cache misses)

    def __call__(self, strategy: Strategy) -> tuple[Outcome, bool]:
        """The outcome and whether it came from the cache."""
        key = str(strategy)
        hit = self.cache.get(key)
        if hit is not None:
            return hit, True
        out = self.evaluate(strategy)
        if not isinstance(out, Outcome):
            raise ParashiftError(f"the evaluator returned {type(out).__name__}, not an Outcome; "
                                 "an evaluator maps a Strategy to parashift.search.Outcome")
        self.calls += 1
        self.cache[key] = out
        return out, False

    def __getattr__(self, name: str) -> Any:  # program(), model, cluster... of the wrapped evaluator
        if name in ("evaluate", "cache", "calls"):
            raise AttributeError(name)
        return getattr(self.evaluate, name)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for one compile + simulate.

    Both allocate hundreds of thousands of short-lived objects, which trigger many full
    collections that only re-scan the (large, long-lived) heap; reference counting still frees
    them at once, and any cycles are collected after the evaluation. Results are unaffected.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _values(x: Any) -> list[float]:
    if isinstance(x, Mapping):
        return [float(v) for v in x.values()]
    try:
        return [float(v) for v in x]
    except TypeError:
        return [float(x)]
