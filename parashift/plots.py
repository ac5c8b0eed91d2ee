"""Every picture parashift draws (matplotlib): Gantt charts of timelines (one panel per timeline,
e.g. simulated next to measured; ``SimResult.plot_timeline`` draws one), pipeline schedule grids
(``parashift schedule --plot``), memory bars, switch heatmaps, loss curves, and the colour tables.
It imports nothing of parashift, so every layer may import it.

Each ``plot_*`` returns its figure and writes ``path`` when given. In a notebook (an inline
backend) the figure stays open, so it is both saved and displayed; elsewhere a written figure is
closed.

Gantt bars are drawn with one ``broken_barh`` call per (row, colour), so a timeline of tens of
thousands of instructions plots in about a second.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["COLORS", "ACTION_COLORS", "plot_gantt", "plot_order", "plot_memory", "plot_bytes_heatmap", "plot_bars",
           "plot_losses", "pyplot", "inline"]

#: Gantt bar colour per compute phase or communication op.

COLORS = {"fwd": "#4C72B0", "bwd": "#55A868", "bwd_input": "#8FD19E", "bwd_weight": "#2E7D32",
          "recompute": "#937860", "optim": "#8172B2", "send": "#DD8452", "recv": "#E8A87C",
          "all_reduce": "#C44E52", "all_gather": "#DA8BC3", "reduce_scatter": "#CCB974",
          "all_to_all": "#64B5CD", "broadcast": "#8C8C8C", "scatter": "#8C8C8C", "gather": "#8C8C8C",
          "copy": "#B0B0B0"}
_OTHER = "#999999"
#: Schedule-grid cell colour per action type (forward, backward, input-grad, weight-grad).
ACTION_COLORS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868"}


def pyplot() -> Any:
    """matplotlib.pyplot; the Agg backend (files only) unless pyplot was already imported with
    another one (a notebook's inline backend is kept, so figures display)."""
    import sys
    if "matplotlib.pyplot" not in sys.modules:
        import matplotlib
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _subplots(*args: Any, **kw: Any) -> tuple[Any, Any]:
    """``plt.subplots`` in matplotlib's default style (Optuna's plots switch the global style to ggplot)."""
    plt = pyplot()
    with plt.style.context("default"):
        return plt.subplots(*args, **kw)


def _keys(df: "pd.DataFrame") -> np.ndarray:
    op = df["op"].astype(str).to_numpy()
    phase = df["phase"].astype(str).to_numpy()
    return np.where(op == "compute", phase, op)


def plot_gantt(timelines: "Mapping[str, pd.DataFrame]", path: str | None = None, *, max_devices: int = 8,
               unit: str = "s", title: str = "") -> Any:
    """Gantt charts of timelines (columns ``device, stream, op, phase, start, end``), one panel each,
    rows ``(device, stream)`` of the first ``max_devices`` devices, bars coloured by phase/op.
    Writes ``path`` when given; returns the figure (closed when written)."""
    from matplotlib.patches import Patch
    scale = {"s": 1.0, "ms": 1e3, "us": 1e6}[unit]
    panels = [(k, v) for k, v in timelines.items() if v is not None and len(v)]
    heights = []
    prepared = []
    for name, df in panels:
        devs = sorted(df["device"].unique())[:max_devices]
        d = df[df["device"].isin(devs)]
        rows = sorted({(int(a), str(b)) for a, b in zip(d["device"], d["stream"])})
        prepared.append((name, d, rows))
        heights.append(max(1.5, 0.3 * len(rows) + 0.8))
    fig, axes = _subplots(len(prepared) or 1, 1, figsize=(12, sum(heights) + 0.8 if heights else 2),
                             gridspec_kw={"height_ratios": heights} if heights else None, squeeze=False)
    used: set[str] = set()
    for ax, (name, d, rows) in zip(axes[:, 0], prepared):
        ypos = {k: i for i, k in enumerate(rows)}
        keys = _keys(d)
        y = np.array([ypos[(int(a), str(b))] for a, b in zip(d["device"], d["stream"])])
        start = d["start"].to_numpy(dtype=float) * scale
        width = (d["end"].to_numpy(dtype=float) - d["start"].to_numpy(dtype=float)) * scale
        for key in np.unique(keys):
            used.add(str(key))
            mk = keys == key
            for row in np.unique(y[mk]):
                sel = mk & (y == row)
                ax.broken_barh(list(zip(start[sel], width[sel])), (row - 0.4, 0.8),
                               facecolors=COLORS.get(str(key), _OTHER), linewidth=0)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([f"dev {a} {b}" for a, b in rows], fontsize=7)
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.set_xlabel(f"time ({unit})")
        ax.set_title(name, fontsize=9)
        ax.autoscale(axis="x")
    if title:
        fig.suptitle(title)
    fig.legend(handles=[Patch(color=COLORS.get(k, _OTHER), label=k) for k in sorted(used)], fontsize=7,
               loc="lower center", ncol=8, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return _finish(fig, path)


def plot_order(orders: "Mapping[int, Iterable[Any]]", path: str | None = None, *, chunked: bool = False,
               title: str = "") -> Any:
    """Stage x slot grid of each stage's actions (``type``, ``mb``, ``chunk``; e.g.
    :func:`parashift.ir.actions.stage_orders`), coloured by type and labelled with the micro-batch
    (and ``c<chunk>`` when ``chunked``). Writes ``path`` when given; returns the figure."""
    from matplotlib.patches import Patch, Rectangle
    orders = {st: list(acts) for st, acts in orders.items()}
    width = max((len(v) for v in orders.values()), default=1)
    fig, ax = _subplots(figsize=(min(2 + 0.32 * width, 60), 1 + 0.5 * len(orders)))
    for st, acts in orders.items():
        for k, a in enumerate(acts):
            ax.add_patch(Rectangle((k, st), 1, 1, facecolor=ACTION_COLORS[a.type], edgecolor="white"))
            label = f"{a.mb}" + (f"\u2009c{a.chunk}" if chunked else "")
            ax.text(k + 0.5, st + 0.5, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_xlim(0, width)
    ax.set_ylim(len(orders), 0)
    ax.set_yticks([i + 0.5 for i in range(len(orders))])
    ax.set_yticklabels([f"stage {i}" for i in range(len(orders))])
    ax.set_xlabel("slot")
    ax.legend(handles=[Patch(color=c, label=t) for t, c in ACTION_COLORS.items()], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    return _finish(fig, path, dpi=120)


def plot_memory(frame: "pd.DataFrame", path: str | None = None, *, label: str = "schedule",
                capacity: float | None = None, title: str = "Peak memory per device") -> Any:
    """Stacked bars (GiB) of ``states``, ``activations`` and ``buffers`` per row of ``frame``
    (one row per strategy/schedule, bytes), with the device capacity as a line."""
    gib = 2.0 ** 30
    fig, ax = _subplots(figsize=(7, 3.5))
    x = np.arange(len(frame))
    bottom = np.zeros(len(frame))
    for part, color in (("states", "#4C72B0"), ("activations", "#DD8452"), ("buffers", "#8C8C8C")):
        vals = frame[part].to_numpy(dtype=float) / gib
        ax.bar(x, vals, bottom=bottom, color=color, label=part)
        bottom += vals
    if capacity:
        ax.axhline(capacity / gib, color="#C44E52", linestyle="--", label="usable device memory")
    ax.set_xticks(x)
    ax.set_xticklabels([str(v) for v in frame[label]], fontsize=8)
    ax.set_ylabel("GiB per device (fullest device)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return _finish(fig, path)


def plot_bytes_heatmap(matrix: np.ndarray, path: str | None = None, *, title: str = "bytes between devices",
                       src_label: str = "source device", dst_label: str = "destination device") -> Any:
    """A heatmap (GiB, log colour scale; white where nothing moves) of ``matrix[src, dst]`` bytes."""
    from matplotlib.colors import LogNorm
    gib = np.asarray(matrix, dtype=float) / 2.0 ** 30
    shown = np.ma.masked_less_equal(gib, 0)
    fig, ax = _subplots(figsize=(6.5, 5.5))
    positive = gib[gib > 0]
    norm = LogNorm(vmin=positive.min(), vmax=positive.max()) if positive.size and positive.min() < positive.max() \
        else None
    im = ax.imshow(shown, cmap="viridis", norm=norm, interpolation="nearest", aspect="auto")
    fig.colorbar(im, ax=ax, label="GiB")
    ax.set_xlabel(dst_label)
    ax.set_ylabel(src_label)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return _finish(fig, path)


def plot_bars(labels: Sequence[str], values: Sequence[float], path: str | None = None, *, ylabel: str,
              title: str = "", log: bool = False, colors: Sequence[str] | None = None) -> Any:
    """One bar per label, the value written on top (``colors``: one per bar; a palette by default)."""
    fig, ax = _subplots(figsize=(6, 3.2))
    palette = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B2"]
    bars = ax.bar(range(len(values)), values,
                  color=list(colors) if colors is not None else [palette[i % 5] for i in range(len(values))])
    for b, v in zip(bars, values):
        ax.annotate(f"{v:.3g}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                    fontsize=8)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return _finish(fig, path)


def plot_losses(curves: "Mapping[str, Sequence[float]]", path: str | None = None, *,
                marks: "Sequence[tuple[int, str]]" = (), title: str = "loss per step") -> Any:
    """Loss per step of several runs; ``marks``: (step, label) vertical lines (switches)."""
    fig, ax = _subplots(figsize=(7, 3.5))
    styles = ["-", "--", ":", "-."]
    for i, (name, ys) in enumerate(curves.items()):
        ax.plot(range(1, len(ys) + 1), ys, styles[i % len(styles)], marker="o", markersize=3, label=name)
    for step, label in marks:
        ax.axvline(step + 0.5, color="#8C8C8C", linewidth=0.8)
        ax.annotate(label, (step + 0.5, ax.get_ylim()[1]), fontsize=7, rotation=90, va="top", ha="right")
    ax.set_xlabel("training step")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _finish(fig, path)


def _finish(fig: Any, path: str | None, dpi: int = 110) -> Any:
    if path is not None:
        fig.savefig(path, dpi=dpi)
        if not inline():
            pyplot().close(fig)
    return fig


def inline() -> bool:
    """True under a notebook's inline backend (figures display when their cell ends)."""
    import matplotlib
    return "inline" in matplotlib.get_backend().lower()
