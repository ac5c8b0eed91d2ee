"""Local etcd members: a one- or three-member cluster on free loopback ports, for tests and one-machine jobs.

:class:`Members` starts ``etcd`` (Debian's ``etcd-server`` package, etcd 3.4) as child processes that die
with their parent (``PR_SET_PDEATHSIG``), each with its data and log in a directory of its own, with
short raft timings (50 ms heartbeat, 500 ms election) so that a 1 s lease is granted and a lost member
is replaced in about half a second; :meth:`Members.stop` ends them all and removes what it created.
On a real cluster each host runs its own member (see the reliability docs) and the job is given
``--store etcd://HOST:PORT,...``.
"""
from __future__ import annotations

import http.client
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

from ...errors import StoreError
from ..jobstore import die_with_parent

__all__ = ["ETCD_PACKAGE", "etcd_binary", "Members"]

#: the Debian package that provides /usr/bin/etcd
ETCD_PACKAGE = "etcd-server"


def etcd_binary() -> str | None:
    """The ``etcd`` executable on PATH (or /usr/bin/etcd), None when it is not installed."""
    found = shutil.which("etcd")
    if found is None and os.access("/usr/bin/etcd", os.X_OK):
        found = "/usr/bin/etcd"
    return found


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _healthy(port: int, timeout: float = 0.5) -> bool:
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        c.request("GET", "/health")
        ok = b'"true"' in c.getresponse().read()
        c.close()
        return ok
    except (OSError, http.client.HTTPException):
        return False


class Members:
    """``n`` etcd members on loopback forming one cluster; use as a context manager, or call :meth:`stop`."""

    def __init__(self, n: int = 1, workdir: str | None = None, start_timeout: float = 20.0) -> None:
        self.binary = etcd_binary()
        if self.binary is None:
            raise StoreError(f"etcd is not installed: install Debian's {ETCD_PACKAGE!r} package (apt-get install "
                             f"{ETCD_PACKAGE}) or put an etcd 3.4+ binary on PATH")
        self._own_dir = workdir is None
        self.dir = workdir or tempfile.mkdtemp(prefix="parashift-etcd-")
        self.n = n
        self.procs: list[subprocess.Popen | None] = [None] * n
        for attempt in range(3):        # a port taken between choosing it and etcd binding it: choose again
            ports = _free_ports(2 * n)
            self.client_ports, self.peer_ports = ports[:n], ports[n:]
            try:
                self._start(start_timeout)
                return
            except StoreError:
                self._kill_all()
                if attempt == 2:
                    self.stop()
                    raise

    def _start(self, timeout: float) -> None:
        token = f"parashift-{os.getpid()}-{self.client_ports[0]}"
        cluster = ",".join(f"m{i}=http://127.0.0.1:{p}" for i, p in enumerate(self.peer_ports))
        parent = os.getpid()
        for i in range(self.n):
            data = os.path.join(self.dir, f"m{i}")
            shutil.rmtree(data, ignore_errors=True)
            client, peer = f"http://127.0.0.1:{self.client_ports[i]}", f"http://127.0.0.1:{self.peer_ports[i]}"
            args = [self.binary, "--name", f"m{i}", "--data-dir", data,
                    "--listen-client-urls", client, "--advertise-client-urls", client,
                    "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                    "--initial-cluster", cluster, "--initial-cluster-state", "new",
                    "--initial-cluster-token", token, "--heartbeat-interval", "50", "--election-timeout", "500",
                    "--logger", "zap", "--log-level", "warn"]
            with open(os.path.join(self.dir, f"m{i}.log"), "ab") as log:
                self.procs[i] = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                                 preexec_fn=lambda: die_with_parent(parent))
        end = time.monotonic() + timeout
        while not all(_healthy(p) for p in self.client_ports):
            dead = [i for i, pr in enumerate(self.procs) if pr is not None and pr.poll() is not None]
            if dead or time.monotonic() > end:
                why = f"member m{dead[0]} exited" if dead else f"not healthy after {timeout:.0f} s"
                raise StoreError(f"local etcd cluster failed to start ({why}); see the logs in {self.dir}")
            time.sleep(0.05)

    def url(self, members: list[int] | None = None) -> str:
        """``etcd://127.0.0.1:P,...`` for ``members`` (default: all)."""
        idx = range(self.n) if members is None else members
        return "etcd://" + ",".join(f"127.0.0.1:{self.client_ports[i]}" for i in idx)

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` (a lost host's member)."""
        p = self.procs[i]
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait(5.0)

    def _kill_all(self) -> None:
        for i in range(self.n):
            self.kill(i)

    def stop(self) -> None:
        """End every member (SIGTERM, SIGKILL after 1 s: a member of a cluster that is going away can wait on
        its peers for longer) and remove the directory this object created."""
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.terminate()
        for p in self.procs:
            if p is None:
                continue
            try:
                p.wait(1.0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5.0)
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "Members":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
