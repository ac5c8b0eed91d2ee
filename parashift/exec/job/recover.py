"""Recovery of a multi-host live job after a host is lost without notice.

:func:`guard` wraps each process's ``Runtime.step``:

- the rank's loss share goes to the store (``hosts/loss/<step>/<device>``) as soon as it is whole,
  before any of its gradients leave the rank, so every step that completed anywhere has all its
  shares even when their host died right after;
- a step that fails (a peer's connection dropped) bumps ``hosts/fault``; a watcher thread in every
  process sees it within :data:`WATCH_SECONDS` and interrupts that process's waits, so survivors
  blocked on a live peer that already left the collective stop too (gloo alone would hold them
  until its timeout);
- every process then takes part in one recovery round (:func:`_recover`) run by device 0: it names
  the hosts declared lost (their liveness connection closed) or whose heartbeats stopped
  (:func:`.liveness.silent_hosts`), every survivor reports its step
  counter, a checksum of its state and its optimizer step, and device 0 publishes a plan that all
  follow (``hosts/plan/<g>``, then the generation ``hosts/gen/<g>`` with cause ``failure``):

  * ``replicas`` (:func:`memory_plan`): when the survivors still hold a copy of every cell of the
    layout (a cell: one (tp, cp, pp) position, and under hybrid sharding (``shard=N``) one ZeRO shard
    index; no expert parallelism), the same layout with a narrower dp runs on them, each survivor
    keeping its own shard. Survivors may have finished
    different steps (a collective can complete on some ranks and fail on others); the plan takes
    the most advanced step, each cell's state from a survivor that reached it (checksums of the
    survivors at that step must agree), broadcast to members that lag;
  * ``snapshot`` (:mod:`.snapshot`): otherwise, the newest whole DCP snapshot, resharded into the
    job's strategy for the survivors' count (``--strategy-for``) or else the widest layout like the
    current one that fits them (:func:`.fit.next_strategy`); the steps since are lost (re-run);
  * otherwise the job ends with an error naming the lost host.

A survivor that the smaller layout leaves out stops training (its host's agent then exits 0).
"""
from __future__ import annotations

import pickle
import threading
import time
import zlib
from typing import Any

from ...errors import RuntimeFailure
from .fit import choose_devices, fit_strategy, next_strategy
from .liveness import FAULT_KEY, silent_hosts

__all__ = ["guard", "after_switch", "replicated", "uncovered", "memory_plan", "survivability", "copies_axis"]

#: seconds between a process's looks at :data:`FAULT_KEY`
WATCH_SECONDS = 0.1


def replicated(strategy: Any) -> bool:
    """Whether every device holds every piece of the state (so any survivor can carry the job on)."""
    return strategy.tp == 1 and strategy.pp == 1 and strategy.cp == 1 and strategy.ep == 1 and not strategy.zero_stage.sharded


def _cell(strategy: Any, rank: int) -> tuple[int, int, int, int]:
    """The state a rank holds: its (tp, cp, pp) position and ZeRO shard index (0 without ZeRO)."""
    c = strategy.coords(rank)
    return int(c["tp"]), int(c["cp"]), int(c["pp"]), int(c["shard"]) if strategy.zero_stage.sharded else 0


def copies_axis(strategy: Any) -> str:
    """Group axis of the ranks holding the same state as a rank: ``dp`` (ZeRO 0) or ``replica`` (ZeRO)."""
    return "replica" if strategy.zero_stage.sharded else "dp"


