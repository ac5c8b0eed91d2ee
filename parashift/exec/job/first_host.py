"""The first host of a multi-host job: it serves the job's store, holds device 0 and assembles the result.

:func:`run_first_host` binds the job's TCPStore to ``HOST:PORT`` under the job's secret
(:func:`.endpoint.read_secret`) and registers its ``nprocs`` processes as devices ``0..nprocs-1``;
agents (:mod:`.agent`) bring the rest. When the strategy's world is registered it publishes the
settings; every host then starts its own processes with :func:`.elastic.launch_elastic` on the shared
store, and their groups are built over that store by the elastic device manager: no process is
restarted. Joins and notices turn into new generations (:mod:`.follow`); a host lost without notice
is declared by :mod:`.liveness` and the survivors recover (:mod:`.recover`) from their copies or from
a snapshot (:mod:`.snapshot`). Device 0 runs every recovery: losing this host ends the job.
With ``store_url`` the job's store is on an etcd cluster (:func:`..jobstore.attach`) rather than in
this process; the coordination still runs here.
"""
from __future__ import annotations

import pickle
import time
from typing import Any

from ...errors import RuntimeFailure, StrategyError
from ..jobstore import attach, serve
from .elastic import Member, launch_elastic
from .endpoint import check_gloo_interface, check_local_gpus, parse_endpoint, say
from .fit import splits_groups
from .follow import Follow
from .keys import JobConfig, append_generations, eval_pair, host_map, wait_key
from .liveness import HEARTBEAT_TIMEOUT, monitor, serve_liveness, silent_hosts
from .recover import after_switch, survivability

__all__ = ["run_first_host"]


def _local_members(devices: range) -> list[Member]:
    return [Member(d, 0, 0) for d in devices]


def run_first_host(model, strategy, *, steps: int, endpoint: str, nprocs: int, secret: str,
                   timeout: float = 600.0, quiet: bool = False, on_join: str = "grow",
                   heartbeat_timeout: float = HEARTBEAT_TIMEOUT, store_url: str | None = None,
                   **live) -> tuple[Any, dict[int, list[int]]]:
    """Serve the job at ``endpoint``, wait for agents to bring the strategy's world, train, and
    return the whole job's :class:`..switch.LiveResult` and {host number: its devices} (this host is 1). ``live``: :func:`..switch.run_live`'s
    options (global_batch, seq_len, optim, notice, memory_budget, placement, ...). ``heartbeat_timeout``: seconds
    of heartbeat silence after which an agent is declared lost (one whose process dies is declared at once).
    ``store_url``: the job's store is on that etcd cluster (``etcd://HOST:PORT,...``), and ``endpoint`` is where
    this host's liveness listener listens (agents find it in the store)."""
    from ..switch.session import LiveResult
    host, port = parse_endpoint(endpoint)
    check_gloo_interface(host)
    spec, gens, opts = _settings(model, strategy, steps, nprocs, timeout, quiet, on_join, heartbeat_timeout, live)
    job = attach(store_url, timeout, secret) if store_url else serve(timeout, host, port, secret)
    store = job.store
    serve_liveness(store, host, secret, port if store_url else 0)
    store.set("hosts/heartbeat", repr(float(heartbeat_timeout)))
    _publish_resumed_snapshot(store, opts)
    where = store_url or f"{host}:{port}"
    _wait_for_world(store, spec, gens, steps, opts, nprocs, on_join, where, timeout, quiet)
    surv = _survivability(store, spec, gens[0].strategy, nprocs, opts, timeout)
    _say_survivability(surv, quiet)
    monitor(store, heartbeat_timeout)
    reports = _train(job, spec, gens, steps, opts, nprocs, where, timeout)
    placed = _collect_reports(store, reports, nprocs, timeout)
    store.set("hosts/done", "1")
    causes: list[str] = []
    append_generations(store, gens, causes)
    losses = _losses(store, gens, steps, reports)
    switches = _switches(store, gens, causes, reports, spec, opts)
    resumed = {"step": opts.resume[0], "strategy": opts.resume[1]} if opts.resume else None
    return LiveResult(losses, switches, reports, gens, survivability=surv, resumed=resumed), placed


