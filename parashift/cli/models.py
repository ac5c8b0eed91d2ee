"""`parashift models`: the model presets with their parameter counts."""
from __future__ import annotations

import argparse

from .. import models

HELP = "list the model presets with their parameter counts"


def add_arguments(p: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> list:
    rows = []
    for n in models.names():
        m = models.get(n)
        rows.append({"name": n, "params": m.params, "active_params": m.active_params, "layers": m.layers,
                     "hidden": m.hidden, "heads": m.heads, "kv_heads": m.kv_heads, "experts": m.experts,
                     "top_k": m.top_k, "vocab": m.vocab, "dtype": m.dtype})
    return rows


def render(result: list, args: argparse.Namespace) -> None:
    import pandas as pd
    df = pd.DataFrame(result)
    df["params"] = df["params"].map(lambda p: f"{p / 1e9:.2f}B" if p >= 1e8 else f"{p / 1e6:.2f}M")
    df["active_params"] = df["active_params"].map(lambda p: f"{p / 1e9:.2f}B" if p >= 1e8 else f"{p / 1e6:.2f}M")
    print(df.to_string(index=False))
