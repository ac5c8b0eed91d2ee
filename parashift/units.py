"""Quantities people type and read (byte sizes) and the one machine quantity every layer asks for (free memory)."""
from __future__ import annotations

import math
import os

from .errors import MemoryBudgetError

__all__ = ["parse_bytes", "format_bytes", "available_memory"]

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


def format_bytes(n: float) -> str:
    """Bytes in the unit that keeps 1-4 digits before the point: ``512 B``, ``3.25 MiB``, ``1.50 GiB``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} PiB"  # pragma: no cover - unreachable


def available_memory() -> int:
    """Bytes of memory this machine can still give (MemAvailable, else total physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 2**40
