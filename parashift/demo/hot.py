"""Step 4, hot switch: the live 4-process job shrinks to 3 devices and grows back to 4, each switch's
pause next to a DCP checkpoint-reshard of the same state; the loss next to a job that never switched."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .core import DemoError, require
from .deploy import LIVE

if TYPE_CHECKING:  # pragma: no cover
    from .core import DemoContext, StepResult

__all__ = ["HOT", "run_live_fn", "best_strategy", "hot_switch", "step_hot_switch"]

#: Steps of the live job and where it switches: 4 devices, then 3 (device 3 leaves), then 4 again.
HOT = {"steps": 8, "shrink_at": 3, "grow_at": 6}


def run_live_fn() -> Any:
    """``parashift.exec``'s runner of live, hot-switching jobs."""
    return require("parashift.exec", "run_live").run_live


def best_strategy(devices: int, n_trials: int = LIVE["n_trials"]) -> Any:
    """The search's best strategy for :data:`LIVE`'s model on all of ``devices`` CPU processes."""
    search = require("parashift.search", "tune")
    res = search.tune(LIVE["model"], LIVE["cluster"], devices=devices, global_batch=LIVE["global_batch"],
                      seq_len=LIVE["seq_len"], n_trials=n_trials, seed=LIVE["seed"], all_devices=True)
    if res.best is None:
        raise DemoError(f"the search found no strategy for {LIVE['model']} on {devices} processes in {n_trials} "
                        f"trials; run more trials")
    return res.best.strategy


def hot_switch(big: Any, small: Any, *, steps: int = HOT["steps"], shrink_at: int = HOT["shrink_at"],
               grow_at: int = HOT["grow_at"], workdir: str | None = None, progress: Any = None) -> dict:
    """The live job (``big`` on devices 0-3, ``small`` on 0-2 from step ``shrink_at``, ``big`` on 0-3
    from ``grow_at``: device 3 rejoins as a fresh process), a static job of ``big``, and the same
    layouts and steps by checkpoint-restart (DCP save, new processes, DCP load and reshard).

    Returns the loss curves (``losses``, ``static_losses``, ``restart_losses``), the live job's
    ``switches`` (``pause_seconds``, ``seconds`` and phases) and, per switch, the training time lost
    (end of the step before it to the start of the step after it, slowest process) by the hot
    switch (``hot_lost``) and by checkpoint-restart (``restart_lost``)."""
    import tempfile

    from .. import models
    from ..strategy import Strategy
    run_live = run_live_fn()
    ex = require("parashift.exec", "run")
    rr = require("parashift.replay.restart", "run_restart_job")
    rres = require("parashift.replay.result", "step_rows", "lost_per_switch")
    big, small = Strategy.parse(big), Strategy.parse(small)
    gb, seq = LIVE["global_batch"], LIVE["seq_len"]

    def tick(step: int, loss: float) -> None:
        if progress is not None:
            progress(f"live step {step + 1}/{steps}: loss {loss:.4f}")
    live = run_live(LIVE["model"], big, steps=steps, global_batch=gb, seq_len=seq,
                    switches=[(shrink_at, small, None), (grow_at, big, None)], progress=tick)
    if progress is not None:
        progress(f"static job of {big} for {steps} steps (the reference loss curve)")
    static = ex.run(LIVE["model"], big, steps=steps, global_batch=gb, seq_len=seq, profile=False)
    if progress is not None:
        progress("the same job by checkpoint-restart: DCP save, new processes, DCP load and reshard")
    with tempfile.TemporaryDirectory(prefix="parashift-demo-ckpt-", dir=workdir) as tmp:
        segs = rr.run_restart_job(models.get(LIVE["model"]), [(big, 0, shrink_at), (small, shrink_at, grow_at),
                                                              (big, grow_at, steps)], tmp, global_batch=gb,
                                  seq_len=seq, export_final=False)
    restart_ranks = [r for s in segs for r in s["ranks"]]
    restart_losses = [sum(r["losses"][k] for r in restart_ranks if k in r["losses"]) for k in range(steps)]
    at = [shrink_at, grow_at]
    return {"live": live, "losses": list(live.losses), "static_losses": list(static.losses),
            "restart_losses": restart_losses, "switches": list(live.switches),
            "hot_lost": rres.lost_per_switch(rres.step_rows(list(live.reports.values())), at),
            "restart_lost": rres.lost_per_switch(rres.step_rows(restart_ranks), at)}


