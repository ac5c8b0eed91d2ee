"""``fit(timelines, cluster)``: a calibrated :class:`CostModel` and the fit's error per op kind."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import pandas as pd

from ..cluster import Cluster, get as get_cluster
from ..ir.program import Instr
from ..cost import CostModel
from .params import apply, comm_candidates, compute_candidates, drop_gauges, get_value, transfer_phases
from .samples import CalibrationError, Samples, extract_normalized, normalize_inputs
from .solve import Block, Solution, informed, match_means, solve

if TYPE_CHECKING:  # pragma: no cover
    from ..ir.program import Program

__all__ = ["Fit", "fit", "ape", "spearman", "predict_samples", "step_table", "posts_p2p", "with_op_terms",
           "with_dispatch_terms"]

_IDENTIFIED = 0.25  # relative standard error below which a fitted parameter counts as pinned down


def ape(predicted: "np.ndarray | Sequence[float]", measured: "np.ndarray | Sequence[float]") -> np.ndarray:
    """Absolute percentage errors ``|predicted - measured| / measured`` (as fractions)."""
    p, m = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    return np.abs(p - m) / m


def spearman(a: "Sequence[float]", b: "Sequence[float]") -> float:
    """Spearman rank correlation (average ranks for ties); NaN with fewer than two points."""
    a, b = pd.Series(np.asarray(a, dtype=float)), pd.Series(np.asarray(b, dtype=float))
    if len(a) < 2:
        return float("nan")
    ra, rb = a.rank().to_numpy(), b.rank().to_numpy()
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


# ---- blocks -------------------------------------------------------------------------------------
def _shape_weights(inv: np.ndarray) -> np.ndarray:
    """``1 / sqrt(n)`` for a sample of a shape seen ``n`` times: a shape's weight grows with its
    evidence, but hundreds of one small op do not drown the few large ones that pin bandwidths."""
    return 1.0 / np.sqrt(np.bincount(inv)[inv])


def _compute_block(df: pd.DataFrame) -> tuple[Block, list]:
    keys = list(zip(df["phase"], df["region"], df["flops"], df["nbytes"], df["state_bytes"]))
    uniq: dict[tuple, int] = {}
    inv = np.fromiter((uniq.setdefault(k, len(uniq)) for k in keys), dtype=np.int64, count=len(keys))
    shapes = list(uniq)
    instrs = [(Instr(0, "compute", phase=ph, region=reg if isinstance(reg, str) else None, flops=float(fl),
                     nbytes=int(nb)), float(sb)) for ph, reg, fl, nb, sb in shapes]

    def evaluate(cm: CostModel) -> np.ndarray:
        return np.fromiter((cm.compute_time(i, sb) for i, sb in instrs), dtype=float, count=len(instrs))

    return Block("compute", evaluate, inv, df["measured"].to_numpy(dtype=float), _shape_weights(inv)), shapes


def _comm_shapes(df: pd.DataFrame) -> list[tuple]:
    return [(kind, op, int(nb), link, topo) for kind, op, nb, link, topo in
            zip(df["kind"], df["op"], df["nbytes"], df["link"], df["topo"])]


def _comm_block(df: pd.DataFrame) -> tuple[Block, list]:
    keys = _comm_shapes(df)
    uniq: dict[tuple, int] = {}
    inv = np.fromiter((uniq.setdefault(k, len(uniq)) for k in keys), dtype=np.int64, count=len(keys))
    shapes = list(uniq)

    def one(cm: CostModel, s: tuple) -> float:
        kind, op, nb, link, topo = s
        if kind in ("p2p", "copy"):
            return cm.op_time(_op_name(kind), cm.p2p_phases(nb, link))
        return cm.op_time(op, cm.collective_phases(op, nb, topo))

    def evaluate(cm: CostModel) -> np.ndarray:
        return np.fromiter((one(cm, s) for s in shapes), dtype=float, count=len(shapes))

    return Block("comm", evaluate, inv, df["measured"].to_numpy(dtype=float), _shape_weights(inv)), shapes


def _op_name(kind: str) -> str:
    """The operation a comm sample's ``kind`` runs (p2p samples are send/recv pairs)."""
    return "send" if kind == "p2p" else kind


