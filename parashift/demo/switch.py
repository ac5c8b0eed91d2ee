"""Step 2, switch: the 128 -> 120 device shrink after node 5 of a800-16x8 is lost.

Also the helpers notebook 02 uses: the bytes-between-devices matrix of a plan and the transition
engine's ablation (each lowering pass turned off in turn).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..explore import PASSES, ablation, bytes_matrix, lower_and_simulate, node_bytes

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from ..vps import SwitchPlan
    from .core import DemoContext, StepResult

__all__ = ["NODE_LOSS", "bytes_matrix", "node_bytes", "lower_and_simulate", "ablation", "node_loss", "step_switch"]

#: The scenario: dp=4,tp=8,pp=4 on 128 A800s loses node 5 (devices 40-47) and shrinks to 120.
NODE_LOSS = {"model": "llama2-70b", "cluster": "a800-16x8", "src": "dp=4,tp=8,pp=4,zero=1",
             "dst": "dp=3,tp=8,pp=5,zero=1", "src_devices": "0-127", "dst_devices": "0-39,48-127"}


def node_loss(**overrides: str) -> tuple["SwitchPlan", dict]:
    """Plan, verify, lower and simulate the :data:`NODE_LOSS` switch (fields overridable) and
    estimate checkpoint-restart for it. Returns the plan and its figures."""
    import time

    from .. import sim, vps
    sc = {**NODE_LOSS, **overrides}
    t0 = time.perf_counter()
    plan = vps.plan_switch(sc["model"], sc["src"], sc["dst"], cluster=sc["cluster"], src_devices=sc["src_devices"],
                           dst_devices=sc["dst_devices"])
    plan_s = time.perf_counter() - t0
    plan.verify()
    sw = lower_and_simulate(plan)
    ck = sim.estimate_checkpoint_restart(plan.model, plan.src_strategy, plan.dst_strategy, plan.cluster)
    stats = plan.stats()
    return plan, {**stats, "plan_s": plan_s, **sw, "checkpoint_restart_s": ck.total_seconds,
                  "checkpoint_save_s": ck.save_seconds, "checkpoint_restart_only_s": ck.restart_seconds,
                  "checkpoint_load_s": ck.load_seconds, "speedup": ck.total_seconds / sw["switch_s"]}


def step_switch(ctx: "DemoContext", res: "StepResult") -> None:
    """Step 2: plan stats, simulated switch time and the checkpoint-restart estimate."""
    from ..plots import plot_bars, plot_bytes_heatmap
    ctx.say("planning and verifying the 128 -> 120 device switch")
    plan, f = node_loss()
    gib = 2**30
    plan.to_frame().to_csv(ctx.path("switch_plan.csv"), index=False)
    plot_bytes_heatmap(node_bytes(plan), ctx.path("switch_node_bytes.png"),
                       title="bytes moved between nodes (node 5 lost)", src_label="source node",
                       dst_label="destination node")
    plot_bars(["hot switch (simulated)", "checkpoint-restart (estimate)"], [f["switch_s"], f["checkpoint_restart_s"]],
              ctx.path("switch_vs_checkpoint.png"), ylabel="seconds (log scale)", log=True,
              colors=["#4C72B0", "#DD8452"],
              title="128 -> 120 devices after a node loss")
    res.add("state kept in place", f["bytes_kept"] / gib, "GiB")
    res.add("state moved", f["bytes_moved"] / gib, "GiB")
    res.add("state moved across nodes", f["bytes_inter_node"] / gib, "GiB")
    res.add("device pairs exchanging data", f["messages"], "messages")
    res.add("planning time", f["plan_s"], "s")
    res.add("simulated switch time", f["switch_s"], "s")
    res.add("switch peak memory", f["peak_memory_gib"], "GiB")
    res.add("checkpoint-restart estimate", f["checkpoint_restart_s"], "s")
    res.add("hot switch speedup over checkpoint-restart", f["speedup"], "x")
    res.files.update({"bytes between nodes": "switch_node_bytes.png",
                      "switch vs checkpoint-restart": "switch_vs_checkpoint.png", "plan pieces": "switch_plan.csv"})
    sc = NODE_LOSS
    res.body = (f"{sc['model']} on {sc['cluster']}: `{sc['src']}` on devices {sc['src_devices']} -> `{sc['dst']}` "
                f"on devices {sc['dst_devices']} (node 5 lost). The plan is verified (every destination element "
                f"covered exactly once); it moves exactly the {f['bytes_needed'] / gib:.1f} GiB the new layout lacks. "
                f"Checkpoint-restart = save {f['checkpoint_save_s']:.1f} s + restart {f['checkpoint_restart_only_s']:.0f} s"
                f" + load/reshard {f['checkpoint_load_s']:.1f} s.")
    res.data.update(plan=plan, figures=f)
