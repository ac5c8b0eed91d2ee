"""A live job that spans hosts: the first host serves the job's store at an endpoint, agents join it.

The first host (:func:`run_first_host`) binds the job's TCPStore to ``HOST:PORT`` under the job's
secret (:func:`read_secret`: ``$PARASHIFT_JOB_SECRET`` or a 0600 file; never argv) and registers
its ``nprocs`` processes as devices ``0..nprocs-1``. Each other host runs an agent
(:func:`run_agent`) that connects with the same secret, takes the next free device ids
(``store.add``) and waits for the job's settings. When the strategy's world is registered, the
first host publishes the settings; every host then starts its own processes with
:func:`.elastic.launch_elastic` on the shared store, and their groups are built over that store
by the elastic device manager (:class:`.elastic.ElasticManager`): no process is restarted. Each
agent sends its processes' reports back through the store; the first host assembles the result.

A host that joins a running job (its devices beyond the first world) is announced through
``hosts/devices``; with ``on_join="grow"`` the process of device 0 (:class:`_Follow`, called at
every step boundary) picks the next strategy for the larger device set (:func:`next_strategy`: the
job's ``--strategy-for`` entry of that count, else :func:`grow_strategy`) and its devices, each
tp x cp group on one host (:func:`choose_devices`), ordered to keep the most state on each host
(``--switch-placement keep``, with the hosts of :func:`host_map`),
and publishes the next generation ``hosts/gen/<g>`` with a switch step ``notice + 2`` steps
ahead; every process appends it to its schedule at its next step boundary, so the world is built
in the background during the notice and the switch happens between iterations; the joining
agent starts its processes for that generation.

A host lost without notice: the first host declares an agent lost as soon as its liveness connection
closes (:func:`_liveness`: the kernel closes it when the agent's process dies) or when its heartbeat stood
still for the job's heartbeat window (:func:`_monitor`, ``--heartbeat-timeout``); the survivors recover
(:mod:`.recover`) from their copies or from a
snapshot (:mod:`.snapshot`). The first host serves the store and holds device 0, which runs every
recovery: losing it ends the job.

Store keys (under the job's secret): ``hosts/devices`` (devices registered), ``hosts/count``
(hosts), ``hosts/heartbeat`` (the heartbeat window, seconds), ``hosts/live_port`` (the liveness listener),
``hosts/config`` (pickled settings), ``hosts/gen/<g>`` (generations after the first, with
their cause), ``hosts/leave/<h>`` (a SIGTERM notice: its devices and seconds left), ``hosts/beat/<h>`` (heartbeat counters),
``hosts/devices_of/<h>`` (each host's device ids, the first host's too), ``hosts/declared/<h>`` (who
declares it lost, once), ``hosts/dead/<h>`` and ``dead/<device>`` (declared lost),
``hosts/handled/<h>`` (taken out by recovery round ``g``), ``hosts/report/<h>``, ``hosts/failed/<h>``,
``hosts/done``; written by :mod:`.recover`: ``hosts/loss/<step>/<device>`` (loss shares),
``hosts/fault`` (failed steps), ``hosts/recovery`` (the open round), ``hosts/lost/<g>``,
``hosts/state/<g>/<device>``, ``hosts/plan/<g>``, ``hosts/recovered/<g>/<device>``; by
:mod:`.snapshot`: ``hosts/snap/<step>/<device>``.
"""
from __future__ import annotations

import contextlib
import ipaddress
import os
import pickle
import re
import socket
import stat
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ...errors import RuntimeFailure, StrategyError
from .elastic import Member, launch_elastic
from ..jobstore import JobStore, connect, serve

__all__ = ["SECRET_ENV", "parse_endpoint", "read_secret", "run_first_host", "run_agent", "next_strategy"]

#: environment variable holding the job's secret (the alternative is a 0600 file named by --secret-file)
SECRET_ENV = "PARASHIFT_JOB_SECRET"
#: default seconds of heartbeat silence after which the first host declares an agent lost (``--heartbeat-timeout``)
HEARTBEAT_TIMEOUT = 4.0
_SECRET_RE = re.compile(r"^[A-Za-z0-9_-]{16,128}$")


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise StrategyError(f"--endpoint {text!r} is not HOST:PORT; e.g. 10.0.0.5:29500 or 127.0.0.1:29500")
    return host, int(port)


