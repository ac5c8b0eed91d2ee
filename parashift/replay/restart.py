"""The checkpoint-restart baseline: the same layouts and steps, by save, process restart and load.

Every segment between two switches is its own job (:func:`~parashift.exec.launch.launch_local`,
fresh processes): it builds its runtime, loads the previous segment's checkpoint with
``torch.distributed.checkpoint`` (DCP), trains its steps and saves a checkpoint with DCP before
its processes exit. Each rank saves its flat state buffers (parameters, fp32 masters, Adam
moments) under its own keys, plus the step counters; each rank of the next layout loads every
saved buffer, assembles the global state (:func:`~parashift.exec.switch.full_from_arrays`) and
keeps its own part of it (:func:`~parashift.exec.switch.store_from_full`). The time lost per
switch is measured exactly as for a hot switch: from the end of the last step before it to the
start of the first step after it, on the wall clock.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import models
from ..strategy import Strategy
from ..exec.launch import RankContext, launch_local
from ..exec.reference import OptimConfig
from ..exec.state import StateStore
from ..exec.switch import STATE_KINDS, full_from_arrays, store_arrays, store_from_full

__all__ = ["run_restart_job", "save_state", "load_state"]


def _skeleton(spec: models.ModelSpec, strategy: Strategy, rank: int) -> dict[str, torch.Tensor]:
    """Empty tensors shaped like ``rank``'s saved buffers, keyed as :func:`save_state` keys them."""
    s = StateStore(spec, strategy, rank, torch.device("cpu"), init=False)
    return {f"r{rank}/{fam}/{k}": torch.empty_like(getattr(b, k)) for fam, b in s.buffers.items()
            for k in STATE_KINDS if getattr(b, k) is not None}


def save_state(store: StateStore, rank: int, steps_done: int, path: str) -> None:
    """Collective: every rank writes its flat buffers and counters to the DCP checkpoint ``path``."""
    import torch.distributed.checkpoint as dcp
    sd: dict[str, Any] = {f"r{rank}/{fam}/{k}": getattr(b, k) for fam, b in store.buffers.items()
                          for k in STATE_KINDS if getattr(b, k) is not None}
    sd[f"r{rank}/counters"] = torch.tensor([steps_done] + [b.step for b in store.buffers.values()],
                                           dtype=torch.int64)
    dcp.save(sd, checkpoint_id=path)


def load_state(store: StateStore, spec: models.ModelSpec, src: Strategy, path: str) -> int:
    """Collective: fill ``store`` (any layout) from the DCP checkpoint ``path`` saved under ``src``
    in place (parameter views stay valid); returns the saved step count."""
    import torch.distributed.checkpoint as dcp
    sd: dict[str, Any] = {}
    for r in range(src.world):
        sd.update(_skeleton(spec, src, r))
        sd[f"r{r}/counters"] = torch.zeros(1 + len(StateStore(spec, src, r, torch.device("cpu"),
                                                               init=False).buffers), dtype=torch.int64)
    dcp.load(sd, checkpoint_id=path)
    arrays: dict[int, dict[str, dict[str, np.ndarray]]] = {}
    for key, t in sd.items():
        r, fam, *kind = key.split("/")
        if fam != "counters":
            arrays.setdefault(int(r[1:]), {}).setdefault(fam, {})[kind[0]] = t.numpy()
    counters = sd["r0/counters"].tolist()
    full = full_from_arrays(spec, src, arrays)
    mine = store_from_full(spec, store.strategy, store.rank, full, opt_step=int(max(counters[1:], default=0)))
    for fam, b in store.buffers.items():
        nb = mine.buffers[fam]
        for k in STATE_KINDS:
            t = getattr(b, k)
            if t is not None:
                t.copy_(getattr(nb, k))
        b.step = nb.step
    return int(counters[0])


def _segment(ctx: RankContext, spec: models.ModelSpec, strategy: str, first: int, last: int,
             load_from: "tuple[str, str] | None", save_to: str | None, opts: dict) -> dict:
    """One segment's rank: build, load, train steps ``first..last-1``, save."""
    from ..exec.runtime import Runtime, compile_program
    torch.manual_seed(0)
    t_enter = time.time()
    st = Strategy.parse(strategy)
    prog = compile_program(spec.name if _preset(spec) else spec, st, global_batch=opts["global_batch"],
                           seq_len=opts["seq_len"])
    rt = Runtime(prog, ctx, seed=opts.get("seed", 0), data_seed=opts.get("data_seed", 0), model=spec,
                 optim=OptimConfig(**opts.get("optim", {})), timeout=opts.get("timeout", 300.0))
    t_built = time.time()
    if load_from is not None:
        rt.steps_done = load_state(rt.store, spec, Strategy.parse(load_from[1]), load_from[0])
        if rt.steps_done != first:
            raise RuntimeError(f"checkpoint {load_from[0]} holds step {rt.steps_done}, not {first}")
    t_loaded = time.time()
    rows, losses = [], {}
    for s in range(first, last):
        ts = time.time()
        loss, _ = rt.step()
        rows.append(("train", "step", ts, time.time(), s))
        losses[s] = float(loss)
    t_save = time.time()
    rt.sync_params()
    if save_to is not None:
        save_state(rt.store, ctx.rank, rt.steps_done, save_to)
    t_end = time.time()
    out = {"rank": ctx.rank, "losses": losses, "rows": rows, "enter": t_enter, "built": t_built,
           "loaded": t_loaded, "save_start": t_save, "save_end": t_end}
    if save_to is None and opts.get("export_final", True):
        out["final"] = {"rank": ctx.rank, "arrays": store_arrays(rt.store)}
    return out


def _preset(spec: models.ModelSpec) -> bool:
    try:
        return models.get(spec.name) == spec
    except Exception:  # noqa: BLE001 - a custom model
        return False


def run_restart_job(spec: models.ModelSpec, segments: list[tuple[Strategy, int, int]], workdir: str, *,
                    global_batch: int, seq_len: int, seed: int = 0, data_seed: int = 0,
                    optim: OptimConfig = OptimConfig(), timeout: float = 300.0,
                    export_final: bool = True) -> list[dict]:
    """Run ``segments`` (strategy, first step, end step) as separate jobs chained by DCP checkpoints
    under ``workdir``; returns per segment ``{"launch": wall time, "ranks": [rank reports]}``."""
    opts = {"global_batch": global_batch, "seq_len": seq_len, "seed": seed, "data_seed": data_seed,
            "optim": optim.__dict__, "timeout": timeout, "export_final": export_final}
    out = []
    prev: tuple[str, str] | None = None
    for i, (st, first, last) in enumerate(segments):
        save_to = os.path.join(workdir, f"ckpt{i}") if i + 1 < len(segments) else None
        if save_to:
            Path(save_to).mkdir(parents=True, exist_ok=True)
        t = time.time()
        ranks = launch_local(_segment, st.world, args=(spec, str(st), first, last, prev, save_to, opts),
                             timeout=timeout, backend="gloo")
        out.append({"launch": t, "done": time.time(), "ranks": ranks, "strategy": str(st)})
        prev = (save_to, str(st)) if save_to else None
    return out
