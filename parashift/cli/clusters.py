"""`parashift clusters`: the cluster presets with their GPUs, links and NICs."""
from __future__ import annotations

import argparse

from .. import cluster as clusters

HELP = ("list the cluster presets (GPU, memory, peak FLOP/s per dtype, HBM, NVLink, NICs); --cluster also takes "
        "overrides")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster", action="append",
                   help="describe this cluster instead (a preset, preset:key=value,... or a JSON file); repeatable")


def run(args: argparse.Namespace) -> list:
    rows = []
    for n in (args.cluster or clusters.names()):
        c = clusters.get(n)
        g = c.gpu
        rows.append({"name": c.name, "gpu": g.name, "nodes": c.nodes, "per_node": c.per_node, "devices": c.devices,
                     "memory": g.memory, **{f"peak_{d}": g.peak(d) if g.has(d) else None
                                            for d in ("bf16", "tf32", "fp32", "fp8", "fp4")}, "hbm_bw": g.hbm_bw,
                     "intra_bw": g.intra_bw, "intra_latency": g.intra_latency, "nics_per_node": c.nics_per_node,
                     "nic_bw": c.nic_bw, "inter_bw_per_device": c.inter_bw, "inter_latency": g.inter_latency,
                     "interconnect": g.interconnect, "nvlink_domain": g.nvlink_domain, "power": g.power})
    return rows


def render(result: list, args: argparse.Namespace) -> None:
    import pandas as pd
    df = pd.DataFrame(result)
    out = pd.DataFrame({
        "name": df["name"], "devices": df["devices"],
        "memory": (df["memory"] / 2**30).map(lambda v: f"{v:.0f}GiB"),
        "bf16": (df["peak_bf16"] / 1e12).map(lambda v: f"{v:.0f}T"),
        "fp8": (df["peak_fp8"] / 1e12).map(lambda v: "-" if v != v else f"{v:.0f}T"),
        "hbm": (df["hbm_bw"] / 1e12).map(lambda v: f"{v:.2f}TB/s"),
        "nvlink": (df["intra_bw"] / 1e9).map(lambda v: f"{v:.0f}GB/s"),
        "nics": df["nics_per_node"].astype(str) + "x" + (df["nic_bw"] / 1e9).map(lambda v: f"{v:g}GB/s"),
        "inter/device": (df["inter_bw_per_device"] / 1e9).map(lambda v: f"{v:g}GB/s"),
    })
    print(out.to_string(index=False))
    print(f"any <gpu>-<nodes>x<per-node> parses (gpu: {', '.join(g for g in clusters.GPUS if g != 'cpu')}; "
          "gb200-nvl72 is one NVL72 rack); override with e.g. a100-64x8:nic_bw=12.5GB,nics_per_node=4 "
          f"(keys: {', '.join(clusters.OVERRIDES)})")
