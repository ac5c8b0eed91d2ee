"""The job's TCPStore, bound to loopback and namespaced by a per-job secret; workers that die with their launcher.

:func:`serve` binds a listening socket to ``127.0.0.1`` (or to the address the user asks for with
``PARASHIFT_STORE_HOST``) and hands it to ``TCPStore(master_listen_fd=...)``, so the store never
listens on other interfaces. Every key of the job lives under ``parashift/<secret>/``, a prefix
derived from 16 random bytes made for the job; the secret reaches the workers through the
process-start pipe (never argv, never logged), so a client that does not hold it cannot name,
read or overwrite the job's keys. :func:`die_with_parent` makes a process receive SIGKILL when its
parent dies (Linux ``PR_SET_PDEATHSIG``), the first link of the chain launcher -> forkserver ->
worker that leaves no orphan when the launcher is killed.
"""
from __future__ import annotations

import ctypes
import datetime
import os
import secrets
import signal
import socket
import sys
from dataclasses import dataclass
from typing import Any

from ..errors import RuntimeFailure

__all__ = ["JobStore", "serve", "connect", "namespace", "die_with_parent", "HOST_ENV"]

#: environment variable naming the address the store listens on (default loopback)
HOST_ENV = "PARASHIFT_STORE_HOST"
_PR_SET_PDEATHSIG = 1


def namespace(secret: str) -> str:
    """The key prefix of the job holding ``secret``."""
    return f"parashift/{secret}"


@dataclass
class JobStore:
    """The launcher's side: the raw server store, the job's namespaced view, where to reach it."""

    server: Any
    store: Any        # PrefixStore(namespace(secret), server): use this one
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
    return JobStore(server, dist.PrefixStore(namespace(secret), server), host, port, secret)


def connect(host: str, port: int, secret: str, timeout: float) -> Any:
    """A worker's view of the job's store: a client, namespaced by the job's secret."""
    import torch.distributed as dist
    client = dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=timeout))
    return dist.PrefixStore(namespace(secret), client)


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
