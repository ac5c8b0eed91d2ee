"""The learning-rate schedule and AdamW's weight-decay rule, as pure functions of plain numbers.

:class:`LRSchedule` gives a linear warmup, then cosine, linear or constant decay to ``min_lr``. It counts
steps in one of two conventions. Both index steps from 0, and step ``k`` is the ``k``-th optimizer update.

- ``"megatron"`` (the default) is Megatron-LM's ``OptimizerParamScheduler.get_lr`` with steps counted in
  iterations. Step ``k <= W`` (``W`` = ``warmup_steps``) uses ``init + (lr - init) * k / W``. So step 0
  trains at ``warmup_init`` (default 0), and step ``W`` reaches ``lr``. For ``W < k <= D`` (``D`` =
  ``decay_steps``), the decay ratio ``(k - W) / (D - W)`` scales ``lr - min_lr``: cosine
  ``0.5 * (1 + cos(pi * ratio))``, linear ``1 - ratio``. After ``D`` the rate stays at ``min_lr``.
  ``constant`` keeps ``lr`` after warmup. These are Megatron's ``--lr``, ``--min-lr``,
  ``--lr-warmup-iters``, ``--lr-decay-iters``, ``--lr-decay-style`` and ``--lr-warmup-init``.
- ``"torchtitan"`` is torchtitan's ``linear_warmup_stable_decay`` ``LambdaLR`` factor with
  ``decay_ratio`` unset and ``D`` as its total steps. Step ``k < W`` uses ``lr * (k + 1) / W``, so step
  ``W - 1`` reaches ``lr``. Step ``W`` holds ``lr`` (torchtitan's "virtual last step"). From step
  ``W + 1`` the ratio ``(k - W) / (D - W)`` decays toward ``min_lr``. Past ``D`` (where torchtitan never
  goes) the rate stays at ``min_lr``.
  ``constant`` maps to ``decay_ratio = 0``. ``warmup_init`` does not exist there and must be 0.

The schedule has no state beyond the step, so resuming needs only the step count.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

from ..errors import InputError

__all__ = ["LRSchedule", "DECAYS", "CONVENTIONS", "decays"]

DECAYS = ("cosine", "linear", "constant")
CONVENTIONS = ("megatron", "torchtitan")


@dataclass(frozen=True)
class LRSchedule:
    """Warmup plus decay (see the module doc). ``decay_steps``: the step the decay ends at, warmup
    included (Megatron's ``--lr-decay-iters``, torchtitan's ``total_steps``); None: the run's length,
    given to :meth:`at` as ``total_steps``."""

    lr: float
    warmup_steps: int = 0
    decay: str = "constant"
    min_lr: float = 0.0
    decay_steps: int | None = None
    warmup_init: float = 0.0
    convention: str = "megatron"

    def __post_init__(self) -> None:
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise InputError(f"--lr {self.lr} must be a positive number")
        if self.decay not in DECAYS:
            raise InputError(f"--lr-decay {self.decay!r} is not one of {', '.join(DECAYS)}")
        if self.convention not in CONVENTIONS:
            raise InputError(f"schedule convention {self.convention!r} is not one of {', '.join(CONVENTIONS)}")
        if not 0 <= self.min_lr <= self.lr:
            raise InputError(f"--min-lr {self.min_lr} must lie between 0 and --lr {self.lr}")
        if not 0 <= self.warmup_init <= self.lr:
            raise InputError(f"the warmup's initial rate {self.warmup_init} must lie between 0 and --lr {self.lr}")
        if self.convention == "torchtitan" and self.warmup_init:
            raise InputError("torchtitan's warmup starts at lr/warmup_steps; a warmup_init needs the megatron convention")
        if self.warmup_steps < 0:
            raise InputError(f"--lr-warmup-steps {self.warmup_steps} must be 0 or more")
        if self.decay_steps is not None:
            self._check_decay(self.decay_steps, "decay_steps")

    def _check_decay(self, d: int, what: str) -> None:
        if self.decay != "constant" and d <= self.warmup_steps:
            raise InputError(f"{what} {d} must exceed --lr-warmup-steps {self.warmup_steps} so that a "
                             f"{self.decay} decay has steps to run over; raise it or shorten the warmup")

    def at(self, step: int, total_steps: int | None = None) -> float:
        """The learning rate of update ``step`` (0-based)."""
        if step < 0:
            raise InputError(f"step {step} is negative")
        d = self.decay_steps if self.decay_steps is not None else total_steps
        if d is None and self.decay != "constant":
            raise InputError("a decaying schedule needs decay_steps or the run's total_steps")
        if d is not None and self.decay_steps is None:
            self._check_decay(d, "total steps")
        if self.convention == "megatron":
            return self._megatron(step, d)
        return self._torchtitan(step, d)

    def _coeff(self, ratio: float) -> float:
        return 0.5 * (1.0 + math.cos(math.pi * ratio)) if self.decay == "cosine" else 1.0 - ratio

    def _megatron(self, k: int, d: int | None) -> float:
        w = self.warmup_steps
        if w > 0 and k <= w:
            return self.warmup_init + (self.lr - self.warmup_init) * k / w
        if self.decay == "constant":
            return self.lr
        assert d is not None
        if k > d:
            return self.min_lr
        return self.min_lr + self._coeff((k - w) / (d - w)) * (self.lr - self.min_lr)

    def _torchtitan(self, k: int, d: int | None) -> float:
        w = self.warmup_steps
        if k < w:
            return self.lr * (k + 1) / w
        if self.decay == "constant" or k <= w:
            return self.lr
        assert d is not None
        ratio = min(1.0, (k - w) / (d - w))
        return self.min_lr + self._coeff(ratio) * (self.lr - self.min_lr)

    def rates(self, steps: int) -> list[float]:
        """The rates of updates ``0 .. steps - 1`` of a ``steps``-step run."""
        return [self.at(k, steps) for k in range(steps)]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LRSchedule":
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise InputError(f"unknown learning-rate schedule keys {sorted(unknown)}; keys are "
                             f"{', '.join(cls.__dataclass_fields__)}")
        return cls(**d)


def decays(name: str, shape: Sequence[int]) -> bool:
    """Whether AdamW applies weight decay to parameter ``name`` of ``shape``: matrices and embeddings
    (two or more dimensions) do. Vectors and scalars (norm gains, biases) do not, and neither does
    any tensor named as a bias or a norm, whatever its shape (Megatron's ``no_wd`` rule, nanoGPT's
    ``dim() >= 2``)."""
    parts = name.lower().split(".")
    if len(shape) < 2 or parts[-1].endswith("bias"):
        return False
    return not any("norm" in p for p in parts)
