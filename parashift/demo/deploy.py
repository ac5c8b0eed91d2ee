"""Step 3, tune and deploy: an Optuna search for tiny-gpt on 4 CPU processes, the winning plan
exported and executed live on 4 gloo processes, its measured timeline next to the simulated one."""
from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any, Callable

from .core import require

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from .core import DemoContext, StepResult

__all__ = ["LIVE", "search_and_export", "deploy_and_compare", "step_deploy"]

#: The live job of steps 3-5: tiny-gpt on this machine's processes. A global batch of 12 divides
#: evenly over 3 and 4 data-parallel ranks, so the job can shrink and grow without changing it.
LIVE = {"model": "tiny-gpt", "cluster": "cpu-local", "devices": 4, "global_batch": 12, "seq_len": 32,
        "n_trials": 30, "seed": 0, "steps": 4}


def search_and_export(plan_path: str, *, devices: int = LIVE["devices"], n_trials: int = LIVE["n_trials"],
                      seed: int = LIVE["seed"], plot_path: str | None = None,
                      progress: "Callable[[str], None] | None" = None) -> Any:
    """Tune :data:`LIVE`'s model on ``devices`` devices, write the deploy plan of the best strategy
    to ``plan_path`` (and the search's Optuna plots to ``plot_path``); returns the SearchResult."""
    search = require("parashift.search", "tune")

    def tick(done: int, total: int, best: Any) -> None:
        if progress is not None and (done == total or done % 10 == 0):
            progress(f"search trial {done}/{total}, best so far {best.strategy if best else 'none'}")
    res = search.tune(LIVE["model"], LIVE["cluster"], devices=devices, global_batch=LIVE["global_batch"],
                      seq_len=LIVE["seq_len"], n_trials=n_trials, seed=seed, progress=tick)
    if not hasattr(res, "export"):
        from .core import NotAvailable
        raise NotAvailable("parashift.search's SearchResult has no export() to write a deploy plan yet")
    res.export(plan_path)
    if plot_path is not None:
        res.plot(plot_path)
    return res


def deploy_and_compare(plan_path: str, *, steps: int = LIVE["steps"],
                       progress: "Callable[[str], None] | None" = None) -> dict:
    """Execute the deploy plan live for ``steps`` steps and simulate the same Program on cpu-local.

    Returns ``measured`` / ``simulated`` timelines (the last step; same columns), the run, the
    simulation, the measured step times and the predicted step time."""
    ex = require("parashift.exec", "load_plan", "run_program")
    from ..sim import simulate
    program = ex.load_plan(plan_path)

    def tick(step: int, loss: float, seconds: float) -> None:
        if progress is not None:
            progress(f"live step {step + 1}/{steps}: loss {loss:.4f}, {seconds * 1e3:.0f} ms")
    run = ex.run_program(program, steps=steps, progress=tick, timeout=300.0)
    sim = simulate(program, LIVE["cluster"])
    measured = run.to_frame()
    out = {"program": program, "run": run, "sim": sim, "measured": measured, "simulated": sim.timeline,
           "step_times": run.step_times, "predicted_step_s": sim.step_time}
    if steps >= 2:   # calibrate on the steps after the first (warm-up) one and simulate again
        cal = require("parashift.calibrate", "fit")
        fitted = cal.fit([run.to_frame(k) for k in range(1, steps)], LIVE["cluster"], programs=program)
        again = simulate(program, LIVE["cluster"], fitted.cost_model)
        out.update(calibration=fitted, calibrated=again.timeline, calibrated_step_s=again.step_time)
    return out


def _joined(measured: "pd.DataFrame", simulated: "pd.DataFrame") -> "pd.DataFrame":
    """Measured and simulated durations of each instruction, joined on (rank, id)."""
    a = measured.assign(seconds=measured["end"] - measured["start"])[["rank", "id", "op", "phase", "seconds"]]
    b = simulated.assign(seconds=simulated["end"] - simulated["start"])[["rank", "id", "seconds"]]
    return a.merge(b, on=["rank", "id"], suffixes=("_measured", "_simulated"), validate="one_to_one")


def step_deploy(ctx: "DemoContext", res: "StepResult") -> None:
    """Step 3: search, export, run live, compare with the simulation."""
    from .plots import plot_gantt
    plan = ctx.path("deploy_plan.json")
    ctx.say(f"Optuna search over strategies of {LIVE['model']} on {LIVE['devices']} CPU processes")
    sr = search_and_export(plan, plot_path=ctx.path("deploy_search.png"), progress=ctx.say)
    best = sr.best
    ctx.say(f"running {best.strategy} live on {best.strategy.world} gloo processes")
    d = deploy_and_compare(plan, progress=ctx.say)
    run = d["run"]
    steady = d["step_times"][1:] or d["step_times"]
    measured_s = statistics.median(steady)
    d["measured"].to_csv(ctx.path("deploy_measured_timeline.csv"), index=False)
    run.to_chrome_trace(ctx.path("deploy_measured_trace.json"))
    panels = {f"simulated, datasheet cost model of cpu-local ({d['predicted_step_s'] * 1e3:.1f} ms per step)":
              d["simulated"],
              f"measured on {run.nprocs} gloo processes (last step, {d['step_times'][-1] * 1e3:.1f} ms)": d["measured"]}
    if "calibrated" in d:
        panels[f"simulated after calibrating on this run's steps 2-{len(run.losses)} "
               f"({d['calibrated_step_s'] * 1e3:.1f} ms per step)"] = d["calibrated"]
    plot_gantt(panels, ctx.path("deploy_sim_vs_measured.png"), unit="ms",
               title=f"{LIVE['model']}, {best.strategy}: simulated vs measured")
    joined = _joined(d["measured"], d["simulated"])
    res.add("trials", len(sr.trials), "trials")
    res.add("feasible trials", sr.feasible_trials, "trials")
    res.add("search time", sr.search_seconds, "s")
    res.add(f"best strategy {best.strategy}: predicted throughput", best.tokens_per_s, "tokens/s")
    res.add("predicted step time", d["predicted_step_s"] * 1e3, "ms")
    res.add("measured step time (median after the first step)", measured_s * 1e3, "ms")
    res.add("measured / predicted step time", measured_s / d["predicted_step_s"], "x")
    if "calibrated" in d:
        res.add("predicted step time after calibration on this run (in-sample)", d["calibrated_step_s"] * 1e3, "ms")
    res.add("instructions matched between run and simulation", len(joined), "instructions")
    res.add("loss, first step", run.losses[0], "")
    res.add("loss, last step", run.losses[-1], "")
    res.files.update({"simulated vs measured timeline": "deploy_sim_vs_measured.png",
                      "search (Optuna history and importances)": "deploy_search.png",
                      "deploy plan (run it: parashift run deploy_plan.json)": "deploy_plan.json",
                      "measured Chrome trace": "deploy_measured_trace.json",
                      "measured timeline": "deploy_measured_timeline.csv"})
    res.body = (f"{len(sr.trials)} Optuna trials over the strategies of {LIVE['model']} on {LIVE['devices']} CPU "
                f"processes (global batch {LIVE['global_batch']} x {LIVE['seq_len']} tokens) picked "
                f"`{best.strategy}`; its deploy plan ran live for {len(run.losses)} steps on "
                f"{run.nprocs} gloo processes. The first prediction uses the datasheet cost model of "
                f"`cpu-local`; the calibrated one is fitted (`parashift.calibrate.fit`) on this run's own "
                f"steps after the first, so it is an in-sample figure, not a forecast.")
    res.data.update(search=sr, deploy=d, share_strategy=best.strategy, share_plan=plan)
