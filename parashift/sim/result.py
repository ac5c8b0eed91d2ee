"""Simulation results: step time, throughput, bubbles, memory, and the timeline.

The timeline schema (:data:`TIMELINE_COLUMNS`) is shared with the runtime's profiler, so a
measured and a simulated run of one Program join row by row on ``(rank, id)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from ..cluster import Cluster
    from ..ir.program import Program
    from ..cost import CostModel
    from .engine import RawRun

from ..ir.program import TIMELINE_COLUMNS
from ..traces.chrome import write_chrome_trace

__all__ = ["SimResult", "TIMELINE_COLUMNS", "timeline_frame", "write_chrome_trace"]

@dataclass(frozen=True)
class SimResult:
    """The simulated execution of one Program.

    ``peak_memory``: device -> peak bytes (static state + live buffers); ``fits``: every device's
    peak plus the cost model's reserve is within its memory. ``bubble_fraction``: mean over devices
    of the share of the step in which the device's ``compute`` stream runs nothing.
    """

    program: "Program" = field(repr=False)
    cluster: "Cluster" = field(repr=False)
    cost_model: "CostModel" = field(repr=False)
    raw: "RawRun" = field(repr=False)
    step_time: float
    tokens_per_s: float
    mfu: float
    bubble_fraction: float
    peak_memory: Mapping[int, int] = field(repr=False)
    fits: bool
    sim_seconds: float
    events: int

    # ---- construction ---------------------------------------------------------------------------
    @classmethod
    def from_raw(cls, program: "Program", cluster: "Cluster", cost: "CostModel", raw: "RawRun") -> "SimResult":
        fo = raw.folding
        assert fo is not None
        step = raw.records[-1][4] if raw.records else 0.0   # recorded as they end: the last ends last
        busy, model_flops = raw.busy, raw.model_flops   # summed by the engine as it recorded
        world = sum(len(m) for m in fo.members.values())
        bubble = (sum((1.0 - busy[r] / step) * len(m) for r, m in fo.members.items()) / world) if step > 0 else 0.0
        meta = program.meta
        tokens = float(meta.get("global_batch") or 0) * float(meta.get("seq_len") or 0)   # user models: no seq_len
        tps = tokens / step if step > 0 and tokens else float("nan")
        mfu = model_flops / (step * world * cluster.gpu.peak_flops) if step > 0 else float("nan")
        peak = {raw.devices[m]: int(round(raw.peak[r])) for r, ms in fo.members.items() for m in ms}
        cap = cost.memory_capacity - cost.memory_reserved
        fits = all(p <= cap for p in peak.values())
        return cls(program, cluster, cost, raw, step, tps, mfu, bubble, peak, fits, raw.sim_seconds, raw.events)

    # ---- summaries ----------------------------------------------------------------------------
    @property
    def peak_memory_max(self) -> int:
        return max(self.peak_memory.values()) if self.peak_memory else 0

    @property
    def peak_activations(self) -> dict[int, int]:
        """Device -> the most activation bytes (``act``/``rc.`` buffers) it held at once; the
        ``activations`` of :meth:`memory_frame` are those at the device's memory peak instead."""
        raw = self.raw
        return {raw.devices[m]: int(round(raw.peak_activations[r])) for r, ms in raw.folding.members.items()
                for m in ms}

    @property
    def events_per_s(self) -> float:
        return self.events / self.sim_seconds if self.sim_seconds > 0 else float("nan")

    @property
    def link_bytes(self) -> dict[str, float]:
        """Bytes sent per link class (local, intra, inter) over all ranks."""
        return dict(self.raw.link_bytes)

    def summary(self) -> dict[str, Any]:
        """The headline numbers as a JSON-able dict."""
        return {"step_time": self.step_time, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "bubble_fraction": self.bubble_fraction,
                "peak_memory": {str(k): v for k, v in sorted(self.peak_memory.items())},
                "peak_memory_max": self.peak_memory_max, "fits": self.fits, "sim_seconds": self.sim_seconds}

    def memory_frame(self) -> "pd.DataFrame":
        """Per device at its peak: static states (param, grad, master, optim), activations, other
        buffers, peak, capacity and whether it fits."""
        import pandas as pd
        raw, fo = self.raw, self.raw.folding
        cap = self.cost_model.memory_capacity - self.cost_model.memory_reserved
        rows = []
        for r, ms in fo.members.items():
            st = raw.static[r]
            states = {k: st.get(k, 0.0) for k in ("param", "grad", "master", "optim")}
            other_static = sum(v for k, v in st.items() if k not in states)
            parts = raw.peak_parts[r]
            for m in ms:
                rows.append({"device": raw.devices[m], "rank": m, **states, "other_static": other_static,
                             "activations": parts["activations"], "buffers": parts["buffers"],
                             "peak": raw.peak[r], "capacity": cap})
        df = pd.DataFrame(rows).sort_values("device").reset_index(drop=True)
        df["fits"] = df["peak"] <= df["capacity"]
        return df

    def memory_summary(self) -> dict[str, Any]:
        """What dominates memory on the fullest device: ``states`` or ``activations`` (or ``buffers``)."""
        df = self.memory_frame()
        row = df.loc[df["peak"].idxmax()]
        states = float(row[["param", "grad", "master", "optim", "other_static"]].sum())
        parts = {"states": states, "activations": float(row["activations"]), "buffers": float(row["buffers"])}
        return {"device": int(row["device"]), "peak": float(row["peak"]), "capacity": float(row["capacity"]),
                **parts, "dominant": max(parts, key=parts.get)}

    def memory_timeline(self, ranks: "list[int] | None" = None) -> "pd.DataFrame":
        """Bytes in use per device over time: columns ``rank, device, time, bytes`` (one row per change)."""
        import pandas as pd
        raw, fo = self.raw, self.raw.folding
        want = None if ranks is None else set(int(r) for r in ranks)
        ev = pd.DataFrame(raw.mem_events, columns=["rep", "time", "bytes"])
        mem = pd.DataFrame([(rep, m, raw.devices[m]) for rep, ms in fo.members.items() for m in ms
                            if want is None or m in want], columns=["rep", "rank", "device"])
        df = ev.merge(mem, on="rep").sort_values(["device", "time"], kind="stable").reset_index(drop=True)
        return df[["rank", "device", "time", "bytes"]]

    # ---- timeline -----------------------------------------------------------------------------
    def timeline_of(self, ranks: "list[int] | None" = None) -> "pd.DataFrame":
        """The timeline of ``ranks`` (all ranks when None), with :data:`TIMELINE_COLUMNS`."""
        return timeline_frame(self.raw, ranks)

    @cached_property
    def timeline(self) -> "pd.DataFrame":
        """Every rank's executed instructions (folded ranks expanded), sorted by start, device."""
        return timeline_frame(self.raw, None)

    def event_log(self, ranks: "list[int] | None" = None) -> list[tuple[float, int, str, int]]:
        """``(start, device, stream, instruction id)`` in start order: a compact golden for tests."""
        df = self.timeline_of(ranks)
        return [(float(a), int(d), str(s), int(i)) for a, d, s, i in
                zip(df["start"], df["device"], df["stream"], df["id"])]

    def to_chrome_trace(self, path: str, ranks: "list[int] | None" = None) -> None:
        """Write the timeline in Chrome/Perfetto trace format (one process per device)."""
        write_chrome_trace(self.timeline_of(ranks), path)

    def plot_timeline(self, path: str, ranks: "list[int] | None" = None, max_devices: int = 16) -> None:
        """A Gantt chart per device and stream (the first ``max_devices`` devices), titled with the
        strategy, written to ``path`` (:func:`parashift.plots.plot_gantt`)."""
        from ..plots import plot_gantt
        plot_gantt({str(self.program.meta.get("strategy", "")): self.timeline_of(ranks)}, path, max_devices=max_devices)