def read_secret(secret_file: str | None, create: bool = False) -> str:
    """The job's secret: ``secret_file`` (owner-only permissions) when given, else ``$PARASHIFT_JOB_SECRET``.
    ``create``: write a new secret to ``secret_file`` (mode 0600) when it does not exist (the first host)."""
    import secrets
    if secret_file:
        if create and not os.path.exists(secret_file):
            fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(16) + "\n")
        try:
            st = os.stat(secret_file)
        except OSError as e:
            raise StrategyError(f"--secret-file {secret_file!r}: {e.strerror}; copy the first host's secret file "
                                f"here (mode 0600) or set {SECRET_ENV}") from None
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise StrategyError(f"--secret-file {secret_file!r} can be read by other users (mode "
                                f"{stat.S_IMODE(st.st_mode):o}); run chmod 600 on it")
        with open(secret_file) as f:
            secret = f.read().strip()
    else:
        secret = os.environ.get(SECRET_ENV, "").strip()
        if not secret:
            raise StrategyError(f"a multi-host job needs its secret: set {SECRET_ENV} (the same value on every "
                                f"host, e.g. from `openssl rand -hex 16`) or pass --secret-file PATH (mode 0600)")
    if not _SECRET_RE.match(secret):
        raise StrategyError(f"the job's secret must be 16-128 characters of letters, digits, '-' or '_' "
                            f"(e.g. `openssl rand -hex 16`), not {len(secret)} other characters")
    return secret


def _check_gloo_interface(host: str) -> None:
    """Processes of different hosts must not bind gloo to loopback (launch_elastic's default)."""
    try:
        loop = ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        loop = False
    if not loop and not os.environ.get("GLOO_SOCKET_IFNAME"):
        raise StrategyError(f"endpoint {host} is not loopback: set GLOO_SOCKET_IFNAME to the network interface "
                            f"that reaches the other hosts (e.g. eth0) on every host")


def eval_pair(raw: bytes) -> tuple[float, int]:
    """``repr((seconds, step))`` as written by :mod:`.recover`."""
    a, b = raw.decode().strip("()").split(",")
    return float(a), int(b)


def _count(store: Any, gens: list) -> int:
    """Generations published so far, less one (the index of the last published one)."""
    g = len(gens)
    while store.check([f"hosts/gen/{g}"]):
        g += 1
    return g - 1


def _append(store: Any, gens: list, causes: list | None = None) -> None:
    """Append the published generations ``gens`` does not hold yet (their causes to ``causes``)."""
    import pickle as pk
    while store.check([f"hosts/gen/{len(gens)}"]):
        gen, cause = pk.loads(store.get(f"hosts/gen/{len(gens)}"))
        gens.append(gen)
        if causes is not None:
            causes.append(cause)


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


@dataclass
class _Follow:
    """Called by every process at each step boundary (``LiveOptions.on_step``): device 0 turns newly
    registered devices into the next generation; every process appends published generations."""

    on_join: str
    steps: int
    seen: dict = field(default_factory=dict)     # device 0: host -> when it first read that host's notice

    def __call__(self, session: Any, step: int) -> None:
        import pickle as pk
        from .recover import guard
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
                    store.set(f"hosts/gen/{len(gens)}", pk.dumps((Generation(at, st, new), "join")))
        if session.device == 0 and session.gen == len(gens) - 1 and len(gens) - 1 == _count(store, gens):
            self._leave(session, step)
        _append(store, gens)

    def _leave(self, session: Any, step: int) -> None:
        """Device 0: a host that got SIGTERM (``hosts/leave/<h>``) -> the next generation without its devices,
        ``notice`` + 2 steps ahead, or at the next step boundary when a notice's deadline comes first
        (:func:`notice_is_short`)."""
        import pickle as pk
        from ..switch.session import Generation
        store, gens = session.ctx.store, session.gens
        cur = gens[-1]
        gone: set[int] = set()
        rest: list[float] = []               # seconds of each bounded notice left now
        for h in range(2, int(store.add("hosts/count", 0)) + 1):
            if store.check([f"hosts/leave/{h}"]):
                got = pk.loads(store.get(f"hosts/leave/{h}"))
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
        store.set(f"hosts/gen/{len(gens)}", pk.dumps((Generation(at, got[0], _placed(session, cur, *got)), "notice")))


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


