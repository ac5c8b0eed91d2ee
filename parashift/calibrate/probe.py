"""Live probes: run a few strategies on this machine through the runtime and keep their timelines.

The probes are chosen to exercise every term the cost model has on the machine: fused and
per-region compute (tp = 1 and tp > 1), forward and backward, the optimizer, and each kind of
communication the strategies use (TP and DP all-reduces, ZeRO gathers and reduce-scatters,
pipeline send/recv).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import pandas as pd

from ..errors import StrategyError
from ..strategy import Strategy
from .samples import CalibrationError

if TYPE_CHECKING:  # pragma: no cover
    from ..ir.program import Program
    from ..models import ModelSpec

__all__ = ["ProbeRun", "probe_strategies", "run_probe", "run_probes"]

_COLUMNS = ("step", "rank", "device", "stream", "id", "op", "phase", "microbatch", "start", "end", "nbytes", "flops")


@dataclass(frozen=True)
class ProbeRun:
    """One live run: its Program, its measured timeline (a ``step`` column; warm-up steps dropped;
    the runtime's profiler may keep only the last step) and the runtime's wall time of every
    measured step (the slowest rank's, barrier to end)."""

    strategy: Strategy
    program: "Program" = field(repr=False)
    timeline: pd.DataFrame = field(repr=False)
    step_times: tuple[float, ...]

    @property
    def step_time(self) -> float:
        """Median wall time of the kept steps."""
        return float(np.median(self.step_times))


def probe_strategies(model: "ModelSpec | str", nprocs: int, count: int | None = None, *,
                     global_batch: int = 8) -> list[Strategy]:
    """Diverse valid strategies for ``nprocs`` processes (pure DP first, then TP, PP and ZeRO mixes)."""
    from .. import models
    spec = models.get(model) if isinstance(model, str) else model
    n = int(nprocs)
    h = n // 2
    texts = [f"dp={n}", f"tp=2,dp={h}", f"dp={h},pp=2", f"pp={n}", f"tp=2,pp={h}", f"dp={h},pp=2,zero=1",
             f"tp=2,dp={h},zero=1", f"dp={n},zero=2", f"dp={h},pp=2,mbs=2", f"pp={n},schedule=gpipe",
             f"tp=2,dp={h},zero=3", f"dp={n},zero=3", f"tp={n}", f"pp={h},dp=2,schedule=zb-h1"]
    out: list[Strategy] = []
    seen: set[str] = set()
    for t in texts:
        try:
            s = Strategy.parse(t).validate(spec)
        except StrategyError:
            continue
        if s.world != n or str(s) in seen or global_batch % (s.dp * s.mbs) or global_batch // s.dp // s.mbs < s.pp:
            continue
        seen.add(str(s))
        out.append(s)
    if not out:
        raise CalibrationError(f"no probe strategy of {spec.name} fits {n} processes; use 2, 4 or 8 processes")
    return out[:count] if count else out


def _frame(rows: list[tuple], warmup: int) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=list(_COLUMNS))
    df = df[df["step"] >= warmup].reset_index(drop=True)
    df["microbatch"] = df["microbatch"].astype("Int64")
    return df


def run_probe(program: "Program", *, steps: int = 3, warmup: int = 1, timeout: float = 300.0) -> ProbeRun:
    """Execute ``program`` live for ``warmup + steps`` steps and keep the last ``steps``."""
    from ..exec.runtime import run_program
    res = run_program(program, steps=steps + warmup, timeout=timeout)
    return ProbeRun(program.strategy, program, _frame(res.rows, warmup), tuple(res.step_times[warmup:]))


def run_probes(model: str, strategies: Sequence["Strategy | str"], *, global_batch: int = 8,
               seq_len: int | None = None, steps: int = 3, warmup: int = 1, timeout: float = 300.0,
               progress: Callable[[str], None] | None = None) -> list[ProbeRun]:
    """Compile and run each strategy live on local processes (gloo on CPU)."""
    from .. import models
    from ..ir import compile as ir_compile
    spec = models.get(model)
    seq = seq_len or spec.seq_len
    out = []
    for k, s in enumerate(strategies):
        st = Strategy.parse(s).validate(spec)
        prog = ir_compile(spec, st, global_batch=global_batch, seq_len=seq)
        run = run_probe(prog, steps=steps, warmup=warmup, timeout=timeout)
        if progress is not None:
            progress(f"probe {k + 1}/{len(strategies)} {st}: {run.step_time * 1e3:.1f} ms/step")
        out.append(run)
    return out
