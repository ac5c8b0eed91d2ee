"""A seeded chaos run of a multi-host live job on loopback hosts (one JSON object with ``--json``).

``--hosts N`` hosts (the first serves the job, N-1 ``parashift join`` agents; process groups of their
own, ``--nprocs`` processes each) train tiny-gpt with gloo, dp over every device (the global batch is
divisible by every device count the run reaches), a DCP snapshot every ``--snapshot-every`` steps. A
schedule of ``--events K`` events is drawn up front from ``numpy.random.default_rng(--seed)`` and
printed, so any failure reproduces from its seed; the moments are aimed by watching the job's store:

- ``join``: a new agent; ``notice_long`` / ``notice_short``: SIGTERM to an agent started with
  ``--notice-seconds`` 600 / ``--short-notice`` (the agent SIGKILLs itself when it runs out);
- ``kill``: SIGKILL of an agent's process group ``mid-step`` (just after device 0's loss of a step),
  ``mid-snapshot`` (just after a step that starts a snapshot), ``mid-switch`` (fired quickly after a join or
  a notice, at the step before the switch) or ``mid-recovery`` (fired once the previous kill is declared);
- ``stall_short`` / ``stall_long``: SIGSTOP of an agent's group for 0.3 s / the heartbeat window + 1.5 s,
  then SIGCONT (a long stall is declared lost; a short one must not be);
- ``snapshot_fail``: the next snapshot's write fails (``blocked``: a file where its folder goes;
  ``disk_full``: its data file is /dev/full); the job must train on and write the one after;
- ``etcd_member``: SIGKILL of one of 3 etcd members (``--store etcd``), restarted after the event;
- ``coordinator`` (only with ``--coordinator-kills``): SIGKILL of the first host. Not survived: the first
  host still serves the job (no takeover yet); counted in ``coordinator_lost`` and the run ends there.

Events flagged ``quick`` fire 0-0.3 s after the previous one, before it has been handled. Per event:
``detect_seconds`` (to ``hosts/dead/<h>``, ``hosts/leave/<h>``, the new host's generation or
``hosts/snap_failed``; None where the job has nothing to detect) and ``recover_seconds`` (until the job
runs on the expected devices and device 0 completes a step beyond the newest it had completed, for a
snapshot failure until the next snapshot is written). After the run: the losses against the same job on
one process (1e-5 on every step), every step lost reported by a failure switch with its cause, and
``orphans``: processes and process groups of the job (every pid and pgid seen below the hosts) alive 10 s
after the last host exited. Every event the state of every surviving host is sampled (RSS, fds,
threads, /dev/shm segments it maps, process groups) with the snapshot folders; ``leaks`` names any metric
whose second-half median exceeds the first half's beyond a noise margin.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

SECRET = "chaos-bench-secret-0123456789abc"
TYPES = ("join", "notice_long", "notice_short", "kill", "stall_short", "stall_long", "snapshot_fail", "etcd_member",
         "coordinator")
REMOVES = {"notice_long", "notice_short", "kill", "stall_long"}
MOMENTS = ("mid-step", "mid-snapshot")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- the schedule

def schedule(rng: np.random.Generator, hosts: int, events: int, max_live: int, etcd: bool, coordinator: bool,
             short_share: float = 0.5) -> tuple[list[dict], dict[int, str]]:
    """K events drawn from ``rng``, feasible on the membership they lead to (host numbers as the job gives
    them: 1 the first, agents 2.. in start order); and each agent's notice kind ({host: "long"|"short"})."""
    notice = {h: ("short" if rng.random() < short_share else "long") for h in range(2, hosts + 1)}
    alive, nxt, out = list(range(2, hosts + 1)), hosts + 1, []
    weights = {"join": 3, "notice_long": 2, "notice_short": 2, "kill": 4, "stall_short": 2, "stall_long": 1,
               "snapshot_fail": 2, "etcd_member": 2 if etcd else 0, "coordinator": 1 if coordinator else 0}
    while len(out) < events:
        live = 1 + len(alive)
        ok = {t: w for t, w in weights.items() if w > 0 and (
            (t == "join" and live + 1 <= max_live) or
            (t == "notice_long" and any(notice[h] == "long" for h in alive)) or
            (t == "notice_short" and any(notice[h] == "short" for h in alive)) or
            (t in ("kill", "stall_short", "stall_long") and alive) or
            t in ("snapshot_fail", "etcd_member") or
            (t == "coordinator" and len(out) == events - 1))}     # the job ends there: last, when drawn
        names = sorted(ok)
        p = np.array([ok[t] for t in names], float)
        t = names[int(rng.choice(len(names), p=p / p.sum()))]
        prev = out[-1]["type"] if out else None       # quick after what a kill can meet mid-way: more often
        quick = bool(out and rng.random() < (0.4 if prev in ("join", "notice_long", "kill", "stall_long") else 0.15))
        ev: dict = {"i": len(out), "type": t, "quick": quick, "u": float(rng.random())}
        if t == "kill":
            if ev["quick"] and prev in ("join", "notice_long"):
                ev["moment"] = "mid-switch"
            elif ev["quick"] and prev in ("kill", "stall_long"):
                ev["moment"] = "mid-recovery"
            else:
                ev["moment"] = MOMENTS[int(rng.integers(len(MOMENTS)))]
        if t == "snapshot_fail":
            ev["how"] = ("blocked", "disk_full")[int(rng.integers(2))]
        if t == "etcd_member":
            ev["member"] = int(rng.integers(3))
        if t == "join":
            ev["host"] = nxt
            notice[nxt] = "short" if rng.random() < short_share else "long"
            alive.append(nxt)
            nxt += 1
        elif t in REMOVES:
            pool = [h for h in alive if t not in ("notice_long", "notice_short") or notice[h] == t[7:]]
            ev["host"] = pool[int(ev["u"] * len(pool))]
            alive.remove(ev["host"])
        elif t == "stall_short":
            ev["host"] = alive[int(ev["u"] * len(alive))]
        out.append(ev)
    return out, notice


