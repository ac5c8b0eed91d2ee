"""The training states every parameter carries and which ZeRO stage shards each.

Shared by :mod:`parashift.vps` (layouts) and :mod:`parashift.ir` (memory accounting): it sits
below both so neither imports the other for it.
"""
from __future__ import annotations

__all__ = ["KINDS", "ZERO_STAGE", "zero_shards"]

#: Every VPS state kind, in canonical order.
KINDS = ("param", "grad", "master", "exp_avg", "exp_avg_sq")
#: Smallest ZeRO stage that shards each kind over the data-parallel (x context-parallel) group.
ZERO_STAGE = {"param": 3, "grad": 2, "master": 1, "exp_avg": 1, "exp_avg_sq": 1}


def zero_shards(kind: str, zero: int) -> bool:
    """Whether ZeRO stage ``zero`` shards state ``kind``."""
    return zero >= ZERO_STAGE[kind]