def _settings(model, strategy, steps: int, nprocs: int, timeout: float, quiet: bool, on_join: str,
              heartbeat_timeout: float, live: dict) -> tuple[Any, list, Any]:
    """The job's model, generations (the first one from a snapshot on disk with ``resume``) and
    :class:`..switch.LiveOptions`, each setting checked (``live`` is consumed)."""
    from ... import models
    from ...cluster import get as get_cluster
    from ..switch.session import LiveOptions, generations, switch_cluster
    spec = models.get(model)
    placement = live.pop("placement", "keep")
    gens = generations(spec, strategy, steps, [], placement)
    world = gens[0].strategy.world
    if live.pop("resume", False):             # a restarted job: from the newest whole snapshot on disk
        from .snapshot import latest_on_disk
        if live.get("device", "cpu") != "cpu":
            raise StrategyError("--resume restores into CPU state only for now; drop --device or --resume")
        snap = latest_on_disk(live.get("snapshot_dir") or "parashift-snapshots", spec.name)
        if snap[0] >= steps:
            raise StrategyError(f"the newest snapshot in {live.get('snapshot_dir')} is of step {snap[0]}, and the "
                                f"job ends at --steps {steps}; give --steps above {snap[0]}")
        gens[0] = type(gens[0])(snap[0], gens[0].strategy, gens[0].devices)
        live["resume"] = snap
        say(quiet, f"resuming from the snapshot of step {snap[0]} (taken under {snap[1]}) in "
                   f"{live.get('snapshot_dir')}, into {gens[0].strategy}")
    if nprocs > world:
        raise StrategyError(f"--nprocs {nprocs} is more than strategy {gens[0].strategy} runs ({world}); "
                            f"start at most {world} processes here")
    seq_len = live.pop("seq_len", None) or spec.seq_len
    for st in [gens[0].strategy, *(st for _, st in live.get("strategy_for", ()))]:
        if st.overlap_param:    # a lost host's pending gathers could never finish: survivors' parameters are stale
            raise StrategyError(f"{st} gathers parameters in the next step (overlap_param), which a multi-host "
                                f"job cannot recover from when a host is lost mid-step; drop overlap_param")
    check_local_gpus(live.get("device", "cpu"), nprocs)
    if on_join not in ("grow", "ignore"):
        raise StrategyError(f"--on-join {on_join!r}: use grow (switch to a wider strategy) or ignore")
    if not 0 < heartbeat_timeout <= timeout:
        raise StrategyError(f"--heartbeat-timeout {heartbeat_timeout:g} must be above 0 and at most --timeout "
                            f"({timeout:g} s)")
    live["cluster"] = get_cluster(live["cluster"]) if live.get("cluster") else switch_cluster(live.get("device", "cpu"))
    opts = LiveOptions(seq_len=seq_len, on_step=Follow(on_join, steps), recover=after_switch, placement=placement,
                       hosts=host_map, **live)
    return spec, gens, opts


def _publish_resumed_snapshot(store: Any, opts: Any) -> None:
    """A resumed job whose snapshot falls on its ``snapshot_every``: name that snapshot in the store
    (``hosts/snap/<step>/<device>``), so that a loss before the next snapshot restores it."""
    every = int(opts.snapshot_every or 0)
    if opts.resume and every and opts.resume[0] % every == 0:
        from ...strategy import Strategy
        s, snap_st, opt = opts.resume
        for r in range(Strategy.parse(snap_st).world):
            store.set(f"hosts/snap/{s}/{r}", pickle.dumps((snap_st, r, opt)))


