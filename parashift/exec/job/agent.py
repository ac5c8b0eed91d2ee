"""An agent: a host that joins a job served elsewhere (``parashift join``).

It connects with the job's secret, takes the next free device ids (``store.add``), beats and holds its
liveness connection (:mod:`.liveness`), waits for the job's settings, and starts its processes with
:func:`.elastic.launch_elastic` when a generation uses its devices; its processes' reports go back
through the store. SIGTERM announces that its devices leave (a notice, :mod:`.follow`).
"""
from __future__ import annotations

import os
import pickle
import sys
import time
from typing import Any

from ...errors import RuntimeFailure
from ..jobstore import JobStore, connect
from .elastic import Member, launch_elastic
from .endpoint import check_gloo_interface, check_local_gpus, parse_endpoint, say
from .keys import JobConfig, append_generations, store_gone, wait_key
from .liveness import beat, beat_every, heartbeat_window, hold_liveness

__all__ = ["run_agent"]


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
            say(quiet, f"host {h}: the notice of {notice_seconds:g} s ran out before this host's processes left "
                        f"the job: SIGKILL to its processes, as the platform would")
            _reclaim()

    def handler(signum, frame) -> None:
        if got:                         # one notice: a second SIGTERM changes nothing
            return
        got.append(time.monotonic())
        bound = "" if notice_seconds is None else f"; this host is killed {notice_seconds:g} s after the SIGTERM"
        say(quiet, f"host {h}: SIGTERM: devices {devices.start}-{devices.stop - 1} leave at the job's next "
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
        append_generations(store, gens)
        for g in range(n, len(gens)):
            if set(devices) & set(gens[g].devices):
                del gens[g + 1:]
                return g
        if store.check(["job/end"]):
            return None
        time.sleep(0.05)
    raise RuntimeFailure(f"timed out after {timeout:.0f} s waiting for the job to use this host's devices")


def _reach(endpoint: str | None, store_url: str | None, secret: str, timeout: float) -> tuple[str, int, Any]:
    """(host, port, the job's store) for ``connect``: the first host's TCPStore at ``endpoint``, or the etcd
    cluster of ``store_url`` (host the URL, port 0) once the first host has published its heartbeat window there
    (it clears the job's keys when it starts: registering earlier would be lost)."""
    if store_url:
        host, port = store_url, 0
        store = connect(host, port, secret, timeout)
        wait_key(store, "hosts/heartbeat", timeout, f"the first host to start the job on {store_url}")
        if endpoint is None:
            check_gloo_interface(store.get("hosts/live_host").decode())
        return host, port, store
    host, port = parse_endpoint(endpoint)
    try:
        return host, port, connect(host, port, secret, timeout)
    except Exception as e:  # noqa: BLE001 - torch raises several kinds for an unreachable store
        raise RuntimeFailure(f"cannot reach the job's store at {host}:{port} ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:120]}); start `parashift run ... --live --endpoint "
                             f"{host}:{port}` on the first host first") from None


def run_agent(*, endpoint: str | None, nprocs: int, secret: str, timeout: float = 600.0, quiet: bool = False,
              notice_seconds: float | None = None, store_url: str | None = None) -> dict:
    """Join the job served at ``endpoint`` (or whose store is the etcd cluster of ``store_url``) with ``nprocs``
    local processes; returns what this host ran (``host``, ``devices``, per-device step counts).
    ``notice_seconds``: the platform kills this host that long after a SIGTERM (None: unbounded); the agent then
    SIGKILLs itself and its processes, as a reclaimed machine."""
    if endpoint is not None:
        check_gloo_interface(parse_endpoint(endpoint)[0])
    host, port, store = _reach(endpoint, store_url, secret, timeout)
    where = store_url or f"{host}:{port}"
    h = int(store.add("hosts/count", 1))
    end = int(store.add("hosts/devices", nprocs))
    devices = range(end - nprocs, end)
    store.set(f"hosts/devices_of/{h}", f"{devices.start}-{devices.stop - 1}")
    beat(host, port, secret, h, beat_every(heartbeat_window(store, timeout)))
    try:
        hold_liveness(store, None if store_url else host, secret, h)
    except OSError as e:
        say(False, f"host {h}: no liveness connection to the first host ({e}); a loss of this host is detected "
                    f"by its heartbeat alone (--heartbeat-timeout on the first host)")
    try:
        wait_key(store, "hosts/config", timeout, "the first host to publish the job")
        cfg: JobConfig = pickle.loads(store.get("hosts/config"))
        gens, first = list(cfg.gens), 0
        check_local_gpus(cfg.opts.device, nprocs)
        if devices.start < cfg.world < end:
            raise RuntimeFailure(f"this host's devices {devices.start}-{end - 1} straddle the job's first world of "
                                 f"{cfg.world} devices; make the hosts' --nprocs add up to the strategy's world, "
                                 f"then join more hosts")
        if end > cfg.world:
            if cfg.on_join != "grow":
                store.set(f"hosts/report/{h}", pickle.dumps({}))    # the job goes on without this host
                raise RuntimeFailure(f"the job runs {cfg.world} devices and already has them all, and its first host "
                                     f"ignores joins (--on-join ignore); start it with --on-join grow")
            say(quiet, f"host {h}: devices {devices.start}-{devices.stop - 1} announced; waiting for the job to "
                        f"switch to a strategy that uses them")
            first = _wait_generation(store, gens, devices, timeout)
            if first is None:
                say(quiet, f"host {h}: the job ended (or found no strategy for these devices) before using them")
                store.set(f"hosts/report/{h}", pickle.dumps({}))
                return {"host": h, "devices": list(devices), "steps": {}}
        say(quiet, f"host {h}: devices {devices.start}-{devices.stop - 1}, training {cfg.spec.name} under "
                    f"{gens[first].strategy}" + (f" from step {gens[first].step}" if first else ""))
        from ..switch.session import _live_worker
        job = JobStore(store, store, host, port, secret)
        left = _leave_on_sigterm(host, port, secret, h, devices, quiet, notice_seconds)
        members = [Member(d, first, first) for d in devices if d in gens[first].devices]
        if first:     # processes start when the switch that brings them in is announced (notice steps ahead)
            wait_key(store, f"sw{first}/notice", timeout, f"the notice of the switch at step {gens[first].step}",
                      lambda: None)
        reports = launch_elastic(_live_worker, members, args=(cfg.spec, gens, cfg.steps, cfg.opts),
                                 timeout=timeout, job=job, keep_sigterm=True)
        left.set()                 # its processes have exited: a notice's deadline is met
    except BaseException as e:
        if type(e).__name__.startswith("Dist") or store_gone(store):    # the store went away with the first host
            e = RuntimeFailure(f"lost the job's store at {where} ({str(e).splitlines()[0][:120]}); the "
                               f"first host has ended or failed: see its output")
        try:
            store.set(f"hosts/failed/{h}", f"{type(e).__name__}: {e}"[:500])
        except Exception:  # noqa: BLE001 - the store may be gone with the first host
            pass
        raise e from None
    store.set(f"hosts/report/{h}", pickle.dumps(reports))
    say(quiet, f"host {h}: done; report sent to {where}")
    return {"host": h, "devices": list(devices),
            "steps": {k: len(r["losses"]) for k, r in reports.items() if r}}
