"""Read a compiled Program back as per-stage action orders, and draw them as a grid (matplotlib)."""
from __future__ import annotations

from .actions import Action
from .program import Program

__all__ = ["stage_orders", "plot_order"]

_TYPE = {"fwd": "F", "bwd": "B", "recompute": "B", "bwd_input": "I", "bwd_weight": "W"}
_COLORS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868"}


def stage_orders(program: Program) -> dict[int, list[Action]]:
    """Each stage's compute actions in stream order (consecutive instructions of one action merged)."""
    s = program.strategy
    per = (s.world // s.pp) if s is not None else 1
    stages = (s.pp if s is not None else 1)
    out: dict[int, list[Action]] = {}
    for st in range(stages):
        rp = program.ranks[st * per]
        acts: list[Action] = []
        seen: set = set()
        for ins in rp.streams.get("compute", ()):
            if ins.op != "compute" or ins.phase not in _TYPE:
                continue
            a = Action(ins.chunk, _TYPE[ins.phase], ins.microbatch)
            if a not in seen:
                seen.add(a)
                acts.append(a)
        out[st] = acts
    return out


def plot_order(program: Program, path: str, *, title: str | None = None) -> str:
    """Stage x slot grid, F/B/I/W colored, micro-batch numbers (chunk as subscript when vpp > 1)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    orders = stage_orders(program)
    width = max((len(v) for v in orders.values()), default=1)
    multi = program.strategy is not None and program.strategy.vpp > 1
    fig, ax = plt.subplots(figsize=(min(2 + 0.32 * width, 60), 1 + 0.5 * len(orders)))
    for st, acts in orders.items():
        for k, a in enumerate(acts):
            ax.add_patch(Rectangle((k, st), 1, 1, facecolor=_COLORS[a.type], edgecolor="white"))
            label = f"{a.mb}" + (f"\u2009c{a.chunk}" if multi else "")
            ax.text(k + 0.5, st + 0.5, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_xlim(0, width)
    ax.set_ylim(len(orders), 0)
    ax.set_yticks([i + 0.5 for i in range(len(orders))])
    ax.set_yticklabels([f"stage {i}" for i in range(len(orders))])
    ax.set_xlabel("slot")
    ax.legend(handles=[Patch(color=c, label=t) for t, c in _COLORS.items()], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_title(title or f"{program.meta.get('model', '')} {program.meta.get('strategy', '')}".strip())
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
