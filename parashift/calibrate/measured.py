"""Calibrate from a table of measured runs: one step time per (model, strategy, batch) row.

A team that has trained on its cluster knows step times, not instruction timelines. Each row of the
table names the ``model`` (a preset, a JSON file or an inline ``gpt:``/``moe:`` spec), the
``strategy`` (devices follow from it), ``global_batch``, ``seq_len`` and the measured
``step_seconds``. :func:`fit_measured` compiles every row, then fits with the simulator in the loop
(the robust solver of :mod:`parashift.calibrate.solve`), in stages that keep the terms apart:
compute first (GEMM ceiling, elementwise traffic, per-kernel overhead), then the links inside a node
(bandwidth and latency), then the links between nodes. A stage fits only the parameters that move
some row's prediction, so a table of single-node runs leaves the inter-node link at its base value.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import pandas as pd

from ..cluster import Cluster, get as get_cluster
from ..cost import CostModel
from .params import Param, apply, get_value
from .samples import CalibrationError
from .solve import Block, informed, solve

if TYPE_CHECKING:  # pragma: no cover
    from ..ir.program import Program
    from ..models import ModelSpec

__all__ = ["fit_measured", "holdout_measured", "MeasuredFit", "MEASURED_COLUMNS", "STAGES", "read_measured"]

MEASURED_COLUMNS = ("model", "strategy", "global_batch", "seq_len", "step_seconds")
#: The fitting stages: name -> parameters (compute terms, then each link class apart).
STAGES: dict[str, tuple[str, ...]] = {
    "compute": ("gemm_efficiency", "elementwise_bytes", "gemm_overhead"),
    "intra": ("link_bw.intra", "latency.intra"),
    "inter": ("link_bw.inter", "latency.inter"),
}


@dataclass(frozen=True)
class MeasuredFit:
    """The fitted ``cost_model``, the ``base`` it started from, ``rows`` (per row: model, strategy,
    measured, base_predicted, predicted, ape, base_ape) and ``params`` (stage, name, base, fitted;
    parameters no row informs are absent)."""

    cost_model: CostModel
    base: CostModel
    rows: pd.DataFrame
    params: pd.DataFrame = field(repr=False)

    @property
    def median_ape(self) -> float:
        return float(self.rows["ape"].median())

    def summary(self) -> dict[str, Any]:
        """JSON-able: median and mean APE before and after, per-row errors, fitted parameters."""
        return {"median_ape": self.median_ape, "mean_ape": float(self.rows["ape"].mean()),
                "base_median_ape": float(self.rows["base_ape"].median()),
                "rows": self.rows.to_dict(orient="records"),
                "params": {r.name: {"stage": r.stage, "base": float(r.base), "fitted": float(r.fitted)}
                           for r in self.params.itertuples()}}


def read_measured(path: str) -> pd.DataFrame:
    """The measured-runs CSV at ``path``, checked for :data:`MEASURED_COLUMNS`."""
    try:
        df = pd.read_csv(path)
    except (OSError, ValueError) as e:
        raise CalibrationError(f"cannot read measured runs {path}: {e}") from None
    return _checked(df, path)


def _checked(frame: pd.DataFrame, where: str = "the measured runs") -> pd.DataFrame:
    missing = [c for c in MEASURED_COLUMNS if c not in frame.columns]
    if missing:
        raise CalibrationError(f"{where} lack columns {missing}; give {', '.join(MEASURED_COLUMNS)} "
                               f"(one row per measured run)")
    if not len(frame):
        raise CalibrationError(f"{where} have no rows; give at least one measured run")
    t = pd.to_numeric(frame["step_seconds"], errors="coerce")
    bad = frame.index[~(t > 0) | ~np.isfinite(t)]
    if len(bad):
        raise CalibrationError(f"{where}: row {int(bad[0]) + 1} has step_seconds {str(frame.loc[bad[0], 'step_seconds'])!r}; "
                               f"give positive seconds")
    ints = {}
    for col in ("global_batch", "seq_len"):
        v = pd.to_numeric(frame[col], errors="coerce")
        bad = frame.index[~np.isfinite(v) | (v < 1) | (v != np.round(v))]
        if len(bad):
            raise CalibrationError(f"{where}: row {int(bad[0]) + 1} has {col} {str(frame.loc[bad[0], col])!r}; "
                                   f"give a whole number >= 1")
        ints[col] = v.astype(np.int64)
    return frame.assign(step_seconds=t.astype(float), **ints)


def _compile(frame: pd.DataFrame, cluster: Cluster) -> "list[tuple[Program, ModelSpec]]":
    from .. import models
    from ..errors import ParashiftError
    from ..ir import compile as ir_compile
    from ..strategy import Strategy
    out = []
    for i, r in enumerate(frame.itertuples(index=False)):
        try:
            m = models.get(str(r.model))
            s = Strategy.parse(str(r.strategy)).validate(m)
            if s.world > cluster.devices:
                raise CalibrationError(f"strategy {s} needs {s.world} devices; {cluster.name} has {cluster.devices}")
            out.append((ir_compile(m, s, global_batch=int(r.global_batch), seq_len=int(r.seq_len)), m))
        except ParashiftError as e:
            raise CalibrationError(f"measured row {i + 1} ({r.model}, {r.strategy}): {e}") from None
    return out


def fit_measured(frame: pd.DataFrame, cluster: "Cluster | str", base: CostModel | None = None, *,
                 stages: "dict[str, Sequence[str]] | None" = None,
                 progress: "Callable[[str], None] | None" = None) -> MeasuredFit:
    """Fit ``base`` (default: the cluster's preset model) to the measured step times of ``frame``
    (columns :data:`MEASURED_COLUMNS`), stage by stage (:data:`STAGES`)."""
    cl = get_cluster(cluster)
    df = _checked(frame.reset_index(drop=True))
    base = base if base is not None else CostModel.for_cluster(cl)
    say = progress or (lambda _m: None)
    say(f"compiling {len(df)} measured runs")
    progs = _compile(df, cl)
    meas = df["step_seconds"].to_numpy(float)
    predict = _predictor(progs, cl)
    cm, rows = _fit_stages(predict, meas, base, stages or STAGES, say)
    before, after = predict(base), predict(cm)
    table = pd.DataFrame({"model": df["model"].astype(str), "strategy": df["strategy"].astype(str),
                          "measured": meas, "base_predicted": before, "predicted": after,
                          "ape": np.abs(after / meas - 1), "base_ape": np.abs(before / meas - 1)})
    return MeasuredFit(cm, base, table, pd.DataFrame(rows, columns=["stage", "name", "base", "fitted"]))


def holdout_measured(frame: pd.DataFrame, cluster: "Cluster | str", base: CostModel | None = None, *,
                     stages: "dict[str, Sequence[str]] | None" = None,
                     progress: "Callable[[str], None] | None" = None) -> pd.DataFrame:
    """Leave one row out: each row predicted by the fit on all the others (columns model, strategy,
    measured, held_out_predicted, held_out_ape). Needs at least two rows."""
    cl = get_cluster(cluster)
    df = _checked(frame.reset_index(drop=True))
    if len(df) < 2:
        raise CalibrationError("a held-out check needs at least two measured runs; add rows or drop --holdout")
    base = base if base is not None else CostModel.for_cluster(cl)
    say = progress or (lambda _m: None)
    progs = _compile(df, cl)
    meas = df["step_seconds"].to_numpy(float)
    held = np.empty(len(df))
    for k in range(len(df)):
        say(f"held-out check: row {k + 1} of {len(df)}")
        keep = np.arange(len(df)) != k
        rest = [p for p, m in zip(progs, keep) if m]
        cm, _ = _fit_stages(_predictor(rest, cl), meas[keep], base, stages or STAGES, lambda _m: None)
        held[k] = _predictor([progs[k]], cl)(cm)[0]
    return pd.DataFrame({"model": df["model"].astype(str), "strategy": df["strategy"].astype(str),
                         "measured": meas, "held_out_predicted": held, "held_out_ape": np.abs(held / meas - 1)})


def _predictor(progs: "list[tuple[Program, ModelSpec]]", cl: Cluster) -> "Callable[[CostModel], np.ndarray]":
    from ..sim import simulate

    def predict(cm: CostModel) -> np.ndarray:
        return np.array([simulate(p, cl, cm, model=m).step_time for p, m in progs])
    return predict


def _fit_stages(predict: "Callable[[CostModel], np.ndarray]", meas: np.ndarray, base: CostModel,
                stages: "dict[str, Sequence[str]]", say: "Callable[[str], None]") -> "tuple[CostModel, list[dict]]":
    """The staged fit: per stage, the parameters some row informs, solved with the simulator in the loop."""
    block = Block("measured", predict, np.arange(len(meas)), meas)
    cm, rows = base, []
    for stage, names in stages.items():
        cands = informed(block, cm, [Param.parse(n) for n in names])
        if not cands:
            say(f"{stage}: no row depends on {', '.join(names)}; kept")
            continue
        say(f"{stage}: fitting {', '.join(p.name for p in cands)}")
        sol = solve(block, cm, cands, max_iter=20, rounds=2)
        rows += [{"stage": stage, "name": p.name, "base": get_value(base, p), "fitted": float(v)}
                 for p, v in zip(sol.params, sol.values)]
        cm = apply(cm, sol.params, sol.values)
    return cm, rows


def run_measured(args: Any, progress: "Callable[[str], None]") -> dict:
    """``parashift calibrate --measured CSV --cluster C --out F [--base B]``: fit, save, report."""
    from ..cluster import get as get_cluster
    cl = get_cluster(args.cluster)
    base = CostModel.load(args.base) if args.base else None
    frame = read_measured(args.measured)
    f = fit_measured(frame, cl, base, progress=progress)
    f.cost_model.save(args.out)
    out = {"out": args.out, "cluster": cl.name, "measured": args.measured, **f.summary(), "holdout": None}
    if getattr(args, "holdout", False):
        h = holdout_measured(frame, cl, base, progress=progress)
        out["holdout"] = {"median_ape": float(h["held_out_ape"].median()),
                          "mean_ape": float(h["held_out_ape"].mean()),
                          "rows": h.to_dict(orient="records")}
    return out


def render_measured(result: dict) -> None:
    """The per-row fit error and the fitted parameters, for people."""
    rows = pd.DataFrame(result["rows"])
    print(f"cost model for {result['cluster']} fitted on {len(rows)} measured runs of {result['measured']} "
          f"-> {result['out']}")
    print(f"  median APE {result['median_ape'] * 100:.1f}% (before: {result['base_median_ape'] * 100:.1f}%)")
    show = pd.DataFrame({"model": rows["model"].str.slice(0, 40), "strategy": rows["strategy"],
                         "measured_s": rows["measured"].round(4), "predicted_s": rows["predicted"].round(4),
                         "APE": (rows["ape"] * 100).map(lambda v: f"{v:.1f}%"),
                         "before": (rows["base_ape"] * 100).map(lambda v: f"{v:.1f}%")})
    print(show.to_string(index=False))
    for name, p in result["params"].items():
        print(f"  [{p['stage']}] {name}: {p['base']:.4g} -> {p['fitted']:.4g}")
    h = result.get("holdout")
    if h is None:
        print("  held-out check not run: add --holdout to predict each row from a fit on the others")
        return
    print(f"  held out (each row predicted by the fit on the others): median APE {h['median_ape'] * 100:.1f}%, "
          f"mean {h['mean_ape'] * 100:.1f}%")
    for r in h["rows"]:
        print(f"    {r['strategy']:<28}{r['measured']:10.4f} s measured, {r['held_out_predicted']:.4f} s held-out "
              f"({r['held_out_ape'] * 100:.1f}%)")
