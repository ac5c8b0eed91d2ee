"""Launchers: run a function on every rank of a local process group, or under torchrun.

``launch_local(fn, nprocs)`` starts ``nprocs`` processes (forkserver: torch is imported once),
rendezvous through a TCPStore the parent holds open (so the port is never raced; bound to
loopback, keys under a per-job secret: :mod:`.jobstore`), gloo on CPU, NCCL when CUDA is
available. Workers die with their launcher (parent-death signals launcher -> forkserver ->
worker) and a SIGTERM to the launcher stops them before it exits. A rank that raises ends the whole job within seconds: the others
are terminated and the failing rank's traceback is raised as :class:`RuntimeFailure`. Under
``torchrun`` (``RANK``/``WORLD_SIZE`` in the environment) the same call runs this process's
rank with the ``env://`` rendezvous.
"""
from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import RuntimeFailure

__all__ = ["RankContext", "launch_local", "under_torchrun", "default_backend"]

_PRELOAD = ["torch", "torch.distributed", "parashift.exec.runtime"]


@dataclass
class RankContext:
    """What a rank function receives: its rank, the world size, backend and device."""

    rank: int
    world: int
    backend: str
    device: Any
    report: Callable[[Any], None] | None = None   # sends a progress message to the launching process


def default_backend() -> str:
    import torch
    return "nccl" if torch.cuda.is_available() else "gloo"


def under_torchrun() -> bool:
    """True when this process was started by torchrun (env:// variables present)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def _device(backend: str, local_rank: int):
    import torch
    if backend == "nccl":
        n = torch.cuda.device_count()
        torch.cuda.set_device(local_rank % n)
        return torch.device("cuda", local_rank % n)
    return torch.device("cpu")


def _run_rank(fn: Callable, args: tuple, rank: int, world: int, backend: str, local_rank: int,
              store: Any, timeout: float, threads: int | None, on_error: Callable | None = None,
              report: Callable | None = None, gather: bool = False) -> Any:
    import torch
    import torch.distributed as dist
    if threads:
        torch.set_num_threads(threads)
    sys.setswitchinterval(2e-4)   # hand the GIL to communication helper threads promptly
    device = _device(backend, local_rank)
    kw: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout)}
    if store is None:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, **kw)
    else:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, **kw)
    try:
        out = fn(RankContext(rank, world, backend, device, report), *args)
        if gather:                    # torchrun: every rank gets every rank's result
            objs: list[Any] = [None] * world
            dist.all_gather_object(objs, out)
            return objs
        return out
    except BaseException as e:
        if on_error is not None:  # report before tearing down, so peers' follow-on errors come later
            on_error(e)
        raise
    finally:
        dist.destroy_process_group()


def _child(fn: Callable, args: tuple, rank: int, world: int, backend: str, where: tuple, results: Any,
           timeout: float, threads: int | None) -> None:
    from .jobstore import connect, die_with_parent
    die_with_parent(os.getppid())   # the forkserver; if it is gone the job is over
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    reported = []

    def report(e: BaseException) -> None:
        if not reported:
            reported.append(True)
            results.put((rank, "err", f"{type(e).__name__}: {e}", traceback.format_exc(), time.time()))

    try:
        import torch.distributed as dist
        store = connect(*where, timeout)
        out = _run_rank(fn, args, rank, world, backend, rank, dist.PrefixStore("job", store), timeout, threads,
                        report, lambda payload: results.put((rank, "progress", payload)))
        results.put((rank, "ok", out))
    except BaseException as e:  # noqa: BLE001 - reported to the parent with the traceback
        report(e)


def _context():
    if getattr(mp.current_process(), "_inheriting", False):
        raise RuntimeFailure("a worker process started a parashift job while it imported the main script (workers "
                             "start with forkserver, which imports it again): put the script's parashift calls "
                             "under `if __name__ == \"__main__\":`")
    ctx = mp.get_context("forkserver")
    # the forkserver dies with the thread that starts it: only the main thread's gets the guard
    guard = ["parashift.exec._forkserver_guard"] if threading.current_thread() is threading.main_thread() else []
    try:
        ctx.set_forkserver_preload(guard + _PRELOAD)
    except Exception:  # noqa: BLE001 - preload is an optimization
        pass
    return ctx


def _script_hint() -> str:
    """A hint for a worker that died at its start under a script (its main module is imported again there)."""
    main = sys.modules.get("__main__")
    if getattr(main, "__file__", None) and not getattr(main, "__spec__", None):
        return " (a script that starts parashift jobs needs its calls under `if __name__ == \"__main__\":`)"
    return ""


@contextlib.contextmanager
def stop_on_sigterm():
    """While the block runs (main thread only), SIGTERM raises SystemExit(143) so that the launcher's
    clean-up stops its workers before it exits."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)
    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _stop(procs: list) -> None:
    """Terminate, then kill, every still-running process we started; reap them all."""
    procs = [p for p in procs if p.pid is not None]
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 3.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(2.0)


