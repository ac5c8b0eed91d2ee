"""A host lost without notice, on loopback: SIGKILL to training again, next to a cold start (one JSON object).

Two "hosts" (process groups of their own, two processes each) run a live tiny-gpt job through the
CLI (``parashift run --live --endpoint`` and ``parashift join``); after the job's 5th step, host 2's
process group gets SIGKILL. Per case, the medians of ``--repeats`` runs:

- ``replicas`` (``dp=4``): the survivors go on from their own copies;
- ``hybrid`` (``dp=4,zero=1,shard=2 --snapshot-every 2``): optimizer shards over pairs of dp ranks, each
  pair's shards copied on the other host; the survivors go on from those copies (no snapshot read);
- ``snapshot`` (``dp=4,zero=1 --snapshot-every 2``): host 2 held optimizer shards alone; the
  survivors restore the newest DCP snapshot;

``kill_to_training_s``: from the SIGKILL until device 0 stores its loss share of step S + 1, S being
the first step the new layout (re-)runs (so S has completed); ``detect_s``: from the SIGKILL until the
first host has declared host 2 lost (``hosts/dead/2``: its liveness connection closed, or its heartbeat
window ran out); ``recovery_s``: the job's own ``seconds`` of the recovery (the decision, state and world);
``steps_lost``. ``cold_start_s``: the same job started from nothing until device 0 stores its share
of step 1 (step 0 completed; processes, imports, store, worlds): what any restart costs before it
even reads a checkpoint; the ratio
``cold_start_s / kill_to_training_s`` is the peer comparison. ``dcp_restart_s``: a restart from
DCP, the cold start plus ``dcp_load_s``, the load of the same job's checkpoint (``dp=4`` after 5
steps, saved with ``torch.distributed.checkpoint``, ``dcp_save_s``) into the survivors' ``dp=2`` by
fresh processes (the replay's checkpoint-restart baseline, :mod:`parashift.replay.restart`);
detection is not counted in it. Wall times on a shared machine are noisy: read the medians side by
side.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

SECRET = "hosts-bench-secret-0123456789"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "parashift", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True)


def _until(store, key: str, procs: list, limit: float = 120.0) -> float:
    end = time.monotonic() + limit
    while not store.check([key]):
        if time.monotonic() > end or any(p.poll() is not None for p in procs):
            raise SystemExit(f"hosts_recovery_bench: {key} never came")
        time.sleep(0.002)
    return time.monotonic()


def one(strategy: str, extra: list[str], kill: bool) -> dict:
    from parashift.exec.jobstore import connect
    port = _port()
    env = dict(os.environ, PARASHIFT_JOB_SECRET=SECRET)
    at = ["--endpoint", f"127.0.0.1:{port}", "--timeout", "150", "--nprocs", "2"]
    job = ["--model", "tiny-gpt", "--strategy", strategy, "--steps", "20", "--live"]
    with tempfile.TemporaryDirectory() as snaps:
        t0 = time.monotonic()
        first = _start(["run", *job, *at, *extra, "--snapshot-dir", snaps, "--json"], env)
        time.sleep(0.3)
        agent = _start(["join", *at], env)
        try:
            store = connect("127.0.0.1", port, SECRET, 60)   # a TCPStore client retries until the server is up
            if not kill:
                return {"cold_start_s": _until(store, "hosts/loss/1/0", [first, agent]) - t0}
            _until(store, "hosts/loss/4/2", [first, agent])
            tk = time.monotonic()
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
            g, td = None, None
            while g is None or td is None:
                if td is None and store.check(["hosts/dead/2"]):
                    td = time.monotonic()
                if store.check(["hosts/recovery"]) and store.check([f"hosts/plan/{int(store.get('hosts/recovery'))}"]):
                    g = int(store.get("hosts/recovery"))
                time.sleep(0.002)
            import pickle
            plan = pickle.loads(store.get(f"hosts/plan/{g}"))
            back = _until(store, f"hosts/loss/{plan['step'] + 1}/0", [first])
            out, _ = first.communicate(timeout=150)
            (sw,) = [s for s in json.loads(out)["switches"] if s["cause"] == "failure"]
            return {"kill_to_training_s": back - tk, "detect_s": td - tk, "recovery_s": sw["seconds"],
                    "steps_lost": sw["steps_lost"],
                    "recovered_from": sw["recovered_from"]}
        finally:
            for p in (first, agent):
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()


def dcp_load() -> dict:
    """The DCP checkpoint of ``dp=4`` after 5 steps, loaded into ``dp=2`` by fresh processes: from the last
    rank's start of the save (of the load: built runtime) to the last rank's end (the calls are collective)."""
    from parashift import models
    from parashift.replay.restart import run_restart_job
    from parashift.strategy import Strategy
    spec = models.get("tiny-gpt")
    with tempfile.TemporaryDirectory() as tmp:
        segs = run_restart_job(spec, [(Strategy.parse("dp=4"), 0, 5), (Strategy.parse("dp=2"), 5, 6)], tmp,
                               global_batch=8, seq_len=spec.seq_len, export_final=False)
    span = lambda ranks, a, b: max(r[b] for r in ranks) - max(r[a] for r in ranks)  # noqa: E731
    return {"dcp_save_s": span(segs[0]["ranks"], "save_start", "save_end"),
            "dcp_load_s": span(segs[1]["ranks"], "built", "loaded")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    cases = {"replicas": ("dp=4", []), "hybrid": ("dp=4,zero=1,shard=2", ["--snapshot-every", "2"]),
             "snapshot": ("dp=4,zero=1", ["--snapshot-every", "2"])}
    out: dict = {"repeats": a.repeats}
    for name, (st, extra) in cases.items():
        runs = [one(st, extra, kill=True) for _ in range(a.repeats)]
        out[name] = {"strategy": st, "recovered_from": sorted({r["recovered_from"] for r in runs}),
                     **{k: statistics.median(r[k] for r in runs) for k in ("kill_to_training_s", "detect_s",
                                                                            "recovery_s", "steps_lost")}}
        print(f"{name}: {out[name]}", file=sys.stderr, flush=True)
    out["cold_start_s"] = statistics.median(one("dp=4", [], kill=False)["cold_start_s"] for _ in range(a.repeats))
    loads = [dcp_load() for _ in range(a.repeats)]
    out.update({k: statistics.median(r[k] for r in loads) for k in ("dcp_save_s", "dcp_load_s")})
    out["dcp_restart_s"] = out["cold_start_s"] + out["dcp_load_s"]
    for name in cases:
        out[name]["cold_start_over_recovery"] = round(out["cold_start_s"] / out[name]["kill_to_training_s"], 2)
        out[name]["dcp_restart_over_recovery"] = round(out["dcp_restart_s"] / out[name]["kill_to_training_s"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