def with_op_terms(cm: CostModel, ops: "Sequence[str]", sized: "Sequence[str] | None" = None) -> CostModel:
    """``cm`` with its own fixed cost (at the shared value: predictions do not change) for every op
    in ``ops`` and a bandwidth factor (at 1) for those in ``sized`` (default: all), but the
    reference op (``all_reduce`` if present, else the first), which would otherwise trade against
    the link bandwidth. An op seen at one message size only cannot tell its fixed cost from its
    bandwidth: leave it out of ``sized``."""
    ops = sorted(set(ops))
    if not ops:
        return cm
    ref = "all_reduce" if "all_reduce" in ops else ops[0]
    sized = ops if sized is None else sorted(set(sized) & set(ops))
    over = {**{op: cm.op_overhead(op) - (cm.p2p_overhead if op in ("send", "recv") else 0.0) for op in ops},
            **cm.comm_op_overhead}
    bw = {**{op: 1.0 for op in sized if op != ref}, **cm.comm_op_bw}
    return cm.replace(comm_op_overhead=over, comm_op_bw=bw)


_SIZES = 2.0  # an op's message sizes must span this factor for its bandwidth to be fitted on its own


def _sized_ops(comm: pd.DataFrame) -> list[str]:
    """Ops whose samples span message sizes (a factor of at least 2), so fixed cost and bandwidth separate."""
    nb = comm.assign(op_=comm["kind"].map(_op_name)).groupby("op_")["nbytes"].agg(["min", "max"])
    return sorted(nb.index[(nb["max"] >= _SIZES * nb["min"].clip(lower=1))])


def with_dispatch_terms(cm: CostModel, regions: "Sequence[str | None]", phases: "Sequence[str]") -> CostModel:
    """``cm`` with a dispatch overhead paid on top of the math (``region_overhead``, a quarter of
    the floor, per region kind in ``regions``; ``phase_overhead`` as the phase floors, per
    non-optimizer phase in ``phases``) for the fit to start from; kept entries stay."""
    from ..cost import region_units
    kinds = sorted({k for r in set(regions) for k, n in region_units(r if isinstance(r, str) else None) if n})
    phs = sorted(set(phases) - {"optim"})
    if not kinds or not phs:
        return cm
    return cm.replace(region_overhead={**{k: 0.25 * cm.region_floor.get(k, 1e-4) for k in kinds}, **cm.region_overhead},
                      phase_overhead={**{p: cm.phase_floor.get(p, 1.0) for p in phs}, **cm.phase_overhead})


def _links(cm: CostModel, df: pd.DataFrame) -> set[str]:
    out: set[str] = set()
    for kind, op, nb, link, topo in set(_comm_shapes(df)):
        phases = cm.p2p_phases(nb, link) if kind in ("p2p", "copy") else cm.collective_phases(op, nb, topo)
        out.update(ph.link for ph in phases)
    return out


