"""Chrome/Perfetto trace files from timeline DataFrames (simulated or measured: one schema)."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["write_chrome_trace"]


def write_chrome_trace(df: "pd.DataFrame", path: str) -> None:
    """Chrome trace events (``ph: X``, microseconds) from a timeline DataFrame."""
    import pandas as pd
    events: list[dict] = []
    tids: dict[tuple[int, str], int] = {}
    per_dev: dict[int, int] = {}
    for dev, stream in sorted({(int(d), str(s)) for d, s in zip(df["device"], df["stream"])}):
        if dev not in per_dev:
            per_dev[dev] = 0
            events.append({"name": "process_name", "ph": "M", "pid": dev, "args": {"name": f"device {dev}"}})
        tids[(dev, stream)] = tid = per_dev[dev]
        per_dev[dev] += 1
        events.append({"name": "thread_name", "ph": "M", "pid": dev, "tid": tid, "args": {"name": stream}})
    for row in df.itertuples(index=False):
        name = row.op if row.op != "compute" else f"{row.phase}"
        if not pd.isna(row.microbatch):
            name += f" m{int(row.microbatch)}"
        dev = int(row.device)
        events.append({"name": name, "cat": row.op, "ph": "X", "pid": dev, "tid": tids[(dev, str(row.stream))],
                       "ts": row.start * 1e6, "dur": (row.end - row.start) * 1e6,
                       "args": {"rank": int(row.rank), "id": int(row.id), "stream": row.stream, "phase": row.phase,
                                "nbytes": int(row.nbytes), "flops": float(row.flops)}})
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
