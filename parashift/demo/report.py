"""The demo's outputs for people: ``summary.md`` in the output folder and a summary DataFrame."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from .core import StepResult

__all__ = ["summary_frame", "write_summary"]


def summary_frame(steps: "Sequence[StepResult]") -> "pd.DataFrame":
    """One row per figure (``step, figure, value, unit``; step as ``"2 switch"``); a step without
    figures gets one row carrying its status."""
    import pandas as pd
    rows = []
    for s in steps:
        step = f"{s.number} {s.title.split(':')[0].lower()}"
        if not s.ok or not s.figures:
            rows.append({"step": step, "figure": "status", "value": s.status, "unit": ""})
            continue
        for f in s.figures:
            text = f.text()
            rows.append({"step": step, "figure": f.name, "value": text[:-len(f.unit)].strip() if f.unit else text,
                         "unit": f.unit})
    return pd.DataFrame(rows, columns=["step", "figure", "value", "unit"])


def write_summary(out: Path, steps: "Sequence[StepResult]", seconds: float) -> Path:
    """Write ``summary.md``: per step its status, its figures with units, links to its files."""
    lines = ["# parashift demo", "",
             f"Everything here was computed by this run ({seconds:.0f} s on this machine); a step whose "
             "capability is missing says `not available` and shows no figures.", ""]
    for s in steps:
        lines += [f"## {s.number}. {s.title}", "", f"Status: **{s.status}** ({s.seconds:.1f} s)", ""]
        if s.body and s.ok:
            lines += [s.body, ""]
        if s.figures:
            lines += ["| figure | value |", "|---|---|"]
            lines += [f"| {f.name} | {f.text()} |" for f in s.figures]
            lines.append("")
        for caption, rel in s.files.items():
            if rel.endswith(".png"):
                lines += [f"![{caption}]({rel})", ""]
            else:
                lines += [f"- [{caption}]({rel})"]
        if s.files:
            lines.append("")
    path = Path(out) / "summary.md"
    path.write_text("\n".join(lines))
    return path