def _wait_for_world(store: Any, spec: Any, gens: list, steps: int, opts: Any, nprocs: int, on_join: str,
                    endpoint: str, timeout: float, quiet: bool) -> None:
    """Register this host's devices, wait until the agents bring the first strategy's world, then publish
    the job's settings (:class:`.keys.JobConfig`); warn when a tp x cp group spans two hosts."""
    world = gens[0].strategy.world
    store.add("hosts/count", 1)
    store.add("hosts/devices", nprocs)
    store.set("hosts/devices_of/1", f"0-{nprocs - 1}")
    join = f"--store {endpoint}" if endpoint.startswith("etcd://") else f"--endpoint {endpoint}"
    say(quiet, f"serving the job at {endpoint}: devices 0-{nprocs - 1} here; waiting for "
               f"{world - nprocs} more from `parashift join {join}`")
    end = time.monotonic() + timeout
    while store.add("hosts/devices", 0) < world:
        if time.monotonic() > end:
            raise RuntimeFailure(f"only {store.add('hosts/devices', 0)} of the {world} devices of {gens[0].strategy} "
                                 f"joined within {timeout:.0f} s; start `parashift join {join} "
                                 f"--nprocs N` on the other hosts")
        time.sleep(0.05)
    store.set("hosts/config", pickle.dumps(JobConfig(spec, gens, steps, opts, world, on_join)))
    say(quiet, f"{int(store.add('hosts/count', 0))} hosts, {world} devices: training {spec.name} under {gens[0].strategy}")
    s0 = gens[0].strategy
    if splits_groups(s0, gens[0].devices, host_map(store, gens[0].devices, timeout)):
        say(False, f"warning: a tp x cp group of {s0} spans two hosts (each step's tensor-parallel traffic crosses "
                   f"the network); give every host an --nprocs that is a multiple of tp*cp={s0.tp * s0.cp}")


def _say_survivability(surv: list[dict], quiet: bool) -> None:
    """Tell the user what a loss of each host without notice would cost."""
    for row in surv:
        say(quiet, f"  if host {row['host']} (devices {row['devices'][0]}-{row['devices'][-1]}) is lost without notice: "
                   + {"replicas": f"the job goes on from the survivors' copies as {row['layout']}",
                      "snapshot": f"the job restores the newest snapshot as {row['layout']} (the steps since are lost)",
                      "none": "the job ends" + (" (it serves the store)" if row["host"] == 1 else
                                                f" ({row['missing']} have no other copy; add --snapshot-every N)")
                      }[row["recovers_from"]])


def _train(job: Any, spec: Any, gens: list, steps: int, opts: Any, nprocs: int, endpoint: str,
           timeout: float) -> dict:
    """Run this host's processes to the end of the job; their reports. A failure that a lost host
    explains is reported as that host's loss."""
    from ..switch.session import _live_worker
    store = job.store
    try:
        return launch_elastic(_live_worker, _local_members(range(nprocs)), args=(spec, gens, steps, opts),
                              timeout=timeout, job=job)
    except RuntimeFailure as e:
        dead = [(h, store.get(f"hosts/devices_of/{h}").decode()) for h in range(2, int(store.add("hosts/count", 0)) + 1)
                if store.check([f"hosts/dead/{h}"])] or silent_hosts(store)      # declared lost, or silent now
        if not dead:
            raise
        what = "; ".join(f"host {h} (devices {d})" for h, d in dead)
        raise RuntimeFailure(f"{what} stopped beating (killed, or cut off from {endpoint}); the job could not "
                             f"go on without it: {str(e).splitlines()[0][:400]}") from None


def _collect_reports(store: Any, reports: dict, nprocs: int, timeout: float) -> dict[int, list[int]]:
    """Add every live agent's report (its processes have finished training) to ``reports``; {host: its
    devices that trained}."""
    placed = {1: list(range(nprocs))}
    hosts = int(store.add("hosts/count", 0))   # every host that came, in time or late
    for h in range(2, hosts + 1):
        if store.check([f"hosts/dead/{h}"]):
            continue
        def failed(h=h) -> None:
            if store.check([f"hosts/failed/{h}"]):
                raise RuntimeFailure(f"host {h} failed: {store.get(f'hosts/failed/{h}').decode()}")
        wait_key(store, f"hosts/report/{h}", timeout, f"host {h}'s report", failed)
        got = pickle.loads(store.get(f"hosts/report/{h}"))
        placed[h] = sorted(r["device"] for r in got.values() if r)
        reports.update(got)
    return placed