@dataclass(frozen=True)
class _Config:
    """What the first host publishes to the agents: the job's settings and device layout."""

    spec: Any
    gens: list
    steps: int
    opts: Any
    world: int
    on_join: str = "grow"


def _wait_key(store: Any, key: str, timeout: float, what: str, alive: Callable[[], None] | None = None) -> None:
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
        _wait_key(store, f"hosts/devices_of/{h}", timeout, f"host {h}'s devices")
        a, b = (int(x) for x in store.get(f"hosts/devices_of/{h}").decode().split("-"))
        for d in range(a, min(b + 1, top)):
            out[d] = h
            left -= 1
        h += 1
    return tuple(out)


def _local_members(devices: range) -> list[Member]:
    return [Member(d, 0, 0) for d in devices]


def _store_gone(store: Any) -> bool:
    """Whether the job's store no longer answers (its first host ended or failed)."""
    try:
        store.check(["hosts/config"])
    except Exception as e:  # noqa: BLE001 - torch raises DistNetworkError (or RuntimeError) for a closed store
        return type(e).__name__.startswith("Dist") or isinstance(e, (RuntimeError, OSError))
    return False


def _say(quiet: bool, text: str) -> None:
    if not quiet:
        print(text, file=sys.stderr, flush=True)


def _check_local_gpus(device: str, nprocs: int) -> None:
    """A CUDA job runs one process per local GPU: refuse ``nprocs`` beyond this host's GPUs."""
    if device != "cuda":
        return
    import torch
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < nprocs:
        raise StrategyError(f"the job trains on CUDA (one GPU per process), and this host has {have} GPU(s) for "
                            f"--nprocs {nprocs}; use --nprocs {have} here" if have else
                            "the job trains on CUDA, and this host has no CUDA GPU; join from a GPU host, or start "
                            "the job with --device cpu")


