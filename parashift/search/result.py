"""What a search returns: the best strategy, every trial as a table, plots and the deploy plan."""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..cluster import Cluster
from ..errors import PlanError
from ..models import ModelSpec
from ..strategy import Strategy

if TYPE_CHECKING:  # pragma: no cover
    import optuna
    import pandas as pd

    from .evaluate import Outcome

__all__ = ["Candidate", "SearchResult", "pareto_mask", "TRIAL_COLUMNS", "PLAN_FORMAT"]

TRIAL_COLUMNS = ("number", "state", "strategy", "status", "reason", "tp", "pp", "dp", "ep", "zero", "vpp", "mbs",
                 "schedule", "recompute", "tokens_per_s", "step_time", "peak_memory", "mfu", "bubble_fraction",
                 "cached", "simulated", "eval_seconds")
_AXES = ("tp", "pp", "dp", "ep", "zero", "vpp", "mbs", "schedule", "recompute")
#: ``meta["deploy"]["format"]`` of a deploy plan file (a Program JSON with deployment metadata)
PLAN_FORMAT = "parashift.plan"


@dataclass(frozen=True)
class Candidate:
    """A strategy with its simulated figures (seconds, tokens/s, bytes per device)."""

    strategy: Strategy
    step_time: float
    tokens_per_s: float
    peak_memory: float
    mfu: float = float("nan")
    bubble_fraction: float = float("nan")

    @classmethod
    def from_outcome(cls, strategy: Strategy, out: "Outcome") -> "Candidate":
        return cls(strategy, out.step_time, out.tokens_per_s, out.peak_memory, out.mfu, out.bubble_fraction)

    @property
    def world(self) -> int:
        return self.strategy.world

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": str(self.strategy), "step_time": self.step_time, "tokens_per_s": self.tokens_per_s,
                "peak_memory": self.peak_memory, "mfu": self.mfu, "bubble_fraction": self.bubble_fraction}

    def __str__(self) -> str:
        return (f"{self.strategy}: {self.tokens_per_s:,.0f} tokens/s, step {self.step_time:.3f} s, "
                f"peak {self.peak_memory / 2**30:.1f} GiB")