def uncovered(spec: Any, strategy: Any, lost_ranks: "list[int] | set[int]") -> dict[str, int]:
    """State kind (gradients aside) -> elements that no rank outside ``lost_ranks`` holds, from the VPS layout (empty: every
    piece of the state has a surviving copy). Boxes of one tensor and kind in a layout are equal (replicas)
    or disjoint, so the distinct boxes of the survivors measure what they cover."""
    import numpy as np
    from ...vps.boxes import volume
    from ...vps.layout import layout
    lay = layout(spec, strategy)
    reg = lay.regions(kinds=[k for k in lay.kinds if k != "grad"])     # gradients are empty between steps
    alive = ~np.isin(reg.rank, np.asarray(sorted(lost_ranks), dtype=np.int64))

    def per_kind(m) -> np.ndarray:
        rows = np.unique(np.column_stack([reg.tensor[m], reg.kind[m], reg.lo[m], reg.hi[m]]), axis=0)
        nd = reg.lo.shape[1]
        return np.bincount(rows[:, 1], weights=volume(rows[:, 2:2 + nd], rows[:, 2 + nd:]), minlength=len(lay.kinds))
    miss = per_kind(np.ones(len(reg.rank), dtype=bool)) - per_kind(alive)
    return {lay.kinds[k]: int(v) for k, v in enumerate(miss) if v > 0}


def memory_plan(spec: Any, strategy: Any, devices: tuple[int, ...], survivors: list[int], global_batch: int,
                prefer: dict[int, int] | None = None) -> tuple[Any, tuple[int, ...]] | None:
    """The layout the ``survivors`` can carry on from their own memory: ``strategy`` with the widest dp
    that every cell's surviving copies, the device count and the global batch allow, and the device of
    each new rank (a survivor holding that rank's cell: each keeps its own shard). None when a cell has
    no surviving copy, or the layout shards state across its copies (ZeRO without replicas of the
    shards, expert parallelism). ``prefer``: device -> priority (higher first) among a cell's copies.
    Under ZeRO the shard group size stays (dp becomes a multiple of it), so each survivor keeps its shard."""
    if strategy.ep > 1 or uncovered(spec, strategy, [r for r, d in enumerate(devices) if d not in survivors]):
        return None
    cells: dict[tuple[int, int, int, int], list[int]] = {}
    for r, d in enumerate(devices):
        if d in survivors:
            cells.setdefault(_cell(strategy, r), []).append(d)
    per = strategy.shard_size if strategy.zero_stage.sharded else 1     # dp ranks holding distinct state
    ncell = strategy.world // strategy.dp * per
    if len(cells) < ncell:
        return None
    for c in cells.values():
        c.sort(key=lambda d: (-(prefer or {}).get(d, 0), d))
    st = fit_strategy(spec, strategy, min(len(c) for c in cells.values()) * ncell, global_batch)
    if st is None or (strategy.zero_stage.sharded and st.shard_size != per):
        return None
    return st, tuple(cells[_cell(st, r)][int(st.coords(r)[copies_axis(strategy)])] for r in range(st.world))


def survivability(spec: Any, strategy: Any, hosts: dict[int, list[int]], global_batch: int,
                  snapshots: bool, table: tuple = ()) -> "Any":
    """Which single-host losses the layout (rank i on device i) survives, and how: a DataFrame with one
    row per host: ``host``, ``devices``, ``recovers_from`` (``replicas``, ``snapshot`` or ``none``),
    ``layout`` (the strategy the job goes on with), ``missing`` (the state kinds left without a copy).
    Losing host 1 (it serves the store) always ends the job. ``table``: the job's strategy per device
    count (:func:`.fit.next_strategy`), which a snapshot restores into."""
    import pandas as pd
    devices = tuple(range(strategy.world))
    rows = []
    for h, devs in sorted(hosts.items()):
        left = [d for d in devices if d not in devs]
        missing = ", ".join(sorted(uncovered(spec, strategy, [d for d in devs if d < strategy.world])))
        got = memory_plan(spec, strategy, devices, left, global_batch) if h != 1 else None
        if got is not None:
            rows.append((h, list(devs), "replicas", str(got[0]), missing))
            continue
        st = next_strategy(spec, strategy, len(left), global_batch, table) if h != 1 else None
        rows.append((h, list(devs), "snapshot" if snapshots and st is not None else "none",
                     str(st) if st is not None and snapshots else "", missing))
    return pd.DataFrame(rows, columns=["host", "devices", "recovers_from", "layout", "missing"])