# ---------------------------------------------------------------- processes

class Proc:
    """A host (its own process group); its output lines collected by a thread."""

    def __init__(self, args: list[str], env: dict, log: str) -> None:
        self.p = subprocess.Popen([sys.executable, "-m", "parashift", *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
        self.pid, self.out, self.err, self.log = self.p.pid, [], [], log
        for stream, into in ((self.p.stdout, self.out), (self.p.stderr, self.err)):
            threading.Thread(target=self._read, args=(stream, into), daemon=True).start()

    def _read(self, stream, into: list) -> None:
        for line in stream:
            into.append(line)
            with open(self.log, "a") as f:
                f.write(line)

    def said(self, pattern: str) -> re.Match | None:
        for line in list(self.err):
            m = re.search(pattern, line)
            if m:
                return m
        return None

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass


def _proc_table() -> dict[int, tuple[int, int, str]]:
    """{pid: (ppid, pgid, start time)} of every process, from /proc."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
            out[int(d)] = (int(rest[1]), int(rest[2]), rest[19])
        except (OSError, IndexError, ValueError):
            continue
    return out


def _below(table: dict, root: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    out, todo = [root] if root in table else [], [root]
    while todo:
        got = kids.get(todo.pop(), [])
        out += got
        todo += got
    return out


def _metrics(pids: list[int]) -> dict:
    rss = fds = threads = 0
    shm: set[str] = set()
    pgids = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                st = f.read()
            rss += int(re.search(r"VmRSS:\s+(\d+)", st).group(1)) if "VmRSS" in st else 0
            threads += int(re.search(r"Threads:\s+(\d+)", st).group(1))
            fds += len(os.listdir(f"/proc/{pid}/fd"))
            with open(f"/proc/{pid}/maps") as f:
                shm |= {ln.split()[-1] for ln in f if "/dev/shm/" in ln}
            pgids.add(os.getpgid(pid))
        except (OSError, AttributeError, ValueError):
            continue
    return {"rss_mb": rss / 1024, "fds": fds, "threads": threads, "shm": len(shm), "pgroups": len(pgids),
            "procs": len(pids)}


# ---------------------------------------------------------------- the run

class Chaos:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.rng = np.random.default_rng(a.seed)
        self.max_live = a.hosts + 1
        self.batch = math.lcm(*range(1, self.max_live * a.nprocs + 1))
        self.events, self.notice = schedule(self.rng, a.hosts, a.events, self.max_live, a.store == "etcd",
                                            a.coordinator_kills)
        self.dir = tempfile.mkdtemp(prefix="parashift-chaos-")
        self.snaps = os.path.join(self.dir, "snapshots")
        self.env = dict(os.environ, PARASHIFT_JOB_SECRET=SECRET, PYTHONUNBUFFERED="1")
        self.hosts: dict[int, Proc] = {}
        self.devices: dict[int, list[int]] = {}
        self.gone: set[int] = set()           # hosts the harness removed (or that ended)
        self.seen_pids: dict[int, str] = {}
        self.seen_pgids: set[int] = set()
        self.members = None
        self.samples: list[dict] = []
        self.stop_watch = threading.Event()

    # -- store views
    def newest(self) -> int:
        k = getattr(self, "_newest", -1)
        while self.store.check([f"hosts/loss/{k + 1}/0"]):
            k += 1
        self._newest = k
        return k

    def gens(self) -> list:
        g = getattr(self, "_gens", None)
        if g is None:
            g = self._gens = []
        while self.store.check([f"hosts/gen/{len(g) + 1}"]):
            g.append(pickle.loads(self.store.get(f"hosts/gen/{len(g) + 1}"))[0])
        return g

    def expected(self) -> set[int]:
        return {d for h, devs in self.devices.items() if h not in self.gone for d in devs}

    def _watch(self) -> None:
        while not self.stop_watch.is_set():
            table = _proc_table()
            for p in list(self.hosts.values()):
                for pid in _below(table, p.pid):
                    self.seen_pids.setdefault(pid, table[pid][2])
                    self.seen_pgids.add(table[pid][1])
            self.stop_watch.wait(0.2)

    # -- hosts
    def start(self) -> None:
        a = self.a
        port = _port()
        # --timeout bounds the whole job's wall time too (launch_elastic): room for every event and step
        at = ["--timeout", str(int(max(300, 120 + 45 * a.events + 2 * a.steps))), "--nprocs", str(a.nprocs)]
        self.job = ["--model", "tiny-gpt", "--strategy", f"dp={a.hosts * a.nprocs}", "--steps", str(a.steps),
                    "--global-batch", str(self.batch), "--live"]
        if a.store == "etcd":
            from parashift.exec.job.etcd_members import Members
            self.members = Members(3, workdir=os.path.join(self.dir, "etcd"))
            url = self.members.url()
            self.join_at = ["--store", url, *at]
            first_at = ["--endpoint", f"127.0.0.1:{port}", "--store", url, *at]
        else:
            self.join_at = ["--endpoint", f"127.0.0.1:{port}", *at]
            first_at = self.join_at
        self.t0 = time.monotonic()
        self.hosts[1] = Proc(["run", *self.job, *first_at, "--switch-notice", "1", "--heartbeat-timeout",
                              str(a.heartbeat), "--snapshot-every", str(a.snapshot_every), "--snapshot-dir",
                              self.snaps, "--json"], self.env, os.path.join(self.dir, "host1.log"))
        self.devices[1] = list(range(a.nprocs))
        threading.Thread(target=self._watch, daemon=True).start()
        from parashift.exec.jobstore import connect
        if a.store == "etcd":
            self.store = connect(url, 0, SECRET, 60)
        else:
            self.store = connect("127.0.0.1", port, SECRET, 60)
        for h in range(2, a.hosts + 1):
            self.join(h)
            self._until(lambda h=h: self._devices_of(h), f"host {h} to register")
        self._until(lambda: self.newest() >= 0, "the first step")
        self.cold_start = time.monotonic() - self.t0

    def join(self, h: int) -> None:
        s = {"long": "600", "short": str(self.a.short_notice)}[self.notice[h]]
        self.hosts[h] = Proc(["join", *self.join_at, "--notice-seconds", s], self.env,
                             os.path.join(self.dir, f"host{h}.log"))
        self.devices[h] = []

    def _until(self, cond, what: str, limit: float | None = None) -> float:
        end = time.monotonic() + (limit or self.a.event_timeout)
        while True:
            try:
                got = cond()
            except Exception as e:  # noqa: BLE001 - the store went away with the first host
                try:
                    self.hosts[1].p.wait(10.0)
                except subprocess.TimeoutExpired:
                    raise e from None
                raise TimeoutError(f"{what}: the first host exited ({self.hosts[1].p.returncode})") from e
            if got:
                return time.monotonic()
            if time.monotonic() > end:
                raise TimeoutError(what)
            if self.hosts[1].p.poll() is not None:
                raise TimeoutError(f"{what}: the first host exited ({self.hosts[1].p.returncode})")
            time.sleep(0.003)

    def _devices_of(self, h: int) -> list[int]:
        if not self.devices[h] and self.store.check([f"hosts/devices_of/{h}"]):
            lo, hi = (int(x) for x in self.store.get(f"hosts/devices_of/{h}").decode().split("-"))
            self.devices[h] = list(range(lo, hi + 1))
        return self.devices[h]

    # -- events
    def fire(self, ev: dict) -> dict:
        """Do ``ev``; returns its record with the waiters still to run."""
        t = ev["type"]
        rec = {"i": ev["i"], "type": t, "quick": ev["quick"]}
        h = ev.get("host")
        if h is not None:
            rec["host"] = h
        if t == "join":
            self.join(h)
            rec["t"] = time.monotonic()
            rec["detect"] = lambda: self._devices_of(h) and any(set(self.devices[h]) <= set(g.devices)
                                                                 for g in self.gens())
        elif t in ("notice_long", "notice_short"):
            self._until(lambda: self.hosts[h].said(rf"host {h}: devices \d+-\d+, training"), f"host {h} training")
            rec["t"] = time.monotonic()
            self.hosts[h].p.send_signal(signal.SIGTERM)
            self.gone.add(h)
            rec["detect"] = lambda: self.store.check([f"hosts/leave/{h}"]) or self.store.check([f"hosts/dead/{h}"])
        elif t == "kill":
            rec["moment"] = self._aim(ev)
            rec["t"] = time.monotonic()
            self.hosts[h].signal(signal.SIGKILL)
            self.gone.add(h)
            rec["detect"] = lambda: self.store.check([f"hosts/dead/{h}"])
        elif t in ("stall_short", "stall_long"):
            rec["t"] = time.monotonic()
            self.hosts[h].signal(signal.SIGSTOP)
            hold = 0.3 if t == "stall_short" else self.a.heartbeat + 1.5
            rec["stalled_s"] = hold
            time.sleep(hold)
            self.hosts[h].signal(signal.SIGCONT)
            if t == "stall_long":
                self.gone.add(h)
                rec["detect"] = lambda: self.store.check([f"hosts/dead/{h}"])
            else:
                rec["declared"] = lambda: self.store.check([f"hosts/dead/{h}"])
        elif t == "snapshot_fail":
            every = self.a.snapshot_every
            s = (self.newest() + 3) // every * every + every       # not begun yet
            rec["step"], rec["how"] = s, ev["how"]
            path = os.path.join(self.snaps, f"step{s}")
            os.makedirs(self.snaps, exist_ok=True)
            if ev["how"] == "blocked":
                with open(path, "w") as f:
                    f.write("not a folder")
            else:
                for r in range(len(self.expected()) + 2):
                    os.makedirs(os.path.join(path, f"rank{r}"), exist_ok=True)
                    os.symlink("/dev/full", os.path.join(path, f"rank{r}", "__0_0.distcp"))
            rec["t"] = time.monotonic()
            rec["blocker"] = path
            rec["detect"] = lambda: self.store.check([f"hosts/snap_failed/{s}/0"])
            rec["recovered"] = lambda: self.store.check([f"hosts/snap/{s + every}/0"])
        elif t == "etcd_member":
            rec["t"] = time.monotonic()
            rec["member"] = ev["member"]
            self.members.kill(ev["member"])
        elif t == "coordinator":
            rec["t"] = time.monotonic()
            self.hosts[1].signal(signal.SIGKILL)
        return rec

    def _aim(self, ev: dict) -> str:
        """Wait for the kill's moment; returns the moment it got."""
        m = ev["moment"]
        if m == "mid-switch":
            k = self.newest()
            pend = [g for g in self.gens() if g.step > k]
            if not pend:
                try:
                    self._until(lambda: [g for g in self.gens() if g.step > self.newest()], "a switch", 10.0)
                    pend = [g for g in self.gens() if g.step > self.newest()]
                except TimeoutError:
                    pend = []
            if pend:
                s = pend[0].step
                try:
                    self._until(lambda: self.newest() >= s - 1, "the step before the switch", 30.0)
                    return m
                except TimeoutError:
                    pass
            m = "mid-step"
        if m == "mid-recovery":
            if self.last_victim is not None:
                try:
                    self._until(lambda: self.store.check([f"hosts/dead/{self.last_victim}"]), "declared",
                                self.a.heartbeat + 10.0)
                    return m
                except TimeoutError:
                    pass
            m = "mid-step"
        k = self.newest()
        if m == "mid-snapshot":
            every = self.a.snapshot_every
            target = (k + 1) // every * every + every - 1        # device 0 finished step target: snapshot begins
            self._until(lambda: self.newest() >= target, "a snapshot step", 60.0)
            return m
        self._until(lambda: self.newest() > k, "a step", 60.0)
        time.sleep(float(self.rng.random()) * 0.05)
        return "mid-step"

    def settle(self, rec: dict) -> None:
        """Wait for ``rec``'s event to be detected and the job to train past it; fills the times."""
        t0 = rec["t"]
        limit = self.a.event_timeout
        try:
            if rec["type"] == "coordinator":
                rec["survived"] = False
                return
            if "detect" in rec:
                rec["detect_seconds"] = self._until(rec["detect"], f"event {rec['i']} detected", limit) - t0
            else:
                rec["detect_seconds"] = None
            if "recovered" in rec:
                rec["recover_seconds"] = self._until(rec["recovered"], f"event {rec['i']} recovered", limit) - t0
            else:
                want = self.expected()

                def on_them() -> bool:
                    g = self.gens()
                    return (g[-1].devices if g else self.devices[1] + [d for h in range(2, self.a.hosts + 1)
                                                                       for d in self.devices[h]]) and \
                        set(g[-1].devices if g else want) == want
                self._until(on_them, f"event {rec['i']}: the job on devices {sorted(want)}", limit)
                k = self.newest()
                rec["recover_seconds"] = self._until(lambda: self.newest() > k, f"event {rec['i']}: a step",
                                                     limit) - t0
            if "declared" in rec:
                rec["falsely_declared"] = bool(rec["declared"]())
            rec["survived"] = not rec.get("falsely_declared", False)
        except TimeoutError as e:
            rec["survived"] = False
            rec["error"] = f"timed out: {e}"
        finally:
            if rec["type"] == "snapshot_fail":
                p = rec["blocker"]
                if os.path.isdir(p) and not os.path.islink(p):
                    shutil.rmtree(p, ignore_errors=True)
                elif os.path.exists(p):
                    os.remove(p)
            if rec["type"] == "etcd_member":
                self._restart_member(rec["member"])
            for k in ("detect", "recovered", "declared", "t", "blocker"):
                rec.pop(k, None)

    def _restart_member(self, i: int) -> None:
        m = self.members
        shutil.rmtree(os.path.join(m.dir, f"m{i}"), ignore_errors=True)
        # a member that lost its data rejoins as a new one: remove the old, add it back (etcdctl v3 API)
        import http.client
        live = [j for j in range(3) if j != i]
        c = http.client.HTTPConnection("127.0.0.1", m.client_ports[live[0]], timeout=5)
        c.request("POST", "/v3/cluster/member/list", "{}")
        got = json.loads(c.getresponse().read())
        for mem in got.get("members", []):
            if mem.get("name") == f"m{i}" or f":{m.peer_ports[i]}" in ",".join(mem.get("peerURLs", [])):
                c.request("POST", "/v3/cluster/member/remove", json.dumps({"ID": mem["ID"]}))
                c.getresponse().read()
        c.request("POST", "/v3/cluster/member/add",
                  json.dumps({"peerURLs": [f"http://127.0.0.1:{m.peer_ports[i]}"]}))
        c.getresponse().read()
        cluster = ",".join(f"m{j}=http://127.0.0.1:{p}" for j, p in enumerate(m.peer_ports))
        client, peer = f"http://127.0.0.1:{m.client_ports[i]}", f"http://127.0.0.1:{m.peer_ports[i]}"
        from parashift.exec.jobstore import die_with_parent
        parent = os.getpid()
        with open(os.path.join(m.dir, f"m{i}.log"), "ab") as log:
            m.procs[i] = subprocess.Popen(
                [m.binary, "--name", f"m{i}", "--data-dir", os.path.join(m.dir, f"m{i}"), "--listen-client-urls",
                 client, "--advertise-client-urls", client, "--listen-peer-urls", peer,
                 "--initial-advertise-peer-urls", peer, "--initial-cluster", cluster, "--initial-cluster-state",
                 "existing", "--heartbeat-interval", "50", "--election-timeout", "500", "--logger", "zap",
                 "--log-level", "warn"], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                preexec_fn=lambda: die_with_parent(parent))

    def sample(self, i: int) -> None:
        table = _proc_table()
        row = {"event": i, "hosts": {}}
        for h, p in self.hosts.items():
            if h in self.gone or p.p.poll() is not None:
                continue
            row["hosts"][h] = _metrics(_below(table, p.pid))
        row["snapshot_dirs"] = len([n for n in os.listdir(self.snaps) if n.startswith("step")]) \
            if os.path.isdir(self.snaps) else 0
        row["dev_shm"] = len(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else 0
        self.samples.append(row)

    def run(self) -> dict:
        a = self.a
        print("chaos schedule (seed %d): %s" % (a.seed, json.dumps(self.events)), file=sys.stderr, flush=True)
        print(f"chaos notices: {json.dumps(self.notice)}; logs in {self.dir}", file=sys.stderr, flush=True)
        records: list[dict] = []
        self.last_victim = None
        try:
            self.start()
            self.sample(-1)
            pending: list[dict] = []
            for ev in self.events:
                if not ev["quick"]:
                    for rec in pending:
                        self.settle(rec)
                    if pending:
                        time.sleep(float(self.rng.random()) * 0.5)
                    pending = []
                    for rec in records[-1:]:
                        self.sample(rec["i"])
                else:
                    time.sleep(float(self.rng.random()) * 0.3)
                if self.hosts[1].p.poll() is not None:
                    break
                try:
                    left = a.steps - self.newest()
                except Exception:  # noqa: BLE001 - the store went away with the first host
                    break
                if a.time_limit and time.monotonic() - self.t0 > a.time_limit:
                    print(f"chaos: --time-limit {a.time_limit:g} s reached; events {ev['i']}.. not fired",
                          file=sys.stderr, flush=True)
                    break
                if left < 20:          # too few steps left for the event to play out: stop here, said in the JSON
                    print(f"chaos: only {left} steps left; events {ev['i']}.. not fired (raise --steps)",
                          file=sys.stderr, flush=True)
                    break
                rec = self.fire(ev)
                if ev["type"] in ("kill", "stall_long"):
                    self.last_victim = ev["host"]
                records.append(rec)
                pending.append(rec)
                print(f"chaos: event {ev['i']} {ev['type']} {ev.get('host', '')} {rec.get('moment', '')}",
                      file=sys.stderr, flush=True)
                if ev["type"] == "coordinator":
                    break
            for rec in pending:
                self.settle(rec)
            if records:
                self.sample(records[-1]["i"])
            return self.finish(records)
        finally:
            self.stop_watch.set()
            for p in self.hosts.values():
                if p.p.poll() is None:
                    p.signal(signal.SIGCONT)
                    p.signal(signal.SIGKILL)
            if self.members is not None:
                self.members.stop()
            if not a.keep:
                shutil.rmtree(self.dir, ignore_errors=True)

    def finish(self, records: list[dict]) -> dict:
        a = self.a
        first = self.hosts[1]
        try:
            first.p.wait(timeout=max(60.0, a.steps * 2.0))
        except subprocess.TimeoutExpired:
            first.signal(signal.SIGKILL)
            first.p.wait()
        codes = {}
        for h, p in self.hosts.items():
            try:
                p.p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.signal(signal.SIGKILL)
                p.p.wait()
            codes[h] = p.p.returncode
        last_exit = time.monotonic()
        time.sleep(0.3)
        self.stop_watch.set()
        time.sleep(max(0.0, 10.0 - (time.monotonic() - last_exit)))
        orphans = self._orphans()
        time.sleep(0.2)                  # the readers have the last lines
        res = None
        try:
            res = json.loads("".join(first.out))
        except ValueError:
            pass
        out: dict = {"seed": a.seed, "hosts": a.hosts, "store": a.store, "steps": a.steps,
                     "global_batch": self.batch, "schedule": self.events, "events": len(records),
                     "events_planned": len(self.events),
                     "coordinator_lost": sum(r["type"] == "coordinator" for r in records), "orphans": len(orphans),
                     "orphan_processes": orphans, "exit_codes": codes, "cold_start_seconds": self.cold_start}
        out["job_ok"] = res is not None and codes[1] == 0
        ok_steps = res is not None and len(res.get("losses", [])) == a.steps
        for r in records:          # the job failed: no event before is survived (a coordinator kill ends it anyway)
            if r["type"] != "coordinator" and not out["job_ok"] and not out["coordinator_lost"]:
                r["survived"] = False
        out["survived"] = sum(bool(r.get("survived")) for r in records)
        out["records"] = records
        if res is not None:
            fails = [s for s in res["switches"] if s.get("cause") == "failure"]
            out["switches"] = [{k: s.get(k) for k in ("step", "cause", "src", "dst", "failed_at", "steps_lost",
                                                       "recovered_from", "lost_devices", "seconds", "aborted")}
                               for s in res["switches"]]
            out["steps_lost"] = sum(int(s.get("steps_lost") or 0) for s in res["switches"])
            lost_devs = {d for s in fails for d in s.get("lost_devices") or []}
            killed = {d for r in records if r["type"] in ("kill", "stall_long") and r.get("host") in self.devices
                      for d in self.devices[r["host"]]}
            out["steps_lost_explained"] = all(
                s.get("cause") == "failure" and s.get("recovered_from") and s.get("failed_at") is not None
                and s["failed_at"] - s["step"] == s["steps_lost"] for s in res["switches"] if s.get("steps_lost"))
            out["losses_not_reported"] = sorted(killed - lost_devs)
            out["recovered_from"] = sorted({s["recovered_from"] for s in fails})
        else:
            out["steps_lost"], out["steps_lost_explained"] = None, False
        out["losses_equal_static"] = False
        if ok_steps:
            st = self._static()
            out["losses_equal_static"] = st is not None and len(st) == len(res["losses"]) and \
                max(abs(x - y) for x, y in zip(st, res["losses"])) <= 1e-5
            if st is not None:
                out["max_loss_diff"] = max(abs(x - y) for x, y in zip(st, res["losses"]))
        out["per_type"] = self._per_type(records)
        out["metrics"], out["leaks"] = self._leaks()
        out["samples"] = self.samples
        return out

    def _static(self) -> list[float] | None:
        job = ["--model", "tiny-gpt", "--strategy", "dp=1", "--steps", str(self.a.steps), "--global-batch",
               str(self.batch), "--json"]
        p = subprocess.run([sys.executable, "-m", "parashift", "run", *job], capture_output=True, text=True,
                           env=self.env, timeout=3600)
        try:
            return json.loads(p.stdout)["losses"]
        except (ValueError, KeyError):
            print(f"chaos: the static job failed: {p.stderr[-2000:]}", file=sys.stderr)
            return None

    def _orphans(self) -> list[dict]:
        table = _proc_table()
        left = []
        for pid, (ppid, pgid, start) in table.items():
            if (self.seen_pids.get(pid) == start) or (pgid in self.seen_pgids and pid != os.getpid()):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
                except OSError:
                    continue
                if "etcd" in cmd.split(" ")[0]:
                    continue
                left.append({"pid": pid, "pgid": pgid, "cmd": cmd})
        for o in left:            # nothing stays behind after the report
            try:
                os.kill(o["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
        return left

    @staticmethod
    def _per_type(records: list[dict]) -> dict:
        out: dict = {}
        for t in TYPES:
            rs = [r for r in records if r["type"] == t]
            if not rs:
                continue
            d = [r["detect_seconds"] for r in rs if r.get("detect_seconds") is not None]
            rc = [r["recover_seconds"] for r in rs if r.get("recover_seconds") is not None]
            out[t] = {"count": len(rs), "survived": sum(bool(r.get("survived")) for r in rs),
                      "detect_seconds": statistics.median(d) if d else None, "detect_seconds_worst": max(d, default=None),
                      "recover_seconds": statistics.median(rc) if rc else None,
                      "recover_seconds_worst": max(rc, default=None)}
        return out

    def _leaks(self) -> tuple[dict, list[str]]:
        """Per metric: the medians of the first and second half of the samples (per surviving host: the first
        host's own, and the mean over agents), and the metrics that grew beyond the margin."""
        rows = [r for r in self.samples if r["event"] >= 0]
        if len(rows) < 4:
            return {}, []
        margins = {"rss_mb": (0.10, 30.0), "fds": (0.10, 6), "threads": (0.10, 4), "shm": (0.0, 2), "pgroups": (0.0, 1),
                   "snapshot_dirs": (0.0, 2), "dev_shm": (0.0, 4)}
        series: dict[str, list[float]] = {}
        for r in rows:
            if 1 in r["hosts"]:
                for k, v in r["hosts"][1].items():
                    series.setdefault(f"first.{k}", []).append(v)
            ag = [m for h, m in r["hosts"].items() if h != 1]
            for k in ("rss_mb", "fds", "threads", "shm", "pgroups"):
                if ag:
                    series.setdefault(f"agent.{k}", []).append(sum(m[k] for m in ag) / len(ag))
            series.setdefault("snapshot_dirs", []).append(r["snapshot_dirs"])
            series.setdefault("dev_shm", []).append(r["dev_shm"])
        out, leaks = {}, []
        for k, v in series.items():
            half = len(v) // 2
            if half < 2 or k.endswith(".procs") or k == "dev_shm":      # dev_shm: the machine's, other jobs' too
                continue
            a_, b_ = statistics.median(v[:half]), statistics.median(v[half:])
            rel, ab = margins[k.split(".")[-1]]
            out[k] = {"first_half": a_, "second_half": b_, "max": max(v)}
            if b_ > a_ * (1 + rel) + ab:
                leaks.append(k)
        return out, leaks


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--events", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--store", choices=("tcp", "etcd"), default="tcp")
    ap.add_argument("--nprocs", type=int, default=1, help="processes per host")
    ap.add_argument("--steps", type=int, default=None, help="the job's steps (default: 60 + 25 per event); events "
                    "are fired while 20 steps are left")
    ap.add_argument("--snapshot-every", type=int, default=2)
    ap.add_argument("--heartbeat", type=float, default=2.0, help="the job's --heartbeat-timeout")
    ap.add_argument("--short-notice", type=float, default=2.0, help="--notice-seconds of short-notice agents")
    ap.add_argument("--event-timeout", type=float, default=90.0)
    ap.add_argument("--coordinator-kills", action="store_true",
                    help="draw a SIGKILL of the first host as the last event (not survived: no takeover yet)")
    ap.add_argument("--time-limit", type=float, default=0.0, metavar="SECONDS",
                    help="fire no event after this long (the job then runs to its end; events < events_planned)")
    ap.add_argument("--keep", action="store_true", help="keep the logs and snapshots (their folder is printed)")
    a = ap.parse_args(argv)
    if a.hosts < 2 or a.events < 1:
        raise SystemExit("chaos: --hosts >= 2 and --events >= 1")
    if a.steps is None:
        a.steps = 60 + 25 * a.events
    out = Chaos(a).run()
    wanted = out["events"] - out["coordinator_lost"]
    out["ok"] = (out["survived"] == wanted and out["orphans"] == 0 and (
        out["events"] == out["events_planned"] or out["coordinator_lost"]) and not out["leaks"] and (
        out["coordinator_lost"] > 0 or (out["losses_equal_static"] and out["steps_lost_explained"]
                                        and not out.get("losses_not_reported"))))
    if a.json:
        print(json.dumps(out))
    else:
        print(json.dumps({k: v for k, v in out.items() if k not in ("samples", "schedule", "records")}, indent=1))
    return out


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
