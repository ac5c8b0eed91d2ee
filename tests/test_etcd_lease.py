"""Leases on etcd: a SIGKILLed process is seen gone within about its TTL, a SIGSTOPped one not before it, and a
leader that dies or stalls is replaced by another candidate."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest

from parashift.exec.job import etcd, lease
from parashift.exec.job.etcd_members import ETCD_PACKAGE, Members, etcd_binary

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason=f"etcd is not installed (Debian package "
                                f"{ETCD_PACKAGE!r}: apt-get install {ETCD_PACKAGE}, or `make install` as root)")
TTL = 1.0


@pytest.fixture(scope="module")
def one():
    with Members(1) as m:
        yield m


def _present(url: str, key: str, ready) -> None:
    """A child: hold ``key`` under a lease of TTL seconds, say so, then idle (until killed)."""
    lease.announce(etcd.Etcd(url), key, str(os.getpid()), TTL)
    ready.send(True)
    while True:
        time.sleep(1)


def _candidate(url: str, ready) -> None:
    """A child: campaign for ``lead``, say so once leading, then idle (until killed or stopped)."""
    e = lease.Election(etcd.Etcd(url), "lead", f"child-{os.getpid()}", TTL)
    ready.send(e.campaign(timeout=20))
    while True:
        time.sleep(1)


def _child(target, *args):
    ctx = mp.get_context("fork")
    rx, tx = ctx.Pipe(duplex=False)
    p = ctx.Process(target=target, args=(*args, tx), daemon=True)
    p.start()
    assert rx.poll(20) and rx.recv() is True
    return p


def _end(p) -> None:
    if p.is_alive():
        os.kill(p.pid, signal.SIGCONT)
        p.kill()
    p.join(5)


class _Gone:
    """The times at which presence keys under a prefix disappear."""

    def __init__(self, client: etcd.Etcd, prefix: str) -> None:
        self.seen: dict[str, float] = {}
        self.stop = threading.Event()
        lease.watch_gone(client, prefix, lambda k, t: self.seen.setdefault(k, t), self.stop)

    def wait(self, key: str, within: float) -> float | None:
        end = time.monotonic() + within
        while key not in self.seen and time.monotonic() < end:
            time.sleep(0.01)
        return self.seen.get(key)


def test_a_killed_process_is_seen_gone_within_its_ttl_and_a_stalled_one_not_before(one):
    """TTL 1 s, renewed every 0.25 s. SIGKILL: the key goes between 0.75 and 1.5 s later (etcd's leader checks
    for expired leases every 0.5 s). SIGSTOP for 0.4 s: never declared. SIGSTOP for good: not before 0.7 s."""
    c = etcd.Etcd(one.url())
    gone = _Gone(c, "alive/")
    killed = []
    for i in range(3):
        p = _child(_present, one.url(), f"alive/k{i}")
        t0 = time.monotonic()
        os.kill(p.pid, signal.SIGKILL)
        seen = gone.wait(f"alive/k{i}", 5.0)
        _end(p)
        assert seen is not None, "a SIGKILLed holder's key never went"
        killed.append(seen - t0)
    p = _child(_present, one.url(), "alive/s")
    try:
        os.kill(p.pid, signal.SIGSTOP)
        time.sleep(0.4)
        os.kill(p.pid, signal.SIGCONT)
        assert gone.wait("alive/s", 1.5) is None, "a 0.4 s stall was declared dead under a 1 s TTL"
        t0 = time.monotonic()
        os.kill(p.pid, signal.SIGSTOP)
        seen = gone.wait("alive/s", 5.0)
        assert seen is not None
        stalled = seen - t0
    finally:
        _end(p)
    gone.stop.set()
    print(f"\nTTL {TTL:.0f} s: SIGKILL seen gone after {', '.join(f'{t:.2f}' for t in killed)} s; "
          f"a 0.4 s SIGSTOP not declared; a lasting SIGSTOP declared after {stalled:.2f} s")
    assert all(0.5 < t < TTL + 1.0 for t in killed), killed
    assert 0.7 <= stalled < TTL + 1.0, stalled


def test_election_one_leader_then_another_when_it_dies_or_stalls(one):
    c = etcd.Etcd(one.url())
    c.delete("lead")
    p = _child(_candidate, one.url())
    try:
        assert c.get("lead") == f"child-{p.pid}".encode()
        mine, who = lease.elect(c, "lead", "parent", TTL)
        assert who == f"child-{p.pid}" and not mine.is_leader
        t0 = time.monotonic()
        os.kill(p.pid, signal.SIGKILL)
        assert mine.campaign(timeout=5.0) and mine.is_leader
        took = time.monotonic() - t0
        assert mine.leader() == "parent" and lease.elect(c, "lead", "other", TTL)[1] == "parent"
    finally:
        _end(p)
    mine.resign()
    assert c.get("lead") is None
    q = _child(_candidate, one.url())                 # the parent resigned: a new candidate wins at once
    try:
        again = lease.Election(c, "lead", "parent", TTL)
        assert not again.campaign(timeout=0.3)
        t0 = time.monotonic()
        os.kill(q.pid, signal.SIGSTOP)                # a stalled leader loses its lease, not at once
        assert again.campaign(timeout=5.0)
        stalled = time.monotonic() - t0
    finally:
        _end(q)
    again.resign()
    print(f"\nTTL {TTL:.0f} s: leader SIGKILLed, another leads after {took:.2f} s; "
          f"leader SIGSTOPped, another leads after {stalled:.2f} s")
    assert took < TTL + 1.5 and 0.7 <= stalled < TTL + 1.5


def test_a_lease_that_expires_tells_its_holder(one):
    """A holder whose lease ran out (here: revoked behind its back) learns it on its next renewal."""
    c = etcd.Etcd(one.url())
    told = threading.Event()
    held = lease.Lease(c, TTL, on_lost=told.set)
    c.revoke(held.id)
    assert told.wait(2.0) and held.lost.is_set()
