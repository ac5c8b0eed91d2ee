"""How the first host of a multi-host job finds a lost agent: its liveness connection closes, or its heartbeat stops."""
from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from parashift.exec.job import first_host, liveness
from parashift.exec.jobstore import serve
from parashift.exec.job.liveness import FAULT_KEY

SECRET = "liveness-test-secret-0123456789"


def _job(window: float):
    """A first host's store with the liveness listener, the heartbeat window ``window`` and agents 2 (devices 2-3)
    and 3 (devices 4-5) registered."""
    job = serve(60.0, "127.0.0.1", 0, SECRET)
    store = job.store
    liveness.serve_liveness(store, "127.0.0.1", SECRET)
    store.set("hosts/heartbeat", repr(window))
    store.add("hosts/count", 3)
    store.set("hosts/devices_of/2", "2-3")
    store.set("hosts/devices_of/3", "4-5")
    return job, store


def _until(store, key: str, within: float = 20.0) -> float:
    t0 = time.monotonic()
    while not store.check([key]):
        assert time.monotonic() - t0 < within, f"{key} never came"
        time.sleep(0.005)
    return time.monotonic() - t0


def test_an_agent_whose_process_dies_is_declared_lost_at_once():
    """The kernel closes a dead agent's liveness connection: the host is declared lost (its devices dead, the
    fault counter bumped) at once, although its heartbeat window is 10 minutes; device 0's check after a
    failed step then names it without waiting for the window."""
    job, store = _job(600.0)
    liveness.hold_liveness(store, "127.0.0.1", SECRET, 2)
    conn = liveness._LIVE.pop()
    fault = int(store.add(FAULT_KEY, 0))
    conn.close()                              # what the kernel does when the agent's process is SIGKILLed
    assert _until(store, "hosts/dead/2") < 20.0
    assert store.check(["dead/2", "dead/3"]) and not store.check(["dead/4"])
    assert int(store.add(FAULT_KEY, 0)) == fault + 1
    t0 = time.monotonic()
    assert liveness.silent_hosts(store) == [(2, "2-3")]
    assert time.monotonic() - t0 < 30.0       # not the 300 s half-window
    liveness.hold_liveness(store, "127.0.0.1", SECRET, 3)
    conn = liveness._LIVE.pop()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()                              # a reset instead of an orderly close
    _until(store, "hosts/dead/3")
    assert store.check(["dead/4", "dead/5"]) and int(store.add(FAULT_KEY, 0)) == fault + 2


def test_a_finished_agent_and_a_stranger_are_not_declared_lost():
    """An agent that reported before exiting, and a connection that cannot prove the job's secret, close without
    anything being declared; an agent killed after them is (the positive control)."""
    job, store = _job(600.0)
    liveness.hold_liveness(store, "127.0.0.1", SECRET, 3)
    done = liveness._LIVE.pop()
    store.set("hosts/report/3", b"{}")
    done.close()
    port = int(store.get("hosts/live_port"))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:       # claims host 2, wrong secret
        s.recv(16)
        s.sendall(liveness._proof("another-secret-0123456789", b"x" * 16, 2))
    liveness.hold_liveness(store, "127.0.0.1", SECRET, 2)
    killed = liveness._LIVE.pop()
    time.sleep(0.2)
    assert not store.check(["hosts/dead/2"]) and not store.check(["hosts/dead/3"])
    killed.close()
    _until(store, "hosts/dead/2")
    assert not store.check(["hosts/dead/3"]) and not store.check(["dead/4"])


def test_the_heartbeat_window_catches_a_host_cut_off_without_a_reset():
    """No liveness connection (or one that never closes): the monitor declares an agent whose heartbeat stood
    still for the window, and never one that keeps beating, with training-like load on this process."""
    window = 0.6
    job, store = _job(window)
    liveness.beat("127.0.0.1", job.port, SECRET, 3, liveness.beat_every(window))   # host 3 beats, host 2 is silent
    stop = threading.Event()

    def load() -> None:                       # a busy Python thread competing for the GIL
        x = 0
        while not stop.is_set():
            x += sum(range(1000))
    threading.Thread(target=load, daemon=True).start()
    try:
        t0 = time.monotonic()
        liveness.monitor(store, window)
        took = _until(store, "hosts/dead/2")
        assert took >= window
        time.sleep(3 * window)
        assert not store.check(["hosts/dead/3"])
    finally:
        stop.set()
        store.set("hosts/done", "1")
    assert time.monotonic() - t0 < 30.0


def test_heartbeat_timeout_is_checked():
    from parashift.errors import StrategyError
    with pytest.raises(StrategyError, match="--heartbeat-timeout"):
        first_host.run_first_host("tiny-gpt", __import__("parashift").strategy.Strategy.parse("dp=2"), steps=2,
                             endpoint="127.0.0.1:1", nprocs=1, secret=SECRET, timeout=10.0, heartbeat_timeout=20.0)
    assert liveness.beat_every(4.0) == 0.5 and liveness.beat_every(0.8) == pytest.approx(0.1)
