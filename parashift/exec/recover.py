"""Recovery of a multi-host live job from surviving replicas after a host is lost without notice.

:func:`guard` wraps a process's ``Runtime.step``: each finished step's loss share goes to the store
(``hosts/loss/<step>/<device>``, so the job's losses survive the host that trained them), and a
failed step on a layout whose every piece is replicated on each device (pure data parallel,
``tp = pp = ep = 1``, ``zero = 0``) is recovered: device 0 names the hosts whose heartbeats
stopped, publishes the next generation on the surviving devices (``cause`` ``failure``), the
survivors check that they hold the same state (step counter and a checksum), copy it into the
new layout's store, build the new training world over the job's store and re-run the step. Any
other layout, or survivors that disagree, end the job with an error (no snapshot fallback yet).
"""
from __future__ import annotations

import pickle
import time
import zlib
from typing import Any

from ..errors import RuntimeFailure

__all__ = ["guard", "replicated"]


def replicated(strategy: Any) -> bool:
    """Whether every device holds every piece of the state (so any survivor can carry the job on)."""
    return strategy.tp == 1 and strategy.pp == 1 and strategy.ep == 1 and strategy.zero == 0


def guard(session: Any) -> None:
    """Wrap ``session.runtime.step`` (once per runtime) with loss publication and recovery."""
    rt = session.runtime
    if rt is None or getattr(rt, "_hosts_guarded", False):
        return
    inner = rt.step

    def step(*a, **kw):
        k = rt.steps_done
        try:
            loss, extra = inner(*a, **kw)
        except (RuntimeFailure, RuntimeError) as e:   # gloo raises RuntimeError for a lost peer
            _recover(session, e)
            if session.runtime is None:
                raise RuntimeFailure(f"device {session.device} is not needed by the layout after the loss; "
                                     f"leaving after a recovery is not built yet") from e
            guard(session)
            return session.runtime.step(*a, **kw)
        session.ctx.store.set(f"hosts/loss/{k}/{session.device}", repr(float(loss)))
        return loss, extra
    rt.step = step
    rt._hosts_guarded = True


def _checksum(store: Any) -> str:
    from .switch.stores import STATE_KINDS
    h = 0
    for fam in sorted(store.buffers):
        b = store.buffers[fam]
        for kind in STATE_KINDS:
            t = getattr(b, kind)
            if t is not None:
                h = zlib.crc32(t.detach().cpu().contiguous().numpy().tobytes(), h)
    return f"{h:08x}"


def _recover(session: Any, err: Exception) -> None:
    from .hosts import _silent_hosts, fit_strategy
    from .switch.session import Generation
    store, gens, rt = session.ctx.store, session.gens, session.runtime
    cur = gens[session.gen]
    if not replicated(cur.strategy):
        raise err
    t0 = time.time()
    k = rt.steps_done
    if session.device == 0:
        dead = _silent_hosts(store)
        if not dead:
            raise err
        gone: set[int] = set()
        for h, devs in dead:
            a, b = (int(x) for x in devs.split("-"))
            gone |= set(range(a, b + 1))
            store.set(f"hosts/dead/{h}", "1")
        left = [d for d in cur.devices if d not in gone]
        st = fit_strategy(session.spec, cur.strategy, len(left), session.opts.global_batch)
        if st is None:
            raise RuntimeFailure(f"devices {sorted(gone)} were lost and no strategy like {cur.strategy} fits the "
                                 f"{len(left)} left") from err
        g = len(gens)
        while store.check([f"hosts/gen/{g}"]):
            g += 1
        store.set(f"hosts/recovery", str(g))
        store.set(f"hosts/gen/{g}", pickle.dumps((Generation(k, st, tuple(left[:st.world])), "failure")))
    else:
        end = time.monotonic() + session.timeout
        while not store.check(["hosts/recovery"]) or int(store.get("hosts/recovery")) <= session.gen:
            if time.monotonic() > end:
                raise err
            time.sleep(0.05)
        g = int(store.get("hosts/recovery"))
    gen, _ = pickle.loads(store.get(f"hosts/gen/{g}"))
    while len(gens) < g:       # generations published before the failure that never ran (superseded)
        gens.append(pickle.loads(store.get(f"hosts/gen/{len(gens)}"))[0])
    del gens[g:]
    gens.append(gen)
    if session.device not in gen.devices:
        session.runtime, session.gen = None, g        # not needed by the smaller layout: leave
        return
    # the survivors must hold the same state: same step counter, same bytes
    mine = f"{k}:{_checksum(rt.store)}"
    store.set(f"hosts/key/{g}/{session.device}", session.ctx.member.key)
    store.set(f"hosts/recover/{g}/{session.device}", mine)
    for d in gen.devices:
        key = f"hosts/recover/{g}/{d}"
        end = time.monotonic() + session.timeout
        while not store.check([key]):
            if time.monotonic() > end:
                raise RuntimeFailure(f"device {d} did not report its state within {session.timeout:.0f} s") from err
            time.sleep(0.02)
        if store.get(key).decode() != mine:
            raise RuntimeFailure(f"the surviving replicas disagree after the loss (device {d}: "
                                 f"{store.get(key).decode()}, device {session.device}: {mine}); not training on "
                                 f"state that may be corrupted") from err
    session.runtime, session.gen = _rebuild(session, g, rt), g
    store.set(f"hosts/recovered/{g}/{session.device}", repr((time.time() - t0, k)))


def _rebuild(session: Any, g: int, old: Any) -> Any:
    """A Runtime of generation ``g`` over a copy of ``old``'s (fully replicated) state."""
    import torch
    from .launch import RankContext
    from .runtime import Runtime, compile_program
    from .state import StateStore
    from .switch.protocol import training_worlds
    from .switch.stores import STATE_KINDS
    gens, o = session.gens, session.opts
    gen = gens[g]
    rank = gen.devices.index(session.device)
    prog = compile_program(session.spec.name, gen.strategy, global_batch=o.global_batch, seq_len=o.seq_len)
    new = StateStore(session.spec, gen.strategy, rank, torch.device("cpu"), init=False)
    for fam, b in new.buffers.items():
        ob = old.store.buffers[fam]
        for kind in STATE_KINDS:
            t, s = getattr(b, kind), getattr(ob, kind)
            if t is not None and s is not None:
                n = min(t.numel(), s.numel())
                t.view(-1)[:n].copy_(s.view(-1)[:n])
        b.step = ob.step
    keys = [store_get(session, f"hosts/key/{g}/{d}") for d in gen.devices]
    worlds = training_worlds(session.manager, keys, rank, prog)
    rctx = RankContext(rank, gen.strategy.world, session.ctx.backend, torch.device("cpu"), None)
    rt = Runtime(prog, rctx, store=new, worlds=worlds, data_seed=o.data_seed, model=session.spec, optim=o.optim,
                 timeout=session.ctx.timeout)
    rt.steps_done = old.steps_done
    return rt


def store_get(session: Any, key: str) -> str:
    return session.ctx.store.get(key).decode()
