"""A switch between processes whose state lives on a device, checked byte for byte.

:func:`switch_check` starts one process per participating device (:func:`..job.elastic.launch_elastic`),
fills every source rank's store from one random global state, runs the live switch protocol
(:func:`.protocol.prepare`, then :func:`.protocol.execute_switch`: transfer and verification) and
compares each destination store with what a job started in the new layout from that state would
hold. It is the live switch without the training around it, so it runs where a training job
cannot, on one GPU shared by several processes.

Transports (``transport``):

- ``"nccl"``: state on each process's GPU (``device % GPUs``; one process per GPU, as NCCL needs),
  NCCL communicators, the ordered driver on CUDA streams, staging in device memory;
- ``"gloo-pinned"``: state on the GPU (processes may share one), gloo communicators, every message
  staged through pinned host memory (gloo reads host pointers only);
- ``"gloo"``: state in host memory (``ordered=True`` runs the ordered driver's CPU twin).

Default: ``"nccl"`` on CUDA when every process gets a GPU of its own, ``"gloo-pinned"`` when they
share, ``"gloo"`` without CUDA.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import torch

from ...errors import StrategyError
from ...models import ModelSpec
from ...strategy import Strategy

__all__ = ["switch_check", "TRANSPORTS"]

TRANSPORTS = ("nccl", "gloo-pinned", "gloo")


def _full_state(spec: ModelSpec, seed: int) -> dict:
    from .stores import STATE_KINDS
    rng = np.random.default_rng(seed)
    kinds = [k for k in STATE_KINDS if k != "master" or spec.dtype != "fp32"]
    return {(t.name, k): rng.standard_normal(t.shape).astype(np.float32) for t in spec.tensors for k in kinds}


def _worker(ctx, spec: ModelSpec, src: Strategy, sd: tuple, dst: Strategy, dd: tuple, transport: str,
            ordered: bool, repeats: int, timeout: float, seed: int) -> dict:
    from ..job.elastic import ElasticManager
    from ..state import StateStore
    from ..streams import Streams, backend_for
    from .memory import BufferPool, lazy_alloc, state_alloc
    from .protocol import SwitchRecord, execute_switch, prepare
    from .stores import store_arrays, store_from_full
    d = ctx.device
    if transport == "gloo":
        dev, backend = torch.device("cpu"), "gloo"
    else:
        dev = torch.device("cuda", d % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        backend = "nccl" if transport == "nccl" else "gloo"
    manager = ElasticManager(ctx.store, ctx.member.key, timeout, backend, dev)
    parts = tuple(sorted(set(sd) | set(dd)))
    keys = {p: f"{p}.0" for p in parts}
    full = _full_state(spec, seed)
    old = None
    if d in sd:
        host = store_from_full(spec, src, sd.index(d), full)
        old = StateStore(spec, src, sd.index(d), dev, init=False)
        for fam, b in host.buffers.items():
            for k in ("param", "master", "exp_avg", "exp_avg_sq"):
                if getattr(b, k) is not None:
                    getattr(old.buffers[fam], k).copy_(getattr(b, k))
    prep = prepare(manager, spec, src, dst, sd, dd, keys, d, global_batch=8, seq_len=spec.seq_len)
    pool = BufferPool(dev if transport == "nccl" else "cpu", pinned=transport == "gloo-pinned")
    out: dict[str, Any] = {"device": d, "placed_on": str(dev), "transport": transport, "ordered": ordered,
                           "transfer_seconds": [], "verify_seconds": [], "bytes_sent": 0, "mismatches": []}
    for k in range(repeats):
        new = None
        if d in dd:
            new = StateStore(spec, dst, dd.index(d), dev, init=False,
                             alloc=lazy_alloc if prep.planned.staged else state_alloc)
        rec = SwitchRecord(1, str(src), str(dst), d, joining=old is None)
        streams = Streams(backend_for(dev), default=("pack",)) if ordered else None
        if dev.type == "cuda":
            torch.cuda.synchronize()
        execute_switch(prep, ctx.store, f"check{k}/", d, old, new, rec, timeout=timeout, pool=pool,
                       steps_done=0, streams=streams, host_wire=transport == "gloo-pinned")
        out["transfer_seconds"].append(rec.transfer_seconds)
        out["verify_seconds"].append(rec.verify_seconds)
        out["bytes_sent"] = rec.bytes_sent
        if new is not None and k == repeats - 1:
            want = store_arrays(store_from_full(spec, dst, dd.index(d), full))
            got = store_arrays(new)
            out["mismatches"] = [f"{fam} {kind}" for fam in want for kind in want[fam]
                                 if got[fam][kind].tobytes() != want[fam][kind].tobytes()]
        pool.clear()
    return out


def switch_check(model: "str | ModelSpec", src: "str | Strategy", dst: "str | Strategy",
                 src_devices: "tuple[int, ...] | None" = None, dst_devices: "tuple[int, ...] | None" = None, *,
                 transport: str | None = None, ordered: bool | None = None, repeats: int = 1,
                 timeout: float = 120.0, seed: int = 0) -> dict:
    """Run one switch (``repeats`` times) between fresh processes and check the moved state; returns
    ``{"ok", "transport", "ordered", "processes", "gpus", "transfer_seconds" (median of the slowest
    process), "verify_seconds", "bytes_moved", "mismatches", "reports"}``. ``ordered``: the ordered
    driver (default: on NCCL only). Raises StrategyError for a transport this host cannot run."""
    from ... import models
    from ..job.elastic import Member, launch_elastic
    spec = models.get(model)
    src, dst = Strategy.parse(src), Strategy.parse(dst)
    src.validate(spec)
    dst.validate(spec)
    sd = tuple(src_devices) if src_devices is not None else tuple(range(src.world))
    dd = tuple(dst_devices) if dst_devices is not None else tuple(range(dst.world))
    parts = tuple(sorted(set(sd) | set(dd)))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if transport is None:
        transport = "gloo" if not gpus else "nccl" if len({p % gpus for p in parts}) == len(parts) else "gloo-pinned"
    if transport not in TRANSPORTS:
        raise StrategyError(f"unknown transport {transport!r}; use one of {', '.join(TRANSPORTS)}")
    if transport != "gloo" and not gpus:
        raise StrategyError(f"transport {transport!r} keeps the state on a GPU, and this machine has none; use 'gloo'")
    if transport == "nccl" and len({p % gpus for p in parts}) < len(parts):
        raise StrategyError(f"NCCL puts one process per GPU, but {len(parts)} processes share {gpus} GPU(s); use "
                            f"transport='gloo-pinned'")
    if spec.dtype != "fp32":
        raise StrategyError(f"the switch check fills states from fp32 arrays; give an fp32 model, not {spec.dtype}")
    ordered = transport == "nccl" if ordered is None else bool(ordered)
    t0 = time.time()
    reports = launch_elastic(_worker, [Member(p, 0, 0) for p in parts],
                             args=(spec, src, sd, dst, dd, transport, ordered, int(repeats), float(timeout), seed),
                             timeout=timeout * (1 + repeats) + 60, backend="nccl" if transport == "nccl" else "gloo")
    rs = [reports[f"{p}.0"] for p in parts]
    per = [max(r["transfer_seconds"][k] for r in rs) for k in range(repeats)]
    ver = [max(r["verify_seconds"][k] for r in rs) for k in range(repeats)]
    mism = [f"device {r['device']}: {m}" for r in rs for m in r["mismatches"]]
    return {"ok": not mism, "transport": transport, "ordered": ordered, "processes": len(parts), "gpus": gpus,
            "model": spec.name, "src": str(src), "dst": str(dst), "src_devices": list(sd), "dst_devices": list(dd),
            "transfer_seconds": statistics.median(per), "transfer_seconds_all": per,
            "verify_seconds": statistics.median(ver), "bytes_moved": sum(r["bytes_sent"] for r in rs),
            "placed_on": sorted({r["placed_on"] for r in rs}), "mismatches": mism, "wall_seconds": time.time() - t0}