def run_first_host(model, strategy, *, steps: int, endpoint: str, nprocs: int, secret: str,
                   timeout: float = 600.0, quiet: bool = False, on_join: str = "grow",
                   heartbeat_timeout: float = HEARTBEAT_TIMEOUT, **live) -> tuple[Any, dict[int, list[int]]]:
    """Serve the job at ``endpoint``, wait for agents to bring the strategy's world, train, and
    return the whole job's :class:`..switch.LiveResult` and {host number: its devices} (this host is 1). ``live``: :func:`..switch.run_live`'s
    options (global_batch, seq_len, optim, notice, memory_budget, placement, ...). ``heartbeat_timeout``: seconds
    of heartbeat silence after which an agent is declared lost (one whose process dies is declared at once)."""
    from ... import models
    from ..switch.session import LiveOptions, LiveResult, _live_worker, _summarize, generations
    spec = models.get(model)
    host, port = parse_endpoint(endpoint)
    _check_gloo_interface(host)
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
        _say(quiet, f"resuming from the snapshot of step {snap[0]} (taken under {snap[1]}) in "
                    f"{live.get('snapshot_dir')}, into {gens[0].strategy}")
    if nprocs > world:
        raise StrategyError(f"--nprocs {nprocs} is more than strategy {gens[0].strategy} runs ({world}); "
                            f"start at most {world} processes here")
    seq_len = live.pop("seq_len", None) or spec.seq_len
    for st in [gens[0].strategy, *(st for _, st in live.get("strategy_for", ()))]:
        if st.overlap_param:    # a lost host's pending gathers could never finish: survivors' parameters are stale
            raise StrategyError(f"{st} gathers parameters in the next step (overlap_param), which a multi-host "
                                f"job cannot recover from when a host is lost mid-step; drop overlap_param")
    _check_local_gpus(live.get("device", "cpu"), nprocs)
    if on_join not in ("grow", "ignore"):
        raise StrategyError(f"--on-join {on_join!r}: use grow (switch to a wider strategy) or ignore")
    if not 0 < heartbeat_timeout <= timeout:
        raise StrategyError(f"--heartbeat-timeout {heartbeat_timeout:g} must be above 0 and at most --timeout "
                            f"({timeout:g} s)")
    from .recover import after_switch
    from ..switch.session import switch_cluster
    from ...cluster import get as get_cluster
    live["cluster"] = get_cluster(live["cluster"]) if live.get("cluster") else switch_cluster(live.get("device", "cpu"))
    opts = LiveOptions(seq_len=seq_len, on_step=_Follow(on_join, steps), recover=after_switch, placement=placement,
                       hosts=host_map, **live)
    job = serve(timeout, host, port, secret)
    store = job.store
    _liveness(store, host, secret)
    store.set("hosts/heartbeat", repr(float(heartbeat_timeout)))
    every = int(live.get("snapshot_every", 0) or 0)
    if live.get("resume") and every and live["resume"][0] % every == 0:    # a loss before the next snapshot restores it
        from ...strategy import Strategy
        s, snap_st, opt = live["resume"]
        for r in range(Strategy.parse(snap_st).world):
            store.set(f"hosts/snap/{s}/{r}", pickle.dumps((snap_st, r, opt)))
    store.add("hosts/count", 1)
    store.add("hosts/devices", nprocs)
    store.set("hosts/devices_of/1", f"0-{nprocs - 1}")
    _say(quiet, f"serving the job at {host}:{port}: devices 0-{nprocs - 1} here; waiting for "
                f"{world - nprocs} more from `parashift join --endpoint {host}:{port}`")
    end = time.monotonic() + timeout
    while store.add("hosts/devices", 0) < world:
        if time.monotonic() > end:
            raise RuntimeFailure(f"only {store.add('hosts/devices', 0)} of the {world} devices of {gens[0].strategy} "
                                 f"joined within {timeout:.0f} s; start `parashift join --endpoint {host}:{port} "
                                 f"--nprocs N` on the other hosts")
        time.sleep(0.05)
    store.set("hosts/config", pickle.dumps(_Config(spec, gens, steps, opts, world, on_join)))
    _say(quiet, f"{int(store.add('hosts/count', 0))} hosts, {world} devices: training {spec.name} under {gens[0].strategy}")
    s0 = gens[0].strategy
    if splits_groups(s0, gens[0].devices, host_map(store, gens[0].devices, timeout)):
        _say(False, f"warning: a tp x cp group of {s0} spans two hosts (each step's tensor-parallel traffic crosses "
                    f"the network); give every host an --nprocs that is a multiple of tp*cp={s0.tp * s0.cp}")
    surv = _survivability(store, spec, gens[0].strategy, nprocs, opts, timeout)
    for row in surv:
        _say(quiet, f"  if host {row['host']} (devices {row['devices'][0]}-{row['devices'][-1]}) is lost without notice: "
                    + {"replicas": f"the job goes on from the survivors' copies as {row['layout']}",
                       "snapshot": f"the job restores the newest snapshot as {row['layout']} (the steps since are lost)",
                       "none": "the job ends" + (" (it serves the store)" if row["host"] == 1 else
                                                 f" ({row['missing']} have no other copy; add --snapshot-every N)")
                       }[row["recovers_from"]])
    _monitor(store, heartbeat_timeout)
    try:
        reports = launch_elastic(_live_worker, _local_members(range(nprocs)), args=(spec, gens, steps, opts),
                                 timeout=timeout, job=job)
    except RuntimeFailure as e:
        dead = [(h, store.get(f"hosts/devices_of/{h}").decode()) for h in range(2, int(store.add("hosts/count", 0)) + 1)
                if store.check([f"hosts/dead/{h}"])] or _silent_hosts(store)      # declared lost, or silent now
        if not dead:
            raise
        what = "; ".join(f"host {h} (devices {d})" for h, d in dead)
        raise RuntimeFailure(f"{what} stopped beating (killed, or cut off from {host}:{port}); the job could not "
                             f"go on without it: {str(e).splitlines()[0][:400]}") from None
    placed = {1: list(range(nprocs))}
    hosts = int(store.add("hosts/count", 0))   # every host that came, in time or late
    for h in range(2, hosts + 1):          # the agents' reports (their processes have finished training)
        if store.check([f"hosts/dead/{h}"]):
            continue
        def failed(h=h) -> None:
            if store.check([f"hosts/failed/{h}"]):
                raise RuntimeFailure(f"host {h} failed: {store.get(f'hosts/failed/{h}').decode()}")
        _wait_key(store, f"hosts/report/{h}", timeout, f"host {h}'s report", failed)
        got = pickle.loads(store.get(f"hosts/report/{h}"))
        placed[h] = sorted(r["device"] for r in got.values() if r)
        reports.update(got)
    store.set("hosts/done", "1")
    causes: list[str] = []
    _append(store, gens, causes)
    losses = []
    for k in range(gens[0].step, steps):    # every device's share, as published after each step (dead hosts' too)
        devs = [g for g in gens if g.step <= k][-1].devices
        keys = [f"hosts/loss/{k}/{d}" for d in devs]
        if not store.check(keys):
            break
        losses.append(float(sum(float(store.get(key)) for key in keys)))
    errors = [r["error"] for r in reports.values() if r and r.get("error")]
    if len(losses) < steps - gens[0].step:
        raise RuntimeFailure(f"the multi-host job stopped after {gens[0].step + len(losses)} of {steps} steps"
                             + (f": {errors[0]}" if errors else ""))
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
    resumed = {"step": opts.resume[0], "strategy": opts.resume[1]} if opts.resume else None
    return LiveResult(losses, switches, reports, gens, survivability=surv, resumed=resumed), placed


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
    from .recover import survivability
    hosts = {1: list(range(nprocs))}
    for h in range(2, int(store.add("hosts/count", 0)) + 1):
        _wait_key(store, f"hosts/devices_of/{h}", timeout, f"host {h}'s devices")
        a, b = (int(x) for x in store.get(f"hosts/devices_of/{h}").decode().split("-"))
        if b < strategy.world:
            hosts[h] = list(range(a, b + 1))
    df = survivability(spec, strategy, hosts, opts.global_batch, snapshots=bool(opts.snapshot_every),
                       table=opts.strategy_for)
    return df.to_dict("records")


