"""A small etcd v3 client over etcd's JSON gateway, and :class:`EtcdStore`, a ``torch.distributed.Store`` on it.

:class:`Etcd` speaks HTTP/JSON to etcd's gRPC gateway (``/v3/kv/*``, ``/v3/lease/*``, ``/v3/watch``;
keys and values base64, 64-bit numbers as strings) with the standard library only. It is given one or
more endpoints (``etcd://h1:p1,h2:p2``) and moves to the next one when an endpoint refuses the
connection, drops it, or answers "unavailable" (a member that is down or cut off from its quorum);
every failure ends as a :class:`~parashift.errors.StoreError` naming the endpoints, a wait that runs
out as a :class:`~parashift.errors.StoreTimeout`. Each thread has its own keep-alive connection.

:func:`store` returns an :class:`EtcdStore`: the ``torch.distributed.Store`` calls (set, get, add,
compare_set, wait, check, delete_key, num_keys) on the keys below a prefix, so gloo process groups
rendezvous over it and :func:`~parashift.exec.jobstore.sealed` seals it as it seals a TCPStore.
Counters are decimal text, as in a TCPStore; ``add`` is a compare-and-swap loop.
"""
from __future__ import annotations

import base64
import datetime
import functools
import http.client
import json
import secrets
import socket
import threading
import time
from typing import Any, Iterable

from ...errors import StoreError, StoreTimeout, StrategyError

__all__ = ["SCHEME", "parse_url", "Etcd", "store", "is_url"]

#: the URL scheme of a job's store on etcd: ``etcd://HOST:PORT[,HOST:PORT...][/PREFIX]``
SCHEME = "etcd://"

#: where ``add`` leaves its markers (outside every prefix a store uses: keys there never start with NUL)
_MARKS = b"\0parashift-add/"

#: gRPC status codes after which the next endpoint is tried (unavailable, deadline exceeded)
_RETRY_CODES = {14, 4}


def is_url(text: str | None) -> bool:
    return bool(text) and text.startswith(SCHEME)


def parse_url(text: str) -> tuple[list[tuple[str, int]], str]:
    """``etcd://h1:p1,h2:p2[/prefix]`` -> ([(h1, p1), (h2, p2)], prefix) (prefix ``""`` when absent)."""
    if not is_url(text):
        raise StrategyError(f"--store {text!r} is not an etcd URL; write etcd://HOST:PORT[,HOST:PORT...], "
                            f"e.g. etcd://10.0.0.5:2379,10.0.0.6:2379")
    rest = text[len(SCHEME):]
    hosts, _, prefix = rest.partition("/")
    out = []
    for part in hosts.split(","):
        host, sep, port = part.strip().rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise StrategyError(f"--store {text!r}: {part!r} is not HOST:PORT; write "
                                f"etcd://HOST:PORT[,HOST:PORT...], e.g. etcd://127.0.0.1:2379")
        out.append((host, int(port)))
    return out, prefix


def _b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else bytes(data)).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: bytes) -> bytes:
    """The smallest key after every key that starts with ``prefix`` (etcd's ``range_end`` of a prefix)."""
    p = bytearray(prefix)
    while p and p[-1] == 0xFF:
        p.pop()
    if not p:
        return b"\0"
    p[-1] += 1
    return bytes(p)


class _Retry(Exception):
    """An endpoint failed in a way the next endpoint may not (connection lost, member unavailable)."""


