"""The job's store as the hosts share it: the published settings, generations and device map.

Store keys (under the job's secret): ``hosts/devices`` (devices registered), ``hosts/count``
(hosts), ``hosts/heartbeat`` (the heartbeat window, seconds), ``hosts/live_host`` and ``hosts/live_port`` (the liveness listener),
``hosts/config`` (pickled :class:`JobConfig`), ``hosts/gen/<g>`` (generations after the first, with
their cause), ``hosts/leave/<h>`` (a SIGTERM notice: its devices and seconds left), ``hosts/beat/<h>`` (heartbeat counters),
``hosts/devices_of/<h>`` (each host's device ids, the first host's too), ``hosts/declared/<h>`` (who
declares it lost, once), ``hosts/dead/<h>`` and ``dead/<device>`` (declared lost),
``hosts/handled/<h>`` (taken out by recovery round ``g``), ``hosts/report/<h>``, ``hosts/failed/<h>``,
``hosts/done``; written by :mod:`.recover`: ``hosts/loss/<step>/<device>`` (loss shares),
``hosts/fault`` (failed steps), ``hosts/recovery`` (the open round), ``hosts/lost/<g>``,
``hosts/state/<g>/<device>``, ``hosts/plan/<g>``, ``hosts/recovered/<g>/<device>``; by
:mod:`.snapshot`: ``hosts/snap/<step>/<device>`` (written) and ``hosts/snap_failed/<step>/<device>`` (a failed write).
"""
from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from typing import Any, Callable

from ...errors import RuntimeFailure

__all__ = ["JobConfig", "wait_key", "host_map", "store_gone", "eval_pair", "last_generation", "append_generations"]


@dataclass(frozen=True)
class JobConfig:
    """What the first host publishes to the agents: the job's settings and device layout."""

    spec: Any
    gens: list
    steps: int
    opts: Any
    world: int
    on_join: str = "grow"


def wait_key(store: Any, key: str, timeout: float, what: str, alive: Callable[[], None] | None = None) -> None:
    end = time.monotonic() + timeout
    while not store.check([key]):
        if alive is not None:
            alive()
        if time.monotonic() > end:
            raise RuntimeFailure(f"timed out after {timeout:.0f} s waiting for {what}; raise --timeout or check "
                                 f"that every host runs its command against the same --endpoint and secret")
        time.sleep(0.05)


def host_map(store: Any, devices, timeout: float = 60.0) -> tuple[int, ...]:
    """The host number of each device id up to ``max(devices)`` (``LiveOptions.hosts`` of a
    multi-host job), from ``hosts/devices_of/<h>``; a host that has taken its device ids but not yet
    published them is waited for. The same on every process: a device's host never changes."""
    top = max(devices) + 1
    out = [0] * top
    left, h = top, 1
    while left > 0:
        wait_key(store, f"hosts/devices_of/{h}", timeout, f"host {h}'s devices")
        a, b = (int(x) for x in store.get(f"hosts/devices_of/{h}").decode().split("-"))
        for d in range(a, min(b + 1, top)):
            out[d] = h
            left -= 1
        h += 1
    return tuple(out)


def store_gone(store: Any) -> bool:
    """Whether the job's store no longer answers (its first host ended or failed)."""
    try:
        store.check(["hosts/config"])
    except Exception as e:  # noqa: BLE001 - torch raises DistNetworkError (or RuntimeError) for a closed store
        return type(e).__name__.startswith("Dist") or isinstance(e, (RuntimeError, OSError))
    return False


def eval_pair(raw: bytes) -> tuple[float, int]:
    """``repr((seconds, step))`` as written by :mod:`.recover`."""
    a, b = raw.decode().strip("()").split(",")
    return float(a), int(b)


def last_generation(store: Any, gens: list) -> int:
    """Generations published so far, less one (the index of the last published one)."""
    g = len(gens)
    while store.check([f"hosts/gen/{g}"]):
        g += 1
    return g - 1


def append_generations(store: Any, gens: list, causes: list | None = None) -> None:
    """Append the published generations ``gens`` does not hold yet (their causes to ``causes``)."""
    while store.check([f"hosts/gen/{len(gens)}"]):
        gen, cause = pickle.loads(store.get(f"hosts/gen/{len(gens)}"))
        gens.append(gen)
        if causes is not None:
            causes.append(cause)
