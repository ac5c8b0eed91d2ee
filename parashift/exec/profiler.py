"""Profiler: every executed instruction's start/end/bytes in the simulator's timeline schema.

Times are seconds since the start of the profiled step on that rank; ranks align their step
start with a barrier, so rows of different ranks share one clock to within the barrier skew.
The rows of the last ``keep`` steps are kept (a calibration fits medians over several steps and
drops the warm-up one; a long run does not grow without bound).
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from ..ir.program import TIMELINE_COLUMNS, Instr

__all__ = ["Profiler", "TIMELINE_COLUMNS", "timeline_frame", "tensor_bytes"]



class Profiler:
    """Rows of one rank: (step, rank, device, stream, id, op, phase, microbatch, start, end, nbytes, flops)."""

    def __init__(self, rank: int, device: int, keep_all: bool = False, keep: int = 16) -> None:
        """``keep``: how many of the latest steps' rows to hold (``keep_all``: every step's)."""
        self.rank, self.device, self.keep_all, self.keep = rank, device, keep_all, max(int(keep), 1)
        self.rows: list[tuple] = []
        self.origin = 0.0
        self.step = 0

    def begin(self, step: int, origin: float) -> None:
        """Start recording ``step``; rows of steps before the last ``keep`` are dropped."""
        if not self.keep_all and self.rows and self.rows[0][0] <= step - self.keep:
            self.rows = [r for r in self.rows if r[0] > step - self.keep]
        self.step, self.origin = step, origin

    def record(self, ins: Instr, stream: str, t0: float, t1: float) -> None:
        self.rows.append((self.step, self.rank, self.device, stream, ins.id, ins.op, ins.phase, ins.microbatch,
                          t0 - self.origin, t1 - self.origin, int(ins.nbytes), float(ins.flops)))


def timeline_frame(rows: Iterable[tuple], step: int | None = None):
    """A DataFrame with TIMELINE_COLUMNS (rows of ``step``, or of the last recorded step)."""
    import pandas as pd
    df = pd.DataFrame(list(rows), columns=("step",) + TIMELINE_COLUMNS)
    if len(df):
        df = df[df["step"] == (df["step"].max() if step is None else step)]
    df = df.drop(columns="step")
    df["microbatch"] = df["microbatch"].astype("Int64")
    df = df.sort_values(["start", "device", "stream", "id"], kind="stable").reset_index(drop=True)
    return df[list(TIMELINE_COLUMNS)]


def tensor_bytes(objs: Iterable[Any]) -> int:
    """Bytes of the distinct tensors in ``objs`` (lists/dicts/tuples walked; a tensor counts once
    per data pointer, so views of one buffer at the same offset are not double counted)."""
    seen: set[int] = set()
    total = 0
    stack = list(objs)
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            ptr = o.data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += o.numel() * o.element_size()
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple)):
            stack.extend(o)
    return total
