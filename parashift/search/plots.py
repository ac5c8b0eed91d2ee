"""The drawing helpers the search's pictures share: pyplot on a headless backend, and one Optuna plot
rendered into an image. :meth:`SearchResult.plot <parashift.search.result.SearchResult.plot>` and
:meth:`TracePlan.plot <parashift.search.trace_plan.TracePlan.plot>` draw with them; matplotlib loads
only when a picture is drawn."""
from __future__ import annotations

import io
import sys
import warnings
from typing import Any, Callable

import numpy as np

__all__ = ["pyplot", "render"]


def pyplot() -> Any:
    """pyplot on the Agg backend (unless the caller already chose one)."""
    if "matplotlib.pyplot" not in sys.modules:
        import matplotlib
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def render(draw: Callable[[], Any], plt: Any) -> "np.ndarray | str":
    """Run one Optuna plot function into its own figure and return it as an RGBA image
    (or the reason it could not be drawn)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # optuna marks its matplotlib functions experimental
            ax = draw()
    except (ValueError, RuntimeError, ZeroDivisionError) as e:
        return str(e) or type(e).__name__
    fig = ax.figure if hasattr(ax, "figure") else np.ravel(ax)[0].figure
    fig.set_size_inches(6.4, 4.4)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    buf.seek(0)
    return plt.imread(buf)
