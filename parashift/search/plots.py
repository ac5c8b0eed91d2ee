"""Pictures of a search (through Optuna's matplotlib visualizations) and of a trace plan."""
from __future__ import annotations

import io
import warnings
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .result import _pyplot

if TYPE_CHECKING:  # pragma: no cover
    from .result import SearchResult
    from .trace_plan import TracePlan

__all__ = ["plot_search", "plot_trace_plan"]


def _render(draw: Callable[[], Any], plt: Any) -> "np.ndarray | str":
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


def plot_search(result: "SearchResult", path: str) -> str:
    """History (or Pareto front) and parameter importances of ``result.study`` side by side."""
    plt = _pyplot()
    from optuna.trial import TrialState
    from optuna.visualization import matplotlib as ovm
    study = result.study
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    multi = len(result.objective) > 1
    panels: list[tuple[str, Any]] = []
    if multi:
        panels.append(("Pareto front", _render(lambda: _pareto(result, plt), plt)))
    else:
        panels.append(("Optimization history", _render(lambda: ovm.plot_optimization_history(
            study, target_name="tokens/s"), plt)))
    if len(done) >= 2:
        img = _render(lambda: ovm.plot_param_importances(study, target_name="tokens/s"), plt)
    else:
        img = f"only {len(done)} completed trial(s): parameter importances need at least 2"
    panels.append(("Parameter importances", img))
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.6))
    for ax, (title, img) in zip(np.ravel(axes), panels):
        ax.axis("off")
        if isinstance(img, str):
            ax.set_title(title)
            ax.text(0.5, 0.5, img, ha="center", va="center", wrap=True)
        else:
            ax.imshow(img)
    b = result.best
    head = f"{result.model.name} on {result.devices} x {result.cluster.gpu.name}, {len(result.trials)} trials"
    if b is not None:
        head += f" - best {b.strategy} ({b.tokens_per_s:,.0f} tokens/s)"
    fig.suptitle(head)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _pareto(result: "SearchResult", plt: Any) -> Any:
    """Every feasible trial's peak memory against tokens/s, the Pareto front joined."""
    ok = result.trials[result.trials["status"] == "ok"]
    fig, ax = plt.subplots()
    ax.scatter(ok["peak_memory"] / 2**30, ok["tokens_per_s"], s=12, color="tab:gray", label="feasible trials")
    front = result.pareto
    ax.plot([c.peak_memory / 2**30 for c in front], [c.tokens_per_s for c in front], "o-", color="tab:red",
            label="Pareto front")
    ax.set_xlabel("peak memory per device (GiB)")
    ax.set_ylabel("tokens/s")
    ax.legend(fontsize=8)
    return ax


def plot_trace_plan(plan: "TracePlan", path: str) -> str:
    """Device count and the switch-aware plan's strategy over time (top), cumulative tokens per
    policy (bottom)."""
    plt = _pyplot()
    seg = plan.segments
    span = float(seg["end"].iloc[-1] - seg["start"].iloc[0])
    unit, scale = ("hours", 3600.0) if span >= 3 * 3600 else (("minutes", 60.0) if span >= 180 else ("seconds", 1.0))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 7), sharex=True, gridspec_kw={"height_ratios": [1, 1.2]})
    t = np.append(seg["start"].to_numpy(), seg["end"].to_numpy()[-1:]) / scale
    avail = np.append(seg["devices"].to_numpy(), seg["devices"].to_numpy()[-1:])
    ax1.step(t, avail, where="post", color="black", lw=1.5, label="available devices")
    path_df = plan.policy_frame("switch-aware")
    names = list(dict.fromkeys(path_df["strategy"].dropna()))
    cmap = plt.get_cmap("tab10")
    for _, r in path_df.iterrows():
        if r["strategy"] is None or not isinstance(r["strategy"], str):
            continue
        k = names.index(r["strategy"])
        ax1.fill_between([r["start"] / scale, r["end"] / scale], 0, r["world"], step="post",
                         color=cmap(k % 10), alpha=0.45, lw=0)
    for k, n in enumerate(names):
        ax1.fill_between([], [], color=cmap(k % 10), alpha=0.45, label=f"switch-aware: {n}")
    ax1.set_ylabel("devices")
    ax1.set_ylim(0, max(1, float(avail.max())) * 1.1)
    ax1.legend(loc="lower left", fontsize=7, ncol=2)
    for pol in plan.policies:
        ct, ctok = plan.cumulative_tokens(pol)
        ax2.plot(ct / scale, ctok, label=f"{pol} ({plan.summary().loc[pol, 'tokens']:.3g} tokens)")
    ax2.set_xlabel(f"time ({unit})")
    ax2.set_ylabel("tokens trained")
    ax2.legend(loc="upper left", fontsize=8)
    fig.suptitle(f"{plan.model.name} on {plan.cluster.name}: trace plan")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