def beat_every(timeout: float) -> float:
    """Seconds between an agent's heartbeats under a detection window of ``timeout`` seconds (8 beats a window,
    at most 0.5 s apart)."""
    return min(0.5, timeout / 8)


def _window(store: Any, wait: float = 30.0) -> float:
    """The job's heartbeat window, as the first host published it (``hosts/heartbeat``)."""
    _wait_key(store, "hosts/heartbeat", wait, "the first host to publish its heartbeat window")
    return float(store.get("hosts/heartbeat"))


def _beat(host: str, port: int, secret: str, h: int, every: float) -> None:
    """A daemon thread that bumps ``hosts/beat/<h>`` every ``every`` seconds over its own connection, until
    the interpreter exits (:func:`_halt_at_exit`)."""
    import threading
    stop = threading.Event()

    def loop() -> None:
        try:
            store = connect(host, port, secret, 30.0)
            while not stop.is_set():
                store.add(f"hosts/beat/{h}", 1)
                stop.wait(every)
        except Exception:  # noqa: BLE001 - the store is gone: the job is over
            return
    t = threading.Thread(target=loop, name="parashift-heartbeat", daemon=True)
    t.start()
    _halt_at_exit(stop, thread=t)


def _halt_at_exit(stop: Any, thread: Any = None, lock: Any = None) -> None:
    """At the interpreter's exit, first stop a daemon thread that calls the job's store: set ``stop`` (holding
    ``lock``, which the thread holds around its calls), then wait for ``thread``. A daemon thread that the exit
    finds inside the store's C++ client aborts the process ("terminate called without an active exception")."""
    import atexit

    def halt() -> None:
        with lock if lock is not None else contextlib.nullcontext():
            stop.set()
        if thread is not None:
            thread.join(5.0)
    atexit.register(halt)


def _live_key(secret: str) -> bytes:
    import hashlib
    return hashlib.sha256(b"parashift-live:" + secret.encode()).digest()


def _proof(secret: str, nonce: bytes, h: int) -> bytes:
    import hmac
    return h.to_bytes(4, "big") + hmac.new(_live_key(secret), nonce + h.to_bytes(4, "big"), "sha256").digest()


#: an agent's open liveness connection (held for the life of its process; the kernel closes it when it dies)
_LIVE: list = []


def _hold_liveness(store: Any, host: str, secret: str, h: int) -> None:
    """Open this agent's liveness connection to the first host (``hosts/live_port``) and prove the job's
    secret; the kernel closes it when this process dies, however it dies, which the first host sees at once."""
    port = int(store.get("hosts/live_port"))
    conn = socket.create_connection((host, port), timeout=30.0)
    nonce = _recv_exact(conn, 16)
    conn.sendall(_proof(secret, nonce, h))
    conn.settimeout(None)
    _LIVE.append(conn)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        got = conn.recv(n - len(out))
        if not got:
            raise ConnectionError("the liveness connection closed during its handshake")
        out += got
    return out


