"""Same-host switch transfers by local reads (parashift.exec.switch.local)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from parashift.errors import SwitchAborted
from parashift.exec.switch import local, run_live
from parashift.exec.switch.local import (LOCAL_READS_ENV, NODE_ENV, LocalPeers, negotiate, node_token, read_bytes,
                                         read_into)
from parashift.exec.switch.local import READ_BLOCK
from parashift.exec.switch.wire import CHUNK, checksum

from test_switch_live import GPT, check_switches


pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/ns/pid"), reason="local reads are Linux only")


class _Store:
    """A dict with a TCPStore's set/get (values as bytes)."""

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}

    def set(self, k: str, v) -> None:
        self.kv[k] = v.encode() if isinstance(v, str) else bytes(v)

    def get(self, k: str) -> bytes:
        return self.kv[k]


@pytest.mark.parametrize("n", [0, 7, 4096, READ_BLOCK + 13, 3 * READ_BLOCK])
def test_read_into_copies_and_sums_like_the_wire(n):
    src = torch.from_numpy(np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8))
    part = torch.zeros(n, dtype=torch.uint8)
    got = read_into(os.getpid(), src.data_ptr(), part, CHUNK)
    assert torch.equal(part, src)
    assert got == checksum(src)


def test_a_read_of_memory_that_is_not_there_is_a_switch_abort():
    part = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(SwitchAborted, match="no longer lends its memory"):
        read_bytes(os.getpid(), part.data_ptr(), 8, 64)     # address 8 is never mapped


def test_negotiate_pairs_processes_of_one_launch_only(monkeypatch):
    monkeypatch.setenv(NODE_ENV, "launch-a")
    store = _Store()
    me, peer, other = "0.0", "1.0", "2.0"
    mine = node_token()
    assert mine is not None
    # a peer of the same launch (this very process stands in for it) and one of another launch
    store.set(f"local/info/{peer}", json.dumps({"node": mine, "pid": os.getpid(), "addr": 0, "probe": [1]}))
    store.set(f"local/info/{other}", json.dumps({"node": "launch-b@" + mine.split("@")[1], "pid": os.getpid(),
                                                 "addr": 0, "probe": [1]}))
    store.set(f"local/can/{peer}/{me}", b"1")
    got = negotiate(store, me, {0: me, 1: peer, 2: other})
    # the peer's probe (address 0) cannot be read: this process does not read it; it reads this one
    assert got == LocalPeers({}, frozenset({1}))
    assert store.get(f"local/can/{me}/{peer}") == b"0"
    assert f"local/can/{me}/{other}" not in store.kv


def test_negotiate_reads_a_peer_whose_probe_matches(monkeypatch):
    monkeypatch.setenv(NODE_ENV, "launch-c")       # keys of its own: pairs are probed once per process
    store = _Store()
    probe = local._probe_buffer()
    store.set("local/info/6.0", json.dumps({"node": node_token(), "pid": os.getpid(), "addr": int(probe.ctypes.data),
                                           "probe": probe.tolist()}))
    store.set("local/can/6.0/5.0", b"0")
    got = negotiate(store, "5.0", {5: "5.0", 6: "6.0"})
    assert got.sources == {6: os.getpid()} and got.readers == frozenset()
    monkeypatch.setenv(LOCAL_READS_ENV, "0")
    assert node_token() is None
    assert negotiate(_Store(), "0.0", {0: "0.0", 1: "1.0"}) == LocalPeers()


def _local_bytes(res) -> tuple[int, int]:
    recs = [s for r in res.reports.values() if r for s in r.get("switches", [])]
    return sum(s["bytes_local"] for s in recs), sum(s["bytes_received"] for s in recs)


def test_one_host_switch_moves_by_local_reads_bit_exactly(monkeypatch):
    res = run_live(GPT, "dp=2,tp=2,zero=1", steps=3, switches=[(1, "tp=4", None)], export=True, timeout=180,
                   switch_timeout=30)
    assert [s.get("aborted") for s in res.switches] == [None]
    assert check_switches(GPT, res) == 1
    local, received = _local_bytes(res)
    assert 0 < local == received
    monkeypatch.setenv(LOCAL_READS_ENV, "0")          # the launcher's setting: every message through gloo
    off = run_live(GPT, "dp=2,tp=2,zero=1", steps=3, switches=[(1, "tp=4", None)], timeout=180, switch_timeout=30)
    assert _local_bytes(off) == (0, received)
    assert off.losses == res.losses


class _Done:
    def wait(self, timeout=None) -> bool:
        return True


class _Pair:
    """One end of a gloo pair whose receives are filled with ``replies`` in order."""

    def __init__(self, *replies: list[int]) -> None:
        self.replies, self.sent = list(replies), []

    def send(self, tensors, peer, tag):
        self.sent.append(tensors[0].clone())
        return _Done()

    def recv(self, tensors, peer, tag):
        tensors[0].copy_(torch.tensor(self.replies.pop(0), dtype=torch.int64))
        return _Done()


def test_a_lent_part_of_another_length_or_a_short_ack_is_refused():
    src = torch.arange(16, dtype=torch.uint8)
    part = torch.zeros(16, dtype=torch.uint8)
    ok = local.LocalRecv(_Pair([src.data_ptr(), 16]), 1, 7, part, os.getpid(), CHUNK)
    assert ok.wait(None) and torch.equal(part, src) and ok.sum == checksum(src)
    assert ok.world.sent[-1].tolist() == [16]                       # acknowledged with the length it read
    bad = local.LocalRecv(_Pair([src.data_ptr(), 8]), 1, 7, part, os.getpid(), CHUNK)
    with pytest.raises(SwitchAborted, match="Programs differ"):
        bad.wait(None)
    lent = local.LocalSend(_Pair([8]), 1, 7, src)
    assert lent.desc.tolist() == [src.data_ptr(), 16]
    with pytest.raises(SwitchAborted, match="acknowledged 8 bytes of a 16-byte part"):
        lent.wait(None)
    assert lent.sum == checksum(src)                                 # summed while the reader read it
