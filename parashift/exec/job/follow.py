"""The next generation at a step boundary: a host that joins (``on_join="grow"``) or leaves on notice.

The process of device 0 (:class:`Follow`, called at every step boundary) picks the next strategy for
the new device set (:func:`.fit.choose_devices`), ordered to keep the most state on each host
(``--switch-placement keep``), and publishes the next generation ``hosts/gen/<g>`` with a switch
step ``notice + 2`` steps ahead; every process appends it to its schedule at its next step boundary,
so the world is built in the background during the notice and the switch happens between iterations.
"""
from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field
from typing import Any

from ...errors import RuntimeFailure
from .fit import choose_devices
from .keys import append_generations, last_generation
from .recover import guard

__all__ = ["Follow", "notice_is_short"]


@dataclass
class Follow:
    """Called by every process at each step boundary (``LiveOptions.on_step``): device 0 turns newly
    registered devices into the next generation; every process appends published generations."""

    on_join: str
    steps: int
    seen: dict = field(default_factory=dict)     # device 0: host -> when it first read that host's notice

    def __call__(self, session: Any, step: int) -> None:
        from ..switch.session import Generation
        store, gens = session.ctx.store, session.gens
        guard(session)
        if self.on_join == "grow" and session.device == 0 and session.gen == len(gens) - 1:
            cur = gens[-1]
            have = int(store.add("hosts/devices", 0))
            top = max(max(g.devices) for g in gens) + 1      # devices once used (lost ones) never come back
            at = step + session.opts.notice + 2
            if have > top and at < self.steps:
                pool = tuple(cur.devices) + tuple(range(top, have))
                got = choose_devices(session.spec, cur, pool, session.host_map(pool), session.opts.global_batch,
                                     session.opts.strategy_for, grow=True)
                if got is not None:
                    st, new = got[0], _placed(session, cur, *got)
                    store.set(f"hosts/gen/{len(gens)}", pickle.dumps((Generation(at, st, new), "join")))
        if session.device == 0 and session.gen == len(gens) - 1 and len(gens) - 1 == last_generation(store, gens):
            self._leave(session, step)
        append_generations(store, gens)

    def _leave(self, session: Any, step: int) -> None:
        """Device 0: a host that got SIGTERM (``hosts/leave/<h>``) -> the next generation without its devices,
        ``notice`` + 2 steps ahead, or at the next step boundary when a notice's deadline comes first
        (:func:`notice_is_short`)."""
        from ..switch.session import Generation
        store, gens = session.ctx.store, session.gens
        cur = gens[-1]
        gone: set[int] = set()
        rest: list[float] = []               # seconds of each bounded notice left now
        for h in range(2, int(store.add("hosts/count", 0)) + 1):
            if store.check([f"hosts/leave/{h}"]):
                got = pickle.loads(store.get(f"hosts/leave/{h}"))
                devs = set(got["devices"]) & set(cur.devices)
                gone |= devs
                if devs and got["seconds"] is not None:
                    rest.append(got["seconds"] - (time.monotonic() - self.seen.setdefault(h, time.monotonic())))
        at = step + session.opts.notice + 2
        if rest and notice_is_short(min(rest), session):
            at = step + 1
        if not gone or at >= self.steps:
            return
        left = tuple(d for d in cur.devices if d not in gone)
        got = choose_devices(session.spec, cur, left, session.host_map(left), session.opts.global_batch,
                             session.opts.strategy_for) if left else None
        if got is None:
            raise RuntimeFailure(f"devices {sorted(gone)} are leaving and no strategy like {cur.strategy} fits the "
                                 f"{len(left)} that stay")
        store.set(f"hosts/gen/{len(gens)}", pickle.dumps((Generation(at, got[0], _placed(session, cur, *got)), "notice")))


def _placed(session: Any, cur: Any, st: Any, devices: tuple[int, ...]) -> tuple[int, ...]:
    """``devices`` in the order that keeps the most state in place, each on its host (``--switch-placement
    keep``), or as given."""
    if session.opts.placement != "keep":
        return devices
    from ...vps.transition.live import place
    return place(session.spec, cur.strategy, st, cur.devices, devices, session.host_map(cur.devices + devices))


def notice_is_short(seconds: float, session: Any) -> bool:
    """Whether a notice with ``seconds`` left is too short for the switch as scheduled (``notice`` + 2 steps
    ahead): those steps and one more (the notice is read at a step boundary), each as long as the last
    step, plus the switch, as long as this process's last completed one. With no switch measured yet its
    length is unknown: short (the switch starts at the next step boundary)."""
    done = [r.seconds for r in session.records if not r.aborted]
    if not done:
        return True
    last = next((b - a for stream, op, a, b, _ in reversed(session.rows) if op == "step"), 0.0)
    return seconds < (session.opts.notice + 2 + 1) * last + done[-1]
