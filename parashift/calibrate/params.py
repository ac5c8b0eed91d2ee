"""The cost model's fittable parameters, their values as a vector, and which ones data can inform.

A parameter is a :class:`CostModel` field (``memory_efficiency``) or one key of a mapping field
(``efficiency.fwd``). ``link_bw.<link>`` is the achieved bandwidth of a link class
(``bandwidth * link_efficiency``): setting it keeps the datasheet bandwidth and moves the
efficiency, unless the achieved rate exceeds the datasheet, then the bandwidth rises instead.

Candidates are found from the CostModel's fields (so new fields are fitted without changes
here); the data then decides which ones it informs. Products that only act together
(``efficiency[phase] * region_efficiency[kind]``, ``phase_floor[phase] * region_floor[kind]``) keep
one factor, the reference kind, at its base value, so the fit is unique.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterable, Mapping, Sequence

from ..cost import CostModel

__all__ = ["Param", "get_value", "apply", "compute_candidates", "comm_candidates", "drop_gauges", "transfer_phases"]



@dataclass(frozen=True, order=True)
class Param:
    """One fittable parameter: ``field`` of CostModel and, for mapping fields, its ``key``."""

    field: str
    key: str | None = None

    @property
    def name(self) -> str:
        return f"{self.field}.{self.key}" if self.key is not None else self.field

    @classmethod
    def parse(cls, name: str) -> "Param":
        f, _, k = name.partition(".")
        return cls(f, k or None)


def get_value(cm: CostModel, p: Param) -> float:
    """The parameter's value in ``cm`` (an absent mapping key reads as the simulator's default 1 or 0)."""
    if p.field == "link_bw":
        return cm.link_bw(p.key)
    v = getattr(cm, p.field)
    if p.key is None:
        return float(v)
    return float(v.get(p.key, 0.0 if p.field.startswith("region_") and p.field != "region_efficiency" else 1.0))


def apply(cm: CostModel, params: Sequence[Param], values: Iterable[float]) -> CostModel:
    """``cm`` with ``params`` set to ``values``."""
    changes: dict[str, object] = {}
    for p, v in zip(params, values):
        v = float(v)
        if p.field == "link_bw":
            bw = dict(changes.get("bandwidth", cm.bandwidth))
            eff = dict(changes.get("link_efficiency", cm.link_efficiency))
            if v <= bw[p.key]:
                eff[p.key] = v / bw[p.key]
            else:
                bw[p.key], eff[p.key] = v, 1.0
            changes["bandwidth"], changes["link_efficiency"] = bw, eff
        elif p.key is None:
            changes[p.field] = v
        else:
            d = dict(changes.get(p.field, getattr(cm, p.field)))
            d[p.key] = v
            changes[p.field] = d
    return cm.replace(**changes)


#: fields that describe the hardware or the model's bookkeeping, not something a run measures
_STRUCTURAL = {"gpu", "peak_flops", "hbm_bw", "memory_capacity", "memory_reserved", "algorithm", "optim_traffic",
               "host_cores", "switch_overhead", "compute_model", "gemm_tile_m", "gemm_tile_n", "sms",
               "pp_scatter_gather", "step_p2p_posted", "gemm_sustained", "dtype_peaks",
               "bandwidth", "link_efficiency"}
_COMM = {"comm_overhead", "latency"}
#: products that only act together: (phase-keyed field, region-kind-keyed field)
_PRODUCTS = (("efficiency", "region_efficiency"), ("phase_floor", "region_floor"),
             ("phase_overhead", "region_overhead"))
#: order in which parameters are worth fitting (earlier first; later ones of a product are the reference)
_ORDER = ("efficiency", "region_floor", "region_overhead", "memory_efficiency", "optim_overhead",
          "region_efficiency", "phase_floor", "phase_overhead")
_KIND_ORDER = ("embed", "head", "attn", "moe", "layer", "mlp")
_PHASE_ORDER = ("optim", "recompute", "bwd_weight", "bwd_input", "bwd", "fwd")


def _key_rank(field: str, key: str) -> tuple:
    order = _KIND_ORDER if field.startswith("region_") else _PHASE_ORDER
    return (order.index(key) if key in order else -1, key)


def compute_candidates(cm: CostModel) -> list[Param]:
    """Every numeric compute parameter of ``cm`` (fields other than hardware, comm and bookkeeping),
    mapping fields one key each, in the order worth fitting."""
    out: list[Param] = []
    for f in fields(cm):
        if f.name in _STRUCTURAL or f.name in _COMM or f.name.startswith("comm_"):
            continue
        v = getattr(cm, f.name)
        if isinstance(v, Mapping):
            out += [Param(f.name, k) for k in sorted(v, key=lambda k: _key_rank(f.name, k))
                    if isinstance(v[k], (int, float))]
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append(Param(f.name))
    rank = {n: i for i, n in enumerate(_ORDER)}
    return sorted(out, key=lambda p: rank.get(p.field, len(rank)))


def comm_candidates(cm: CostModel, links: Iterable[str]) -> list[Param]:
    """Communication parameters: the per-operation overhead (and any other ``comm_*`` field, one
    key each for mappings), then achieved bandwidth and latency of each link class used."""
    ls = sorted(set(links))
    out: list[Param] = []
    for f in fields(cm):
        if not f.name.startswith("comm_"):
            continue
        v = getattr(cm, f.name)
        if isinstance(v, Mapping):
            out += [Param(f.name, k) for k in sorted(v) if isinstance(v[k], (int, float))]
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append(Param(f.name))
    return out + [Param("link_bw", k) for k in ls] + [Param("latency", k) for k in ls]


def drop_gauges(params: Sequence[Param]) -> list[Param]:
    """``params`` less one region-kind factor of each product that acts only together with a
    phase factor (the last kind in fitting order, usually ``mlp``), so the fit is unique."""
    drop: set[Param] = set()
    names = {p.field for p in params}
    for phase_f, kind_f in _PRODUCTS:
        if phase_f in names and kind_f in names:
            kinds = [p for p in params if p.field == kind_f]
            drop.add(kinds[-1])
    return [p for p in params if p not in drop]


#: an unobserved phase takes the calibration of the first observed phase it runs like
_RELATED = {"bwd_input": ("bwd", "bwd_weight"), "bwd_weight": ("bwd", "bwd_input"),
            "bwd": ("bwd_input", "bwd_weight"), "recompute": ("fwd",), "fwd": ("recompute",)}
_PHASE_KEYED = ("efficiency", "phase_floor", "phase_overhead")


def transfer_phases(base: CostModel, fitted: dict[Param, float], observed: Iterable[str]) -> dict[Param, float]:
    """Values for the phase-keyed parameters of phases no sample ran, moved from their base values
    by the factor their closest observed phase moved (split backward halves follow the full
    backward, recompute follows the forward, and the other way round)."""
    seen = set(observed)
    out: dict[Param, float] = {}
    for f in _PHASE_KEYED:
        if not hasattr(base, f):
            continue
        table = getattr(base, f)
        for q, related in _RELATED.items():
            if q in seen or q not in table:
                continue
            src = next((p for p in related if p in seen and Param(f, p) in fitted), None)
            if src is not None and get_value(base, Param(f, src)) > 0:
                out[Param(f, q)] = table[q] * fitted[Param(f, src)] / get_value(base, Param(f, src))
    return out
