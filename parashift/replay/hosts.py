"""Node-level replay: a preemption trace's node events played on a live multi-host job on this machine.

Every node of the trace is a host with ``devices_per_node`` processes: the first node runs the job's
first host (``parashift run --live --endpoint``), every other node an agent (``parashift join``) in a
process group of its own, on loopback. The trace's clock maps onto the job's steps (``seconds_per_step``
trace seconds a step, the job's progress read from its store). At an event's step the driver applies it:

The job runs a strategy per device count (``strategies``, e.g. the trace planner's,
:func:`planned_strategies`; tp, pp, ZeRO and the schedule may change at every event), else the
current one with dp widened or narrowed.

- ``add``: starts ``count`` agents; the job grows onto them at a step boundary (``--on-join grow``);
- ``preempt`` with a notice: SIGTERM to ``count`` agents (the newest first): the job switches away
  from their devices and they exit 0. The notice has a length: its trace seconds are
  ``notice / seconds_per_step`` steps, in wall time at the job's mean step so far; an agent still
  running when it has run out is SIGKILLed (its process group, as the platform reclaims the machine) and
  the job recovers as from a preemption without notice;
- ``preempt`` without a notice (NaN or 0): SIGKILL of their process groups: the job recovers from the
  survivors' copies or its snapshot, or ends.

An event is applied at its step or once the previous one has taken effect (the job uses the added
hosts' devices, or no longer uses the removed ones), whichever is later, so a slow agent start does
not pile events up; each applied event reports the step it was applied at. The first node serves
the store and is never preempted: an event that would need it is cut to the agents there are.
"""
from __future__ import annotations

import math
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import RuntimeFailure, StrategyError

__all__ = ["replay_hosts", "planned_strategies"]


@dataclass
class _Agent:
    node: int
    proc: subprocess.Popen
    host: int = 0                 # the job's host number (order of arrival)
    devices: tuple[int, ...] = ()
    signalled: str = ""


@dataclass
class _Job:
    store: Any
    first: subprocess.Popen
    agents: list[_Agent] = field(default_factory=list)
    step: int = -1                # the newest step device 0 stored a loss share of
    began: float = 0.0            # when device 0's first step was seen (monotonic; 0: not yet)

    def progress(self) -> int:
        while self.store.check([f"hosts/loss/{self.step + 1}/0"]):
            self.step += 1
            self.began = self.began or time.monotonic()
        return self.step

    def step_seconds(self) -> float | None:
        """Wall seconds of the job's mean step since its first (None before its first step)."""
        done = self.progress()
        return (time.monotonic() - self.began) / max(done, 1) if self.began else None


class _Notices:
    """A thread that SIGKILLs the process group of each agent still running when its notice has run out."""

    def __init__(self) -> None:
        import threading
        self.due: list[tuple[float, _Agent, dict]] = []
        self.stop = threading.Event()
        threading.Thread(target=self._loop, name="parashift-replay-notices", daemon=True).start()

    def add(self, seconds: float, agent: _Agent, rec: dict) -> None:
        self.due.append((time.monotonic() + seconds, agent, rec))

    def _loop(self) -> None:
        while not self.stop.wait(0.02):
            for item in [d for d in self.due if d[0] <= time.monotonic()]:
                self.due.remove(item)
                _, a, rec = item
                if a.proc.poll() is None:
                    os.killpg(a.proc.pid, signal.SIGKILL)
                    rec.setdefault("ran_out", []).append(a.node)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gens(store: Any) -> list:
    out, g = [], 1
    while store.check([f"hosts/gen/{g}"]):
        out.append(pickle.loads(store.get(f"hosts/gen/{g}"))[0])
        g += 1
    return out


def planned_strategies(trace: Any, model: str = "tiny-gpt", *, devices_per_node: int = 1, global_batch: int = 12,
                       seq_len: int | None = None, policy: str = "switch-aware", cost_model: Any = None) -> dict:
    """The trace planner's strategy per device count of ``trace`` (nodes x ``devices_per_node``), as
    :func:`parashift.search.plan_trace` chooses it on ``cpu-local`` (``policy``: ``best`` or ``switch-aware``,
    the first strategy the policy's path runs at that count), for the counts where it uses every device
    (a node-level job runs all its hosts' processes): {device count: Strategy}. No torch here."""
    import numpy as np
    import pandas as pd
    from .. import cluster, models, search, traces
    from ..strategy import Strategy
    from .schedule import _PLAN_POLICY
    if policy not in _PLAN_POLICY:
        raise StrategyError(f"unknown strategy policy {policy!r}; use one of {', '.join(_PLAN_POLICY)}")
    spec = models.get(model)
    curve = traces.availability(trace)
    devs = curve["available"].to_numpy(np.int64) * int(devices_per_node)
    most = int(devs.max())
    if most < 1:
        raise StrategyError("the trace has no node at any time; pick a window where the pool is not empty")
    plan = search.plan_trace(pd.DataFrame({"time": curve["time"].to_numpy(np.float64), "devices": devs}), spec,
                             cluster.get("cpu-local").with_devices(max(most, 8)), global_batch=global_batch,
                             seq_len=int(seq_len or spec.seq_len), max_devices=most, cost_model=cost_model)
    out: dict[int, Any] = {}
    frame = plan.policy_frame(_PLAN_POLICY[policy])
    for n, st in zip(frame["devices"], frame["strategy"]):
        if st is not None and int(n) not in out and Strategy.parse(st).world == int(n):
            out[int(n)] = Strategy.parse(st)
    return out


