"""The job's store on etcd: the client's operations, EtcdStore against TCPStore's semantics, gloo rendezvous
over it, the job's seal on top, a wait that times out, and a 3-member cluster that loses a member."""
from __future__ import annotations

import datetime
import multiprocessing as mp
import threading
import time

import pytest

from parashift.errors import RuntimeFailure, StoreError, StoreTimeout, StrategyError
from parashift.exec.job import etcd
from parashift.exec.job.etcd_members import ETCD_PACKAGE, Members, etcd_binary
from parashift.exec.jobstore import sealed

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason=f"etcd is not installed (Debian package "
                                f"{ETCD_PACKAGE!r}: apt-get install {ETCD_PACKAGE}, or `make install` as root)")


@pytest.fixture(scope="module")
def one():
    with Members(1) as m:
        yield m


def test_urls_parse_and_bad_ones_say_the_form():
    assert etcd.parse_url("etcd://10.0.0.5:2379,[::1]:2380/job7") == ([("10.0.0.5", 2379), ("::1", 2380)], "job7")
    for bad in ("tcp://h:1", "etcd://h", "etcd://h:0", "etcd://:5"):
        with pytest.raises(StrategyError, match="HOST:PORT"):
            etcd.parse_url(bad)
    assert etcd.prefix_end(b"a/") == b"a0" and etcd.prefix_end(b"a\xff") == b"b"


def test_client_operations(one):
    c = etcd.Etcd(one.url())
    rev = c.put("ops/a", b"1")
    assert c.get("ops/a") == b"1" and c.get("ops/none") is None and c.get_kv("ops/a")["mod_revision"] == rev
    c.put("ops/b", "2")
    assert c.range("ops/") == [(b"ops/a", b"1"), (b"ops/b", b"2")] and c.count("ops/") == 2
    assert c.create("ops/c", "x") == (True, b"x") and c.create("ops/c", "y") == (False, b"x")
    assert c.replace("ops/c", rev, "z")[0] is False                     # not written at that revision
    assert c.replace("ops/c", c.get_kv("ops/c")["mod_revision"], "z")[0] and c.get("ops/c") == b"z"
    assert c.delete("ops/a") == 1 and c.delete("ops/a") == 0
    assert c.delete("ops/", prefix=True) == 2 and c.count("ops/") == 0
    with pytest.raises(StoreError, match="not a counter"):
        c.put("ops/text", "abc")
        c.add("ops/text", 1)

    def bump() -> None:                    # each thread its own connection; every add lands exactly once
        for _ in range(25):
            c.add("ops/n", 1)
    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert c.get("ops/n") == b"100"

    lease = c.grant(1)
    c.put("ops/leased", "v", lease=lease)
    assert c.keepalive(lease) == 1 and c.get_kv("ops/leased")["lease"] == lease
    c.revoke(lease)
    assert c.get("ops/leased") is None and c.keepalive(lease) == 0 and c.time_to_live(lease) == -1
    c.revoke(lease)                          # gone already: fine

    rev = c.put("ops/w", "0")
    threading.Timer(0.2, lambda: etcd.Etcd(one.url()).put("ops/w", "1")).start()
    t0 = time.monotonic()
    events = c.watch("ops/w", rev + 1, 5.0)
    assert [(e["type"], e["value"]) for e in events] == [("PUT", b"1")] and time.monotonic() - t0 < 3.0
    assert c.watch("ops/w", c.get_kv("ops/w")["revision"] + 1, 0.2) == []


def _reply_dropping_proxy(port: int, path: str) -> int:
    """A loopback HTTP proxy to etcd at ``port`` that forwards every request and returns every reply, except the
    first reply to ``path``: that request reaches etcd, then the connection is closed (a member that died after
    applying a request, before answering it). Returns the proxy's port."""
    import http.client
    import socket
    srv = socket.create_server(("127.0.0.1", 0))
    dropped = []

    def serve(conn: socket.socket) -> None:
        f = conn.makefile("rb")
        with conn:
            while True:
                line = f.readline()
                if not line:
                    return
                method, target, _ = line.decode().split(" ", 2)
                headers = {}
                while (h := f.readline().decode().strip()):
                    k, _, v = h.partition(":")
                    headers[k.strip().lower()] = v.strip()
                body = f.read(int(headers.get("content-length", 0)))
                up = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                up.request(method, target, body, {"Content-Type": "application/json"})
                r = up.getresponse()
                data = r.read()
                up.close()
                if target == path and not dropped:
                    dropped.append(target)
                    return
                conn.sendall(b"HTTP/1.1 %d OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                             % (r.status, len(data)) + data)

    def accept() -> None:
        while True:
            c, _ = srv.accept()
            threading.Thread(target=serve, args=(c,), daemon=True).start()
    threading.Thread(target=accept, daemon=True).start()
    return srv.getsockname()[1]


def test_add_counts_once_when_a_reply_is_lost(one):
    """The first endpoint applies add's swap and loses the reply; the retry on the next endpoint finds the try's
    marker and adds nothing more (without it the counter would read 2)."""
    direct = one.client_ports[0]
    c = etcd.Etcd([("127.0.0.1", _reply_dropping_proxy(direct, "/v3/kv/txn")), ("127.0.0.1", direct)])
    assert c.add("once/n", 1) == 1
    assert etcd.Etcd(one.url()).get("once/n") == b"1"
    assert c.add("once/n", 1) == 2 and c.count("once/") == 1          # markers lie outside every prefix


def test_wait_times_out_cleanly_and_wakes_on_the_key(one):
    s = etcd.store(one.url(), timeout=0.5, prefix="waits")
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout, match="timed out after 0.5 s"):
        s.wait(["never"])
    assert 0.45 < time.monotonic() - t0 < 2.0
    with pytest.raises(StoreTimeout):
        s.get("never")                                       # a blocking get times out alike
    t0 = time.monotonic()
    with pytest.raises(StoreTimeout, match="0.3 s"):
        s.wait(["never"], datetime.timedelta(seconds=0.3))
    assert time.monotonic() - t0 < 1.5
    threading.Timer(0.2, lambda: s.clone().set("later", "1")).start()
    t0 = time.monotonic()
    s.wait(["later"], datetime.timedelta(seconds=10))
    assert time.monotonic() - t0 < 2.0 and s.get("later") == b"1"