class Etcd:
    """A client of one etcd cluster through any of ``endpoints`` (``[(host, port)]`` or an ``etcd://`` URL);
    ``timeout``: seconds a single request may take before the next endpoint is tried."""

    def __init__(self, endpoints: Any, timeout: float = 5.0) -> None:
        self.endpoints = parse_url(endpoints)[0] if isinstance(endpoints, str) else [tuple(e) for e in endpoints]
        if not self.endpoints:
            raise StrategyError("an etcd client needs at least one HOST:PORT endpoint")
        self.timeout = timeout
        self._at = 0                          # the endpoint tried first (the last one that answered)
        self._local = threading.local()

    def url(self) -> str:
        return SCHEME + ",".join(f"{h}:{p}" for h, p in self.endpoints)

    # -- transport --------------------------------------------------------------------------
    def _conn(self, i: int, timeout: float) -> http.client.HTTPConnection:
        conns = self._local.__dict__.setdefault("conns", {})
        c = conns.get(i)
        if c is None:
            c = conns[i] = http.client.HTTPConnection(*self.endpoints[i], timeout=timeout)
        c.timeout = timeout
        if c.sock is not None:
            c.sock.settimeout(timeout)
        return c

    def _drop(self, i: int) -> None:
        c = self._local.__dict__.get("conns", {}).pop(i, None)
        if c is not None:
            c.close()

    def close(self) -> None:
        """Close this thread's connections."""
        for i in list(self._local.__dict__.get("conns", {})):
            self._drop(i)

    def _post(self, i: int, path: str, body: dict, timeout: float) -> dict:
        c = self._conn(i, timeout)
        try:
            c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            resp = c.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException) as e:
            self._drop(i)
            raise _Retry(f"{type(e).__name__}: {e}") from None
        try:
            out = json.loads(raw) if raw else {}
        except ValueError:
            self._drop(i)
            raise _Retry(f"HTTP {resp.status}: not JSON ({raw[:80]!r})") from None
        if resp.status != 200 or "error" in out and "header" not in out:
            code = out.get("code")
            msg = out.get("message") or out.get("error") or f"HTTP {resp.status}"
            if code in _RETRY_CODES or resp.status in (502, 503, 504):
                raise _Retry(msg)
            raise StoreError(f"etcd at {self.endpoints[i][0]}:{self.endpoints[i][1]} refused {path}: {msg}")
        return out

    def call(self, path: str, body: dict, timeout: float | None = None) -> dict:
        """POST ``body`` to ``path`` on the first endpoint that answers (the last one that did, first)."""
        timeout = self.timeout if timeout is None else timeout
        n, start, errors = len(self.endpoints), self._at, []
        for k in range(n):
            i = (start + k) % n
            try:
                out = self._post(i, path, body, timeout)
            except _Retry as e:
                errors.append(f"{self.endpoints[i][0]}:{self.endpoints[i][1]} ({e})")
                continue
            self._at = i
            return out
        raise StoreError(f"no etcd endpoint answers {path}: {'; '.join(errors)}; start the etcd members "
                         f"(or point --store at a running cluster) and check the addresses")

    # -- keys -------------------------------------------------------------------------------
    def revision(self) -> int:
        """The store's revision now (a watch from ``revision() + 1`` sees every later change)."""
        return int(self.call("/v3/kv/range", {"key": _b64(b"\0"), "count_only": True})["header"]["revision"])

    def put(self, key: bytes | str, value: bytes | str, lease: int = 0) -> int:
        """Set ``key``; returns the store's revision after the write."""
        body = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return int(self.call("/v3/kv/put", body)["header"]["revision"])

    def get_kv(self, key: bytes | str) -> dict | None:
        """``key``'s record (``value`` as bytes, ``mod_revision``, ``create_revision``, ``lease`` as ints), or None;
        ``revision``: the store's revision at the read."""
        out = self.call("/v3/kv/range", {"key": _b64(key)})
        kvs = out.get("kvs")
        return _kv(kvs[0], out) if kvs else None

    def get(self, key: bytes | str) -> bytes | None:
        kv = self.get_kv(key)
        return None if kv is None else kv["value"]

    def range(self, prefix: bytes | str, keys_only: bool = False) -> list[tuple[bytes, bytes]]:
        """Every (key, value) under ``prefix``, in key order."""
        p = prefix.encode() if isinstance(prefix, str) else prefix
        body = {"key": _b64(p), "range_end": _b64(prefix_end(p))}
        if keys_only:
            body["keys_only"] = True
        return [(_unb64(kv["key"]), _unb64(kv.get("value"))) for kv in self.call("/v3/kv/range", body).get("kvs", [])]

    def count(self, prefix: bytes | str) -> int:
        p = prefix.encode() if isinstance(prefix, str) else prefix
        return int(self.call("/v3/kv/range", {"key": _b64(p), "range_end": _b64(prefix_end(p)),
                                               "count_only": True}).get("count", 0))

    def delete(self, key: bytes | str, prefix: bool = False) -> int:
        """Delete ``key`` (every key under it with ``prefix``); returns how many were deleted."""
        body = {"key": _b64(key)}
        if prefix:
            body["range_end"] = _b64(prefix_end(key.encode() if isinstance(key, str) else key))
        return int(self.call("/v3/kv/deleterange", body).get("deleted", 0))

    def txn(self, compare: list[dict], success: list[dict], failure: list[dict] = ()) -> tuple[bool, list[dict]]:
        """An etcd transaction (request bodies in the gateway's JSON); returns (succeeded, responses)."""
        out = self.call("/v3/kv/txn", {"compare": compare, "success": list(success), "failure": list(failure)})
        return bool(out.get("succeeded")), out.get("responses", [])

    def create(self, key: bytes | str, value: bytes | str, lease: int = 0) -> tuple[bool, bytes | None]:
        """Set ``key`` if it does not exist; returns (created, the value it holds now)."""
        put = {"key": _b64(key), "value": _b64(value)}
        if lease:
            put["lease"] = str(lease)
        ok, resp = self.txn([{"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
                            [{"request_put": put}], [{"request_range": {"key": _b64(key)}}])
        if ok:
            return True, value.encode() if isinstance(value, str) else bytes(value)
        kvs = resp[0].get("response_range", {}).get("kvs") if resp else None
        return False, _unb64(kvs[0].get("value")) if kvs else None

    def replace(self, key: bytes | str, mod_revision: int, value: bytes | str) -> tuple[bool, dict | None]:
        """Set ``key`` if it was last written at ``mod_revision`` (0: if it does not exist); returns
        (done, the record it holds when not done)."""
        cmp = ({"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(mod_revision)}
               if mod_revision else
               {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"})
        ok, resp = self.txn([cmp], [{"request_put": {"key": _b64(key), "value": _b64(value)}}],
                            [{"request_range": {"key": _b64(key)}}])
        if ok:
            return True, None
        r = resp[0].get("response_range", {}) if resp else {}
        return False, _kv(r["kvs"][0], r) if r.get("kvs") else None

    def add(self, key: bytes | str, amount: int) -> int:
        """Add ``amount`` to the decimal counter at ``key`` (0 when absent), atomically and exactly once; returns
        the new value. Each compare-and-swap also writes a marker (under :data:`_MARKS`, on a 60 s lease) named
        by a token of this call, holding the value it wrote: when a reply is lost (a member died mid-request) and
        the request is retried, a failed swap finds the marker if an earlier try landed, and adds nothing more."""
        token = _MARKS + secrets.token_hex(12).encode()
        kv = self.get_kv(key)
        while True:
            try:
                now = int(kv["value"] or b"0") if kv else 0
            except ValueError:
                raise StoreError(f"etcd key {key!r} holds {kv['value'][:40]!r}, not a counter; it was set by "
                                 f"something else than add(): use another key for the counter") from None
            cmp = ({"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(kv["mod_revision"])}
                   if kv else {"key": _b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"})
            new = str(now + amount)
            try:
                ok, resp = self.txn([cmp], [{"request_put": {"key": _b64(key), "value": _b64(new)}},
                                            {"request_put": {"key": _b64(token), "value": _b64(new),
                                                             "lease": str(self._mark_lease())}}],
                                    [{"request_range": {"key": _b64(key)}}, {"request_range": {"key": _b64(token)}}])
            except StoreError as e:
                if "lease not found" not in str(e):
                    raise
                self._marks = (0, 0.0)                   # the markers' lease is gone (a restarted cluster)
                continue
            if ok:
                return now + amount
            here, mark = (r.get("response_range", {}) for r in resp)
            if mark.get("kvs"):                          # a try whose reply was lost has landed
                return int(_unb64(mark["kvs"][0].get("value")))
            kv = _kv(here["kvs"][0], here) if here.get("kvs") else None

    def _mark_lease(self) -> int:
        """The lease of this client's add markers (60 s; a new one every 30 s)."""
        lease, since = getattr(self, "_marks", (0, 0.0))
        if not lease or time.monotonic() - since > 30.0:
            self._marks = (self.grant(60), time.monotonic())
        return self._marks[0]

    # -- leases -----------------------------------------------------------------------------
    def grant(self, ttl: float) -> int:
        """A new lease of ``ttl`` seconds (rounded up to whole seconds, at least the cluster's minimum); its id."""
        out = self.call("/v3/lease/grant", {"TTL": str(max(1, int(-(-ttl // 1))))})
        return int(out["ID"])

    def keepalive(self, lease: int) -> int:
        """Renew ``lease``; returns its TTL in seconds, 0 when it has expired or was revoked."""
        out = self.call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(out.get("result", out).get("TTL", 0))

    def time_to_live(self, lease: int) -> int:
        """Seconds ``lease`` has left, -1 when it no longer exists."""
        return int(self.call("/v3/lease/timetolive", {"ID": str(lease)}).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        """End ``lease`` now: the keys attached to it are deleted (a lease that is gone already is fine)."""
        try:
            self.call("/v3/lease/revoke", {"ID": str(lease)})
        except StoreError as e:
            if "lease not found" not in str(e):
                raise

    # -- watch ------------------------------------------------------------------------------
    def watch(self, key: bytes | str, start_revision: int, timeout: float, prefix: bool = False) -> list[dict]:
        """Events on ``key`` (or under it, with ``prefix``) at ``start_revision`` or later; waits up to ``timeout``
        seconds for the first and returns [] when none came. Events: ``{"type": "PUT"|"DELETE", "key", "value",
        "mod_revision"}``."""
        req: dict = {"key": _b64(key), "start_revision": str(start_revision)}
        if prefix:
            req["range_end"] = _b64(prefix_end(key.encode() if isinstance(key, str) else key))
        end = time.monotonic() + timeout
        n, start, errors = len(self.endpoints), self._at, []
        for k in range(n):
            i = (start + k) % n
            try:
                return self._watch_on(i, req, end)
            except _Retry as e:
                errors.append(f"{self.endpoints[i][0]}:{self.endpoints[i][1]} ({e})")
        raise StoreError(f"no etcd endpoint answers a watch: {'; '.join(errors)}; start the etcd members "
                         f"(or point --store at a running cluster) and check the addresses")

    def _watch_on(self, i: int, req: dict, end: float) -> list[dict]:
        left = end - time.monotonic()
        if left <= 0:
            return []
        host, port = self.endpoints[i]
        try:        # a connection of its own: the stream stays open until it is closed here
            conn = http.client.HTTPConnection(host, port, timeout=min(left, self.timeout) + 0.05)
            conn.request("POST", "/v3/watch", json.dumps({"create_request": req}),
                         {"Content-Type": "application/json"})
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            raise _Retry(f"{type(e).__name__}: {e}") from None
        try:
            if resp.status != 200:
                raise _Retry(f"HTTP {resp.status}")
            while True:
                left = end - time.monotonic()
                if left <= 0:
                    return []
                conn.sock.settimeout(left)
                try:
                    line = resp.readline()
                except (socket.timeout, TimeoutError):
                    return []
                except (OSError, http.client.HTTPException) as e:
                    raise _Retry(f"{type(e).__name__}: {e}") from None
                if not line:
                    raise _Retry("the watch stream closed")
                msg = json.loads(line)
                if "error" in msg:
                    raise _Retry(msg["error"].get("message", "watch error"))
                result = msg.get("result", {})
                if result.get("canceled"):
                    raise StoreError(f"etcd cancelled a watch: {result.get('cancel_reason', 'compacted')}; "
                                     f"the revision it started from was compacted away, retry from now")
                events = result.get("events")
                if events:
                    return [{"type": e.get("type", "PUT"), "key": _unb64(e["kv"]["key"]),
                             "value": _unb64(e["kv"].get("value")), "mod_revision": int(e["kv"]["mod_revision"])}
                            for e in events]
        finally:
            conn.close()

    def wait(self, keys: Iterable[bytes | str], timeout: float) -> None:
        """Return when every key of ``keys`` exists; :class:`StoreTimeout` after ``timeout`` seconds."""
        keys = list(keys)
        end = time.monotonic() + timeout
        while True:
            out = self.call("/v3/kv/txn", {"compare": [], "success": [
                {"request_range": {"key": _b64(k), "count_only": True}} for k in keys]})
            missing = [k for k, r in zip(keys, out.get("responses", []))
                       if not int(r.get("response_range", {}).get("count", 0))]
            if not missing:
                return
            left = end - time.monotonic()
            if left <= 0:
                raise StoreTimeout(f"timed out after {timeout:.1f} s waiting for {len(missing)} key(s) of the "
                                   f"job's store (e.g. {missing[0]!r}); a peer did not write it: check that every "
                                   f"host runs against the same --store, or raise --timeout")
            self.watch(missing[0], int(out["header"]["revision"]) + 1, left)


def _kv(kv: dict, out: dict) -> dict:
    return {"value": _unb64(kv.get("value")), "mod_revision": int(kv.get("mod_revision", 0)),
            "create_revision": int(kv.get("create_revision", 0)), "lease": int(kv.get("lease", 0)),
            "revision": int(out.get("header", {}).get("revision", 0))}


def _as_bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _seconds(timeout: Any) -> float:
    return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)


@functools.lru_cache(maxsize=None)
def _store_class() -> type:
    import torch.distributed as dist

    class EtcdStore(dist.Store):
        """The keys below ``prefix`` of an etcd cluster, as a ``torch.distributed.Store``."""

        def __init__(self, client: Etcd, prefix: str, timeout: float):
            super().__init__()
            self.client = client
            self.prefix = prefix.rstrip("/") + "/"
            self._timeout = timeout

        def _k(self, key: str) -> bytes:
            return (self.prefix + key).encode()

        def set(self, key: str, value: Any) -> None:
            self.client.put(self._k(key), _as_bytes(value))

        def get(self, key: str) -> bytes:
            got = self.client.get(self._k(key))
            if got is None:
                self.client.wait([self._k(key)], self._timeout)
                got = self.client.get(self._k(key))
            if got is None:
                raise StoreTimeout(f"the job's store key {key!r} was deleted while it was read; retry")
            return got

        def add(self, key: str, amount: int) -> int:
            return self.client.add(self._k(key), int(amount))

        def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
            exp, new, k = _as_bytes(expected), _as_bytes(desired), self._k(key)
            kv = self.client.get_kv(k)
            while True:
                if kv is None and exp:
                    return exp                        # as TCPStore: a missing key with a non-empty expectation
                if kv is not None and kv["value"] != exp:
                    return kv["value"]
                ok, kv = self.client.replace(k, kv["mod_revision"] if kv else 0, new)
                if ok:
                    return new

        def wait(self, keys: list[str], timeout: Any = None) -> None:
            self.client.wait([self._k(k) for k in keys], self._timeout if timeout is None else _seconds(timeout))

        def check(self, keys: list[str]) -> bool:
            if len(keys) == 1:
                return self.client.get_kv(self._k(keys[0])) is not None
            _, resp = self.client.txn([], [{"request_range": {"key": _b64(self._k(k)), "count_only": True}}
                                           for k in keys])
            return all(int(r.get("response_range", {}).get("count", 0)) for r in resp)

        def delete_key(self, key: str) -> bool:
            return self.client.delete(self._k(key)) > 0

        def num_keys(self) -> int:
            return self.client.count(self.prefix)

        def set_timeout(self, timeout: Any) -> None:
            self._timeout = _seconds(timeout)

        @property
        def timeout(self) -> datetime.timedelta:
            return datetime.timedelta(seconds=self._timeout)

        def clone(self) -> "EtcdStore":
            """A second client of the same keys (its own connections, for a thread of its own)."""
            return EtcdStore(Etcd(self.client.endpoints, self.client.timeout), self.prefix, self._timeout)

    return EtcdStore


def store(url: str, timeout: float = 300.0, prefix: str | None = None, request_timeout: float = 5.0) -> Any:
    """An :class:`EtcdStore` on the cluster of ``url`` (``etcd://h1:p1,h2:p2[/prefix]``), keys under ``prefix``
    (default: the URL's, else ``parashift``); ``timeout``: seconds ``wait`` and a blocking ``get`` wait."""
    endpoints, url_prefix = parse_url(url)
    return _store_class()(Etcd(endpoints, request_timeout), prefix or url_prefix or "parashift", timeout)
