"""The files a user passes to the CLI, read through one layer (:mod:`parashift.validate`).

Cost models, deploy plans and traces are checked against a schema before the library sees them,
so a wrong file ends in one line naming the file and the offending key, never a traceback or
the file's contents.
"""
from __future__ import annotations

from pathlib import Path
from ..errors import InputError, ParashiftError
from ..validate import Num, check, file_size, read_json

__all__ = ["load_cost_model", "load_plan", "resolve_trace", "COST_MODEL_SCHEMA", "PLAN_SCHEMA", "MAX_TRACE_BYTES"]

#: a trace file larger than this is refused before it is parsed (planning grows with its events)
MAX_TRACE_BYTES = 16 * 2**20

_POS = Num(0, lo_open=True)
_NONNEG = Num(0)
_RATE = Num(1)          # FLOP/s or bytes/s: below 1 a step's time overflows to inf
_EFF = Num(1e-6)        # an efficiency (a fraction of a peak); below it likewise
_LATENCY = Num(0, 3600)  # seconds a message waits: an hour is already no network
COST_MODEL_SCHEMA = {
    "format": str, "gpu": str, "peak_flops!": _RATE, "hbm_bw!": _RATE, "memory_capacity!": Num(0, lo_open=True),
    "efficiency": {"*": _EFF}, "region_efficiency": {"*": _EFF}, "region_floor": {"*": _NONNEG},
    "phase_floor": {"*": _NONNEG}, "attention_score_bytes": _NONNEG, "memory_efficiency": _EFF,
    "optim_traffic": _NONNEG, "optim_overhead": _NONNEG, "bandwidth": {"*": _RATE},
    "link_efficiency": {"*": _EFF}, "latency": {"*": _LATENCY}, "comm_overhead": _NONNEG, "p2p_overhead": _NONNEG,
    "algorithm": str, "memory_reserved": _NONNEG, "comm_op_overhead": {"*": _NONNEG}, "comm_op_bw": {"*": _EFF},
    "host_cores": _NONNEG, "p2p_posted": bool, "region_overhead": {"*": _NONNEG}, "phase_overhead": {"*": _NONNEG},
    "switch_overhead": _NONNEG,
}

_INSTR = [(Num(0, integer=True), str, dict)]
PLAN_SCHEMA = {
    "format!": str, "version!": Num(integer=True), "strategy!": str, "meta!": {
        "model!": str, "global_batch!": Num(1, integer=True), "seq_len!": Num(1, integer=True)},
    "programs!": [{"streams!": {"*": list}, "static_memory": {"*": Num(0)}}],
    "ranks!": {"*": Num(0, integer=True)},
}


def load_cost_model(path: "str | None"):
    """The :class:`~parashift.cost.CostModel` in ``path`` (schema-checked), or None when no path."""
    if not path:
        return None
    from ..cost import CostModel
    obj = read_json(path, "cost model")
    check(obj, COST_MODEL_SCHEMA, f"cost model {path}")
    try:
        return CostModel.from_json(obj)
    except ParashiftError:
        raise
    except (TypeError, ValueError, KeyError) as e:
        raise InputError(f"cost model {path} is malformed ({type(e).__name__}); start from "
                         f"CostModel.for_cluster(...).to_json()") from None


def load_plan(path: str):
    """A deploy plan (a saved Program), schema-checked, with at least one instruction on every rank."""
    from ..exec import load_plan as exec_load_plan
    from ..ir.program import Program
    obj = read_json(path, "plan")
    where = f"plan {path}"
    if not isinstance(obj, dict) or obj.get("format") != "parashift.program":
        raise InputError(f"{where} is not a parashift plan (format must be parashift.program); write one with "
                         f"`parashift search --out` or `parashift schedule --out`")
    check(obj, PLAN_SCHEMA, where)
    for i, prog in enumerate(obj["programs"]):
        for stream, instrs in prog["streams"].items():
            for k, ins in enumerate(instrs):
                if not (isinstance(ins, list) and len(ins) == 3 and isinstance(ins[1], str)
                        and isinstance(ins[2], dict) and isinstance(ins[0], int)):
                    raise InputError(f"{where}: programs[{i}].streams.{stream}[{k}] must be [id, op, {{fields}}]")
        if not any(prog["streams"].values()):
            raise InputError(f"{where}: programs[{i}] has no instructions (empty streams); a plan must "
                             f"compute something, recompile it")
    n = len(obj["programs"])
    bad = [r for r, i in obj["ranks"].items() if not (0 <= i < n) or not r.isdigit()]
    if bad:
        raise InputError(f"{where}: ranks.{bad[0]} names a program that does not exist (there are {n})")
    if not obj["ranks"]:
        raise InputError(f"{where}: ranks is empty; a plan runs at least one rank")
    try:
        Program.from_json(obj)
    except ParashiftError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise InputError(f"{where}: an instruction is malformed ({type(e).__name__}: {_short(e)}); "
                         f"recompile the plan") from None
    return exec_load_plan(path)


def _short(e: BaseException) -> str:
    text = str(e)
    return text if len(text) <= 60 else text[:57] + "..."


def resolve_trace(name: str) -> Path:
    """A trace argument as a file: an existing path is that path; otherwise a shipped trace name,
    resolved inside the shipped trace folder only (no ``..`` escapes). Size-checked."""
    from ..traces.shipped import resolve
    p = resolve(name)
    size = file_size(p, "trace")
    if size > MAX_TRACE_BYTES:
        raise InputError(f"trace {name} is {size / 2**20:.1f} MiB, over the {MAX_TRACE_BYTES / 2**20:.0f} MiB "
                         f"limit of trace planning; cut it to a window (e.g. with parashift.traces.window) first")
    return p
