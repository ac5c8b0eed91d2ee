"""The job's TCPStore, bound to loopback and sealed by a per-job secret; workers that die with their launcher.

:func:`serve` binds a listening socket to ``127.0.0.1`` (or to the address the user asks for with
``PARASHIFT_STORE_HOST``) and hands it to ``TCPStore(master_listen_fd=...)``, so the store never
listens on other interfaces. The job talks to it only through :func:`sealed`, a view keyed by 16
random bytes made for the job (the secret reaches the workers through the process-start pipe or a
0600 file, never argv, never logged): key names are stored as HMAC-SHA256(secret, name), values
are encrypted (a BLAKE2b keystream) and authenticated (HMAC-SHA256). A client without the secret
sees only opaque names (``list_keys``) and ciphertext; a value it writes or alters is detected when
a member reads it (:class:`~parashift.errors.RuntimeFailure` naming the key), never trusted.
Counters (``add``) are plain integers by the store's nature: their names are sealed, their values
are not. :func:`die_with_parent` makes a process receive SIGKILL when its parent dies (Linux
``PR_SET_PDEATHSIG``), the first link of the chain launcher -> forkserver -> worker that leaves no
orphan when the launcher is killed. :func:`attach` puts the job's store on an etcd cluster instead
(:mod:`.job.etcd`), sealed alike; :func:`connect` reaches either.
"""
from __future__ import annotations

import ctypes
import datetime
import functools
import hashlib
import hmac
import os
import secrets
import signal
import socket
import sys
from dataclasses import dataclass
from typing import Any

from ..errors import RuntimeFailure

__all__ = ["JobStore", "serve", "attach", "connect", "sealed", "namespace", "die_with_parent", "HOST_ENV"]

#: environment variable naming the address the store listens on (default loopback)
HOST_ENV = "PARASHIFT_STORE_HOST"
_PR_SET_PDEATHSIG = 1


def namespace(secret: str) -> str:
    """The public key prefix of the job holding ``secret`` (names below it are sealed)."""
    return "parashift/" + hashlib.sha256(b"parashift-job:" + secret.encode()).hexdigest()[:16]


_NONCE, _MAC = 16, 32


def _as_bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


@functools.lru_cache(maxsize=None)
def _sealed_class() -> type:
    import torch.distributed as dist

    class SealedStore(dist.Store):
        """A view of ``inner`` whose key names and values only holders of ``secret`` can read or forge."""

        def __init__(self, inner: Any, secret: str):
            super().__init__()
            self.inner = inner
            self._secret = secret
            self._key = hashlib.sha256(b"parashift-seal:" + secret.encode()).digest()
            self._prefix = namespace(secret) + "/"

        def name(self, key: str) -> str:
            return self._prefix + hmac.new(self._key, key.encode(), "sha256").hexdigest()

        def _stream(self, nonce: bytes, n: int) -> int:
            blocks = (n + 63) // 64
            ks = b"".join(hashlib.blake2b(nonce + i.to_bytes(8, "little"), key=self._key).digest()
                          for i in range(blocks))
            return int.from_bytes(ks[:n], "little")

        def seal(self, key: str, value: bytes) -> bytes:
            nonce = os.urandom(_NONCE)
            ct = (int.from_bytes(value, "little") ^ self._stream(nonce, len(value))).to_bytes(len(value), "little")
            return nonce + hmac.new(self._key, key.encode() + nonce + ct, "sha256").digest() + ct

        def open(self, key: str, blob: bytes) -> bytes:
            nonce, mac, ct = blob[:_NONCE], blob[_NONCE:_NONCE + _MAC], blob[_NONCE + _MAC:]
            want = hmac.new(self._key, key.encode() + nonce + ct, "sha256").digest()
            if len(blob) < _NONCE + _MAC or not hmac.compare_digest(mac, want):
                raise RuntimeFailure(f"the job's store holds a value for {key!r} that no member of the job "
                                     f"wrote (it fails the job's seal): another process on this machine wrote "
                                     f"to the job's store; stop it and restart the job")
            return (int.from_bytes(ct, "little") ^ self._stream(nonce, len(ct))).to_bytes(len(ct), "little")

        def set(self, key: str, value: Any) -> None:
            self.inner.set(self.name(key), self.seal(key, _as_bytes(value)))

        def get(self, key: str) -> bytes:
            return self.open(key, bytes(self.inner.get(self.name(key))))

        def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
            exp, k = _as_bytes(expected), self.name(key)
            old = bytes(self.inner.get(k)) if self.inner.check([k]) else b""
            if old:
                now = self.open(key, old)
                if now != exp:
                    return now
            elif exp:
                return exp              # as TCPStore: a missing key with a non-empty expectation
            new = self.seal(key, _as_bytes(desired))
            got = bytes(self.inner.compare_set(k, old, new))
            return _as_bytes(desired) if got == new else self.open(key, got)

        def add(self, key: str, amount: int) -> int:
            return self.inner.add(self.name(key), amount)

        def check(self, keys: list[str]) -> bool:
            return self.inner.check([self.name(k) for k in keys])

        def wait(self, keys: list[str], timeout: Any = None) -> None:
            names = [self.name(k) for k in keys]
            return self.inner.wait(names) if timeout is None else self.inner.wait(names, timeout)

        def delete_key(self, key: str) -> bool:
            return self.inner.delete_key(self.name(key))

        def num_keys(self) -> int:
            return self.inner.num_keys()

        def set_timeout(self, timeout: Any) -> None:
            self.inner.set_timeout(timeout)

        def clone(self) -> "SealedStore":
            """A second connection to the same store, sealed alike (for a thread of its own)."""
            return SealedStore(self.inner.clone(), self._secret)

    return SealedStore


