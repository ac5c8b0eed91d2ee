"""What an export takes (a model, a strategy, a batch, optional trainer settings) and what it returns."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from ..errors import InputError
from ..models import ModelSpec
from ..strategy import Strategy
from ..train.schedule import LRSchedule

__all__ = ["Job", "Training", "Export", "FP8_FORMATS", "build"]

#: fp8 formats an export can ask for: all-E4M3, or E4M3 forward with E5M2 gradients (Transformer Engine's names)
FP8_FORMATS = ("e4m3", "hybrid")


@dataclass(frozen=True)
class Training:
    """Trainer settings to export besides the strategy; None leaves the target's default."""

    schedule: LRSchedule | None = None
    steps: int | None = None
    clip_grad: float | None = None
    weight_decay: float | None = None
    fp8: str | None = None

    def __post_init__(self) -> None:
        if self.fp8 is not None and self.fp8 not in FP8_FORMATS:
            raise InputError(f"--fp8 {self.fp8!r} is not one of {', '.join(FP8_FORMATS)}")
        if self.steps is not None and self.steps < 1:
            raise InputError(f"--steps {self.steps} must be at least 1")
        if self.clip_grad is not None and not self.clip_grad > 0:
            raise InputError(f"--clip-grad {self.clip_grad} must be positive")
        if self.weight_decay is not None and self.weight_decay < 0:
            raise InputError(f"--weight-decay {self.weight_decay} must be 0 or more")


@dataclass(frozen=True)
class Job:
    """The model, strategy and batch to export (a deploy plan holds all four)."""

    model: ModelSpec
    strategy: Strategy
    global_batch: int
    seq_len: int
    training: Training = field(default_factory=Training)

    def __post_init__(self) -> None:
        self.strategy.validate(self.model)
        if self.training.fp8 and self.strategy.fp8 != "none":
            raise InputError(f"fp8 is given twice: the strategy's fp8={self.strategy.fp8} (simulated) and --fp8 "
                             f"{self.training.fp8}; drop --fp8")
        self.strategy.num_microbatches(self.global_batch)   # raises when gb does not divide into micro-batches


@dataclass
class Export:
    """One target's rendering: ``options`` are the option names it sets (``--flag`` for Megatron-LM,
    ``section.key`` for torchtitan) with their values; ``unsupported`` lists what the target cannot express
    (the job there differs from the plan in that way); ``notes`` what the user must still add or know."""

    target: str
    version: str
    options: list[tuple[str, object]] = field(default_factory=list)
    unsupported: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    text: str = ""

    def set(self, name: str, value: object = True) -> None:
        if any(n == name for n, _ in self.options):
            raise AssertionError(f"{self.target} option {name} set twice")   # a bug in an exporter
        self.options.append((name, value))

    def set_plain(self, training: Training, names: dict[str, str]) -> None:
        """Set the trainer settings that map one to one (``steps``, ``clip_grad``, ``weight_decay``) under the
        target's ``names`` for them, leaving the unset ones at the target's default."""
        for key, name in names.items():
            value = getattr(training, key)
            if value is not None:
                self.set(name, value)

    def header(self) -> str:
        """Comment lines (``#``) naming the target, then every unsupported item and every note."""
        return (f"# parashift export for {self.version}\n" + "".join(f"# unsupported: {u}\n" for u in self.unsupported)
                + "".join(f"# note: {n}\n" for n in self.notes))

    def to_dict(self) -> dict:
        return {"target": self.target, "version": self.version, "options": {n: v for n, v in self.options},
                "unsupported": list(self.unsupported), "notes": list(self.notes), "text": self.text}


def build(target: str, version: str, job: Job, passes: "Sequence[Callable[[Job, Export], None]]") -> Export:
    """An empty :class:`Export` for ``target`` filled by each of ``passes`` in turn."""
    out = Export(target, version)
    for p in passes:
        p(job, out)
    return out
