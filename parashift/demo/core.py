"""The demo's records: figures with units, one result per step, and the step runner.

A step is a function ``(ctx) -> StepResult``. A step whose capability is not in this build raises
:class:`NotAvailable` and is reported as ``not available: <why>``; any other error is reported as
``failed: <error>``. Nothing is ever faked: a figure exists only if it was computed.
"""
from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..errors import ParashiftError

__all__ = ["Figure", "StepResult", "DemoContext", "NotAvailable", "DemoError", "run_step", "require"]


#: Units whose values are counts (printed as whole numbers).
_COUNTS = ("devices", "messages", "pieces", "instructions", "steps", "events", "trials", "stages", "switches")


class NotAvailable(Exception):
    """A step's capability is missing from this build (the message says which, and why)."""


class DemoError(ParashiftError, RuntimeError):
    """The demo could not run as asked, or a step failed (the summary says which)."""


@dataclass(frozen=True)
class Figure:
    """One reported number: ``value`` in ``unit`` (``""`` for a pure ratio or count)."""

    name: str
    value: float
    unit: str
    note: str = ""

    def text(self) -> str:
        """The value for people: counts whole, large values with thousands separators, small ones
        to three significant digits; then the unit."""
        v = self.value
        if isinstance(v, (int, np.integer)) or self.unit in _COUNTS:
            s = f"{int(round(v)):,}"
        elif abs(v) >= 1000:
            s = f"{v:,.0f}"
        elif abs(v) >= 10:
            s = f"{v:.1f}"
        else:
            s = f"{v:.3g}"
        return f"{s} {self.unit}".strip()


@dataclass
class StepResult:
    """What one demo step produced: its figures, its files (relative to the output folder), a
    markdown body for the summary, and its status (``ok``, ``not available: ...``, ``failed: ...``)."""

    number: int
    title: str
    status: str = "ok"
    figures: list[Figure] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)      # caption -> relative path
    body: str = ""
    seconds: float = 0.0
    data: dict[str, Any] = field(default_factory=dict, repr=False)   # tables/results for callers

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def add(self, name: str, value: float, unit: str, note: str = "") -> None:
        self.figures.append(Figure(name, value, unit, note))

    def figure(self, name: str) -> Figure:
        for f in self.figures:
            if f.name == name:
                return f
        raise KeyError(f"step {self.number} has no figure {name!r}; it has {[f.name for f in self.figures]}")

    def to_json(self) -> dict:
        return {"step": self.number, "title": self.title, "status": self.status, "seconds": self.seconds,
                "figures": {f.name: {"value": f.value, "unit": f.unit} for f in self.figures},
                "files": dict(self.files)}


@dataclass
class DemoContext:
    """Shared by the steps: the output folder, the progress callback, and what earlier steps left
    for later ones (``shared``: keys starting with ``share_``)."""

    out: Path
    progress: Callable[[str], None] | None = None
    shared: dict[str, Any] = field(default_factory=dict)

    def say(self, text: str) -> None:
        if self.progress is not None:
            self.progress(text)

    def path(self, name: str) -> str:
        return str(self.out / name)


def require(module: str, *names: str) -> Any:
    """Import ``module`` and check it has ``names``; raise :class:`NotAvailable` saying what is missing."""
    import importlib
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise NotAvailable(f"{module} cannot be imported ({e})") from None
    missing = [n for n in names if not hasattr(mod, n)]
    if missing:
        raise NotAvailable(f"{module} has no {', '.join(missing)} yet")
    return mod


def run_step(number: int, title: str, fn: Callable[[DemoContext, StepResult], None], ctx: DemoContext) -> StepResult:
    """Run one step, turning a missing capability or an error into the step's status."""
    res = StepResult(number, title)
    t0 = time.perf_counter()
    try:
        fn(ctx, res)
    except NotAvailable as e:
        res.status = f"not available: {e}"
    except Exception as e:  # noqa: BLE001 - any failure of a step is reported in the summary, loudly
        last = traceback.extract_tb(e.__traceback__)[-1]
        res.status = f"failed: {type(e).__name__}: {e} (at {Path(last.filename).name}:{last.lineno})"
    res.seconds = time.perf_counter() - t0
    return res
