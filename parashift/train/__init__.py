"""Trainer rules as pure functions: the learning-rate schedule and the weight-decay rule (no torch)."""
from __future__ import annotations

from .schedule import CONVENTIONS, DECAYS, LRSchedule, decays

__all__ = ["LRSchedule", "decays", "DECAYS", "CONVENTIONS"]