def pareto_mask(values: np.ndarray, maximize: "tuple[bool, ...]") -> np.ndarray:
    """Boolean mask of the non-dominated rows of ``values`` [n, k] (``maximize[j]``: direction of
    column j). Rows equal on every column do not dominate each other."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return np.zeros(len(v), dtype=bool)
    v = v * np.where(np.asarray(maximize), -1.0, 1.0)  # all minimized
    le = (v[:, None, :] <= v[None, :, :]).all(-1)      # le[i, j]: i no worse than j everywhere
    lt = (v[:, None, :] < v[None, :, :]).any(-1)       # ... and strictly better somewhere
    dominated = (le & lt).any(0)
    return ~dominated


@dataclass(frozen=True, eq=False)
class SearchResult:
    """The outcome of :func:`parashift.search.tune`.

    ``best``: the feasible strategy of highest tokens/s (None when nothing fits); ``pareto``: the
    non-dominated feasible strategies (tokens/s up, peak memory down), sorted by memory;
    ``trials``: every trial of the study (resumed ones included), columns ``TRIAL_COLUMNS``;
    ``evaluations``: strategies this call actually scored (cache misses).
    """

    model: ModelSpec
    cluster: Cluster
    devices: int
    global_batch: int
    seq_len: int
    objective: tuple[str, ...]
    best: Candidate | None
    pareto: tuple[Candidate, ...]
    trials: "pd.DataFrame" = field(repr=False)
    study: "optuna.Study" = field(repr=False)
    search_seconds: float = 0.0
    evaluations: int = 0
    cost_model: Any = field(default=None, repr=False)
    evaluator: Any = field(default=None, repr=False)

    @classmethod
    def from_study(cls, study: "optuna.Study", **kw: Any) -> "SearchResult":
        trials = trials_frame(study, kw["devices"])
        ok = trials[trials["status"] == "ok"].drop_duplicates("strategy")
        cands = [Candidate(Strategy.parse(r.strategy), r.step_time, r.tokens_per_s, r.peak_memory, r.mfu,
                           r.bubble_fraction) for r in ok.itertuples()]
        best = max(cands, key=lambda c: c.tokens_per_s, default=None)
        mask = pareto_mask(np.array([[c.tokens_per_s, c.peak_memory] for c in cands]).reshape(-1, 2), (True, False))
        front = tuple(sorted((c for c, keep in zip(cands, mask) if keep), key=lambda c: c.peak_memory))
        return cls(best=best, pareto=front, trials=trials, study=study, **kw)

    # ---- views ---------------------------------------------------------------------------------------
    @property
    def feasible_trials(self) -> int:
        return int((self.trials["status"] == "ok").sum())

    def top(self, k: int) -> list[Candidate]:
        """The ``k`` feasible distinct strategies of highest tokens/s."""
        ok = self.trials[self.trials["status"] == "ok"].drop_duplicates("strategy")
        ok = ok.sort_values(["tokens_per_s", "number"], ascending=[False, True]).head(k)
        return [Candidate(Strategy.parse(r.strategy), r.step_time, r.tokens_per_s, r.peak_memory, r.mfu,
                          r.bubble_fraction) for r in ok.itertuples()]

    def summary(self) -> dict[str, Any]:
        """The figures ``parashift search --json`` prints."""
        b = self.best
        return {"best": str(b.strategy) if b else None,
                "best_tokens_per_s": b.tokens_per_s if b else None,
                "best_step_time": b.step_time if b else None,
                "best_peak_memory": b.peak_memory if b else None,
                "trials": int(len(self.trials)), "feasible_trials": self.feasible_trials,
                "evaluations": self.evaluations, "search_seconds": self.search_seconds,
                "pareto": [c.to_dict() for c in self.pareto] if len(self.objective) > 1 else None}

    # ---- outputs -------------------------------------------------------------------------------------
    def program(self, strategy: "Strategy | None" = None) -> Any:
        """The compiled training-step Program of ``strategy`` (default: the best)."""
        s = strategy or self._best().strategy
        comp = getattr(self.evaluator, "program", None)
        if comp is not None:
            return comp(s)
        from .. import ir
        return ir.compile(self.model, s, global_batch=self.global_batch, seq_len=self.seq_len)

    def export(self, path: str, strategy: "Strategy | None" = None) -> dict[str, Any]:
        """Write the deploy plan of ``strategy`` (default: the best) to ``path`` and return it.

        The file is the compiled Program's JSON (``Program.load`` reads it) whose ``meta`` also
        holds ``deploy``: the model, strategy, batch, cluster, devices, the cost model used and
        the simulated figures; ``parashift run plan.json`` executes it.
        """
        cand = self._best() if strategy is None else self._candidate(strategy)
        obj = plan_json(self.program(cand.strategy), model=self.model, strategy=cand.strategy,
                        global_batch=self.global_batch, seq_len=self.seq_len, cluster=self.cluster,
                        devices=self.devices, cost_model=self.cost_model, predicted=cand.to_dict())
        with open(path, "w") as f:
            json.dump(obj, f, separators=(",", ":"))
        return obj

    def plot(self, path: str) -> str:
        """Optuna's optimization history (Pareto front when multi-objective) next to the parameter
        importances for tokens/s, as one image."""
        from .plots import plot_search
        return plot_search(self, path)

    # ---- helpers -------------------------------------------------------------------------------------
    def _best(self) -> Candidate:
        if self.best is None:
            raise PlanError(f"no feasible strategy among {len(self.trials)} trials for {self.model.name} on "
                            f"{self.devices} devices; run more trials, add devices or lower the global batch")
        return self.best

    def _candidate(self, strategy: "Strategy | str") -> Candidate:
        s = str(Strategy.parse(strategy))
        rows = self.trials[(self.trials["strategy"] == s) & (self.trials["status"] == "ok")]
        if rows.empty:
            raise PlanError(f"strategy {s} is not a feasible trial of this search; pick one from result.trials")
        r = next(rows.itertuples())
        return Candidate(Strategy.parse(s), r.step_time, r.tokens_per_s, r.peak_memory, r.mfu, r.bubble_fraction)


def plan_json(program: Any, *, model: ModelSpec, strategy: Strategy, global_batch: int, seq_len: int,
              cluster: Cluster, devices: int, cost_model: Any = None, predicted: dict | None = None) -> dict:
    """A deploy plan: ``program.to_json()`` with ``meta["deploy"]`` describing how it was made."""
    obj = program.to_json()
    if cost_model is None:
        from ..sim import CostModel
        cost_model = CostModel.for_cluster(cluster)
    deploy = {"format": PLAN_FORMAT, "model": model.name, "strategy": str(strategy), "global_batch": global_batch,
              "seq_len": seq_len, "cluster": cluster.name, "devices": devices,
              "cost_model": cost_model.to_json() if hasattr(cost_model, "to_json") else cost_model,
              "predicted": {k: (v if not (isinstance(v, float) and math.isnan(v)) else None)
                            for k, v in (predicted or {}).items()}}
    obj["meta"] = {**obj.get("meta", {}), "deploy": deploy}
    return obj


def trials_frame(study: "optuna.Study", devices: int) -> "pd.DataFrame":
    """One row per trial of ``study`` with its point, canonical strategy, outcome and reason."""
    import pandas as pd
    rows = []
    for ft in study.get_trials(deepcopy=False):
        ua, p = ft.user_attrs, dict(ft.params)
        row: dict[str, Any] = {"number": ft.number, "state": ft.state.name, "strategy": ua.get("strategy"),
                               "status": ua.get("status"), "reason": ua.get("reason", "")}
        if row["strategy"]:
            s = Strategy.parse(row["strategy"])
            row.update({a: getattr(s, a) for a in _AXES})
        else:
            tp, pp = p.get("tp"), p.get("pp")
            dp = devices // (tp * pp) if tp and pp and devices % (tp * pp) == 0 else None
            row.update({a: p.get(a) for a in _AXES})
            row.update(dp=dp, ep=p.get("ep", 1), vpp=p.get("vpp", 1))
        for a in ("tokens_per_s", "step_time", "peak_memory", "mfu", "bubble_fraction", "eval_seconds"):
            v = ua.get(a)
            row[a] = float(v) if v is not None else float("nan")
        row["cached"] = bool(ua.get("cached", False))
        row["simulated"] = bool(ua.get("simulated", False))
        rows.append(row)
    df = pd.DataFrame(rows, columns=list(TRIAL_COLUMNS))
    return df.astype({a: "Int64" for a in ("tp", "pp", "dp", "ep", "zero", "vpp", "mbs")})


def _pyplot() -> Any:
    """pyplot on the Agg backend (unless the caller already chose one)."""
    if "matplotlib.pyplot" not in sys.modules:
        import matplotlib
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