def replay_hosts(trace: Any, *, model: str = "tiny-gpt", devices_per_node: int = 1, steps: int,
                 seconds_per_step: float, global_batch: int = 12, notice_steps: int = 1, snapshot_every: int = 0,
                 snapshot_dir: str | None = None, timeout: float = 300.0, secret: str | None = None,
                 strategies: "dict | None" = None) -> dict:
    """Play ``trace`` (a normalized events DataFrame, :mod:`parashift.traces`) on a live multi-host job of
    ``model`` for ``steps`` steps. ``strategies``: {device count: strategy} the job runs at that count
    (e.g. :func:`planned_strategies`; the first host's ``--strategy-for``); at other counts it trains the
    current strategy with dp widened or narrowed (dp-only from the start when the table has no entry
    for the first count). Returns ``{"job": the first host's JSON, "applied": [one record per applied
    event; a preemption with notice has ``notice_seconds``, its wall length, and ``ran_out``, the nodes
    SIGKILLed when it had run out], "exit_codes": {node: exit code}}``."""
    from ..strategy import Strategy
    from ..traces.schema import initial_of
    if seconds_per_step <= 0 or steps < 1 or devices_per_node < 1:
        raise StrategyError("replay_hosts needs seconds_per_step > 0, steps >= 1 and devices_per_node >= 1")
    nodes = initial_of(trace)
    if nodes < 1:
        raise StrategyError("the trace starts with no node: a node-level replay needs the first host from the start")
    table = {int(n): Strategy.parse(str(st)) for n, st in (strategies or {}).items()}
    first_st = table.get(nodes * devices_per_node, f"dp={nodes * devices_per_node}")
    run = ["run", "--model", model, "--strategy", str(first_st), "--steps", str(steps),
           "--global-batch", str(global_batch), "--live", "--switch-notice", str(notice_steps), "--json"]
    run += [f"--strategy-for={n}:{st}" for n, st in sorted(table.items())]
    if snapshot_every:
        run += ["--snapshot-every", str(snapshot_every), "--snapshot-dir", snapshot_dir or "parashift-snapshots"]
    rep = _HostReplay(run, devices_per_node, timeout, secret)
    try:
        for node in range(2, nodes + 1):
            rep.start(node)
        applied = rep.play(trace, nodes + 1, seconds_per_step)
        return rep.report(applied)
    finally:
        rep.close()


