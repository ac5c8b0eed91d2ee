"""Loaders for the vTrain A100 measurements shipped in ``traces/vtrain-a100`` (MIT, see its PROVENANCE.md).

``load_iterations()``: 1440 measured Megatron-DeepSpeed GPT iteration times on one node of 8 A100s
(1F1B, full recomputation). ``load_allreduce_lut(n)``: nccl-tests all-reduce times on n A100s.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import TraceFormatError

if TYPE_CHECKING:  # pragma: no cover
    from ..ir.program import Program
    from ..models import ModelSpec
    from ..strategy import Strategy

__all__ = ["DATA_DIR", "load_iterations", "load_allreduce_lut", "ITERATION_COLUMNS", "model_of", "strategy_of",
           "program_of"]

#: Where the repository ships the data (users have no ../shared).
DATA_DIR = Path(__file__).resolve().parents[2] / "traces" / "vtrain-a100"
ITERATION_COLUMNS = ("gpus", "global_batch", "mbs", "hidden", "heads", "layers", "seq_len", "tp", "dp", "pp",
                     "time_ms")


def _path(path: "str | Path | None", name: str) -> Path:
    p = Path(path) if path is not None else DATA_DIR / name
    if not p.exists():
        raise TraceFormatError(f"vTrain data file {p} is missing; it ships in the repository's "
                               f"traces/vtrain-a100/ folder (pass path= to read another copy)")
    return p


def load_iterations(path: "str | Path | None" = None):
    """The measured iterations as a DataFrame with :data:`ITERATION_COLUMNS` (time in ms)."""
    import pandas as pd
    p = _path(path, "ground_truth_single.csv")
    df = pd.read_csv(p)
    if df.shape[1] != len(ITERATION_COLUMNS):
        raise TraceFormatError(f"{p}: expected {len(ITERATION_COLUMNS)} columns "
                               f"({', '.join(ITERATION_COLUMNS)}), found {df.shape[1]}")
    df.columns = list(ITERATION_COLUMNS)
    bad = df[(df["tp"] * df["dp"] * df["pp"]) != df["gpus"]]
    if len(bad):
        raise TraceFormatError(f"{p}: row {int(bad.index[0]) + 2} has tp*dp*pp != gpus")
    return df


def load_allreduce_lut(gpus: int, path: "str | Path | None" = None):
    """nccl-tests all-reduce on ``gpus`` A100s: columns ``nbytes``, ``seconds`` (out-of-place), ``busbw``."""
    import pandas as pd
    p = _path(path, f"allreduce-lut/AR_GPU{gpus}_1M_1024M_LUT.csv")
    raw = pd.read_csv(p)
    if raw.shape[1] < 5:
        raise TraceFormatError(f"{p}: expected size, count, type, time(ns), busbw columns")
    return pd.DataFrame({"nbytes": raw.iloc[:, 0].astype("int64"), "seconds": raw.iloc[:, 3].astype(float) * 1e-9,
                         "busbw": raw.iloc[:, 4].astype(float) * 1e9})


def model_of(row) -> "ModelSpec":
    """The GPT of one measured row: GELU MLP of 4*hidden, LayerNorm with biases, learned positions,
    tied embeddings, fp16, GPT-2 vocabulary padded (as Megatron does) to a multiple of 128*tp, and
    unfused attention (Megatron-DeepSpeed of 2022: scores go through HBM)."""
    from ..models import gpt
    return gpt(layers=int(row.layers), hidden=int(row.hidden), heads=int(row.heads), ffn=4 * int(row.hidden),
               vocab=50257, seq_len=int(row.seq_len), name=f"gpt-h{int(row.hidden)}-l{int(row.layers)}",
               gated=False, bias=True, norm="ln", pos_emb="learned", tied=True, dtype="fp16",
               pad_vocab=128 * int(row.tp), flash_attention=False)


def strategy_of(row) -> "Strategy":
    """The measured layout: 1F1B with full recomputation."""
    from ..strategy import Strategy
    return Strategy(dp=int(row.dp), tp=int(row.tp), pp=int(row.pp), mbs=int(row.mbs), schedule="1f1b",
                    recompute="full")


def program_of(row) -> "tuple[Program, ModelSpec]":
    """The compiled training step of one measured row, and its model."""
    from ..ir import compile as ir_compile
    model = model_of(row)
    return ir_compile(model, strategy_of(row), global_batch=int(row.global_batch), seq_len=int(row.seq_len)), model