_PEER_ERRORS = ("Connection reset", "Connection closed", "Broken pipe", "Socket Timeout", "transport",
                "connection refused", "NCCL communicator was aborted")


def _fail(first: tuple, results: Any, procs: list | None = None) -> None:
    """Raise RuntimeFailure for the root cause: collect errors for a moment and prefer one that is
    not a peer's broken connection (those follow the real failure); when every error is a broken
    connection and a rank died without reporting, name the dead rank first."""
    errs = [first]
    end = time.monotonic() + 0.5
    while time.monotonic() < end:
        try:
            item = results.get(timeout=0.05)
        except queue_mod.Empty:
            continue
        if item[1] == "err":
            errs.append(item)
    own = [e for e in errs if not any(k.lower() in e[2].lower() for k in _PEER_ERRORS)]
    if not own:
        dead = dead_ranks(procs or [], {e[0] for e in errs})
        if dead:
            r, code = dead[0]
            raise RuntimeFailure(f"rank {r} died ({_exit_text(code)}) without reporting; the other ranks then lost "
                                 f"their connection to it ({errs[0][2].splitlines()[0][:120]})")
    rank, _, msg, tb, _ = min(own or errs, key=lambda e: e[4])
    raise RuntimeFailure(f"rank {rank} failed: {msg}\n--- traceback of rank {rank} ---\n{tb}")


def launch_local(fn: Callable, nprocs: int, *, args: tuple = (), timeout: float = 300.0,
                 backend: str | None = None, threads: int | None = 1,
                 on_report: Callable[[int, Any], None] | None = None, gather: bool = False) -> list[Any]:
    """Run ``fn(ctx, *args)`` on ranks ``0..nprocs-1``; return the per-rank results in rank order.

    ``fn`` must be importable (a module-level function or a picklable callable object); what a
    rank passes to ``ctx.report(payload)`` reaches ``on_report(rank, payload)`` here. Under
    torchrun, runs this process's rank only and returns a list with just its result filled (every
    rank's result with ``gather=True``, an all-gather of the results at the end).
    Raises RuntimeFailure (the failing rank and its traceback) when a rank raises or dies, or when
    the job exceeds ``timeout`` seconds; no process is left behind either way.
    """
    backend = backend or default_backend()
    if under_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        got = _run_rank(fn, args, rank, world, backend, local, None, timeout, threads, gather=gather)
        if gather:
            return got
        out: list[Any] = [None] * world
        out[rank] = got
        return out
    if nprocs < 1:
        raise RuntimeFailure(f"nprocs={nprocs} must be at least 1")
    from .jobstore import serve
    job = serve(timeout)
    ctx = _context()
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(fn, args, r, nprocs, backend, job.client_args(), results, timeout,
                                              threads), name=f"parashift-rank{r}", daemon=True)
             for r in range(nprocs)]
    got: dict[int, Any] = {}
    with stop_on_sigterm():
        return _supervise(procs, results, job, nprocs, timeout, on_report, got)


def _supervise(procs: list, results: Any, job: Any, nprocs: int, timeout: float,
               on_report: Callable | None, got: dict) -> list[Any]:
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while len(got) < nprocs:
            try:
                item = results.get(timeout=0.1)
            except queue_mod.Empty:
                item = None
            if item is not None:
                if item[1] == "err":
                    _fail(item, results, procs)
                if item[1] == "progress":
                    if on_report is not None:
                        on_report(item[0], item[2])
                    continue
                got[item[0]] = item[2]
                continue
            for r, p in enumerate(procs):
                if r not in got and not p.is_alive() and p.exitcode not in (0, None):
                    try:  # a last message may still be in the pipe
                        item = results.get(timeout=0.5)
                    except queue_mod.Empty:
                        raise RuntimeFailure(f"rank {r} died with exit code {p.exitcode} without reporting; "
                                             f"check its output above{_script_hint()}") from None
                    if item[1] == "err":
                        _fail(item, results, procs)
                    if item[1] == "ok":
                        got[item[0]] = item[2]
            if time.monotonic() > deadline:
                raise RuntimeFailure(f"the job did not finish within {timeout:.0f} s (ranks done: {sorted(got)}); "
                                     f"raise the timeout or look for a deadlock in the program")
        for p in procs:
            p.join(10.0)
    finally:
        _stop(procs)
        results.close()
        del job
    return [got[r] for r in range(nprocs)]


def dead_ranks(procs: list, reported: set) -> list[tuple[int, int]]:
    """(index, exit code) of the processes that have exited abnormally and are not in ``reported``."""
    out = []
    for r, p in enumerate(procs):
        if r in reported or p.pid is None:
            continue
        p.join(0.05)
        if p.exitcode not in (None, 0):
            out.append((r, p.exitcode))
    return out


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