def _losses(store: Any, gens: list, steps: int, reports: dict) -> list[float]:
    """The loss of every step, summed from every device's share as published after each step (dead
    hosts' too); raises when the job stopped before its last step."""
    losses = []
    for k in range(gens[0].step, steps):
        devs = [g for g in gens if g.step <= k][-1].devices
        keys = [f"hosts/loss/{k}/{d}" for d in devs]
        if not store.check(keys):
            break
        losses.append(float(sum(float(store.get(key)) for key in keys)))
    errors = [r["error"] for r in reports.values() if r and r.get("error")]
    if len(losses) < steps - gens[0].step:
        raise RuntimeFailure(f"the multi-host job stopped after {gens[0].step + len(losses)} of {steps} steps"
                             + (f": {errors[0]}" if errors else ""))
    return losses


def _switches(store: Any, gens: list, causes: list, reports: dict, spec: Any, opts: Any) -> list[dict]:
    """One record per generation after the first, in the order they happened: a planned switch (join,
    notice) from its processes' records, a recovery from its published plan."""
    from ..switch.session import _summarize
    switches: list[dict] = []
    ran = 0                                     # the generation each recovery started from
    for g, c in zip(range(1, len(gens)), causes):
        if c != "failure":                      # a planned switch (join, notice): its processes' records
            for sw in _summarize([gens[g - 1], gens[g]], reports, spec, opts.memory_budget,
                                 hosts=host_map(store, gens[g - 1].devices + gens[g].devices)) or \
                    _superseded(store, gens, causes, g, ran):
                switches.append(dict(sw, cause=c))
                ran = g if "aborted" not in sw else ran
            continue
        plan = pickle.loads(store.get(f"hosts/plan/{g}"))
        got = [eval_pair(store.get(f"hosts/recovered/{g}/{d}")) for d in gens[g].devices]
        src = gens[ran]
        switches.append({"step": plan["step"], "src": str(src.strategy), "dst": str(gens[g].strategy),
                         "src_devices": list(src.devices), "dst_devices": list(gens[g].devices),
                         "cause": "failure", "lost_devices": plan["lost"], "failed_at": plan["failed_at"],
                         "recovered_from": plan["kind"], "steps_lost": plan["steps_lost"],
                         "seconds": max(s for s, _ in got), "pause_seconds": max(s for s, _ in got)})
        ran = g
    switches.sort(key=lambda sw: (sw.get("failed_at", sw["step"]), sw["step"]))
    return switches


def _superseded(store: Any, gens: list, causes: list, g: int, ran: int) -> list[dict]:
    """Planned generation ``g`` that no process began because a host was lost first (a notice that ran out
    before its switch): one entry marked aborted, naming the lost devices; none when no recovery followed."""
    after = [k for k in range(g + 1, len(gens)) if causes[k - 1] == "failure"]
    if not after:
        return []
    lost = pickle.loads(store.get(f"hosts/plan/{after[0]}"))["lost"]
    return [{"step": gens[g].step, "src": str(gens[ran].strategy), "dst": str(gens[g].strategy),
             "src_devices": list(gens[ran].devices), "dst_devices": list(gens[g].devices), "seconds": 0.0,
             "pause_seconds": 0.0, "aborted": f"never began: devices {lost} were lost before it"}]


def _survivability(store: Any, spec: Any, strategy: Any, nprocs: int, opts: Any, timeout: float) -> list[dict]:
    """:func:`.recover.survivability` of the first world's hosts, as records."""
    hosts = {1: list(range(nprocs))}
    for h in range(2, int(store.add("hosts/count", 0)) + 1):
        wait_key(store, f"hosts/devices_of/{h}", timeout, f"host {h}'s devices")
        a, b = (int(x) for x in store.get(f"hosts/devices_of/{h}").decode().split("-"))
        if b < strategy.world:
            hosts[h] = list(range(a, b + 1))
    df = survivability(spec, strategy, hosts, opts.global_batch, snapshots=bool(opts.snapshot_every),
                       table=opts.strategy_for)
    return df.to_dict("records")
