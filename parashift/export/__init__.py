"""Export a strategy to the frameworks teams train with: Megatron-LM arguments or a torchtitan TOML.

Pure planning code (no torch). :func:`export` renders a :class:`Job` for one target. What the target
cannot express is listed in ``Export.unsupported``, never silently dropped.
"""
from __future__ import annotations

from .common import FP8_FORMATS, Export, Job, Training
from .megatron import to_megatron
from .torchtitan import to_torchtitan

__all__ = ["export", "Job", "Training", "Export", "TARGETS", "FP8_FORMATS", "to_megatron", "to_torchtitan"]

TARGETS = {"megatron": to_megatron, "torchtitan": to_torchtitan}


def export(job: Job, target: str) -> Export:
    """``job`` rendered for ``target`` (``megatron`` or ``torchtitan``)."""
    from ..errors import InputError
    if target not in TARGETS:
        raise InputError(f"--to {target!r} is not one of {', '.join(TARGETS)}")
    return TARGETS[target](job)