def sealed(inner: Any, secret: str) -> Any:
    """``inner`` seen through the job's seal (see the module docstring); a ``torch.distributed.Store``."""
    return _sealed_class()(inner, secret)


@dataclass
class JobStore:
    """The launcher's side: the raw server store, the job's namespaced view, where to reach it."""

    server: Any
    store: Any        # sealed(server, secret): use this one
    host: str
    port: int
    secret: str

    def client_args(self) -> tuple[str, int, str]:
        """What a worker needs to :func:`connect` (pass it through the process-start pipe)."""
        return self.host, self.port, self.secret


def serve(timeout: float, host: str | None = None, port: int = 0, secret: str | None = None) -> JobStore:
    """A TCPStore server on ``host`` (default ``$PARASHIFT_STORE_HOST`` or 127.0.0.1) and ``port`` (0: chosen
    by the OS), keys under ``secret`` (default: a new one)."""
    import torch.distributed as dist
    host = host or os.environ.get(HOST_ENV) or "127.0.0.1"
    try:
        info = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise RuntimeFailure(f"cannot bind the job's store to {host!r} ({e.strerror}); set {HOST_ENV} to an "
                             f"address of this machine or unset it for loopback") from None
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((info[4][0], port))
        sock.listen(1024)
    except OSError as e:
        sock.close()
        raise RuntimeFailure(f"cannot bind the job's store to {host!r} port {port} ({e.strerror}); use an "
                             f"address of this machine and a free port (or unset {HOST_ENV} for loopback)") from None
    port = sock.getsockname()[1]
    server = dist.TCPStore(host, port, None, True, timeout=datetime.timedelta(seconds=timeout),
                           wait_for_workers=False, master_listen_fd=sock.fileno())
    sock.detach()   # the store owns the listening socket now (it closes it when it goes)
    secret = secret or secrets.token_hex(16)
    return JobStore(server, sealed(server, secret), host, port, secret)


def attach(url: str, timeout: float, secret: str) -> JobStore:
    """The job's store on the etcd cluster of ``url`` (``etcd://HOST:PORT[,HOST:PORT...][/PREFIX]``) instead of a
    TCPStore served here; what an earlier job with the same secret left under the job's namespace is deleted."""
    from .job.etcd import store as etcd_store
    raw = etcd_store(url, timeout)
    raw.client.delete(raw.prefix + namespace(secret) + "/", prefix=True)
    return JobStore(raw, sealed(raw, secret), url, 0, secret)


def connect(host: str, port: int, secret: str, timeout: float) -> Any:
    """A worker's view of the job's store: a client, sealed by the job's secret (``host`` an ``etcd://`` URL and
    ``port`` 0: the store is on that etcd cluster, :func:`attach`)."""
    import torch.distributed as dist
    if host.startswith("etcd://"):
        from .job.etcd import store as etcd_store
        return sealed(etcd_store(host, timeout), secret)
    client = dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=timeout))
    return sealed(client, secret)


def die_with_parent(expected_parent: int | None = None) -> None:
    """Ask the kernel to SIGKILL this process when its parent exits (Linux); exit now if the parent
    is already gone (``expected_parent`` given and no longer our parent)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)