class _HostReplay:
    """One node-level replay: the first host's process, its store, the joined agents and pending notices."""

    def __init__(self, run: list[str], devices_per_node: int, timeout: float, secret: str | None):
        """Start the first host with the ``run`` arguments and wait until its store serves."""
        import secrets as _secrets
        from ..exec.job.endpoint import SECRET_ENV
        from ..exec.jobstore import connect
        secret = secret or _secrets.token_hex(16)
        self.env = dict(os.environ, **{SECRET_ENV: secret}, PYTHONUNBUFFERED="1")
        port = _port()
        self.at = ["--endpoint", f"127.0.0.1:{port}", "--timeout", str(timeout), "--nprocs", str(devices_per_node)]
        self.cmd = [sys.executable, "-m", "parashift"]
        self.log = log = tempfile.TemporaryFile("w+")       # the first host's messages (read when it fails)
        self.first = first = subprocess.Popen([*self.cmd, *run, *self.at], stdout=subprocess.PIPE, stderr=log,
                                              text=True, env=self.env, start_new_session=True)
        self.timeout = timeout
        self.end = time.monotonic() + timeout
        while True:
            try:
                store = connect("127.0.0.1", port, secret, 30.0)
                break
            except Exception:  # noqa: BLE001 - not serving yet
                if first.poll() is not None or time.monotonic() > self.end:
                    raise RuntimeFailure(f"the first host did not start: {_tail(log)}") from None
                time.sleep(0.1)
        self.store = store
        self.job = _Job(store, first)
        self.notices = _Notices()

    def start(self, node: int) -> _Agent:
        """Start ``node``'s agent and wait until it has joined the job with its devices."""
        store = self.store
        n = int(store.add("hosts/count", 0))
        a = _Agent(node, subprocess.Popen([*self.cmd, "join", *self.at], stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, env=self.env, start_new_session=True))
        while int(store.add("hosts/count", 0)) == n or not store.check([f"hosts/devices_of/{n + 1}"]):
            if a.proc.poll() is not None or time.monotonic() > self.end:
                raise RuntimeFailure(f"node {node}'s agent did not join (exit code {a.proc.poll()})")
            time.sleep(0.02)
        a.host = n + 1
        lo, hi = (int(x) for x in store.get(f"hosts/devices_of/{a.host}").decode().split("-"))
        a.devices = tuple(range(lo, hi + 1))
        self.job.agents.append(a)
        return a

    def took_effect(self, pending: list[tuple[str, _Agent]]) -> bool:
        """The job trained a step in a layout that uses the added agents' devices / not the removed ones'."""
        gens, done = _gens(self.store), self.job.progress()
        for kind, a in pending:
            if kind == "add" and not any(set(a.devices) <= set(g.devices) and done > g.step for g in gens):
                if not self.store.check([f"hosts/report/{a.host}"]):       # (an agent the job never used reports)
                    return False
            if kind == "preempt" and not (gens and not set(a.devices) & set(gens[-1].devices)
                                          and done > gens[-1].step):
                return False
        return True

    def play(self, trace: Any, next_node: int, seconds_per_step: float) -> list[dict]:
        """Apply each event of ``trace`` at its step, once the previous one took effect; one record each."""
        job = self.job
        applied: list[dict] = []
        pending: list[tuple[str, _Agent]] = []
        for row in trace.itertuples(index=False):
            due = math.ceil(float(row.time) / seconds_per_step)
            while job.first.poll() is None and (job.progress() < due or not self.took_effect(pending)):
                if time.monotonic() > self.end:
                    raise RuntimeFailure(f"the replay did not reach the event at t={row.time:g}s within "
                                         f"{self.timeout:.0f} s")
                time.sleep(0.02)
            if job.first.poll() is not None:
                break
            rec = {"time": float(row.time), "event": row.event, "count": int(row.count), "step": job.progress()}
            if row.event == "add":
                try:
                    got = [self.start(next_node + i) for i in range(int(row.count))]
                except Exception:  # noqa: BLE001 - the store went away: the job ended before the event
                    if job.first.poll() is None and not _ended(job.first):
                        raise
                    break
                next_node += len(got)
                pending = [("add", a) for a in got]
                rec["nodes"] = [a.node for a in got]
            else:
                pending = [("preempt", a) for a in self.preempt(row, rec, seconds_per_step)]
            applied.append(rec)
        return applied

    def preempt(self, row: Any, rec: dict, seconds_per_step: float) -> list[_Agent]:
        """Signal the newest live agents for a preemption event (SIGTERM with notice, else SIGKILL); fills
        ``rec`` and returns the victims."""
        live = [a for a in self.job.agents if not a.signalled and a.proc.poll() is None]
        victims = live[::-1][:int(row.count)]
        sig = "SIGTERM" if isinstance(row.notice, float) and row.notice > 0 else "SIGKILL"
        each = self.job.step_seconds()          # before the job's first step a notice is not timed
        if sig == "SIGTERM":
            rec["notice_seconds"] = None if each is None else float(row.notice) / seconds_per_step * each
        for a in victims:
            if sig == "SIGTERM":
                a.proc.send_signal(signal.SIGTERM)
                if each is not None:
                    self.notices.add(rec["notice_seconds"], a, rec)
            else:
                os.killpg(a.proc.pid, signal.SIGKILL)
            a.signalled = sig
        rec.update(nodes=[a.node for a in victims], signal=sig, cut=int(row.count) - len(victims))
        return victims

    def report(self, applied: list[dict]) -> dict:
        """Wait for every process to end; the first host's JSON, the applied events and the exit codes."""
        import json
        first, end = self.first, self.end
        out, _ = first.communicate(timeout=max(end - time.monotonic(), 1.0))
        codes = {1: first.returncode}
        for a in self.job.agents:
            try:
                a.proc.communicate(timeout=max(end - time.monotonic(), 1.0))
            except subprocess.TimeoutExpired:
                pass
            codes[a.node] = a.proc.returncode if a.proc.returncode is not None else "running"
        if first.returncode != 0:
            raise RuntimeFailure(f"the replayed job failed: {_tail(self.log)}")
        return {"job": json.loads(out), "applied": applied, "exit_codes": codes}

    def close(self) -> None:
        """Stop the notice timer and SIGKILL every process still running."""
        self.notices.stop.set()
        for p in [self.first] + [a.proc for a in self.job.agents]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.log.close()


def _ended(p: subprocess.Popen, within: float = 5.0) -> bool:
    try:
        p.wait(within)
    except subprocess.TimeoutExpired:
        return False
    return True


def _tail(log: Any) -> str:
    log.seek(0)
    lines = [x for x in log.read().splitlines() if x.strip()]
    return lines[-1][:500] if lines else "(no message)"