# ---- the guard ----------------------------------------------------------------------------------------
class _Watch:
    """A thread that reads :data:`FAULT_KEY` every :data:`WATCH_SECONDS` (the last value in ``count``)."""

    def __init__(self, store: Any) -> None:
        self.count = int(store.add(FAULT_KEY, 0))

        def loop() -> None:
            try:
                while True:
                    time.sleep(WATCH_SECONDS)
                    self.count = int(store.add(FAULT_KEY, 0))
            except Exception:  # noqa: BLE001 - the store is gone: the job is over
                return
        threading.Thread(target=loop, name="parashift-fault-watch", daemon=True).start()


def _publish(store: Any, step: int, device: int, share: float) -> None:
    key = f"hosts/loss/{step}/{device}"
    store.set(key, repr(float(share)))
    store.check([key])                 # a round trip: the share is stored before anything else goes out


def _barrier(worlds: Any, interrupted) -> None:
    """``Worlds.barrier`` that a fault interrupts."""
    import torch.distributed as dist
    if worlds.world < 2:
        return
    work = dist.barrier(group=worlds.get(range(worlds.world)), async_op=True)
    nap = 5e-5
    while not work.is_completed():
        if interrupted():
            raise RuntimeFailure("interrupted: a peer reported a failed step (a host of the job was lost)")
        time.sleep(nap)
        nap = min(nap * 2, 2e-3)
    work.wait()


def guard(session: Any) -> None:
    """Wrap ``session.runtime.step`` (once per runtime) with loss publication, fault interrupts,
    snapshots and recovery."""
    rt = session.runtime
    if rt is None or getattr(rt, "_hosts_guarded", False):
        return
    store = session.side_store()
    watch = getattr(session, "_fault_watch", None)
    if watch is None:
        watch = session._fault_watch = _Watch(store)
    base = rt._fault_base = int(store.add(FAULT_KEY, 0))
    watch.count = base
    interrupted = lambda: watch.count > base  # noqa: E731
    interp = rt.interp
    interp.interrupt = interrupted
    interp.on_loss = lambda share: _publish(store, rt.steps_done, session.device, share)
    rt.worlds.barrier = lambda: _barrier(rt.worlds, interrupted)
    inner = rt.step
    snaps = _snapshotter(session)

    def step(*a, **kw):
        k = rt.steps_done
        if interp.n_heads == 0:         # no loss on this rank: its share is 0 from the start
            _publish(store, k, session.device, 0.0)
        try:
            loss, extra = inner(*a, **kw)
        except (RuntimeFailure, RuntimeError) as e:   # gloo raises RuntimeError for a lost peer
            if not interrupted():
                store.add(FAULT_KEY, 1)
            _recover(session, e)
            if session.runtime is None:       # not needed by the smaller layout: this process stops
                return 0.0, 0.0
            guard(session)
            return session.runtime.step(*a, **kw)
        if snaps is not None:
            if snaps.every > 0 and rt.steps_done % snaps.every == 0:
                rt.sync_params()        # overlap_param: a snapshot holds whole parameters
            pos = rt.data_position()
            snaps.maybe(store, rt.store, rt.program.strategy, rt.ctx.rank, session.device, rt.steps_done,
                        pos.to_dict() if pos is not None else None)
        return loss, extra
    rt.step = step
    rt._hosts_guarded = True


def after_switch(session: Any, err: Exception) -> bool:
    """``LiveOptions.recover``: a switch aborted because a peer failed (the old layout's state is whole on
    every survivor): run the recovery round from the old layout. True when this process trains on."""
    if session.runtime is None:
        return False
    if not session._fault_watch.count > getattr(session.runtime, "_fault_base", -1):
        session.side_store().add(FAULT_KEY, 1)
    _recover(session, err)
    guard(session)
    return True


