"""The exact top strategies of a space: enumeration with branch and bound.

Every valid strategy is either scored or proven unable to enter the top ``k``: strategies are
visited in decreasing order of their tokens/s upper bound (the evaluator's
``throughput_bound``), and the visit stops once the next bound is below the ``k``-th best
score. Without a bound every strategy is scored.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from .evaluate import CachedEvaluator, Evaluator, Outcome
from .result import Candidate, rank_key
from .space import Space

__all__ = ["exhaustive", "ExhaustiveResult"]


@dataclass(frozen=True)
class ExhaustiveResult:
    """The top candidates (best first), the space size, strategies scored and seconds taken."""

    top: tuple[Candidate, ...]
    space_size: int
    evaluated: int
    bounded: int
    seconds: float

    @property
    def best(self) -> Candidate | None:
        return self.top[0] if self.top else None


def exhaustive(space: Space, evaluate: "Evaluator | CachedEvaluator", *, top_k: int = 1,
               progress: "Callable[[int, int], None] | None" = None) -> ExhaustiveResult:
    """The ``top_k`` feasible strategies of ``space`` by tokens/s (exact; see the module doc)."""
    t0 = time.perf_counter()
    ev = evaluate if isinstance(evaluate, CachedEvaluator) else CachedEvaluator(evaluate)
    points = space.enumerate()
    bound = getattr(ev.evaluate, "throughput_bound", None)
    order = sorted(points, key=lambda s: -bound(s)) if bound is not None else points
    found: list[Candidate] = []
    evaluated = 0
    for i, s in enumerate(order):
        if bound is not None and len(found) >= top_k and bound(s) < found[top_k - 1].tokens_per_s:
            break
        out: Outcome
        out, _ = ev(s)
        evaluated += 1
        if out.ok:
            found.append(Candidate.from_outcome(s, out))
            found.sort(key=rank_key)
            del found[top_k:]
        if progress is not None:
            progress(i + 1, len(order))
    return ExhaustiveResult(tuple(found), len(points), evaluated, len(points) - evaluated,
                            time.perf_counter() - t0)
