"""What a search returns: the best strategy, every trial as a table, plots and the deploy plan."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..cluster import Cluster
from ..errors import PlanError
from ..models import ModelSpec
from ..strategy import Strategy
from ..units import format_bytes
from .plots import pyplot, render

if TYPE_CHECKING:  # pragma: no cover
    import optuna
    import pandas as pd

    from .evaluate import Outcome

__all__ = ["Candidate", "SearchResult", "plot_search", "pareto_mask", "rank_key", "complexity", "lost_on", "TRIAL_COLUMNS",
           "PLAN_FORMAT"]

NAN = float("nan")

TRIAL_COLUMNS = ("number", "state", "strategy", "status", "reason", "tp", "pp", "dp", "ep", "zero", "vpp", "mbs",
                 "schedule", "recompute", "tokens_per_s", "step_time", "peak_memory", "mfu", "bubble_fraction",
                 "compute", "exposed_comm", "bubble", "memory_budget", "cached", "simulated", "eval_seconds")
_FIGURES = ("step_time", "tokens_per_s", "peak_memory", "mfu", "bubble_fraction", "compute", "exposed_comm",
            "bubble", "memory_budget")
#: relative tokens/s difference below which two strategies tie (then memory, then simplicity decide)
TIE = 1e-6
#: share of the memory budget above which memory is the binding constraint
MEMORY_BOUND = 0.9
_AXES = ("tp", "pp", "dp", "ep", "zero", "vpp", "mbs", "schedule", "recompute")
#: ``meta["deploy"]["format"]`` of a deploy plan file (a Program JSON with deployment metadata)
PLAN_FORMAT = "parashift.plan"


@dataclass(frozen=True)
class Candidate:
    """A strategy with its simulated figures (seconds, tokens/s, bytes per device).

    ``compute``, ``exposed_comm`` and ``bubble`` split ``step_time`` (seconds);
    ``memory_budget``: the bytes a device may use.
    """

    strategy: Strategy
    step_time: float
    tokens_per_s: float
    peak_memory: float
    mfu: float = NAN
    bubble_fraction: float = NAN
    compute: float = NAN
    exposed_comm: float = NAN
    bubble: float = NAN
    memory_budget: float = NAN

    @classmethod
    def from_outcome(cls, strategy: Strategy, out: "Outcome") -> "Candidate":
        return cls(strategy, *(float(getattr(out, a)) for a in _FIGURES[:2]), out.peak_memory, out.mfu,
                   out.bubble_fraction, out.compute, out.exposed_comm, out.bubble, out.memory_budget)

    @classmethod
    def from_row(cls, r: Any) -> "Candidate":
        """From a row (namedtuple) of a trials frame."""
        return cls(Strategy.parse(r.strategy), *(float(getattr(r, a, NAN)) for a in _FIGURES))

    @property
    def world(self) -> int:
        return self.strategy.world

    @property
    def breakdown(self) -> dict[str, float]:
        """compute, exposed_comm and bubble (seconds) and peak_memory (bytes)."""
        return {"compute": self.compute, "exposed_comm": self.exposed_comm, "bubble": self.bubble,
                "peak_memory": self.peak_memory}

    @property
    def binding(self) -> str:
        """What bounds the step: ``memory`` (peak over 90% of the budget), else the largest of
        ``compute``, ``communication`` and ``bubble``."""
        if math.isfinite(self.memory_budget) and self.peak_memory >= MEMORY_BOUND * self.memory_budget:
            return "memory"
        parts = {"compute": self.compute, "communication": self.exposed_comm, "bubble": self.bubble}
        if not all(math.isfinite(v) for v in parts.values()):
            return "unknown"
        return max(parts, key=parts.get)

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": str(self.strategy), "devices_used": self.world, "step_time": _num(self.step_time),
                "tokens_per_s": _num(self.tokens_per_s), "peak_memory": _num(self.peak_memory),
                "mfu": _num(self.mfu), "bubble_fraction": _num(self.bubble_fraction),
                "breakdown": {k: _num(v) for k, v in self.breakdown.items()}, "binding": self.binding}

    def __str__(self) -> str:
        return (f"{self.strategy}: {self.tokens_per_s:,.0f} tokens/s, step {self.step_time:.3f} s, "
                f"peak {format_bytes(self.peak_memory)}")


def rank_key(c: Candidate) -> tuple:
    """Sort key, best first: tokens/s (within :data:`TIE`), then peak memory, then simplicity."""
    return (-_tie_round(c.tokens_per_s), c.peak_memory, complexity(c.strategy), str(c.strategy))


def complexity(s: Strategy) -> tuple[int, int]:
    """How much machinery a strategy uses (parallel axes, ZeRO stage, chunks, recomputation,
    a schedule other than 1F1B, each on/off option and hybrid sharding), then its device count:
    lower is simpler."""
    parts = (s.tp > 1) + (s.pp > 1) + (s.ep > 1) + (s.cp > 1) + s.zero + (s.vpp > 1) + (s.recompute != "none") \
        + (s.pp > 1 and s.schedule != "1f1b") + s.sp + s.overlap_grad + s.overlap_param + s.tp_async \
        + s.grad_fusion + (0 < s.shard < s.dp)
    return int(parts), s.world


def lost_on(c: Candidate, best: Candidate) -> str:
    """Why ``c`` ranks below ``best``, in words."""
    if c.strategy == best.strategy:
        return "winner"
    if _tie_round(c.tokens_per_s) < _tie_round(best.tokens_per_s):
        diffs = {"compute": c.compute - best.compute, "exposed communication": c.exposed_comm - best.exposed_comm,
                 "bubble": c.bubble - best.bubble}
        worse = sorted(((v, k) for k, v in diffs.items() if math.isfinite(v) and v >= 5e-5), reverse=True)
        why = ", ".join(f"+{v * 1e3:.1f} ms {k}" for v, k in worse[:2]) or "a longer step"
        return f"{(c.step_time / best.step_time - 1) * 100:.1f}% slower: {why}"
    if c.peak_memory > best.peak_memory:
        return f"ties on throughput, needs {format_bytes(c.peak_memory - best.peak_memory)} more memory"
    return "ties on throughput and memory; a less simple strategy"


def _tie_round(x: float) -> float:
    return float(f"{x:.6g}") if math.isfinite(x) else -math.inf


def _num(v: float) -> float | None:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


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
        cands = sorted((Candidate.from_row(r) for r in ok.itertuples()), key=rank_key)
        best = cands[0] if cands else None
        mask = pareto_mask(np.array([[_tie_round(c.tokens_per_s), c.peak_memory] for c in cands]).reshape(-1, 2),
                           (True, False))   # tokens/s within TIE are equal: the lighter one dominates
        front = tuple(sorted((c for c, keep in zip(cands, mask) if keep), key=lambda c: c.peak_memory))
        return cls(best=best, pareto=front, trials=trials, study=study, **kw)

    # ---- views ---------------------------------------------------------------------------------------
    @property
    def feasible_trials(self) -> int:
        return int((self.trials["status"] == "ok").sum())

    def top(self, k: int) -> list[Candidate]:
        """The ``k`` best feasible distinct strategies (order of :func:`rank_key`)."""
        ok = self.trials[self.trials["status"] == "ok"].drop_duplicates("strategy")
        return sorted((Candidate.from_row(r) for r in ok.itertuples()), key=rank_key)[:k]

    def explain(self, k: int = 5) -> "pd.DataFrame":
        """The winner and the next ``k - 1`` strategies: tokens/s, the step split into compute,
        exposed communication and bubble (seconds), peak memory (bytes), devices used and idle,
        the binding constraint and what each runner-up lost on."""
        import pandas as pd
        top = self.top(k)
        rows = [{"strategy": str(c.strategy), "tokens_per_s": c.tokens_per_s, "step_time": c.step_time,
                 "compute": c.compute, "exposed_comm": c.exposed_comm, "bubble": c.bubble,
                 "peak_memory": c.peak_memory, "devices_used": c.world, "idle_devices": self.devices - c.world,
                 "binding": c.binding, "lost_on": lost_on(c, top[0])} for c in top]
        return pd.DataFrame(rows, columns=["strategy", "tokens_per_s", "step_time", "compute", "exposed_comm",
                                           "bubble", "peak_memory", "devices_used", "idle_devices", "binding",
                                           "lost_on"])

    def counts(self) -> dict[str, int]:
        """How the trials split: ``feasible`` (distinct strategies that fit), ``infeasible``,
        ``invalid``, ``dominated`` (pruned unscored: could not beat the best), ``repeats`` (a
        strategy scored before, answered from the cache) and ``simulated`` (simulator runs)."""
        t = self.trials
        st = t["status"].fillna("invalid")
        scored = t[st.isin(["ok", "infeasible"])]
        return {"trials": int(len(t)), "feasible": int(t.loc[st == "ok", "strategy"].nunique()),
                "infeasible": int(t.loc[st == "infeasible", "strategy"].nunique()),
                "invalid": int((st == "invalid").sum()), "dominated": int((st == "dominated").sum()),
                "repeats": int(scored["cached"].sum()),
                "simulated": int((scored["simulated"] & ~scored["cached"]).sum()),
                "evaluations": int(self.evaluations)}

    def summary(self) -> dict[str, Any]:
        """The figures ``parashift search --json`` prints."""
        b = self.best
        return {"best": str(b.strategy) if b else None,
                "best_tokens_per_s": b.tokens_per_s if b else None,
                "best_step_time": b.step_time if b else None,
                "best_peak_memory": b.peak_memory if b else None,
                "breakdown": {k: _num(v) for k, v in b.breakdown.items()} if b else None,
                "binding": b.binding if b else None,
                "devices_used": b.world if b else None, "idle_devices": self.devices - b.world if b else None,
                "trials": int(len(self.trials)), "feasible_trials": self.feasible_trials,
                "evaluations": self.evaluations, "search_seconds": self.search_seconds,
                "counts": self.counts(),
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

    def export(self, path: str, strategy: "Strategy | None" = None, train: dict | None = None) -> dict[str, Any]:
        """Write the deploy plan of ``strategy`` (default: the best) to ``path`` and return it.

        The file is the compiled Program's JSON (``Program.load`` reads it) whose ``meta`` also
        holds ``deploy``: the model, strategy, batch, cluster, devices, the cost model used, the
        simulated figures and ``train`` (the trainer settings, when given: learning rate and its
        schedule, clipping, weight decay, precision); ``parashift run plan.json`` executes it.
        """
        cand = self._best() if strategy is None else self._candidate(strategy)
        obj = plan_json(self.program(cand.strategy), model=self.model, strategy=cand.strategy,
                        global_batch=self.global_batch, seq_len=self.seq_len, cluster=self.cluster,
                        devices=self.devices, cost_model=self.cost_model, predicted=cand.to_dict(), train=train)
        with open(path, "w") as f:
            json.dump(obj, f, separators=(",", ":"))
        return obj

    def plot(self, path: str) -> str:
        """Optuna's optimization history (Pareto front when multi-objective) next to the parameter
        importances for tokens/s, as one image."""
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
        return Candidate.from_row(next(rows.itertuples()))


def plan_json(program: Any, *, model: ModelSpec, strategy: Strategy, global_batch: int, seq_len: int,
              cluster: Cluster, devices: int, cost_model: Any = None, predicted: dict | None = None,
              train: dict | None = None) -> dict:
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
    if train is not None:
        deploy["train"] = dict(train)
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
        for a in _FIGURES + ("eval_seconds",):
            v = ua.get(a)
            row[a] = float(v) if v is not None else float("nan")
        row["cached"] = bool(ua.get("cached", False))
        row["simulated"] = bool(ua.get("simulated", False))
        rows.append(row)
    df = pd.DataFrame(rows, columns=list(TRIAL_COLUMNS))
    return df.astype({a: "Int64" for a in ("tp", "pp", "dp", "ep", "zero", "vpp", "mbs")})


def plot_search(result: "SearchResult", path: str) -> str:
    """History (or Pareto front) and parameter importances of ``result.study`` side by side."""
    plt = pyplot()
    from optuna.trial import TrialState
    from optuna.visualization import matplotlib as ovm
    study = result.study
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    multi = len(result.objective) > 1
    panels: list[tuple[str, Any]] = []
    if multi:
        panels.append(("Pareto front", render(lambda: _pareto(result, plt), plt)))
    else:
        panels.append(("Optimization history", render(lambda: ovm.plot_optimization_history(
            study, target_name="tokens/s"), plt)))
    if len(done) >= 2:
        img = render(lambda: ovm.plot_param_importances(study, target_name="tokens/s"), plt)
    else:
        img = f"only {len(done)} completed trial(s): parameter importances need at least 2"
    panels.append(("Parameter importances", img))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.6))
    for ax, (title, img) in zip(np.ravel(axes), panels):
        ax.axis("off")
        if isinstance(img, str):
            ax.set_title(title)
            ax.text(0.5, 0.5, img, ha="center", va="center", wrap=True)
        else:
            ax.imshow(img)
    b = result.best
    head = f"{result.model.name} on {result.devices} x {result.cluster.gpu.name}, {len(result.trials)} trials"
    if b is not None:
        head += f" - best {b.strategy} ({b.tokens_per_s:,.0f} tokens/s)"
    fig.suptitle(head)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _pareto(result: "SearchResult", plt: Any) -> Any:
    """Every feasible trial's peak memory against tokens/s, the Pareto front joined."""
    ok = result.trials[result.trials["status"] == "ok"]
    fig, ax = plt.subplots()
    ax.scatter(ok["peak_memory"] / 2**30, ok["tokens_per_s"], s=12, color="tab:gray", label="feasible trials")
    front = result.pareto
    ax.plot([c.peak_memory / 2**30 for c in front], [c.tokens_per_s for c in front], "o-", color="tab:red",
            label="Pareto front")
    ax.set_xlabel("peak memory per device (GiB)")
    ax.set_ylabel("tokens/s")
    ax.legend(fontsize=8)
    return ax