def _snapshotter(session: Any) -> Any:
    o = session.opts
    if not getattr(o, "snapshot_every", 0):
        return None
    snap = getattr(session, "_snapshots", None)
    if snap is None:
        from .snapshot import Snapshotter
        snap = session._snapshots = Snapshotter(o.snapshot_dir, o.snapshot_every)
    return snap


def _checksum(store: Any) -> str:
    from ..switch.stores import STATE_KINDS
    h = 0
    for fam in sorted(store.buffers):
        b = store.buffers[fam]
        for kind in STATE_KINDS:
            t = getattr(b, kind)
            if t is not None:
                h = zlib.crc32(t.detach().cpu().contiguous().numpy().tobytes(), h)
    return f"{h:08x}"


def _wait(store: Any, key: str, timeout: float, what: str, err: Exception) -> bytes:
    end = time.monotonic() + timeout
    while not store.check([key]):
        if time.monotonic() > end:
            raise RuntimeFailure(f"{what} did not come within {timeout:.0f} s during the recovery") from err
        time.sleep(0.02)
    return store.get(key)


def _recover(session: Any, err: Exception) -> None:
    """One recovery round (see the module docstring); leaves ``session.runtime`` on the new layout
    (None when this device is not in it) or raises RuntimeFailure."""
    store, gens, rt = session.side_store(), session.gens, session.runtime
    t0 = time.time()
    k = rt.steps_done
    snap = _snapshotter(session)
    if snap is not None:
        try:
            snap.finish(wait=True)     # a snapshot being written when the host was lost still counts
        except RuntimeFailure:
            pass                       # a failed write is not recorded: an older snapshot is used
    if session.device == 0:
        g = _declare(session, err)
    else:
        end = time.monotonic() + session.timeout
        while not store.check(["hosts/recovery"]) or int(store.get("hosts/recovery")) <= session.gen:
            if time.monotonic() > end:
                raise RuntimeFailure(f"device 0 decided no recovery within {session.timeout:.0f} s") from err
            time.sleep(0.05)
        g = int(store.get("hosts/recovery"))
    lost = pickle.loads(store.get(f"hosts/lost/{g}"))
    if isinstance(lost, str):
        raise RuntimeFailure(lost) from err
    store.set(f"hosts/state/{g}/{session.device}", pickle.dumps(
        (k, _checksum(rt.store), max((b.step for b in rt.store.buffers.values()), default=0),
         session.ctx.member.key)))
    if session.device == 0:
        _plan(session, g, lost, err)
    plan = pickle.loads(_wait(store, f"hosts/plan/{g}", session.timeout, "device 0's recovery plan", err))
    if plan["kind"] == "end":
        raise RuntimeFailure(plan["message"]) from err
    gen, _ = pickle.loads(store.get(f"hosts/gen/{g}"))
    while len(gens) < g:       # generations published before the failure that never ran (superseded)
        gens.append(pickle.loads(store.get(f"hosts/gen/{len(gens)}"))[0])
    del gens[g:]
    gens.append(gen)
    if session.device not in gen.devices:
        session.runtime, session.gen = None, g
        store.set(f"hosts/recovered/{g}/{session.device}", repr((time.time() - t0, k)))
        return
    # an aborted switch's preparation may still block in a rendezvous on the job's store connection:
    # the new layout's worlds (and every later call) go through a fresh one
    session.ctx.store = session.manager.store = store.clone()
    session.runtime, session.gen = _rebuild(session, g, rt, plan), g
    store.set(f"hosts/recovered/{g}/{session.device}", repr((time.time() - t0, k)))


