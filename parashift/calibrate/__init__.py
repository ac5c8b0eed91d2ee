"""Calibration: fit the simulator's cost model to measured timelines.

``fit(timelines, cluster, programs=...)`` turns the runtime profiler's tables into a
:class:`~parashift.sim.CostModel` (compute efficiency and dispatch floors per phase and region
kind, latency and achieved bandwidth per link class) and reports the fit error per op kind.
``run_probes`` runs a few strategies live (``probe_strategies`` picks them) to collect such
timelines; ``parashift calibrate`` does both and writes the model as JSON. ``fit_programs`` fits
parameters to whole-program times (e.g. live switch transfers) with the simulator in the loop;
``fit_steps`` (which ``fit`` runs last) fits time scales of compute and communication, and the
host's shared cores, to measured step times the same way. ``fit_measured`` fits a table of measured
step times (model, strategy, global_batch, seq_len, step_seconds) of runs on the user's cluster.
"""
from .fit import Fit, ape, fit, posts_p2p, predict_samples, spearman, step_table
from .measured import MEASURED_COLUMNS, MeasuredFit, fit_measured, holdout_measured, read_measured
from .params import Param
from .probe import ProbeRun, probe_strategies, run_probe, run_probes
from .programs import fit_programs, simulated_times
from .samples import CalibrationError, Samples, align_clocks, extract
from .steps import StepFit, fit_steps, scaled

__all__ = ["fit", "Fit", "extract", "align_clocks", "Samples", "CalibrationError", "Param", "ape", "spearman",
           "predict_samples", "step_table", "ProbeRun", "probe_strategies", "run_probe", "run_probes",
           "fit_programs", "simulated_times", "fit_steps", "StepFit", "scaled", "posts_p2p",
           "fit_measured", "holdout_measured", "MeasuredFit", "read_measured", "MEASURED_COLUMNS"]
