"""Pipeline schedule records: one :class:`Schedule` per schedule (chunks per stage, V shape, split
backward, the rules it checks, its published bubble formula and the name of its order recipe) in a
registry that strategy validation, compile, the cost estimate and the search space all read.

It sits below :mod:`parashift.strategy`, which validates a schedule's name and rules without loading
the IR; the recipes that produce each stage's actions live in :mod:`parashift.ir.schedules`. A new
schedule is one :func:`register` call with its recipe callable.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

from .errors import StrategyError

__all__ = ["Schedule", "register", "get_schedule", "schedule_names", "canonical", "ALIASES"]

# (strategy, micro-batches, ScheduleCosts or None) -> {stage: steps}; see parashift.ir.schedules
Recipe = Callable[..., dict]


def _flat_bubble(p: int, m: int, v: int, f: float, i: float, w: float) -> float:
    return (p - 1) / m


@dataclass(frozen=True)
class Schedule:
    """Everything the rest of parashift knows about one pipeline schedule.

    ``recipe``: the stage orders, a callable ``(strategy, m, costs)`` or the name of a built-in recipe in
    :data:`parashift.ir.schedules.BUILTIN_RECIPES`. ``chunks``: chunks per stage (1; a fixed count such
    as DualPipeV's 2; None: any ``vpp >= 2``). ``costs``: whether the recipe is list-scheduled with F/I/W
    durations (``"never"``, ``"always"``, or ``"given"``: only when the caller passes some).
    ``hides_ep_comm``: expert all-to-alls run on the comm stream, overlapped with the other
    micro-batch's compute. ``layers_divisible``: Megatron rejects layer counts not divisible by
    ``pp * vpp``; ``microbatches_multiple_of_pp``: Megatron rejects micro-batch counts that are not a
    multiple of ``pp``. ``bubble(p, m, v, f, i, w)``: the published idle fraction of a stage (idle time
    over busy time) on uniform stages with per-chunk forward ``f``, input-grad ``i`` and weight-grad
    ``w`` durations.
    """

    name: str
    recipe: Union[str, Recipe]
    summary: str
    bubble: Callable[[int, int, int, float, float, float], float]
    source: str
    chunks: "int | None" = 1
    vshape: bool = False
    split_backward: bool = False
    costs: str = "never"
    hides_ep_comm: bool = False
    layers_divisible: bool = False
    microbatches_multiple_of_pp: bool = False

    @property
    def chunked(self) -> bool:
        """Whether a stage runs more than one chunk."""
        return self.chunks != 1

    def vpp_choices(self, vpps: "tuple[int, ...]") -> tuple[int, ...]:
        """The ``vpp`` values this schedule can run, out of ``vpps`` for a free choice."""
        if self.chunks is None:
            return tuple(v for v in vpps if v >= 2)
        return (self.chunks,)

    def vpp_problems(self, vpp: int) -> list[str]:
        if self.chunks is None and vpp < 2:
            return [f"schedule {self.name} needs vpp >= 2; set vpp=2 or use schedule=1f1b"]
        if self.chunks == 1 and vpp != 1:
            return [f"schedule {self.name} runs one chunk per stage (vpp=1); "
                    f"use schedule=interleaved-1f1b or dualpipev for vpp={vpp}"]
        if self.chunks not in (None, 1) and vpp != self.chunks:
            return [f"schedule {self.name} places exactly {self.chunks} chunks per stage; set vpp={self.chunks}, "
                    f"not {vpp}"]
        return []

    def microbatch_problems(self, pp: int, m: int) -> list[str]:
        """What is wrong with ``m`` micro-batches on ``pp`` stages."""
        if self.microbatches_multiple_of_pp and pp > 1 and m % pp:
            return [f"{self.name} needs the micro-batch count ({m}) to be a multiple of pp={pp} (as "
                    f"Megatron-LM requires); change the global batch or mbs so that it is"]
        return []

    def layer_problems(self, pp: int, vpp: int, layers: int) -> list[str]:
        """What is wrong with splitting ``layers`` over ``pp`` stages of ``vpp`` chunks."""
        if self.layers_divisible and pp > 1 and layers % (pp * vpp):
            ok = [v for v in range(2, 9) if layers % (pp * v) == 0]
            fix = f"use vpp={ok[0]}" if ok else "use schedule=1f1b"
            return [f"{self.name} needs the {layers} layers to split evenly over pp*vpp={pp * vpp} chunks (as "
                    f"Megatron-LM requires); {fix} or change pp"]
        return []


_REGISTRY: dict[str, Schedule] = {}


def register(schedule: Schedule) -> Schedule:
    """Add a schedule to the registry (strategy parsing, compile, costs and search read it)."""
    _REGISTRY[schedule.name] = schedule
    return schedule


for _s in (
    Schedule("gpipe", "gpipe", "all forwards, then all backwards", _flat_bubble, "Huang et al. 2019 (GPipe): (p-1)/m"),
    Schedule("1f1b", "1f1b", "one forward, one backward (PipeDream-flush)",
             _flat_bubble, "Narayanan et al. 2021: (p-1)/m"),
    Schedule("interleaved-1f1b", "interleaved-1f1b", "Megatron-LM's interleaved 1F1B over vpp chunks per stage",
             lambda p, m, v, f, i, w: (p - 1) / (v * m), "Narayanan et al. 2021: (p-1)/(v*m)",
             chunks=None, layers_divisible=True, microbatches_multiple_of_pp=True),
    Schedule("zb-h1", "zb-h1", "zero-bubble H1: split backward, W fills the bubbles",
             lambda p, m, v, f, i, w: (p - 1) * (f + i - w) / (m * (f + i + w)),
             "Qi et al. 2024 (Zero Bubble PP), ZB-H1: (p-1)(F+B-W) over m(F+B+W)",
             split_backward=True, costs="always"),
    Schedule("zb-2p", "zb-2p", "zero-bubble 2p: split backward, twice 1F1B's activations in flight, W fills the rest",
             lambda p, m, v, f, i, w: (p - 1) * max(0.0, f + i - 2 * w) / (m * (f + i + w)),
             "Qi et al. 2024 (Zero Bubble PP), ZB-H2: (p-1)(F+B-2W) over m(F+B+W), 0 when F=B=W",
             split_backward=True, costs="always"),
    Schedule("zb-v", "zb-v", "ZB-V: V-shaped chunks, split backward, 1F1B's activation memory, W fills the bubbles",
             lambda p, m, v, f, i, w: (p - 1) * max(0.0, f + i - 2 * w) / (m * v * (f + i + w)),
             "Qi et al. 2024 (Zero Bubble PP, ZB-V): 0 when F=B=W; (p-1)(F+B-2W) per chunk over m*v*(F+B+W)",
             chunks=2, vshape=True, split_backward=True, costs="always"),
    Schedule("dualpipev", "dualpipev",
             "DualPipeV: V-shaped chunks, split backward, forward overlapped with input-grad backward",
             lambda p, m, v, f, i, w: (p - 1) * ((f + i) + (i + w) - 3 * w) / (m * v * (f + i + w)),
             "DeepSeek-V3 report / DualPipe: (PP/2-1)(F&B+B-3W) with PP/2 = p ranks, F&B = F+I unoverlapped",
             chunks=2, vshape=True, split_backward=True, costs="always", hides_ep_comm=True),
):
    register(_s)


#: Other names a schedule is published under -> its registered name. ``zb-1p``: the zero-bubble paper's
#: automatic schedule under 1F1B's in-flight bound, which zb-h1's list scheduler plans on F/I/W durations.
ALIASES: dict[str, str] = {"zb-1p": "zb-h1"}


def canonical(name: str) -> str:
    """The registered name of schedule ``name`` (itself unless it is an alias)."""
    return ALIASES.get(name, name)


def get_schedule(name: str) -> Schedule:
    """The registered schedule called ``name`` or aliased so (StrategyError naming the choices otherwise)."""
    try:
        return _REGISTRY[canonical(name)]
    except KeyError:
        raise StrategyError(f"unknown schedule {name!r}; use one of {', '.join(_REGISTRY)}") from None


def schedule_names() -> tuple[str, ...]:
    """Every registered schedule, in registration order."""
    return tuple(_REGISTRY)