def _declare(session: Any, err: Exception) -> int:
    """Device 0: name the lost hosts (``hosts/lost/<g>``: their devices, or why the job ends) and open round ``g``."""
    store, gens = session.side_store(), session.gens
    dead = silent_hosts(store)
    g = len(gens)
    while store.check([f"hosts/gen/{g}"]):
        g += 1
    if dead:
        gone: list[int] = []
        for h, devs in dead:
            a, b = (int(x) for x in devs.split("-"))
            gone += range(a, b + 1)
            store.set(f"hosts/dead/{h}", "1")
            store.set(f"hosts/handled/{h}", str(g))      # a later failure is not blamed on this host again
        lost: Any = sorted(gone)
    else:
        lost = (f"a step failed and no host stopped beating (not a lost host): {type(err).__name__}: "
                f"{str(err).splitlines()[0][:300]}")
    store.set(f"hosts/lost/{g}", pickle.dumps(lost))
    store.set("hosts/recovery", str(g))
    return g


def _plan(session: Any, g: int, gone: list[int], err: Exception) -> None:
    """Device 0: read every survivor's report and publish the round's plan and generation."""
    from .snapshot import latest
    from ..switch.session import Generation
    store, cur, o = session.side_store(), session.gens[session.gen], session.opts
    survivors = [d for d in cur.devices if d not in gone]
    reports = _reports(store, g, survivors, gone, session.timeout, err)
    survivors = sorted(reports)
    top = max(r[0] for r in reports.values())
    at_top = {d: int(r[0] == top) for d, r in reports.items()}
    plan: dict[str, Any] = {"kind": "end", "lost": gone, "reports": reports, "step": top, "failed_at": top}
    got = memory_plan(session.spec, cur.strategy, cur.devices, survivors, o.global_batch, prefer=at_top)
    if got is not None:
        st, devs = got
        src, why = {}, None
        for r in range(st.world):            # each cell's source: a survivor at the top step; copies agree
            grp = tuple(devs[q] for q in st.group(r, copies_axis(st)))
            tops = [d for d in grp if at_top[d]]
            if not tops:
                why = f"no survivor of cell {_cell(st, r)} finished step {top - 1}"
                break
            if len({reports[d][1] for d in tops}) > 1:
                why = f"the copies of cell {_cell(st, r)} disagree after step {top - 1}"
                break
            src[grp] = tops[0]
        if why is None:
            plan.update(kind="replicas", strategy=st, devices=devs, sources=src, steps_lost=0,
                        opt_step=max(reports[d][2] for d in survivors if at_top[d]))
        else:
            got = None
    if got is None:
        snap = latest(store, int(store.add("hosts/devices", 0)), getattr(o, "snapshot_every", 0), top)
        chosen = choose_devices(session.spec, cur, tuple(survivors), session.host_map(survivors), o.global_batch,
                                o.strategy_for) if survivors else None
        st = chosen[0] if chosen is not None else None
        if snap is not None and chosen is not None:
            plan.update(kind="snapshot", strategy=st, devices=chosen[1], snapshot=snap,
                        step=snap[0], steps_lost=top - snap[0], opt_step=snap[2])
        else:
            plan["message"] = (
                f"devices {gone} were lost and their state has no surviving copy (recovery from memory needs "
                f"every cell of {cur.strategy} on a survivor, with ep=1: ZeRO shards need replicas, shard=N < dp)"
                + ("" if getattr(o, "snapshot_every", 0) else "; run with --snapshot-every N to restore from a "
                   "snapshot instead") + (f"; no strategy like {cur.strategy} fits the {len(survivors)} devices left"
                                          if st is None else ""))
    store.set(f"hosts/plan/{g}", pickle.dumps(plan))
    if plan["kind"] != "end":
        store.set(f"hosts/gen/{g}", pickle.dumps((Generation(plan["step"], plan["strategy"], plan["devices"]),
                                                  "failure")))