def _declare_lost(store: Any, h: int) -> bool:
    """Declare agent ``h`` lost unless it reported, failed, was declared already, or the job is over:
    ``dead/<device>`` for its devices (a switch in progress aborts, :mod:`..switch.protocol`),
    ``hosts/dead/<h>``, and a bump of :data:`.recover.FAULT_KEY` (training steps stop waiting and recover)
    unless every one of its devices left the job through a verified switch (``left/<device>``)."""
    from .recover import FAULT_KEY
    if store.check(["hosts/done"]) or any(store.check([f"hosts/{k}/{h}"]) for k in ("dead", "report", "failed")) \
            or not store.check([f"hosts/devices_of/{h}"]):
        return False
    if store.add(f"hosts/declared/{h}", 1) != 1:       # the monitor and the liveness listener may both try
        return False
    a, b = (int(x) for x in store.get(f"hosts/devices_of/{h}").decode().split("-"))
    for d in range(a, b + 1):
        store.set(f"dead/{d}", f"host {h}")
    if not store.check([f"left/{d}" for d in range(a, b + 1)]):     # all left through a verified switch: no step
        store.add(FAULT_KEY, 1)                                   # needs them (a notice that ran out just after)
    store.set(f"hosts/dead/{h}", "1")                  # last: whoever sees it sees the fault counted too
    return True


def _liveness(store: Any, host: str, secret: str) -> None:
    """The first host's liveness listener (port published as ``hosts/live_port``): each agent holds one
    connection, authenticated by the job's secret; when it closes (the agent's process died: SIGKILL, a
    crash, the machine went down with a reset) before the agent reported or failed, the agent is declared
    lost at once (:func:`_declare_lost`). A host cut off without a reset is caught by the heartbeat window."""
    import hmac
    import threading
    info = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    srv = socket.socket(info[0], socket.SOCK_STREAM)
    srv.bind((info[4][0], 0))
    srv.listen(64)
    store.set("hosts/live_port", str(srv.getsockname()[1]))
    watch = store.clone()          # the watchers' own connection (the job's is used by the training loop)
    lock, stop = threading.Lock(), threading.Event()
    _halt_at_exit(stop, lock=lock)

    def serve_one(conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(30.0)
                nonce = os.urandom(16)
                conn.sendall(nonce)
                got = _recv_exact(conn, 36)
                h = int.from_bytes(got[:4], "big")
                if not hmac.compare_digest(got, _proof(secret, nonce, h)):
                    return
                conn.settimeout(None)
            except OSError:
                return                      # not an agent of this job: nothing to watch
            try:
                while conn.recv(64):
                    pass
            except OSError:
                pass                        # a reset: closed as well
            try:
                with lock:
                    if not stop.is_set():
                        _declare_lost(watch, h)
            except Exception:  # noqa: BLE001 - the store is gone: the job is over
                pass

    def accept() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=serve_one, args=(conn,), name="parashift-liveness", daemon=True).start()
    threading.Thread(target=accept, name="parashift-liveness-accept", daemon=True).start()


def _silent_hosts(store: Any, wait: float | None = None) -> list[tuple[int, str]]:
    """Agents declared lost (by the monitor or the liveness listener), else, after ``wait`` seconds (default: half
    the job's heartbeat window) of looking, those whose heartbeat did not move meanwhile, with their devices (a
    recovery's lost hosts aside; device 0's check after a failed step: tells a dead host from a failing process).
    Returns as soon as one is declared lost (then every host declared within a further 50 ms)."""
    hosts = [h for h in range(2, int(store.add("hosts/count", 0)) + 1)
             if not store.check([f"hosts/handled/{h}"])]            # lost hosts a recovery already took out
    wait = _window(store) / 2 if wait is None else wait
    before = {h: store.add(f"hosts/beat/{h}", 0) for h in hosts}
    end = time.monotonic() + wait
    while True:
        marked = [h for h in hosts if store.check([f"hosts/dead/{h}"])]
        if marked:
            time.sleep(0.05)
            marked = [h for h in hosts if store.check([f"hosts/dead/{h}"])]
            break
        if time.monotonic() >= end:
            marked = [h for h in hosts if store.add(f"hosts/beat/{h}", 0) == before[h]
                      and not store.check([f"hosts/report/{h}"])]
            break
        time.sleep(0.01)
    return [(h, store.get(f"hosts/devices_of/{h}").decode()) for h in marked]


