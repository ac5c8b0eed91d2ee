"""The strategy for a changed device set, and the devices it runs on (each tp x cp group on one host)."""
from __future__ import annotations

from typing import Any

from ...errors import StrategyError

__all__ = ["grow_strategy", "fit_strategy", "next_strategy", "host_cells", "splits_groups", "choose_devices"]


def grow_strategy(spec: Any, current: Any, devices: int, global_batch: int) -> Any:
    """The ``grow`` policy: keep tp, pp, ep, zero and the schedule, widen dp to the most of ``devices``
    that divides the global batch; None when no wider strategy fits."""
    return fit_strategy(spec, current, devices, global_batch, above=current.dp)


def fit_strategy(spec: Any, current: Any, devices: int, global_batch: int, above: int = 0) -> Any:
    """``current`` with the widest dp (> ``above``) that fits ``devices`` and divides the global batch
    (tp, pp, ep, zero, shard and the schedule kept; dp a multiple of shard); None when there is none."""
    cell = current.world // current.dp
    for dp in range(devices // cell, above, -1):
        if global_batch % (dp * current.mbs) or dp % current.ep or (current.shard and dp % current.shard):
            continue
        try:
            cand = current.replace(dp=dp)     # hybrid sharding keeps its shard group size
            cand.validate(spec)
        except StrategyError:
            continue
        return cand
    return None


def next_strategy(spec: Any, current: Any, devices: int, global_batch: int, table: tuple = (),
                  above: int = 0) -> Any:
    """The strategy for ``devices`` devices: ``table``'s ((device count, strategy) pairs, e.g. the trace
    planner's choice per count, ``--strategy-for``) when it has one of exactly that world with more than
    ``above`` devices, else ``current`` with the widest dp that fits (:func:`fit_strategy`; a wider dp than
    ``current``'s when ``above``); None when neither fits."""
    for n, st in table:
        if n == devices == st.world and st.world > above:
            return st
    return fit_strategy(spec, current, devices, global_batch, above=current.dp if above else 0)


def host_cells(devices, hosts: "tuple[int, ...]", cell: int) -> list[int]:
    """The devices of ``devices`` (in order of preference) that hold whole groups of ``cell`` consecutive
    ranks on one host: each host's devices in their given order, a multiple of ``cell`` of them (the
    rest left out), hosts in the order of their first device."""
    by: dict[int, list[int]] = {}
    for d in devices:
        by.setdefault(hosts[d], []).append(d)
    return [d for ds in by.values() for d in ds[:len(ds) // cell * cell]]


def splits_groups(strategy: Any, devices, hosts: "tuple[int, ...]") -> bool:
    """Whether ``strategy`` on ``devices`` (rank order) puts some tp x cp group on two hosts."""
    cell = strategy.tp * strategy.cp
    devs = list(devices)
    return any(len({hosts[d] for d in devs[i:i + cell]}) > 1 for i in range(0, len(devs), cell))


def choose_devices(spec: Any, current: Any, pool: "tuple[int, ...]", hosts: "tuple[int, ...]", global_batch: int,
                   table: tuple = (), grow: bool = False) -> "tuple[Any, tuple[int, ...]] | None":
    """The next strategy on devices of ``pool`` (current devices first) and the devices it runs on, so
    that each tp x cp group sits on one host (:func:`host_cells`; a host's odd devices stay idle):
    :func:`next_strategy` for the most devices that allow it (``table``'s entry, else ``current``
    widened or narrowed). ``grow``: only a wider strategy than ``current``. None when none fits."""
    above = len(current.devices) if grow else 0
    for n in range(len(pool), above, -1):
        for tab in dict.fromkeys((tuple(table), ())):
            st = next_strategy(spec, current.strategy, n, global_batch, tab, above=above)
            got = host_cells(pool, hosts, st.tp * st.cp) if st is not None else []
            if st is not None and len(got) >= st.world:
                return st, tuple(got[:st.world])
    return None