def _reports(store: Any, g: int, survivors: list[int], gone: list[int], timeout: float, err: Exception) -> dict:
    """Device 0: every survivor's report of round ``g``. A host declared lost meanwhile (killed mid-recovery)
    is taken out in this round: its devices join ``gone`` and it is marked handled, instead of its report
    being waited for until the timeout."""
    reports: dict[int, Any] = {}
    todo = list(survivors)
    end = time.monotonic() + timeout
    while todo:
        for d in list(todo):
            if store.check([f"hosts/state/{g}/{d}"]):
                reports[d] = pickle.loads(store.get(f"hosts/state/{g}/{d}"))
                todo.remove(d)
        if todo and any(store.check([f"dead/{d}"]) for d in todo):
            for h in range(2, int(store.add("hosts/count", 0)) + 1):
                if store.check([f"hosts/dead/{h}"]) and not store.check([f"hosts/handled/{h}"]):
                    a, b = (int(x) for x in store.get(f"hosts/devices_of/{h}").decode().split("-"))
                    store.set(f"hosts/handled/{h}", str(g))
                    gone += [d for d in range(a, b + 1) if d not in gone]
            todo = [d for d in todo if d not in gone]
            gone.sort()
        if todo and time.monotonic() > end:
            raise RuntimeFailure(f"device {todo[0]}'s report did not come within {timeout:.0f} s during the "
                                 f"recovery") from err
        if todo:
            time.sleep(0.02)
    return reports


def _rebuild(session: Any, g: int, old: Any, plan: dict) -> Any:
    """A Runtime of generation ``g``: its state from this survivor's own shard (broadcast from the cell's
    source where this one lags) or from the snapshot; its world built over the job's store."""
    import torch
    import torch.distributed as dist
    from ..launch import RankContext
    from ..runtime import Runtime, compile_program
    from ..state import StateStore
    from ..switch.protocol import training_worlds
    from ..switch.stores import STATE_KINDS
    gens, o = session.gens, session.opts
    gen = gens[g]
    rank = gen.devices.index(session.device)
    st = gen.strategy
    prog = compile_program(session.spec.name, st, global_batch=o.global_batch, seq_len=o.seq_len)
    reports = plan["reports"]
    keys = [reports[d][3] for d in gen.devices]
    if plan["kind"] == "snapshot":
        from .snapshot import restore
        s, snap_st, opt = plan["snapshot"]
        new = restore(o.snapshot_dir, session.spec, snap_st, s, st, rank, opt)
    else:
        new = StateStore(session.spec, st, rank, torch.device("cpu"), init=False)
        for fam, b in new.buffers.items():
            ob = old.store.buffers[fam]
            if ob.numel != b.numel:
                raise RuntimeFailure(f"device {session.device}'s {fam} state holds {ob.numel} elements, not the "
                                     f"{b.numel} of its cell in {st} it recovers into")
            for kind in STATE_KINDS:
                t, s_ = getattr(b, kind), getattr(ob, kind)
                if t is not None:          # the flat buffers' padding (to a multiple of dp) differs: real part only
                    t[:b.numel].copy_(s_[:b.numel])
            b.step = plan["opt_step"]
        grp = tuple(gen.devices[q] for q in st.group(rank, copies_axis(st)))
        src = plan["sources"][grp]
        if any(reports[d][0] != plan["step"] for d in grp):      # a member lags: the source's state to all
            pg = session.manager.process_group(tuple(reports[d][3] for d in grp), f"recover{g}")
            for fam in sorted(new.buffers):
                for kind in STATE_KINDS:
                    t = getattr(new.buffers[fam], kind)
                    if t is not None:
                        dist.broadcast(t, group=pg, group_src=grp.index(src))
    worlds = training_worlds(session.manager, keys, rank, prog)
    rctx = RankContext(rank, st.world, session.ctx.backend, torch.device("cpu"), None)
    rt = Runtime(prog, rctx, store=new, worlds=worlds, data_seed=o.data_seed, model=session.spec, optim=o.optim,
                 timeout=session.ctx.timeout, data=o.data)
    rt.steps_done = plan["step"]
    return rt