def step_hot_switch(ctx: "DemoContext", res: "StepResult") -> None:
    """Step 4: shrink 4 -> 3, grow 3 -> 4, against DCP checkpoint-reshard of the same state."""
    from ..plots import plot_bars, plot_losses
    big = ctx.shared.get("share_strategy")
    if big is None or big.world != LIVE["devices"]:  # the job shrinks from all four devices
        ctx.say(f"searching the best strategy on {LIVE['devices']} processes")
        big = best_strategy(LIVE["devices"])
    ctx.say("searching the best strategy on 3 processes")
    small = best_strategy(3)
    ctx.say(f"live job: {big} on 4 processes -> {small} on 3 at step {HOT['shrink_at']} -> back at {HOT['grow_at']}")
    h = hot_switch(big, small, workdir=str(ctx.out), progress=ctx.say)
    sw = h["switches"]
    if len(sw) != 2 or any(s.get("aborted") for s in sw):
        raise RuntimeError(f"the live job did not complete both switches: {sw}")
    losses, static = h["losses"], h["static_losses"]
    if len(losses) != HOT["steps"]:
        raise RuntimeError(f"the live job trained {len(losses)} of {HOT['steps']} steps")
    dev = max(abs(a - b) / abs(b) for a, b in zip(losses, static))
    plot_losses({"hot-switching job (4 -> 3 -> 4 devices)": losses, "static job (4 devices)": static,
                 "checkpoint-restart job": h["restart_losses"]}, ctx.path("hot_switch_loss.png"),
                marks=[(HOT["shrink_at"], "shrink to 3"), (HOT["grow_at"], "grow to 4")],
                title=f"{LIVE['model']}: loss with and without reconfigurations")
    labels = ["shrink: hot switch", "shrink: DCP ckpt-restart", "grow: hot switch", "grow: DCP ckpt-restart"]
    values = [h["hot_lost"][0], h["restart_lost"][0], h["hot_lost"][1], h["restart_lost"][1]]
    plot_bars(labels, values, ctx.path("hot_switch_pause.png"), ylabel="training time lost (s, log)", log=True,
              title="hot switch vs checkpoint-restart of the same state", colors=["#4C72B0", "#DD8452"] * 2)
    for i, name in enumerate(("shrink 4 -> 3", "grow 3 -> 4")):
        res.add(f"{name}: hot switch pause", sw[i]["pause_seconds"], "s")
        res.add(f"{name}: hot switch, training time lost", h["hot_lost"][i], "s")
        res.add(f"{name}: hot switch work incl. background planning and world creation", sw[i]["seconds"], "s")
        res.add(f"{name}: DCP checkpoint-restart, training time lost", h["restart_lost"][i], "s")
        res.add(f"{name}: checkpoint-restart / hot switch", h["restart_lost"][i] / h["hot_lost"][i], "x")
    res.add("largest relative loss difference to the static job", dev, "")
    res.files.update({"loss: hot-switching vs static vs checkpoint-restart": "hot_switch_loss.png",
                      "training time lost per switch": "hot_switch_pause.png"})
    res.body = (f"The live job trains `{big}` on devices 0-3, switches in memory to `{small}` on devices 0-2 "
                f"before step {HOT['shrink_at'] + 1} (device 3 leaves) and back to `{big}` before step "
                f"{HOT['grow_at'] + 1} (device 3 rejoins as a fresh process). The baseline runs the same "
                f"layouts and steps as separate jobs: PyTorch Distributed Checkpoint save, new processes, "
                f"load and reshard. Time lost = end of the step before the switch to the start of the step "
                f"after it.")
    res.data.update(hot=h, share_small=small)