def test_etcd_store_answers_as_tcpstore_does(one):
    """The same calls on a TCPStore and on an EtcdStore give the same answers (compare_set's corner cases too)."""
    import torch.distributed as dist
    tcp = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=5), wait_for_workers=False)
    ours = etcd.store(one.url(), timeout=5, prefix="same")

    def script(s) -> list:
        out = [s.set("a", "x"), s.get("a"), s.check(["a"]), s.check(["a", "b"]), s.add("n", 3), s.add("n", -1),
               s.get("n"), s.compare_set("a", "x", "y"), s.compare_set("a", "x", "z"), s.get("a"),
               s.compare_set("new", "", "v"), s.compare_set("gone", "e", "v"), s.check(["gone"]),
               s.num_keys(), s.delete_key("a"), s.delete_key("a"), s.check(["a"])]
        s.set("b", b"\x00\xffbytes")
        return out + [s.get("b")]
    assert script(ours) == script(tcp)


def test_the_jobs_seal_holds_on_etcd(one):
    """sealed() over an EtcdStore: values are unreadable without the secret, forged ones are refused."""
    raw = etcd.store(one.url(), timeout=2, prefix="sealed")
    job = sealed(raw, "etcd-test-secret-0123456789")
    job.set("hosts/config", b"settings")
    assert job.get("hosts/config") == b"settings" and job.add("hosts/count", 2) == 2
    assert job.compare_set("hosts/recovery", "", "1") == b"1" and job.compare_set("hosts/recovery", "0", "2") == b"1"
    keys = [k.decode() for k, _ in raw.client.range("sealed/")]
    assert keys and not any("hosts" in k for k in keys)                  # names are HMACs
    assert all(b"settings" not in v for _, v in raw.client.range("sealed/"))
    raw.set(job.name("hosts/config"), b"forged")
    with pytest.raises(RuntimeFailure, match="fails the job's seal"):
        job.get("hosts/config")


def _gloo_rank(url: str, rank: int, world: int, out) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    store = etcd.store(url, timeout=30, prefix="gloo")
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    dist.barrier()
    out.put((rank, t.tolist()))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_rendezvous_and_all_reduce_over_etcd(one, world):
    etcd.Etcd(one.url()).delete("gloo/", prefix=True)
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(one.url(), r, world, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=60) for _ in range(world))
    finally:
        for p in procs:
            p.join(20)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0] * world
    total = float(world * (world + 1) // 2)
    assert got == {r: [total] * 4 for r in range(world)}


def _leader_index(m: Members) -> int:
    c = etcd.Etcd(m.url())
    for i in range(m.n):
        st = etcd.Etcd(m.url([i])).call("/v3/maintenance/status", {})
        if st.get("leader") == st["header"]["member_id"]:
            return i
    raise AssertionError(f"no leader among {c.url()}")


def test_a_three_member_cluster_loses_its_leader_and_the_store_goes_on():
    """SIGKILL the raft leader (also the endpoint the client uses first): the store keeps answering through the
    other members, its keys intact, a wait in flight completes."""
    with Members(3) as m:
        lead = _leader_index(m)
        order = [lead] + [i for i in range(3) if i != lead]
        s = etcd.store(m.url(order), timeout=10, prefix="ha")
        s.set("before", "1")
        assert s.add("n", 1) == 1
        woke = threading.Event()
        w = s.clone()
        threading.Thread(target=lambda: (w.wait(["after"]), woke.set()), daemon=True).start()
        m.kill(lead)
        t0 = time.monotonic()
        assert s.get("before") == b"1" and s.add("n", 1) == 2
        s.set("after", "1")
        took = time.monotonic() - t0
        assert woke.wait(10.0)
        assert s.num_keys() == 3 and took < 8.0
        with pytest.raises(StoreError, match="no etcd endpoint answers"):
            etcd.Etcd(m.url([lead]), timeout=0.5).get("before")
