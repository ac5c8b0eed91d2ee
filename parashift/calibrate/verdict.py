"""The verdict of a probe calibration: held-out step-time error against the measurement noise.

Each probe is predicted by a model fitted on the *other* probes (leave-one-out), so the error
says how the fitted model does on a strategy it has not seen; the noise is how much the probe's
own measured steps disagree with their median. A model whose held-out error is within twice the
noise is as good as the measurements allow; beyond that it misses something the probes show.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from ..cluster import Cluster
    from ..cost import CostModel
    from .probe import ProbeRun

__all__ = ["Verdict", "holdout_verdict"]

#: held-out error within this many times the noise counts as "as good as the measurements allow"
NOISE_FACTOR = 2.0


@dataclass(frozen=True)
class Verdict:
    """Per probe: the held-out predicted step time and its APE, and the measurement noise."""

    strategies: tuple[str, ...]
    measured: tuple[float, ...]
    held_out: tuple[float, ...]
    noise: tuple[float, ...]

    @property
    def held_out_ape(self) -> float:
        """Median absolute percentage error of the held-out predictions (a fraction)."""
        m, p = np.asarray(self.measured), np.asarray(self.held_out)
        return float(np.median(np.abs(p - m) / m)) if len(m) else float("nan")

    @property
    def noise_level(self) -> float:
        """Median over probes of the median relative deviation of a step from its probe's median."""
        return float(np.median(self.noise)) if self.noise else float("nan")

    @property
    def ok(self) -> bool:
        return bool(self.held_out_ape <= NOISE_FACTOR * max(self.noise_level, 0.01))

    def text(self) -> str:
        """One sentence a person reads at the end of the report."""
        e, n = self.held_out_ape * 100, self.noise_level * 100
        if self.ok:
            return (f"verdict: held-out step-time error {e:.1f}% is within {NOISE_FACTOR:g}x the measurement noise "
                    f"({n:.1f}%): the fitted model predicts unseen strategies as well as these measurements allow")
        return (f"verdict: held-out step-time error {e:.1f}% is more than {NOISE_FACTOR:g}x the measurement noise "
                f"({n:.1f}%): the model misses an effect the probes show; probe more strategies (--runs), run "
                f"longer (--steps) on a quieter machine, or try --refine")

    def to_json(self) -> dict[str, Any]:
        return {"held_out_ape": self.held_out_ape, "noise": self.noise_level, "ok": self.ok, "text": self.text(),
                "probes": [{"strategy": s, "measured": m, "held_out_predicted": p, "noise": z}
                           for s, m, p, z in zip(self.strategies, self.measured, self.held_out, self.noise)]}


def step_noise(step_times: Sequence[float]) -> float:
    """Median relative deviation of the measured steps from their median (0 for one step)."""
    t = np.asarray(step_times, dtype=float)
    if len(t) < 2:
        return 0.0
    med = float(np.median(t))
    return float(np.median(np.abs(t - med)) / med) if med > 0 else 0.0


def holdout_verdict(runs: "Sequence[ProbeRun]", cluster: "Cluster", *, base: "CostModel | None" = None,
                    host_cores: float | None = None, refine: bool = False) -> "Verdict | None":
    """Leave-one-out over ``runs`` (None with fewer than two probes: nothing to hold out)."""
    from ..sim import simulate
    from .fit import fit
    if len(runs) < 2:
        return None
    held = []
    for k, r in enumerate(runs):
        rest = [x for i, x in enumerate(runs) if i != k]
        f = fit([x.timeline for x in rest], cluster, programs=[x.program for x in rest], base=base,
                host_cores=host_cores, refine=refine, steps=refine)
        held.append(float(simulate(r.program, cluster, f.cost_model).step_time))
    return Verdict(tuple(str(r.strategy) for r in runs), tuple(r.step_time for r in runs), tuple(held),
                   tuple(step_noise(r.step_times) for r in runs))
