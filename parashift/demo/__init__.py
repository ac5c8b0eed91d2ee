"""``parashift demo``: the whole tour in one run, every figure computed, everything written to a folder.

1. explore (simulate four pipeline schedules of llama2-70b on 128 A800s), 2. switch (plan and
simulate the 128 -> 120 device shrink after a node loss, against checkpoint-restart), 3. the closed
loop (calibrate cpu-local on short probe runs, search tiny-gpt on up to 4 CPU processes with the
fitted model, run the winner and the runner-up live: predicted vs measured, did the ranking hold), 4. hot switch (the live job shrinks to 3 devices and grows back, against a DCP
checkpoint-reshard), 5. replay (a time-compressed slice of a shipped preemption trace against the
live job), 6. real data (a tiny Hugging Face Llama config trained on the shipped text across a hot
switch, next to a static run; its weights and strategy exported), 7. ``summary.md``.

>>> from parashift.demo import run_demo
>>> result = run_demo("demo-out")          # doctest: +SKIP
>>> result.frame()                          # doctest: +SKIP
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .core import DemoContext, DemoError, Figure, NotAvailable, StepResult, require, run_step
from .explore import compare_schedules, schedule_strategy, simulate_fitting, stage_ranks
from .report import summary_frame, write_summary
from .switch import NODE_LOSS, ablation, bytes_matrix, lower_and_simulate, node_bytes, node_loss

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["run_demo", "DemoResult", "STEPS", "Figure", "StepResult", "DemoContext", "DemoError", "NotAvailable",
           "require", "compare_schedules", "schedule_strategy", "simulate_fitting", "stage_ranks", "NODE_LOSS",
           "ablation", "bytes_matrix", "lower_and_simulate", "node_bytes", "node_loss", "summary_frame",
           "write_summary"]


def _steps() -> list[tuple[str, Callable[[DemoContext, StepResult], None]]]:
    from .deploy import step_deploy
    from .explore import step_explore
    from .hot import step_hot_switch
    from .real import step_real_data
    from .replay import step_replay
    from .switch import step_switch
    return [("Explore: four pipeline schedules of llama2-70b on 128 A800s", step_explore),
            ("Switch: 128 -> 120 devices after a node loss", step_switch),
            ("Closed loop: calibrate cpu-local, search, run the winner and the runner-up live", step_deploy),
            ("Hot switch: the live job shrinks to 3 devices and grows back", step_hot_switch),
            ("Replay: a time-compressed slice of a shipped preemption trace", step_replay),
            ("Real data: a Hugging Face Llama on the shipped text, across a hot switch, exported", step_real_data)]


#: Titles of steps 1-6 (step 7 writes the summary).
STEPS = ("explore", "switch", "deploy", "hot-switch", "replay", "real-data")


@dataclass
class DemoResult:
    """The steps' results, the output folder and the summary file."""

    out: Path
    steps: list[StepResult]
    summary: Path
    seconds: float

    @property
    def ok(self) -> bool:
        """No step failed (steps whose capability is missing do not count as failures)."""
        return not any(s.status.startswith("failed") for s in self.steps)

    def frame(self) -> "pd.DataFrame":
        """One row per figure: ``step, title, figure, value, unit``."""
        return summary_frame(self.steps)

    def to_json(self) -> dict:
        return {"out": str(self.out), "summary": str(self.summary), "seconds": self.seconds, "ok": self.ok,
                "steps": [s.to_json() for s in self.steps]}


def run_demo(out: "str | Path" = "demo-out", *, only: "tuple[str, ...] | None" = None,
             progress: Callable[[str], None] | None = None) -> DemoResult:
    """Run the demo's steps (all, or those named in ``only``, see :data:`STEPS`) into ``out`` and
    write ``summary.md`` there. ``progress(text)`` hears what each step is doing."""
    import matplotlib
    matplotlib.use("Agg")
    unknown = sorted(set(only or ()) - set(STEPS))
    if unknown:
        raise DemoError(f"unknown demo step(s) {', '.join(unknown)}; steps are {', '.join(STEPS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results: list[StepResult] = []
    total = len(STEPS) + 1
    for i, ((title, fn), key) in enumerate(zip(_steps(), STEPS), start=1):
        if only is not None and key not in only:
            continue

        def say(text: str, i: int = i, title: str = title) -> None:
            if progress is not None:
                progress(f"[{i}/{total}] {title.split(':')[0]}: {text}")
        ctx = DemoContext(out, progress=say, shared=_shared(results))
        say("starting")
        res = run_step(i, title, fn, ctx)
        say(f"{res.status} ({res.seconds:.1f} s)")
        results.append(res)
    if progress is not None:
        progress(f"[{total}/{total}] Summary: writing {out / 'summary.md'}")
    seconds = time.perf_counter() - t0
    summary = write_summary(out, results, seconds)
    return DemoResult(out, results, summary, seconds)


def _shared(results: list[StepResult]) -> dict:
    """What later steps may reuse from earlier ones (the deployed strategy, the live settings)."""
    shared: dict = {}
    for r in results:
        if r.ok:
            shared.update({k: v for k, v in r.data.items() if k.startswith("share_")})
    return shared
