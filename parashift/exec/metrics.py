"""Per-step training metrics: JSON lines, TensorBoard events (when ``tensorboard`` is installed) and a
progress bar on a terminal.

One record per step: ``step``, ``loss``, ``grad_norm`` (global, before clipping), ``lr``, ``tokens``,
``tokens_per_s``, ``step_seconds`` and ``predicted_step_seconds`` (the simulator's, or None).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import IO, Any

__all__ = ["MetricsLog", "tensorboard_available"]


def tensorboard_available() -> bool:
    """Whether ``torch.utils.tensorboard`` can write events (the ``tensorboard`` package is installed)."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


class MetricsLog:
    """Writes each step's record where asked: ``path`` (JSON lines), ``tensorboard`` (an event directory;
    skipped with a note when the package is missing), ``bar`` (a one-line progress bar on ``stream``
    when it is a terminal)."""

    def __init__(self, steps: int, tokens: int, *, path: "str | None" = None, tensorboard: "str | None" = None,
                 predicted: float | None = None, bar: bool = True, stream: IO[str] | None = None) -> None:
        self.steps, self.tokens, self.predicted = steps, tokens, predicted
        self.records: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self._file = open(path, "w") if path else None
        self._tb = None
        if tensorboard:
            if tensorboard_available():
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(log_dir=str(Path(tensorboard)))
            else:
                self.notes.append(f"--tensorboard {tensorboard}: the tensorboard package is not installed; no "
                                  f"events were written (pip install tensorboard)")
        self.stream = stream if stream is not None else sys.stderr
        self.bar = bar and hasattr(self.stream, "isatty") and self.stream.isatty()

    def __call__(self, step: int, loss: float, seconds: float, grad_norm: float, lr: float) -> dict[str, Any]:
        rec = {"step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens": self.tokens,
               "tokens_per_s": self.tokens / seconds if seconds > 0 else None, "step_seconds": seconds,
               "predicted_step_seconds": self.predicted}
        self.records.append(rec)
        if self._file is not None:
            self._file.write(json.dumps(rec) + "\n")
            self._file.flush()
        if self._tb is not None:
            for k in ("loss", "grad_norm", "lr", "tokens_per_s", "step_seconds"):
                if rec[k] is not None:
                    self._tb.add_scalar(f"train/{k}", rec[k], step)
        if self.bar:
            done = step + 1
            width = 24
            fill = int(width * done / max(self.steps, 1))
            self.stream.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{self.steps}  loss {loss:.4f}  "
                              f"|g| {grad_norm:.3g}  lr {lr:.3g}  {seconds * 1e3:.0f} ms")
            if done >= self.steps:
                self.stream.write("\n")
            self.stream.flush()
        return rec

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
