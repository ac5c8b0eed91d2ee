"""Choosing a strategy per trace segment: the accounting of switches, and the optimal plan.

A trace is cut into segments ``[start, end)`` of constant device count. A *path* assigns each
segment a candidate id (``IDLE`` when nothing can run). Accounting, shared by every policy:

- a change of strategy at a segment's start stops training for the switch's ``cost(prev, cur)``
  seconds; the job trains at the new strategy's tokens/s for the rest of the segment;
- a switch longer than its segment keeps going into the next one (the job is *busy*); a
  further change queues behind it. The first strategy starts for free (``START``); leaving
  ``IDLE`` (no devices) costs ``cost(IDLE, cur)``, e.g. a restart from a checkpoint.

:func:`best_path` finds the path of most tokens exactly, by a label-setting dynamic program
over (segment, strategy) whose labels are the non-dominated (tokens so far, busy carry) pairs:
a label with more tokens and less carry can only do better from there on, because a later
ready time never trains more.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

__all__ = ["START", "IDLE", "PathResult", "run_path", "best_path", "greedy_path"]

START = -1   #: before the first segment
IDLE = -2    #: no strategy runs (no devices, or none fits)

Cost = Callable[[int, int], float]


@dataclass(frozen=True)
class PathResult:
    """Per segment of a path: the switch charged at its start, seconds lost to reconfiguration
    (busy inside the segment), seconds idle (no strategy), and tokens trained."""

    path: tuple[int, ...]
    switch_seconds: np.ndarray
    lost_seconds: np.ndarray
    idle_seconds: np.ndarray
    tokens: np.ndarray

    @property
    def switches(self) -> int:
        """Changes to a new strategy after the first start (resuming from IDLE included)."""
        p = np.asarray(self.path)
        ran = np.maximum.accumulate(p >= 0)                    # a strategy has run by segment i
        changed = np.concatenate([[False], p[1:] != p[:-1]])
        return int(np.count_nonzero(changed & (p >= 0) & np.concatenate([[False], ran[:-1]])))

    @property
    def total_tokens(self) -> float:
        return float(self.tokens.sum())

    @property
    def total_lost(self) -> float:
        return float(self.lost_seconds.sum())


def _step(carry: float, prev: int, cur: int, start: float, end: float, cost: Cost) -> tuple[float, float, float]:
    """One segment: (switch seconds charged, busy-until time, new carry past ``end``)."""
    sw = 0.0 if (cur == prev or cur == IDLE or prev == START) else float(cost(prev, cur))
    busy = start + carry + sw
    return sw, busy, max(0.0, busy - end)


def run_path(start: np.ndarray, end: np.ndarray, path: Sequence[int], tps: Sequence[float], cost: Cost) -> PathResult:
    """Account a given path (``tps[j]``: tokens/s of candidate j)."""
    n = len(path)
    sw, lost, idle, tok = (np.zeros(n) for _ in range(4))
    carry, prev = 0.0, START
    for i, cur in enumerate(path):
        s, e = float(start[i]), float(end[i])
        sw[i], busy, carry = _step(carry, prev, cur, s, e, cost)
        if cur == IDLE:
            idle[i] = e - s
        else:
            lost[i] = min(e - s, max(0.0, busy - s))
            tok[i] = max(0.0, e - max(s, busy)) * tps[cur]
        prev = START if (prev == START and cur == IDLE) else cur
    return PathResult(tuple(int(p) for p in path), sw, lost, idle, tok)


def greedy_path(options: Sequence[Sequence[int]], tps: Sequence[float]) -> list[int]:
    """Per segment the option of most tokens/s (ties: the first listed), IDLE when none."""
    return [max(opts, key=lambda j: (tps[j], -list(opts).index(j))) if opts else IDLE for opts in options]


@dataclass
class _Label:
    tokens: float
    carry: float
    choice: int               # this segment's candidate (or IDLE)
    parent: "_Label | None"   # the label of the previous segment


def _prune(labels: list[_Label]) -> list[_Label]:
    """The non-dominated labels (more tokens, less carry)."""
    labels.sort(key=lambda lb: (lb.carry, -lb.tokens))
    out: list[_Label] = []
    best = -np.inf
    for lb in labels:
        if lb.tokens > best:
            out.append(lb)
            best = lb.tokens
    return out


def best_path(start: np.ndarray, end: np.ndarray, options: Sequence[Sequence[int]], tps: Sequence[float],
              cost: Cost) -> list[int]:
    """The path of most tokens (``options[i]``: candidate ids allowed in segment i; an empty
    list means IDLE)."""
    root = _Label(0.0, 0.0, START, None)
    frontier: dict[int, list[_Label]] = {START: [root]}  # state (strategy running) -> labels
    for i, opts in enumerate(options):
        s, e = float(start[i]), float(end[i])
        made: dict[int, list[_Label]] = {}
        for cur in (list(opts) or [IDLE]):
            rate = 0.0 if cur == IDLE else float(tps[cur])
            for prev, labels in frontier.items():
                state = START if (prev == START and cur == IDLE) else cur
                for lb in labels:
                    _, busy, carry = _step(lb.carry, prev, cur, s, e, cost)
                    gain = max(0.0, e - max(s, busy)) * rate
                    made.setdefault(state, []).append(_Label(lb.tokens + gain, carry, cur, lb))
        frontier = {k: _prune(v) for k, v in made.items()}
    best = max((lb for labels in frontier.values() for lb in labels), key=lambda lb: lb.tokens)
    out: list[int] = []
    node: _Label | None = best
    while node is not None and node.parent is not None:
        out.append(node.choice)
        node = node.parent
    return out[::-1]
