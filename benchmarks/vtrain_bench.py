"""Predict vTrain's 1440 measured A100 iteration times with ir.compile + sim.simulate.

Data: traces/vtrain-a100 (MIT; GPT models on one node of 8 A100s, Megatron-DeepSpeed, 1F1B,
full recomputation, vocabulary 50257 padded to 128*tp). Every configuration is compiled and
simulated on the ``a100-1x8`` preset. The cost model is the A100 default with the knobs
(``NAMES``, all but ``FROZEN``) calibrated by ``--fit`` on a fixed random half of the rows (seed 0) and saved next to
this script (``vtrain_a100_cost.json``); the MAPE reported is on the other half only, overall and
per (tp, dp, pp) layout, next to the uncalibrated datasheet defaults. The published simulator
built on these data reports 8.37%.

Usage: python benchmarks/vtrain_bench.py [--fit] [--limit N]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from parashift import cluster as clusters
from parashift.sim import CostModel, simulate
from parashift.cost.fitted import KNOBS
from parashift.cost.model import apply_knobs, knobs_of
from parashift.sim.vtrain import load_iterations, program_of

CLUSTER = clusters.get("a100-1x8")
SEED = 0


def split(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The fixed fit/test halves (seed 0)."""
    perm = np.random.default_rng(SEED).permutation(n)
    return np.sort(perm[: n // 2]), np.sort(perm[n // 2:])


#: The knobs fitted on the fit half (see parashift.cost.fitted); a pipeline send is none of them: it
#: costs its path's latency plus bytes over bandwidth (an earlier fit's 1.6 ms per send, a hundred times
#: an NVLink send of a few MB, made every schedule with more hops lose).
NAMES = KNOBS
#: Knobs held at their START value (none).
FROZEN: tuple[str, ...] = ()


def theta_of(cm: CostModel) -> np.ndarray:
    k = knobs_of(cm)
    return np.array([k[n] for n in NAMES])


def with_params(base: CostModel, theta: np.ndarray) -> CostModel:
    """``base`` with the knobs of :data:`NAMES` set to ``theta``."""
    return apply_knobs(base, dict(zip(NAMES, (float(x) for x in theta))))


def write_defaults(theta: np.ndarray) -> None:
    """Rewrite the fitted block of parashift/cost/fitted.py (the A100 presets' defaults)."""
    import parashift.cost.fitted as mod
    path = Path(mod.__file__)
    text = path.read_text()
    a, b = text.index("# BEGIN FITTED"), text.index("# END FITTED")
    body = "".join(f'    "{n}": {float(v)!r},\n' for n, v in zip(NAMES, theta))
    block = f"# BEGIN FITTED (python benchmarks/{Path(__file__).name} --fit)\nA100_VTRAIN: dict[str, float] = {{\n{body}}}\n"
    path.write_text(text[:a] + block + text[b:])


def predict(programs: dict, rows: np.ndarray, cost: CostModel) -> np.ndarray:
    return np.array([simulate(programs[i][0], CLUSTER, cost, model=programs[i][1]).step_time * 1e3
                     for i in rows])


def fit(programs: dict, measured: np.ndarray, rows: np.ndarray, base: CostModel, iters: int = 5) -> np.ndarray:
    """Levenberg-Marquardt on relative errors, finite-difference Jacobian, non-negative knobs."""
    theta = theta_of(base)
    theta = np.where(theta > 0, theta, 1e-6)
    y = measured[rows]
    lam = 1e-2
    r0 = predict(programs, rows, with_params(base, theta)) / y - 1
    for it in range(iters):
        J = np.zeros((len(rows), len(theta)))
        for j in range(len(theta)):
            if NAMES[j] in FROZEN:
                continue
            t = theta.copy()
            t[j] *= 1.02
            J[:, j] = (predict(programs, rows, with_params(base, t)) / y - 1 - r0) / (t[j] - theta[j])
        Js = J * theta  # scale columns: steps relative to each knob
        while True:
            A = Js.T @ Js
            step = np.linalg.solve(A + lam * np.diag(np.diag(A) + 1e-12), -Js.T @ r0) * theta
            cand = np.maximum(theta + step, theta * 0.05)
            rc = predict(programs, rows, with_params(base, cand)) / y - 1
            if np.mean(np.abs(rc)) < np.mean(np.abs(r0)) or lam > 1e4:
                break
            lam *= 10
        if np.mean(np.abs(rc)) < np.mean(np.abs(r0)):
            theta, r0, lam = cand, rc, lam / 10
        print(f"fit iter {it}: MAPE {np.mean(np.abs(r0)) * 100:.2f}% " +
              " ".join(f"{n}={v:.4g}" for n, v in zip(NAMES, theta)), file=sys.stderr)
    return theta


FITTED = Path(__file__).with_name("vtrain_a100_cost.json")
#: Where the fit starts (an earlier fit's values, in NAMES order).
START = np.array([0.9025, 141.8, 0.001049, 0.7225, 0.003082, 12.09, 0.8445, 1e-06, 9.891e-06, 1e-06])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--fit", action="store_true", help=f"refit the knobs on the fit half and save {FITTED.name}")
    ap.add_argument("--limit", type=int, default=0, help="use only the first N rows of each half (quick runs)")
    ap.add_argument("--iters", type=int, default=4, help="Levenberg-Marquardt iterations of --fit (default 4)")
    ap.add_argument("--fit-stride", type=int, default=4,
                    help="fit on every Nth row of the fit half (default 4: 180 rows; the test half is whole)")
    args = ap.parse_args()
    df = load_iterations()
    fit_rows, test_rows = split(len(df))
    fit_rows = fit_rows[:: max(1, args.fit_stride)]
    if args.limit:
        fit_rows, test_rows = fit_rows[: args.limit], test_rows[: args.limit]
    t0 = time.perf_counter()
    programs = {int(i): program_of(df.iloc[int(i)])
                for i in (np.concatenate([fit_rows, test_rows]) if args.fit else test_rows)}
    compile_s = time.perf_counter() - t0
    defaults = CostModel.for_cluster(CLUSTER)  # the preset: datasheet + the knobs fitted last time
    datasheet = CostModel.for_gpu(CLUSTER.gpu, fitted=False)
    measured = df["time_ms"].to_numpy()
    out: dict = {}
    if args.fit:
        t1 = time.perf_counter()
        theta = fit(programs, measured, fit_rows, with_params(defaults, START), iters=args.iters)
        fitted = with_params(defaults, theta)
        fitted.save(str(FITTED))
        write_defaults(theta)
        out["fit_seconds"] = time.perf_counter() - t1
        out["fit_mape"] = float(np.mean(np.abs(predict(programs, fit_rows, fitted) / measured[fit_rows] - 1)))
    elif not FITTED.exists():
        sys.exit(f"{FITTED} is missing: run `python {Path(__file__).name} --fit` once to fit it on the fit half")
    fitted = CostModel.load(str(FITTED))
    out["fitted"] = dict(zip(NAMES, theta_of(fitted).tolist()))
    t2 = time.perf_counter()
    pred = predict(programs, test_rows, fitted)
    sim_s = time.perf_counter() - t2
    err = np.abs(pred / measured[test_rows] - 1)
    raw_err = np.abs(predict(programs, test_rows, datasheet) / measured[test_rows] - 1)
    preset_err = np.abs(predict(programs, test_rows, defaults) / measured[test_rows] - 1)
    test = df.iloc[test_rows].assign(pred_ms=pred, ape=err)
    per = test.groupby(["tp", "dp", "pp"])["ape"].agg(["mean", "count"])
    out.update({
        "rows_test": int(len(test_rows)), "mape": float(err.mean()), "median_ape": float(np.median(err)),
        "p90_ape": float(np.quantile(err, 0.9)), "mape_uncalibrated_defaults": float(raw_err.mean()),
        "mape_preset_defaults": float(preset_err.mean()),
        "per_layout": {f"tp{tp}_dp{dp}_pp{pp}": {"mape": float(r["mean"]), "rows": int(r["count"])}
                       for (tp, dp, pp), r in per.iterrows()},
        "compile_seconds": compile_s, "simulate_seconds": sim_s, "published_vtrain_mape": 0.0837,
    })
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
