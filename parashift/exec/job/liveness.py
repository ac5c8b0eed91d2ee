"""Whether each agent is alive: heartbeats, the liveness connection, and declaring a host lost.

An agent bumps ``hosts/beat/<h>`` (:func:`beat`) and holds one authenticated connection to the first
host (:func:`hold_liveness`). The first host declares an agent lost as soon as that connection closes
(:func:`serve_liveness`: the kernel closes it when the agent's process dies) or when its heartbeat
stood still for the job's heartbeat window (:func:`monitor`, ``--heartbeat-timeout``); a declaration
bumps :data:`FAULT_KEY`, which makes every training step stop waiting and recover (:mod:`.recover`).
"""
from __future__ import annotations

import contextlib
import os
import socket
import time
from typing import Any

from ..jobstore import connect
from .keys import wait_key

__all__ = ["FAULT_KEY", "HEARTBEAT_TIMEOUT", "beat_every", "heartbeat_window", "beat", "hold_liveness",
           "serve_liveness", "silent_hosts", "monitor"]

#: store counter bumped by every process whose step failed, and once for each host declared lost
FAULT_KEY = "hosts/fault"

#: default seconds of heartbeat silence after which the first host declares an agent lost (``--heartbeat-timeout``)
HEARTBEAT_TIMEOUT = 4.0


def beat_every(timeout: float) -> float:
    """Seconds between an agent's heartbeats under a detection window of ``timeout`` seconds (8 beats a window,
    at most 0.5 s apart)."""
    return min(0.5, timeout / 8)


def heartbeat_window(store: Any, wait: float = 30.0) -> float:
    """The job's heartbeat window, as the first host published it (``hosts/heartbeat``)."""
    wait_key(store, "hosts/heartbeat", wait, "the first host to publish its heartbeat window")
    return float(store.get("hosts/heartbeat"))


def beat(host: str, port: int, secret: str, h: int, every: float) -> None:
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


def hold_liveness(store: Any, host: str | None, secret: str, h: int) -> None:
    """Open this agent's liveness connection to the first host (``hosts/live_host``, else ``host``, and
    ``hosts/live_port``) and prove the job's secret; the kernel closes it when this process dies, however it
    dies, which the first host sees at once."""
    if store.check(["hosts/live_host"]):
        host = store.get("hosts/live_host").decode()
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
    ``hosts/dead/<h>``, and a bump of :data:`FAULT_KEY` (training steps stop waiting and recover)
    unless every one of its devices left the job through a verified switch (``left/<device>``)."""
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


def serve_liveness(store: Any, host: str, secret: str, port: int = 0) -> None:
    """The first host's liveness listener on ``host`` and ``port`` (0: a free one), published as
    ``hosts/live_host`` and ``hosts/live_port``: each agent holds one
    connection, authenticated by the job's secret; when it closes (the agent's process died: SIGKILL, a
    crash, the machine went down with a reset) before the agent reported or failed, the agent is declared
    lost at once (:func:`_declare_lost`). A host cut off without a reset is caught by the heartbeat window."""
    import hmac
    import threading
    info = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    srv = socket.socket(info[0], socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((info[4][0], port))
    srv.listen(64)
    store.set("hosts/live_host", host)
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


def silent_hosts(store: Any, wait: float | None = None) -> list[tuple[int, str]]:
    """Agents declared lost (by the monitor or the liveness listener), else, after ``wait`` seconds (default: half
    the job's heartbeat window) of looking, those whose heartbeat did not move meanwhile, with their devices (a
    recovery's lost hosts aside; device 0's check after a failed step: tells a dead host from a failing process).
    Returns as soon as one is declared lost (then every host declared within a further 50 ms)."""
    hosts = [h for h in range(2, int(store.add("hosts/count", 0)) + 1)
             if not store.check([f"hosts/handled/{h}"])]            # lost hosts a recovery already took out
    wait = heartbeat_window(store) / 2 if wait is None else wait
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


def monitor(store: Any, timeout: float) -> None:
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