def _monitor(store: Any, timeout: float) -> None:
    """A daemon thread of the first host: an agent whose heartbeat stood still for ``timeout`` seconds (and
    that has not reported or failed) is declared lost (:func:`_declare_lost`), until the job is done or the
    interpreter exits (:func:`_halt_at_exit`)."""
    import threading
    stop = threading.Event()

    def loop() -> None:
        seen: dict[int, tuple[int, float]] = {}        # host -> (last count, when it last moved)
        try:
            while not stop.wait(beat_every(timeout)) and not store.check(["hosts/done"]):
                now = time.monotonic()
                for h in range(2, int(store.add("hosts/count", 0)) + 1):
                    if any(store.check([f"hosts/{k}/{h}"]) for k in ("dead", "report", "failed")) or \
                            not store.check([f"hosts/devices_of/{h}"]):
                        continue
                    n = int(store.add(f"hosts/beat/{h}", 0))
                    last, since = seen.get(h, (n, now))
                    seen[h] = (n, now if n != last else since)
                    if now - seen[h][1] >= timeout:
                        _declare_lost(store, h)
        except Exception:  # noqa: BLE001 - the store is gone: the job is over
            return
    t = threading.Thread(target=loop, name="parashift-monitor", daemon=True)
    t.start()
    _halt_at_exit(stop, thread=t)


def _leave_on_sigterm(host: str, port: int, secret: str, h: int, devices: range, quiet: bool,
                      notice_seconds: float | None = None) -> Any:
    """SIGTERM (a notice) to this agent: announce that its devices leave (``hosts/leave/<h>``: the devices and
    the seconds of notice left, None when unbounded); its processes then switch away with the job and exit
    once the survivors have verified their new state. With ``notice_seconds`` the notice is enforced as a
    platform would: if this host's processes have not exited that long after the SIGTERM, the agent
    SIGKILLs its process group, itself included (:func:`_reclaim`). Returns an Event to set once the
    processes have exited (the deadline then does nothing)."""
    import signal
    import threading
    left = threading.Event()
    got: list[float] = []

    def announce(t0: float) -> None:
        store = connect(host, port, secret, 30.0)
        rest = None if notice_seconds is None else notice_seconds - (time.monotonic() - t0)
        store.set(f"hosts/leave/{h}", pickle.dumps({"devices": list(devices), "seconds": rest}))

    def deadline(t0: float) -> None:
        if not left.wait(max(t0 + notice_seconds - time.monotonic(), 0.0)):
            _say(quiet, f"host {h}: the notice of {notice_seconds:g} s ran out before this host's processes left "
                        f"the job: SIGKILL to its processes, as the platform would")
            _reclaim()

    def handler(signum, frame) -> None:
        if got:                         # one notice: a second SIGTERM changes nothing
            return
        got.append(time.monotonic())
        bound = "" if notice_seconds is None else f"; this host is killed {notice_seconds:g} s after the SIGTERM"
        _say(quiet, f"host {h}: SIGTERM: devices {devices.start}-{devices.stop - 1} leave at the job's next "
                    f"switch{bound}")
        threading.Thread(target=announce, args=(got[0],), daemon=True).start()
        if notice_seconds is not None:
            threading.Thread(target=deadline, args=(got[0],), name="parashift-notice", daemon=True).start()
    signal.signal(signal.SIGTERM, handler)
    return left