def timeline_frame(raw: "RawRun", ranks: "list[int] | None" = None) -> "pd.DataFrame":
    import pandas as pd
    fo = raw.folding
    want = None if ranks is None else set(int(r) for r in ranks)
    recs = raw.records
    n = len(recs)
    ins = [x[2] for x in recs]
    base = pd.DataFrame({
        "rep": np.fromiter((x[0] for x in recs), dtype=np.int64, count=n),
        "stream": [x[1] for x in recs],
        "id": np.fromiter((i.id for i in ins), dtype=np.int64, count=n),
        "op": [i.op for i in ins],
        "phase": [i.phase for i in ins],
        "microbatch": pd.array([i.microbatch for i in ins], dtype="Int64"),
        "start": np.fromiter((x[3] for x in recs), dtype=float, count=n),
        "end": np.fromiter((x[4] for x in recs), dtype=float, count=n),
        "nbytes": np.fromiter((i.nbytes for i in ins), dtype=np.int64, count=n),
        "flops": np.fromiter((i.flops for i in ins), dtype=float, count=n),
    })
    pairs = [(rep, m, raw.devices[m]) for rep, ms in fo.members.items() for m in ms if want is None or m in want]
    mem = pd.DataFrame(pairs, columns=["rep", "rank", "device"])
    df = base.merge(mem, on="rep", how="inner")
    df = df.sort_values(["start", "device", "stream", "id"], kind="stable").reset_index(drop=True)
    return df[list(TIMELINE_COLUMNS)]
