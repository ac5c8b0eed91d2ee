"""The training states every parameter carries, and the ZeRO stages: what each shards and how it
moves parameters and gradients.

Shared by :mod:`parashift.strategy`, :mod:`parashift.vps` (layouts), :mod:`parashift.ir` (memory,
gradient syncs and gathers), :mod:`parashift.cost`, :mod:`parashift.sim` and the runtime: it sits
below all of them so every layer asks the same record instead of comparing stage numbers.
(:mod:`parashift.exec.zero` is the runtime's reduce-scatter code; this module only describes.)
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import StrategyError

__all__ = ["KINDS", "ZERO", "ZERO_LEVELS", "ZERO_STAGE", "ZeroStage", "zero_stage"]

#: Every VPS state kind, in canonical order.
KINDS = ("param", "grad", "master", "exp_avg", "exp_avg_sq")
_OPTIM = ("master", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class ZeroStage:
    """One ZeRO stage: which states it shards over the data-parallel (x context-parallel) group.

    ``shards_optim``: the fp32 master weights and Adam moments (stage 1 and up); ``shards_grads``:
    the gradients (2 and up); ``shards_params``: the parameters themselves (3).
    """

    level: int
    shards_optim: bool
    shards_grads: bool
    shards_params: bool

    def __str__(self) -> str:
        return f"ZeRO-{self.level}"

    def shards(self, kind: str) -> bool:
        """Whether this stage shards state ``kind`` (one of :data:`KINDS`)."""
        if kind == "param":
            return self.shards_params
        if kind == "grad":
            return self.shards_grads
        if kind in _OPTIM:
            return self.shards_optim
        raise KeyError(f"unknown state kind {kind!r}; use one of {', '.join(KINDS)}")

    @property
    def sharded(self) -> bool:
        """Whether it shards anything (every stage but 0): each DP rank then holds distinct state."""
        return self.shards_optim

    @property
    def grad_sync(self) -> str:
        """The collective that syncs gradients: ``all_reduce`` (stage 0) or ``reduce_scatter``."""
        return "reduce_scatter" if self.shards_optim else "all_reduce"

    @property
    def grad_buckets(self) -> bool:
        """Gradients reduce-scatter per micro-batch into the owner's shard buckets (stages 2, 3);
        otherwise the full gradient accumulates over the step and syncs once."""
        return self.shards_grads

    @property
    def gathers_after_step(self) -> bool:
        """Full parameters are kept, the optimizer updates a shard, and the updated shards are
        all-gathered after the step (stages 1, 2)."""
        return self.shards_optim and not self.shards_params

    @property
    def gathers_around_use(self) -> bool:
        """Only the shard is kept; each forward and backward gathers the parameters it uses (stage 3)."""
        return self.shards_params


#: The ZeRO stages, indexed by level.
ZERO = (ZeroStage(0, False, False, False), ZeroStage(1, True, False, False),
        ZeroStage(2, True, True, False), ZeroStage(3, True, True, True))
#: Every ZeRO stage's level (what ``zero=`` takes).
ZERO_LEVELS = tuple(z.level for z in ZERO)
#: Smallest ZeRO stage that shards each kind.
ZERO_STAGE = {k: min(z.level for z in ZERO if z.shards(k)) for k in KINDS}


def zero_stage(level: int) -> ZeroStage:
    """The ZeRO stage ``level`` (0 to 3)."""
    if level not in range(len(ZERO)):
        raise StrategyError(f"zero={level!r} is not a ZeRO stage; use 0, 1, 2 or 3")
    return ZERO[int(level)]
