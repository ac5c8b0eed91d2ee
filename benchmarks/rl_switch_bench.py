"""RL phases: the in-memory weight switch vs reloading the weights from a DCP checkpoint (one JSON object).

Every iteration of RL post-training moves the freshly trained weights into the rollout layout.
Two ways, on 4 gloo processes (CPU), for each case (training layout -> rollout layout):

- ``switch``: :class:`parashift.exec.rl.weights.WeightSwitch` (``kinds=("param",)``; the optimizer
  state stays): the way out, and with ``release`` the way back that restores the freed
  training weights (``switch_roundtrip``).
- ``dcp``: what users do today: ``torch.distributed.checkpoint.save`` of the weights under the
  training layout (each rank's owned boxes as ShardedTensor shards) to /dev/shm and ``load``
  into the rollout layout's boxes (DCP reshards), then copy into the rollout store.

Both fill the same rollout store; the bench reports whether they agree bit for bit
(``rollout_weights_equal``). Progress goes to stderr. Medians over
``--repeats`` (the machine is shared: read the medians, not single runs). Prints one JSON object:
per case the medians and ``dcp_over_switch``.

Run: ``python benchmarks/rl_switch_bench.py [--repeats 5] [--small]``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from switch_live_bench import _box_planner, _boxes, _fill, _model  # noqa: E402  (shared DCP helpers)

from parashift.exec.launch import launch_local  # noqa: E402
from parashift.exec.rl.weights import WeightSwitch  # noqa: E402
from parashift.exec.state import StateStore  # noqa: E402
from parashift.exec.switch import piece_view  # noqa: E402
from parashift.strategy import Strategy  # noqa: E402

CASES = [("tp2dp2z1->tp4", "tp=2,dp=2,zero=1", "tp=4"),
         ("dp4z1->tp2 (2 of 4 devices)", "dp=4,zero=1", "tp=2"),
         ("pp2dp2->tp2dp2", "pp=2,dp=2", "tp=2,dp=2")]


def _save_params(spec, store: StateStore, strategy: Strategy) -> dict:
    """This rank's owned weight boxes as ShardedTensors (one per tensor)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards
    me = torch.distributed.get_rank()
    mine: dict[str, list] = {}
    for name, kind, lo, hi in _boxes(spec, strategy, me, owned=True):
        if kind == "param":     # a copy: DCP pins the storage it saves from (the switch frees that storage)
            t = piece_view(store, name, kind, lo, hi).clone()
            mine.setdefault(name, []).append(Shard(t, ShardMetadata(list(lo), [b - a for a, b in zip(lo, hi)],
                                                                    f"rank:{me}/cpu")))
    return {f"param/{t.name}": init_from_local_shards(mine.get(t.name, []), *t.shape) for t in spec.tensors}


def _dcp(spec, train: Strategy, rollout: Strategy, rank: int, store: StateStore, ws: WeightSwitch, path: str):
    import torch.distributed.checkpoint as dcp
    from parashift.exec.rl.weights import rollout_store
    new = rollout_store(spec, rollout, rank) if rank < rollout.world else None
    torch.distributed.barrier()
    t0 = time.perf_counter()
    dcp.save(_save_params(spec, store, train), checkpoint_id=path)
    boxes: dict[str, list] = {}
    if new is not None:
        for name, kind, lo, hi in _boxes(spec, rollout, rank):
            if kind == "param":
                boxes.setdefault(f"param/{name}", []).append((lo, torch.empty([b - a for a, b in zip(lo, hi)])))
    dcp.load({}, checkpoint_id=path, planner=_box_planner(boxes))
    for fqn, lst in boxes.items():
        name = fqn.split("/", 1)[1]
        for lo, t in lst:
            piece_view(new, name, "param", lo, tuple(a + n for a, n in zip(lo, t.shape))).copy_(t)
    torch.distributed.barrier()
    return time.perf_counter() - t0, new


def _worker(ctx, spec, repeats: int, root: str) -> dict:
    torch.distributed.barrier()
    out = {}
    for ci, (name, train, rollout) in enumerate(CASES):
        tr, ro = Strategy.parse(train), Strategy.parse(rollout)
        store = StateStore(spec, tr, ctx.rank, torch.device("cpu"), init=False)
        _fill(store, spec)
        ws = WeightSwitch(spec, tr, ro, ctx.rank, release=True, timeout=300.0)
        sw, rt, dc, same = [], [], [], True
        for rep in range(repeats):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            ws.to_rollout(store)
            torch.distributed.barrier()
            t1 = time.perf_counter()
            mine = None if ws.store is None else {f: b.param.clone() for f, b in ws.store.buffers.items()}
            ws.to_train(store)
            torch.distributed.barrier()
            t2 = time.perf_counter()
            path = os.path.join(root, f"c{ci}r{rep}")
            dt, new = _dcp(spec, tr, ro, ctx.rank, store, ws, path)
            if new is not None:
                same &= all(torch.equal(mine[f], b.param) for f, b in new.buffers.items())
            if ctx.rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            sw.append(t1 - t0)
            rt.append(t2 - t0)
            dc.append(dt)
            if ctx.rank == 0:
                print(f"{name} {rep + 1}/{repeats}: switch {t1 - t0:.3f} s, round trip {t2 - t0:.3f} s, dcp {dt:.3f} s",
                      file=sys.stderr, flush=True)
        out[name] = {"switch": sw, "roundtrip": rt, "dcp": dc, "same": same,
                     "bytes": sum(b.param.numel() * b.param.element_size() for b in store.buffers.values())}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--small", action="store_true", help="a small model (a quick check)")
    args = ap.parse_args(argv)
    spec = _model(args.small)
    root = tempfile.mkdtemp(prefix="parashift-rl-dcp-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        res = launch_local(_worker, 4, args=(spec, args.repeats, root), timeout=1800)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    cases = {}
    for name, _, _ in CASES:
        per = [r[name] for r in res]
        # the slowest process of each repeat, then the median over repeats
        med = {k: statistics.median(max(p[k][i] for p in per) for i in range(args.repeats))
               for k in ("switch", "roundtrip", "dcp")}
        cases[name] = {"switch_seconds": med["switch"], "switch_roundtrip_seconds": med["roundtrip"],
                       "dcp_seconds": med["dcp"], "dcp_over_switch": med["dcp"] / med["switch"],
                       "dcp_over_roundtrip": med["dcp"] / med["roundtrip"],
                       "weight_bytes_per_training_rank": int(np.median([p["bytes"] for p in per])),
                       "rollout_weights_equal": all(p["same"] for p in per)}
    out = {"model": spec.name, "params": spec.params, "processes": 4, "repeats": args.repeats,
           "dcp_dir": "/dev/shm" if os.path.isdir("/dev/shm") else "tmp", "cases": cases}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
