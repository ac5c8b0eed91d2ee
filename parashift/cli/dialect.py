"""The CLI's one dialect: deprecated option names, byte and time units for people.

A command module may declare ``ALIASES = {"--old": "--new"}``: the old spelling still works for
one release, prints one warning on stderr, and is rewritten to the new one before parsing.
"""
from __future__ import annotations

import sys
from typing import Mapping, Sequence

from ..units import format_bytes  # noqa: F401  (the CLI's byte unit, shared with the library)

__all__ = ["rewrite_aliases", "format_bytes", "format_seconds", "eta"]


def rewrite_aliases(cmd: str, argv: Sequence[str], aliases: Mapping[str, str]) -> list[str]:
    """``argv`` with deprecated option names replaced by their new ones (one warning per name)."""
    out, warned = [], set()
    for tok in argv:
        if tok == "--":
            out.extend(argv[len(out):])
            break
        name, eq, value = tok.partition("=")
        new = aliases.get(name)
        if new is not None and tok.startswith("--"):
            if name not in warned:
                warned.add(name)
                print(f"parashift {cmd}: warning: {name} is deprecated and will be removed; use {new}",
                      file=sys.stderr)
            tok = new + eq + value
        out.append(tok)
    return out


def format_seconds(s: float) -> str:
    """Seconds for people: ``850 ms``, ``12.3 s``, ``4 min 05 s``, ``2 h 03 min``."""
    if s < 1:
        return f"{s * 1e3:.0f} ms"
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


def eta(done: int, total: int, elapsed: float) -> str:
    """``"3/10, about 12.0 s left"`` from the work done so far."""
    if done <= 0 or done >= total:
        return f"{done}/{total}"
    return f"{done}/{total}, about {format_seconds(elapsed / done * (total - done))} left"