def predict_samples(samples: Samples, cost_model: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """Predicted seconds of every compute and every comm sample under ``cost_model``."""
    outs = []
    for df, make in ((samples.compute, _compute_block), (samples.comm, _comm_block)):
        if len(df):
            b, _ = make(df)
            outs.append(np.asarray(b.evaluate(cost_model))[b.inv])
        else:
            outs.append(np.zeros(0))
    return outs[0], outs[1]


# ---- the result ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fit:
    """A calibration: the fitted ``cost_model``, the ``base`` it started from, ``report`` (fit error
    per op kind: kind, count, median_ape and mean_ape of single instructions, total_ape of their
    sum, base_median_ape of the starting model; the ``step`` row compares simulated with measured
    step times), ``params`` (name, block, base, fitted, rel_se: relative
    standard error, identified: rel_se below 25%; a parameter whose term never binds in the data
    keeps a value the data merely tolerates and is not identified)
    the ``samples`` it was fitted on, and ``mean_scales``: the factor each group's times were
    rescaled by so that totals match (``compute:<phase>``, ``comm``)."""

    cost_model: CostModel
    base: CostModel
    report: pd.DataFrame
    params: pd.DataFrame
    samples: Samples = field(repr=False)
    steps: pd.DataFrame = field(repr=False, default_factory=pd.DataFrame)
    mean_scales: dict = field(default_factory=dict)
    step_factors: dict = field(default_factory=dict)

    @property
    def median_ape(self) -> float:
        """Median absolute percentage error over every fitted instruction sample."""
        row = self.report[self.report["kind"] == "all"]
        return float(row["median_ape"].iloc[0]) if len(row) else float("nan")

    @property
    def step_median_ape(self) -> float:
        row = self.report[self.report["kind"] == "step"]
        return float(row["median_ape"].iloc[0]) if len(row) else float("nan")

    def summary(self) -> dict[str, Any]:
        """JSON-able: median_ape, step_median_ape, per_op {kind: {count, median_ape, mean_ape}}, params."""
        per = {r.kind: {"count": int(r.count), "median_ape": float(r.median_ape), "mean_ape": float(r.mean_ape),
                        "total_ape": float(r.total_ape), "base_median_ape": float(r.base_median_ape)}
               for r in self.report.itertuples()}
        return {"median_ape": self.median_ape, "step_median_ape": self.step_median_ape, "per_op": per,
                "params": {r.name: float(r.fitted) for r in self.params.itertuples()},
                "samples": len(self.samples), "dropped": dict(self.samples.dropped),
                "mean_scales": dict(self.mean_scales), "step_factors": dict(self.step_factors)}


def _kind_rows(kinds: np.ndarray, pred: np.ndarray, base_pred: np.ndarray, meas: np.ndarray) -> list[dict]:
    e, eb = ape(pred, meas), ape(base_pred, meas)
    groups = [(k, kinds == k) for k in sorted(set(kinds))] + ([("all", np.ones(len(meas), dtype=bool))]
                                                              if len(meas) else [])
    return [{"kind": k, "count": int(m.sum()), "median_ape": float(np.median(e[m])), "mean_ape": float(np.mean(e[m])),
             "total_ape": float(abs(pred[m].sum() - meas[m].sum()) / meas[m].sum()),
             "base_median_ape": float(np.median(eb[m]))} for k, m in groups]


def step_table(samples: Samples, programs: "Sequence[Program | None]", cluster: Cluster,
               cost_model: CostModel, base: CostModel | None = None) -> pd.DataFrame:
    """Per timeline: its measured step time (median over steps) and the simulated one under
    ``cost_model`` (and ``base``). Programs shared by several timelines are simulated once."""
    from ..sim import simulate
    if not len(samples.steps):
        return pd.DataFrame(columns=["source", "strategy", "measured", "predicted", "base_predicted"])
    med = samples.steps.groupby("source")["measured"].median()
    cache: dict[int, tuple[float, float]] = {}
    rows = []
    for src, meas in med.items():
        prog = programs[int(src)]
        if prog is None:
            continue
        if id(prog) not in cache:
            p = simulate(prog, cluster, cost_model).step_time
            b = simulate(prog, cluster, base).step_time if base is not None else float("nan")
            cache[id(prog)] = (p, b)
        p, b = cache[id(prog)]
        rows.append({"source": int(src), "strategy": str(prog.strategy or prog.meta.get("strategy", "")),
                     "measured": float(meas), "predicted": p, "base_predicted": b})
    return pd.DataFrame(rows, columns=["source", "strategy", "measured", "predicted", "base_predicted"])


def _fit_compute(samples: Samples, base: CostModel, means: bool, huber: float):
    block, _ = _compute_block(samples.compute)
    sol = solve(block, base, drop_gauges(informed(block, base, compute_candidates(base))), huber=huber)
    scales: dict[str, float] = {}
    if means:
        sol, f = match_means(block, base, sol, samples.compute["phase"].to_numpy())
        scales = {f"compute:{k}": v for k, v in f.items()}
    moved = transfer_phases(base, dict(zip(sol.params, sol.values)), set(samples.compute["phase"]))
    return sol, moved, scales


def posts_p2p(timelines: "Sequence[pd.DataFrame]") -> bool | None:
    """Whether the runtime that measured ``timelines`` posts send/recv without waiting: some
    send/recv starts while an earlier one of its rank and stream is still running (None: the
    timelines have no two send/recv on one stream)."""
    seen = False
    for tl in timelines:
        p = tl[tl["op"].isin(("send", "recv"))]
        if len(p) < 2:
            continue
        keys = [c for c in ("step", "rank", "stream") if c in p.columns]
        p = p.sort_values(keys + ["start"], kind="stable")
        prev_end = p.groupby(keys, sort=False)["end"].shift(1).to_numpy(dtype=float)
        ok = np.isfinite(prev_end)
        if ok.any():
            seen = True
            if (p["start"].to_numpy(dtype=float)[ok] < prev_end[ok] - 1e-6).any():
                return True
    return False if seen else None


def _step_targets(samples: Samples, programs: list) -> tuple[list, list]:
    """Distinct Programs of the timelines and the median measured step time of each."""
    if not len(samples.steps):
        return [], []
    med: dict[int, list[float]] = {}
    keep: dict[int, object] = {}
    for src, t in zip(samples.steps["source"], samples.steps["measured"]):
        prog = programs[int(src)]
        if prog is not None:
            keep[id(prog)] = prog
            med.setdefault(id(prog), []).append(float(t))
    return [keep[k] for k in med], [float(np.median(v)) for v in med.values()]


def _fit_comm(samples: Samples, base: CostModel, means: bool, huber: float):
    block, _ = _comm_block(samples.comm)
    sol = solve(block, base, informed(block, base, comm_candidates(base, _links(base, samples.comm))), huber=huber)
    scales: dict[str, float] = {}
    if means:
        sol, f = match_means(block, base, sol)
        scales = {"comm": v for v in f.values()}
    return sol, scales


def _params_table(base: CostModel, solutions: list[tuple[str, Solution]], moved: dict) -> pd.DataFrame:
    rows = [{"name": p.name, "block": name, "base": get_value(base, p), "fitted": float(v), "rel_se": float(se),
             "identified": bool(se < _IDENTIFIED)}
            for name, sol in solutions for p, v, se in zip(sol.params, sol.values, sol.rel_se)]
    rows += [{"name": p.name, "block": "transferred", "base": get_value(base, p), "fitted": float(v),
              "rel_se": float("nan"), "identified": False} for p, v in moved.items()]
    return pd.DataFrame(rows, columns=["name", "block", "base", "fitted", "rel_se", "identified"])


def fit(timelines: "pd.DataFrame | Sequence[pd.DataFrame]", cluster: "Cluster | str", *,
        programs: "Program | Sequence[Program | None] | None" = None, base: CostModel | None = None,
        steps: bool = True, means: bool = True, align: bool = True, jitter: bool = True,
        huber: float = 1.345, per_op: bool = False, dispatch: bool = False,
        refine: "bool | Sequence[str]" = False,
        host_cores: float | None = None, p2p_posted: bool | None = False) -> Fit:
    """Fit the cost model of ``cluster`` to measured ``timelines``.

    ``programs``: the Program each timeline ran (one for all, or one per timeline); without it
    only compute samples (with unknown regions) are fitted. ``base``: the starting model, whose
    parameters the data does not inform are kept (default: the cluster's datasheet model).
    ``steps``: also simulate each program and report step-time errors (row ``step``).
    ``means``: after the robust fit, rescale each compute phase (and communication) so that
    predicted and measured totals agree (see :func:`~parashift.calibrate.solve.match_means`):
    steps sum many jittery costs. Turn it off to recover a model's parameters from data whose
    slow tail is measurement error rather than time the job really spent.
    ``align`` and ``jitter``: how samples are taken (see :func:`~parashift.calibrate.extract`).
    ``per_op``: give every communication operation seen (``all_reduce``, ``send``, ...) its own
    fixed cost and bandwidth factor (``comm_op_overhead``, ``comm_op_bw``); ``comm_overhead``
    becomes their median, for operations no sample ran.
    ``dispatch``: fit a per-region dispatch overhead paid on top of the math (``region_overhead``,
    ``phase_overhead``), as a host that runs every op itself pays (CPU processes).
    ``refine``: then fit time scales of compute, of fixed and of per-byte communication costs
    (and ``host_cores``) to the measured step times of the programs, simulating them (see
    :func:`~parashift.calibrate.steps.fit_steps`; factors in ``step_factors``); a sequence names
    the scales to fit (of :data:`~parashift.calibrate.steps.SCALES`).
    ``host_cores``: the ranks of a node are processes sharing this many CPU cores (a start value,
    fitted by ``refine``); None leaves the base model's setting.
    ``p2p_posted``: whether the simulator should post send/recv without waiting for the stream's
    previous one (see :class:`~parashift.sim.CostModel`); None: as the timelines show the runtime
    did (:func:`posts_p2p`). Default False: on gloo the runtime posts them, yet the posted model
    underpredicts deep pipelines about as much as the serial one overpredicts them (see
    benchmarks/fidelity_bench.py), and the serial one errs less at worst.
    ``per_op``, ``dispatch``, ``refine`` and ``host_cores`` are off by default: each fits its
    terms (tests/test_calibrate_steps.py recovers them from simulated timelines), but on live
    gloo runs of a loaded 2-core machine none lowered the held-out step-time error (the
    instruction samples already carry the contention that ``host_cores`` would add again, and
    ``refine`` fits a few noisy step times too closely).
    Fitted: compute efficiency per phase and per region kind, overhead per region kind and phase,
    memory efficiency, optimizer efficiency and overhead; per-operation comm overhead, and latency
    and achieved bandwidth per link class the samples used. Phases no sample ran follow their
    closest observed phase (``block == "transferred"`` in ``params``).
    """
    cl = get_cluster(cluster)
    base = given = base if base is not None else CostModel.for_cluster(cl)
    tls, progs = normalize_inputs(timelines, programs)
    samples = extract_normalized(tls, progs, cl, align, jitter)
    if not len(samples):
        raise CalibrationError(f"no usable samples in the timelines (dropped: {samples.dropped}); pass "
                               f"timelines of executed instructions with positive durations")
    posted = posts_p2p(tls) if p2p_posted is None else bool(p2p_posted)
    if posted is not None and posted != base.p2p_posted:
        base = base.replace(p2p_posted=posted)
    if host_cores is not None:
        if not host_cores > 0:
            raise CalibrationError(f"host_cores must be a positive number of cores, got {host_cores}")
        base = base.replace(host_cores=float(host_cores))
    solutions: list[tuple[str, Solution]] = []
    scales: dict[str, float] = {}
    moved: dict = {}
    ops = sorted({_op_name(k) for k in samples.comm["kind"]}) if per_op and len(samples.comm) else []
    if dispatch and len(samples.compute):
        base = with_dispatch_terms(base, samples.compute["region"].tolist(), samples.compute["phase"].tolist())
    cbase = with_op_terms(base, ops, _sized_ops(samples.comm) if ops else [])
    cm = cbase
    if len(samples.compute):
        sol, moved, sc = _fit_compute(samples, cbase, means, huber)
        solutions.append(("compute", sol))
        scales.update(sc)
        cm = apply(apply(cm, sol.params, sol.values), list(moved), list(moved.values()))
    if len(samples.comm):
        sol, sc = _fit_comm(samples, cbase, means, huber)
        solutions.append(("comm", sol))
        scales.update(sc)
        cm = apply(cm, sol.params, sol.values)
        if ops:  # operations no sample ran pay the typical fixed cost
            cm = cm.replace(comm_overhead=float(np.median([cm.comm_op_overhead[o] for o in ops])))
    factors: dict[str, float] = {}
    if refine:
        sp, st_meas = _step_targets(samples, progs)
        if sp:
            from .steps import SCALES, fit_steps
            sf = fit_steps(sp, st_meas, cl, cm, huber=huber, scales=SCALES if refine is True else tuple(refine))
            cm, factors = sf.cost_model, sf.factors
    pc, pm = predict_samples(samples, cm)
    bc, bm = predict_samples(samples, given)
    kinds = np.concatenate([samples.compute["phase"].to_numpy(dtype=object),
                            samples.comm["kind"].to_numpy(dtype=object)])
    meas = np.concatenate([samples.compute["measured"].to_numpy(dtype=float),
                           samples.comm["measured"].to_numpy(dtype=float)])
    rows = _kind_rows(kinds, np.concatenate([pc, pm]), np.concatenate([bc, bm]), meas)
    st = step_table(samples, progs, cl, cm, given) if steps else pd.DataFrame()
    if len(st):
        e, eb = ape(st["predicted"], st["measured"]), ape(st["base_predicted"], st["measured"])
        rows.append({"kind": "step", "count": len(st), "median_ape": float(np.median(e)), "mean_ape": float(np.mean(e)),
                     "total_ape": float(abs(st["predicted"].sum() - st["measured"].sum()) / st["measured"].sum()),
                     "base_median_ape": float(np.median(eb))})
    report = pd.DataFrame(rows, columns=["kind", "count", "median_ape", "mean_ape", "total_ape", "base_median_ape"])
    return Fit(cm, given, report, _params_table(cbase, solutions, moved), samples, st, scales, factors)
