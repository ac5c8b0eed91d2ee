"""Rank functions of the RL-phase tests (importable by spawned processes)."""
from __future__ import annotations

import numpy as np

from parashift import models
from parashift.exec.rl.weights import WeightSwitch
from parashift.exec.runtime import Runtime, compile_program
from parashift.exec.switch.stores import store_arrays


def round_trip(ctx, model: str, train: str, rollout: str, dtype: str, release: bool, kinds: tuple) -> dict:
    """Train a step, switch ``kinds`` to the rollout layout and back, train a step; what each saw."""
    spec = models.get(model)
    rt = Runtime(compile_program(model, train, global_batch=8, seq_len=16), ctx, model=spec)
    rt.step()
    before = store_arrays(rt.store)
    ws = WeightSwitch(spec, train, rollout, ctx.rank, kinds=kinds, dtype=dtype, release=release)
    out = ws.to_rollout(rt.store)
    released = {f: int(b.param.untyped_storage().nbytes()) for f, b in rt.store.buffers.items()}
    ro = None if ws.store is None else {f: {k: getattr(b, k).float().numpy().copy() for k in kinds}
                                        for f, b in ws.store.buffers.items()}
    ro_dtype = None if ws.store is None else str(next(iter(ws.store.buffers.values())).param.dtype)
    ws.to_train(rt.store)
    after = store_arrays(rt.store)
    loss, _ = rt.step()
    return {"before": before, "after": after, "rollout": ro, "rollout_dtype": ro_dtype, "released": released,
            "loss": float(loss), "sent": out.bytes_sent}
