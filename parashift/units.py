"""Quantities people type: byte sizes."""
from __future__ import annotations

import math

from .errors import MemoryBudgetError

__all__ = ["parse_bytes"]

_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
          "TIB": 2**40}


def parse_bytes(text: str) -> int:
    """``"60GiB"``, ``"7e10"``, ``"512MB"`` -> bytes."""
    t = str(text).strip().upper().replace(" ", "")
    num = t.rstrip("KMGTIB")
    unit = t[len(num):]
    try:
        value = float(num) * _UNITS[unit]
    except (KeyError, ValueError):
        raise MemoryBudgetError(f"cannot read memory budget {text!r}; write bytes such as 60GiB, 512MB or 7e10") from None
    if not math.isfinite(value) or value < 1:
        raise MemoryBudgetError(f"memory budget {text!r} must be a finite number of bytes >= 1, e.g. 60GiB")
    if value > 2**60:
        raise MemoryBudgetError(f"memory budget {text!r} is over 1 EiB; write bytes such as 60GiB")
    return int(value)