def _reclaim() -> None:
    """SIGKILL this agent as a reclaimed machine dies: its whole process group when it leads one (as
    ``parashift join`` started from a shell or in a process group of its own does), else itself alone,
    and its processes die with it (their parent-death signal, :func:`..jobstore.die_with_parent`)."""
    import signal
    sys.stderr.flush()
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _wait_generation(store: Any, gens: list, devices: range, timeout: float) -> int | None:
    """Append published generations to ``gens`` until one uses ``devices``; its index, or None when the
    job ends first."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        n = len(gens)
        _append(store, gens)
        for g in range(n, len(gens)):
            if set(devices) & set(gens[g].devices):
                del gens[g + 1:]
                return g
        if store.check(["job/end"]):
            return None
        time.sleep(0.05)
    raise RuntimeFailure(f"timed out after {timeout:.0f} s waiting for the job to use this host's devices")


def run_agent(*, endpoint: str, nprocs: int, secret: str, timeout: float = 600.0, quiet: bool = False,
              notice_seconds: float | None = None) -> dict:
    """Join the job served at ``endpoint`` with ``nprocs`` local processes; returns what this host ran
    (``host``, ``devices``, per-device step counts). ``notice_seconds``: the platform kills this host that long
    after a SIGTERM (None: unbounded); the agent then SIGKILLs itself and its processes, as a reclaimed machine."""
    host, port = parse_endpoint(endpoint)
    _check_gloo_interface(host)
    try:
        store = connect(host, port, secret, timeout)
    except Exception as e:  # noqa: BLE001 - torch raises several kinds for an unreachable store
        raise RuntimeFailure(f"cannot reach the job's store at {host}:{port} ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:120]}); start `parashift run ... --live --endpoint "
                             f"{host}:{port}` on the first host first") from None
    h = int(store.add("hosts/count", 1))
    end = int(store.add("hosts/devices", nprocs))
    devices = range(end - nprocs, end)
    store.set(f"hosts/devices_of/{h}", f"{devices.start}-{devices.stop - 1}")
    _beat(host, port, secret, h, beat_every(_window(store, timeout)))
    try:
        _hold_liveness(store, host, secret, h)
    except OSError as e:
        _say(False, f"host {h}: no liveness connection to the first host ({e}); a loss of this host is detected "
                    f"by its heartbeat alone (--heartbeat-timeout on the first host)")
    try:
        _wait_key(store, "hosts/config", timeout, "the first host to publish the job")
        cfg: _Config = pickle.loads(store.get("hosts/config"))
        gens, first = list(cfg.gens), 0
        _check_local_gpus(cfg.opts.device, nprocs)
        if devices.start < cfg.world < end:
            raise RuntimeFailure(f"this host's devices {devices.start}-{end - 1} straddle the job's first world of "
                                 f"{cfg.world} devices; make the hosts' --nprocs add up to the strategy's world, "
                                 f"then join more hosts")
        if end > cfg.world:
            if cfg.on_join != "grow":
                store.set(f"hosts/report/{h}", pickle.dumps({}))    # the job goes on without this host
                raise RuntimeFailure(f"the job runs {cfg.world} devices and already has them all, and its first host "
                                     f"ignores joins (--on-join ignore); start it with --on-join grow")
            _say(quiet, f"host {h}: devices {devices.start}-{devices.stop - 1} announced; waiting for the job to "
                        f"switch to a strategy that uses them")
            first = _wait_generation(store, gens, devices, timeout)
            if first is None:
                _say(quiet, f"host {h}: the job ended (or found no strategy for these devices) before using them")
                store.set(f"hosts/report/{h}", pickle.dumps({}))
                return {"host": h, "devices": list(devices), "steps": {}}
        _say(quiet, f"host {h}: devices {devices.start}-{devices.stop - 1}, training {cfg.spec.name} under "
                    f"{gens[first].strategy}" + (f" from step {gens[first].step}" if first else ""))
        from ..switch.session import _live_worker
        job = JobStore(store, store, host, port, secret)
        left = _leave_on_sigterm(host, port, secret, h, devices, quiet, notice_seconds)
        members = [Member(d, first, first) for d in devices if d in gens[first].devices]
        if first:     # processes start when the switch that brings them in is announced (notice steps ahead)
            _wait_key(store, f"sw{first}/notice", timeout, f"the notice of the switch at step {gens[first].step}",
                      lambda: None)
        reports = launch_elastic(_live_worker, members, args=(cfg.spec, gens, cfg.steps, cfg.opts),
                                 timeout=timeout, job=job, keep_sigterm=True)
        left.set()                 # its processes have exited: a notice's deadline is met
    except BaseException as e:
        if type(e).__name__.startswith("Dist") or _store_gone(store):    # the store went away with the first host
            e = RuntimeFailure(f"lost the job's store at {host}:{port} ({str(e).splitlines()[0][:120]}); the "
                               f"first host has ended or failed: see its output")
        try:
            store.set(f"hosts/failed/{h}", f"{type(e).__name__}: {e}"[:500])
        except Exception:  # noqa: BLE001 - the store may be gone with the first host
            pass
        raise e from None
    store.set(f"hosts/report/{h}", pickle.dumps(reports))
    _say(quiet, f"host {h}: done; report sent to {host}:{port}")
    return {"host": h, "devices": list(devices),
            "steps": {k: len(r["losses"]) for k, r in reports.items() if r}}
