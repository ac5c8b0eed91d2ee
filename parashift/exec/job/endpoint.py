"""How a host reaches a multi-host job: its endpoint, its secret, and the checks every host runs first."""
from __future__ import annotations

import ipaddress
import os
import re
import socket
import stat
import sys

from ...errors import StrategyError

__all__ = ["SECRET_ENV", "parse_endpoint", "read_secret", "check_gloo_interface", "check_local_gpus", "say"]


#: environment variable holding the job's secret (the alternative is a 0600 file named by --secret-file)
SECRET_ENV = "PARASHIFT_JOB_SECRET"


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


def check_gloo_interface(host: str) -> None:
    """Processes of different hosts must not bind gloo to loopback (launch_elastic's default)."""
    try:
        loop = ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        loop = False
    if not loop and not os.environ.get("GLOO_SOCKET_IFNAME"):
        raise StrategyError(f"endpoint {host} is not loopback: set GLOO_SOCKET_IFNAME to the network interface "
                            f"that reaches the other hosts (e.g. eth0) on every host")


def check_local_gpus(device: str, nprocs: int) -> None:
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


def say(quiet: bool, text: str) -> None:
    if not quiet:
        print(text, file=sys.stderr, flush=True)
