"""The cost model: compute from FLOPs/bytes, communication by alpha-beta per link class.

Every parameter lives in one frozen :class:`CostModel` that round-trips through JSON, so
calibration can fit it and users can edit it. Link classes: ``local`` (same device: a copy
through HBM), ``intra`` (NVLink/PCIe inside a node) and ``inter`` (the NIC between nodes).

``nbytes`` of a collective is the full buffer: the reduced tensor for all_reduce, the gathered
(unsharded) output for all_gather, the unsharded input for reduce_scatter, the local send buffer
for all_to_all, and the broadcast/scattered/gathered buffer at the root for the rooted ones.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ..collectives import OPS as SWITCH_OPS, P2P_OPS, TWO_ENDED_OPS
from ..errors import ParashiftError
from ..gpus import DTYPES
from .fitted import A100_VTRAIN

if TYPE_CHECKING:  # pragma: no cover
    from ..cluster import Cluster
    from ..gpus import GPU
    from ..ir.program import Instr
    from .compute import Workload

__all__ = ["CostModel", "Phase", "LINK_CLASSES", "ALGORITHMS", "region_units", "topology", "apply_knobs", "knobs_of"]

LINK_CLASSES = ("local", "intra", "inter")
ALGORITHMS = ("auto", "ring", "tree", "hierarchical")
REGION_KINDS = ("embed", "attn", "mlp", "moe", "head", "layer")


class CostModelError(ParashiftError, ValueError):
    """A cost model file or field that cannot be used."""


@dataclass(frozen=True)
class Phase:
    """One step of a transfer: ``nbytes`` each member sends over its ``link`` class after ``latency`` s."""

    link: str
    nbytes: float
    latency: float


def _d(**kw: float) -> dict:
    return dict(kw)


@dataclass(frozen=True)
class CostModel:
    """All parameters of the simulated cost of an instruction.

    Compute: the largest of ``flops / (peak_flops * efficiency[phase] * region_efficiency[kind])``,
    ``nbytes / (hbm_bw * memory_efficiency)`` and the dispatch floor ``region_floor[kind]`` seconds
    per region unit times ``phase_floor[phase]`` (the host launches kernels ahead of the GPU, so
    small layers take as long as their launches, large ones as long as their math).
    Communication: ``comm_overhead`` (plus ``p2p_overhead`` for send/recv) + per phase ``latency[link] * steps + bytes / (bandwidth[link] *
    link_efficiency[link])``; ``algorithm`` picks ring, tree or hierarchical, ``auto`` the fastest.
    Unfused attention (no flash attention): ``attention_score_bytes`` of HBM traffic per score
    element (mbs x heads/tp x seq^2 per layer) and forward pass, added to attention regions when the
    simulator knows the model; 0 models fused (flash) attention, whose scores never reach HBM.
    Memory: a device fits when its peak plus ``memory_reserved`` is at most ``memory_capacity``.
    Per operation (``all_reduce``, ``send``, ``copy``, ...): ``comm_op_overhead[op]`` replaces
    ``comm_overhead`` and ``comm_op_bw[op]`` scales the achieved bandwidth (e.g. a reduce-scatter
    that a backend runs as an all-reduce); unlisted operations use the shared values.
    Dispatch paid on top of the math (a host that runs each op itself, e.g. CPU processes): every
    compute region adds ``region_overhead[kind]`` seconds per unit times ``phase_overhead[phase]``
    (default 1) after the max above (both empty by default: GPUs overlap launches with math).
    Shared hosts: ``host_cores`` > 0 says the devices of one node are processes sharing that
    many CPU cores, so compute running at once on ``n`` of them proceeds at
    ``min(1, host_cores / n)`` of its speed (0: every device computes on its own, as GPUs do).
    Shapes (``compute_model="shape"``, the default on GPUs, when the simulator knows the model): a
    region's time comes from its kernels (:mod:`parashift.cost.compute`: GEMM tiles and waves over
    ``sms`` SMs at ``gemm_efficiency`` of peak, never above ``gemm_sustained`` of peak (the rate the
    GPU holds at its power limit), memory-bound operands, ``gemm_overhead`` per kernel,
    flash or unfused attention, elementwise traffic through HBM), still at least the dispatch floor;
    ``"flops"`` (or no model known) is the FLOPs-at-efficiency rule above.
    ``pp_scatter_gather``: a pipeline send of a training step under TP moves 1/tp of the activation
    per TP rank, then an all-gather inside the receiving node (Megatron's scatter/gather); False:
    every TP rank sends the whole activation. ``step_p2p_posted``: like ``p2p_posted`` for training
    steps only (a switch Program's rounds still run one transfer at a time per stream).
    ``recompute_tp_comm``: a ``recompute`` of an attention or MLP region under TP (shape model) also
    pays the region's forward TP collective inside the node (all-reduce; with ``sp`` reduce-scatter
    plus all-gather), as Megatron-LM's checkpointed forward re-runs its row-parallel reduction on the
    compute stream; False: the recompute re-runs only the kernels. A ``selective`` recompute (shape
    model) re-runs only the core attention's kernels, without the region's floor or TP collective, and
    nothing under context parallelism (see :class:`~parashift.cost.compute.Workload`).
    ``grad_accum_traffic``: under the shape model, the weight-gradient backward of every micro-batch
    but the first (index 0) also streams ``grad_accum_traffic`` x dtype bytes per parameter of the
    region on this rank through HBM: its gradient is added into the one the earlier micro-batches
    left (read both, write the sum: 3), as PyTorch's ``AccumulateGrad`` does (Megatron-LM's local DDP
    of 2021 included); a strategy with ``grad_fusion`` (the add fused into the weight-gradient GEMM,
    Megatron-LM's ``--gradient-accumulation-fusion``) pays none of it, nor does one with ``zero`` >= 2 (every
    micro-batch's gradients fill a fresh bucket that is reduce-scattered into the shard).
    ``dtype_peaks``: dense FLOP/s per GEMM dtype (fp32, tf32, fp8, fp4 where the GPU has them; see
    :meth:`peak`), from the GPU's record.
    Switches: ``switch_overhead`` seconds a hot switch pays on top of its Program (allocating the
    new layout's buffers, starting the transfer), added by ``simulate_switch``.
    ``p2p_posted``: a stream posts each send/recv and goes on without waiting for it (a runtime
    of asynchronous point-to-point operations); False: a stream's transfers run one at a time.
    """

    gpu: str
    peak_flops: float
    hbm_bw: float
    memory_capacity: int
    efficiency: Mapping[str, float] = field(default_factory=lambda: _d(
        fwd=0.6, bwd=0.6, bwd_input=0.6, bwd_weight=0.6, recompute=0.6, optim=0.6))
    region_efficiency: Mapping[str, float] = field(default_factory=lambda: _d(
        embed=0.5, attn=0.85, mlp=1.0, moe=0.8, head=1.0, layer=0.95))
    region_floor: Mapping[str, float] = field(default_factory=lambda: _d(
        embed=2e-5, attn=1e-4, mlp=6e-5, moe=2e-4, head=5e-5, layer=1.6e-4))
    phase_floor: Mapping[str, float] = field(default_factory=lambda: _d(
        fwd=1.0, bwd=2.0, bwd_input=1.0, bwd_weight=1.0, recompute=1.0, optim=1.0))
    attention_score_bytes: float = 0.0
    memory_efficiency: float = 0.8
    optim_traffic: float = 2.0
    optim_overhead: float = 2e-4
    bandwidth: Mapping[str, float] = field(default_factory=lambda: _d(local=1e12, intra=3e11, inter=2.5e10))
    link_efficiency: Mapping[str, float] = field(default_factory=lambda: _d(local=0.8, intra=0.77, inter=0.9))
    latency: Mapping[str, float] = field(default_factory=lambda: _d(local=1e-6, intra=3e-6, inter=8e-6))
    comm_overhead: float = 1e-5
    p2p_overhead: float = 0.0
    algorithm: str = "auto"
    memory_reserved: int = 2 * 2**30
    comm_op_overhead: Mapping[str, float] = field(default_factory=dict)
    comm_op_bw: Mapping[str, float] = field(default_factory=dict)
    host_cores: float = 0.0
    p2p_posted: bool = False
    region_overhead: Mapping[str, float] = field(default_factory=dict)
    phase_overhead: Mapping[str, float] = field(default_factory=dict)
    switch_overhead: float = 0.0
    compute_model: str = "shape"
    gemm_efficiency: float = 0.8
    gemm_sustained: float = 1.0
    gemm_tile_m: int = 256
    gemm_tile_n: int = 128
    gemm_k_half: float = 64.0
    gemm_overhead: float = 4e-6
    flash_efficiency: float = 0.5
    elementwise_bytes: float = 1.0
    sms: int = 108
    pp_scatter_gather: bool = True
    step_p2p_posted: bool = False
    recompute_tp_comm: bool = True
    grad_accum_traffic: float = 3.0
    dtype_peaks: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.compute_model not in ("shape", "flops"):
            raise CostModelError(f"compute_model {self.compute_model!r} must be shape (kernel shapes) or flops "
                                 f"(FLOPs at efficiency[phase]); fix the cost model file")
        if not (self.gemm_efficiency > 0 and self.flash_efficiency > 0 and 0 < self.gemm_sustained <= 1) \
                or self.gemm_tile_m < 1 \
                or self.gemm_tile_n < 1 or self.sms < 1 or self.gemm_k_half < 0 or self.elementwise_bytes < 0 \
                or self.grad_accum_traffic < 0:
            raise CostModelError("gemm_efficiency and flash_efficiency must be positive, gemm_sustained in (0, 1], "
                                 "tiles and sms >= 1, "
                                 "gemm_k_half, elementwise_bytes and grad_accum_traffic >= 0; fix the cost model file")
        if self.algorithm not in ALGORITHMS:
            raise CostModelError(f"unknown collective algorithm {self.algorithm!r}; use one of {', '.join(ALGORITHMS)}")
        for name in ("bandwidth", "link_efficiency", "latency"):
            missing = [c for c in LINK_CLASSES if c not in getattr(self, name)]
            if missing:
                raise CostModelError(f"cost model field {name} lacks link classes {missing}; give all of {LINK_CLASSES}")
        if self.peak_flops <= 0 or self.hbm_bw <= 0:
            raise CostModelError("peak_flops and hbm_bw must be positive")
        bad = [k for k, v in self.comm_op_bw.items() if not v > 0]
        if bad or self.host_cores < 0 or self.switch_overhead < 0:
            raise CostModelError(f"comm_op_bw factors must be positive (got {bad}) and host_cores >= 0 "
                                 f"(got {self.host_cores}), switch_overhead >= 0; fix the cost model file")

    # ---- construction -----------------------------------------------------------------------
    @classmethod
    def for_gpu(cls, gpu: "GPU", fitted: bool = True) -> "CostModel":
        """Defaults from a GPU kind's record (:mod:`parashift.gpus`: datasheet numbers, its sustained
        GEMM ceiling; a ``clock`` below 1 scales every compute efficiency), the tuning of its ``family`` (:data:`GPU_TUNING`) and, with ``fitted``, the knobs
        fitted on that family's measurements (:mod:`parashift.cost.fitted`). A family this table does
        not know raises: no GPU is priced with another's tuning by default."""
        tuning = GPU_TUNING.get(gpu.family)
        if tuning is None:
            raise CostModelError(f"GPU kind {gpu.name} names cost tuning family {gpu.family!r}, which "
                                 f"parashift.cost does not know; give it one of {', '.join(GPU_TUNING)}")
        base = cls(gpu=gpu.name, peak_flops=gpu.peak_flops, hbm_bw=gpu.hbm_bw, memory_capacity=int(gpu.memory),
                   sms=gpu.sms, gemm_sustained=gpu.gemm_sustained,
                   dtype_peaks={d: gpu.peak(d) for d in DTYPES if gpu.has(d)},
                   bandwidth=_d(local=gpu.hbm_bw / 2, intra=gpu.intra_bw, inter=gpu.inter_bw),
                   latency=_d(local=1e-6, intra=gpu.intra_latency, inter=gpu.inter_latency))
        out = replace(base, **tuning)
        if fitted and gpu.family == "a100":
            out = apply_knobs(out, A100_VTRAIN)
        if gpu.clock != 1.0:    # a part held below its rated clock: every compute rate of the datasheet peak falls
            c = gpu.clock
            out = replace(out, gemm_efficiency=out.gemm_efficiency * c, gemm_sustained=out.gemm_sustained * c,
                          flash_efficiency=out.flash_efficiency * c,
                          efficiency={k: v * c for k, v in out.efficiency.items()})
        return out

    @classmethod
    def for_cluster(cls, cluster: "Cluster") -> "CostModel":
        """Defaults for a cluster's GPU kind, with its NICs' per-device share as the inter-node bandwidth."""
        base = cls.for_gpu(cluster.gpu)
        return replace(base, bandwidth={**base.bandwidth, "inter": cluster.inter_bw})

    def replace(self, **changes: Any) -> "CostModel":
        return replace(self, **changes)

    # ---- JSON -------------------------------------------------------------------------------
    def to_json(self) -> dict:
        d = asdict(self)
        return {"format": "parashift.cost_model", **{k: (dict(v) if isinstance(v, Mapping) else v) for k, v in d.items()}}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "CostModel":
        obj = dict(obj)
        if obj.pop("format", "parashift.cost_model") != "parashift.cost_model":
            raise CostModelError("not a parashift cost model (format must be parashift.cost_model)")
        known = {f.name for f in fields(cls)}
        obj.setdefault("compute_model", "flops")  # files from before the shape model priced FLOPs
        unknown = sorted(set(obj) - known)
        if unknown:
            raise CostModelError(f"unknown cost model fields {unknown}; known fields are {sorted(known)}")
        try:
            return cls(**obj)
        except TypeError as e:
            raise CostModelError(f"incomplete cost model: {e}; start from CostModel.for_cluster(...).to_json()") from None

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "CostModel":
        try:
            with open(path) as f:
                return cls.from_json(json.load(f))
        except (OSError, json.JSONDecodeError) as e:
            raise CostModelError(f"cannot read cost model {path}: {e}") from None

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_json(), sort_keys=True))

    # ---- compute ----------------------------------------------------------------------------
    def compute_time(self, instr: "Instr", state_bytes: float = 0.0, scores_per_layer: float = 0.0,
                     work: "Workload | None" = None) -> float:
        """Seconds of one compute instruction alone on its device.

        ``state_bytes``: the rank's static state bytes; an optimizer step with ``nbytes == 0``
        streams ``optim_traffic * state_bytes`` through HBM. ``scores_per_layer``: attention score
        elements of one layer on this rank (mbs x heads/tp x seq^2), for unfused attention.
        ``work``: the rank's :class:`~parashift.cost.compute.Workload` (shapes); with
        ``compute_model="shape"`` its kernel times replace the FLOPs rule.
        """
        phase = instr.phase or "fwd"
        if phase == "optim":
            nbytes = instr.nbytes or self.optim_traffic * state_bytes
            t_mem = nbytes / (self.hbm_bw * self.memory_efficiency)
            t_flop = instr.flops / (self.peak_flops * self.efficiency.get("optim", 1.0))
            return max(t_mem, t_flop) + self.optim_overhead
        units = region_units(instr.region)
        if work is not None and self.compute_model == "shape":
            t_shape = self._shape_time(units, phase, work)
            if t_shape is not None:
                if phase == "recompute" and work.selective:   # a few core-attention kernels: no region floor
                    return t_shape
                t = self._with_floor(t_shape, units, phase)
                if phase == "recompute" and self.recompute_tp_comm and work.tp > 1:
                    t += self._recompute_comm(units, work)
                if phase == "fwd" and not instr.microbatch and work.fp8 != "none":   # the step's FP8 weight copies
                    t += sum(work.fp8_weight_cast(self, k) * n for k, n in units if n)
                if phase in ("bwd", "bwd_weight") and instr.microbatch and self.grad_accum_traffic:
                    t += sum(work.grad_accum(self, k) * n for k, n in units if n)
                return t
        eff = self.efficiency.get(phase, 1.0)
        kinds = [k for k, n in units if n]
        if len(kinds) == 1:
            eff *= self.region_efficiency.get(kinds[0], 1.0)
        elif kinds:
            eff *= self.region_efficiency.get("layer", 1.0)
        t = instr.flops / (self.peak_flops * eff) if instr.flops else 0.0
        if t and work is not None and work.fp8 != "none" and "fp8" in self.dtype_peaks:
            f = work.fp8_share(units)            # the FP8 GEMMs' FLOPs at the FP8 rate
            t = t * (1 - f + f * self.peak_flops / self.peak("fp8")) + work.fp8_flops_casts(self, units, phase)
        if instr.nbytes:
            t = max(t, instr.nbytes / (self.hbm_bw * self.memory_efficiency))
        pf = self.phase_floor.get(phase, 1.0)
        floor = sum(self.region_floor.get(k, 0.0) * n for k, n in units) * pf
        t = max(t, floor)
        if self.region_overhead:
            t += sum(self.region_overhead.get(k, 0.0) * n for k, n in units) * self.phase_overhead.get(phase, 1.0)
        if scores_per_layer and self.attention_score_bytes and phase != "bwd_weight":
            layers = sum(n for k, n in units if k in ("attn", "layer"))
            t += layers * scores_per_layer * self.attention_score_bytes * pf / (self.hbm_bw * self.memory_efficiency)
        return t

    def best_rate(self) -> float:
        """FLOP/s no compute instruction beats (for lower bounds on step time)."""
        rate = self.peak_flops * max(self.efficiency.values()) * max(self.region_efficiency.values())
        if self.compute_model == "shape":
            rate = max(rate, self.peak_flops * max(min(self.gemm_efficiency, self.gemm_sustained), self.flash_efficiency))
        return rate

    def peak(self, dtype: str) -> float:
        """Dense FLOP/s of one device's ``dtype`` GEMMs (the GPU record's rates in ``dtype_peaks``;
        bf16/fp16 at ``peak_flops``); a dtype the GPU has no rate for raises."""
        if dtype in ("bf16", "fp16"):
            return self.peak_flops
        if dtype not in self.dtype_peaks:
            raise CostModelError(f"the {self.gpu} cost model has no {dtype} rate (it has "
                                 f"{', '.join(['bf16', 'fp16', *sorted(set(self.dtype_peaks) - {'bf16', 'fp16'})])}); "
                                 f"run {dtype} on a GPU kind that has it or add dtype_peaks.{dtype} to the cost model file")
        return float(self.dtype_peaks[dtype])

    def _shape_time(self, units: tuple, phase: str, work: "Workload") -> float | None:
        total = 0.0
        for kind, n in units:
            if not n:
                continue
            t = work.time(self, kind, phase)
            if t is None:
                return None
            total += t * n
        return total

    def _recompute_comm(self, units: tuple, work: "Workload") -> float:
        """Seconds of the forward TP collectives a recompute of ``units`` re-runs (one per attention
        or MLP region, over ``work.tp`` ranks of one node, on the compute stream)."""
        n = sum(c for k, c in units if k in ("attn", "mlp")) + 2 * sum(c for k, c in units if k == "layer")
        if not n:
            return 0.0
        nbytes = work.mbs * work.seq_len / work.cp * work.model.hidden * work.model.dtype_bytes
        topo = (work.tp, 1, work.tp, False)
        ops = ("reduce_scatter", "all_gather") if work.sp else ("all_reduce",)
        return n * sum(self.op_time(op, self.collective_phases(op, nbytes, topo)) for op in ops)

    def _with_floor(self, t: float, units: tuple, phase: str) -> float:
        floor = sum(self.region_floor.get(k, 0.0) * n for k, n in units) * self.phase_floor.get(phase, 1.0)
        t = max(t, floor)
        if self.region_overhead:
            t += sum(self.region_overhead.get(k, 0.0) * n for k, n in units) * self.phase_overhead.get(phase, 1.0)
        return t

    # ---- communication ----------------------------------------------------------------------
    def link_bw(self, link: str) -> float:
        """Achieved bytes/s of one link class."""
        return self.bandwidth[link] * self.link_efficiency[link]

    def phase_time(self, ph: Phase) -> float:
        return ph.latency + ph.nbytes / self.link_bw(ph.link)

    def p2p_phases(self, nbytes: float, link: str) -> tuple[Phase, ...]:
        return (Phase(link, float(nbytes), self.latency[link]),)

    def collective_phases(self, op: str, nbytes: float, topo: tuple) -> tuple[Phase, ...]:
        """Phases of a collective over a group of topology ``topo`` (see :func:`topology`).

        With ``algorithm="auto"`` the algorithm of least uncontended time is chosen.
        """
        return _collective_phases(self, op, float(nbytes), topo)

    def comm_time(self, phases: Sequence[Phase]) -> float:
        return self.comm_overhead + sum(self.phase_time(p) for p in phases)

    def op_overhead(self, op: str) -> float:
        """Fixed seconds of one ``op`` (``send``/``recv`` also pay ``p2p_overhead``)."""
        base = self.comm_op_overhead.get(op, self.comm_overhead)
        return base + self.p2p_overhead if op in P2P_OPS else base

    def op_bw(self, op: str, link: str) -> float:
        """Achieved bytes/s of ``op`` on one link class."""
        return self.link_bw(link) * self.comm_op_bw.get(op, 1.0)

    def op_time(self, op: str, phases: Sequence[Phase]) -> float:
        """Uncontended seconds of communication ``op`` made of ``phases``."""
        return self.op_overhead(op) + sum(p.latency + p.nbytes / self.op_bw(op, p.link) for p in phases)

    def time(self, instr: "Instr", cluster: "Cluster", devices: Sequence[int] = (), *,
             state_bytes: float = 0.0) -> float:
        """Uncontended seconds of ``instr`` on concrete devices.

        ``devices``: the group's devices for a collective, ``(src, dst)`` for send/recv/copy,
        ignored for compute. This is what planners call to compare, e.g., point-to-point
        messages against a broadcast or scatter.
        """
        if instr.op == "compute":
            return self.compute_time(instr, state_bytes)
        if instr.op in TWO_ENDED_OPS:
            if len(devices) != 2:
                raise CostModelError(f"{instr.op} needs devices=(src, dst), got {tuple(devices)}")
            return self.op_time(instr.op, self.p2p_phases(instr.nbytes, link_class(cluster, devices[0], devices[1])))
        return self.op_time(instr.op, self.collective_phases(instr.op, instr.nbytes, topology(cluster, devices)))


def link_class(cluster: "Cluster", a: int, b: int) -> str:
    """``local`` (same device), ``intra`` (same node) or ``inter``."""
    if a == b:
        return "local"
    return "intra" if cluster.node_of(a) == cluster.node_of(b) else "inter"


def topology(cluster: "Cluster", devices: Sequence[int]) -> tuple[int, int, int, bool]:
    """``(members, nodes, max members per node, all on one device)`` of a device group."""
    counts: dict[int, int] = {}
    for d in devices:
        n = cluster.node_of(d)
        counts[n] = counts.get(n, 0) + 1
    return (len(devices), len(counts), max(counts.values()) if counts else 0, len(set(devices)) <= 1)


_LOG2 = lambda n: max(1, math.ceil(math.log2(n))) if n > 1 else 0  # noqa: E731


def _ring(cm: CostModel, op: str, b: float, n: int, link: str) -> tuple[Phase, ...]:
    """Flat ring over ``n`` members whose bottleneck is ``link``."""
    if n <= 1:
        return ()
    a = cm.latency[link]
    f = (n - 1) / n
    if op == "all_reduce":
        return (Phase(link, 2 * f * b, 2 * (n - 1) * a),)
    sw = SWITCH_OPS.get(op)
    if sw is not None and not sw.p2p:   # switch transfer ops: the bytes their busiest link carries, per the op table
        group = tuple(range(n))
        out, inn = sw.link_bytes(0, group, int(b), int(b) // n if sw.chunked else 0)
        return (Phase(link, float(max(max(out.values()), max(inn.values(), default=0))), (n - 1) * a),)
    if op in ("reduce_scatter", "all_to_all"):
        return (Phase(link, f * b, (n - 1) * a),)
    raise CostModelError(f"unknown collective {op!r}")


def _tree(cm: CostModel, op: str, b: float, n: int, link: str) -> tuple[Phase, ...] | None:
    """Double binary tree (as NCCL uses between nodes; inside a node rings win)."""
    if link != "inter":
        return None
    if n <= 1:
        return ()
    a = cm.latency[link]
    if op == "all_reduce":  # reduce up, broadcast down, pipelined
        return (Phase(link, 2 * b, 2 * _LOG2(n) * a),)
    if op == "broadcast":
        return (Phase(link, b, _LOG2(n) * a),)
    return None


def _hier(cm: CostModel, op: str, b: float, n: int, nodes: int, k: int) -> tuple[Phase, ...] | None:
    """Intra-node then inter-node (then intra-node) steps; needs several members per node."""
    if nodes <= 1 or k <= 1 or n != nodes * k:
        return None
    if op == "all_reduce":
        inner = min((_ring(cm, op, b / k, nodes, "inter"), _tree(cm, op, b / k, nodes, "inter")),
                    key=lambda ph: cm.comm_time(ph) if ph is not None else math.inf)
        return _ring(cm, "reduce_scatter", b, k, "intra") + inner + _ring(cm, "all_gather", b, k, "intra")
    if op == "all_gather":
        return _ring(cm, op, b / k, nodes, "inter") + _ring(cm, op, b, k, "intra")
    if op == "reduce_scatter":
        return _ring(cm, op, b, k, "intra") + _ring(cm, op, b / k, nodes, "inter")
    if op == "all_to_all":  # off-node share over the NIC, on-node share over NVLink
        return (Phase("inter", b * (n - k) / n, (nodes - 1) * cm.latency["inter"]),
                Phase("intra", b * (k - 1) / n, (k - 1) * cm.latency["intra"]))
    if op == "broadcast":
        return _ring(cm, op, b, nodes, "inter") + _ring(cm, op, b, k, "intra")
    return None


def _collective_phases(cm: CostModel, op: str, b: float, topo: tuple) -> tuple[Phase, ...]:
    n, nodes, k, same = topo
    if n <= 1:
        return ()
    link = "local" if same else ("intra" if nodes == 1 else "inter")
    cands: dict[str, tuple[Phase, ...] | None] = {"ring": _ring(cm, op, b, n, link),
                                                  "tree": _tree(cm, op, b, n, link),
                                                  "hierarchical": _hier(cm, op, b, n, nodes, k)}
    if cm.algorithm != "auto":
        chosen = cands[cm.algorithm]
        return chosen if chosen is not None else cands["ring"]  # type: ignore[return-value]
    return min((c for c in cands.values() if c is not None), key=cm.comm_time)


_RANGE = re.compile(r"^layers\.(\d+)-(\d+)$")
_ONE = re.compile(r"^layers\.(\d+)\.(attn|mlp|moe)(?:\.\w+)?$")


@lru_cache(maxsize=4096)
def region_units(region: str | None) -> tuple[tuple[str, int], ...]:
    """Region kinds and counts of a (possibly fused) region: ``"embed+layers.0-3"`` ->
    ``(("embed", 1), ("layer", 4))``; ``None`` counts as one layer."""
    if not region:
        return (("layer", 1),)
    out: dict[str, int] = {}
    for part in region.split("+"):
        m = _RANGE.match(part)
        if m:
            out["layer"] = out.get("layer", 0) + int(m.group(2)) - int(m.group(1)) + 1
            continue
        m = _ONE.match(part)
        kind = m.group(2) if m else (part if part in REGION_KINDS else "layer")
        out[kind] = out.get(kind, 0) + 1
    return tuple(out.items())


#: Cost-model tuning by GPU family (:attr:`parashift.gpus.GPU.family`), from public measurements (NCCL bus
#: bandwidth, runtimes); a family's sustained GEMM ceiling lives in its GPU records.
GPU_TUNING: dict[str, dict] = {
    # nccl-tests all-reduce on 2-8 A100s (traces/vtrain-a100 LUT, 1 MiB-1 GiB) fit within 4% by a fixed
    # 62 us per operation, ~0 per ring step and 218 GB/s (73% of the 300 GB/s NVLink).
    # GPU runtimes (Megatron's batched isend/irecv, torch.distributed.pipelining) post their pipeline
    # sends and receives and go on computing: step_p2p_posted.
    "a100": {"link_efficiency": _d(local=0.8, intra=0.726, inter=0.9), "comm_overhead": 6.2e-5,
             "latency": _d(local=1e-6, intra=0.0, inter=8e-6), "step_p2p_posted": True},
    "h100": {"efficiency": _d(fwd=0.55, bwd=0.55, bwd_input=0.55, bwd_weight=0.55, recompute=0.55, optim=0.55),
             "link_efficiency": _d(local=0.8, intra=0.8, inter=0.9), "step_p2p_posted": True},
    "h200": {"efficiency": _d(fwd=0.58, bwd=0.58, bwd_input=0.58, bwd_weight=0.58, recompute=0.58, optim=0.58),
             "link_efficiency": _d(local=0.8, intra=0.8, inter=0.9), "step_p2p_posted": True},
    # Kinds without measurements of their own: the generic defaults, with the link efficiency the H100
    # measurements give (80% of a link's datasheet bandwidth) and posted pipeline sends, as every GPU runtime.
    "datasheet": {"link_efficiency": _d(local=0.8, intra=0.8, inter=0.9), "step_p2p_posted": True},
    # gloo over loopback on one core per process: ~1 GFLOP/s effective matmuls with big per-op costs.
    "cpu": {"efficiency": _d(fwd=0.3, bwd=0.3, bwd_input=0.3, bwd_weight=0.3, recompute=0.3, optim=0.3),
            "region_floor": _d(embed=5e-5, attn=2e-4, mlp=1e-4, moe=3e-4, head=1e-4, layer=3e-4),
            "link_efficiency": _d(local=0.5, intra=0.6, inter=0.6), "comm_overhead": 1e-4,
            "optim_overhead": 1e-3, "memory_reserved": 0, "compute_model": "flops",
            "pp_scatter_gather": False},  # parashift's own runtime sends whole activations
}


def apply_knobs(base: CostModel, knobs: Mapping[str, float]) -> CostModel:
    """``base`` with the knobs of :data:`~parashift.cost.fitted.KNOBS` set (missing ones keep ``base``'s values)."""
    k = {**knobs_of(base), **knobs}
    layer, mb = float(k["layer_floor"]), float(k["microbatch_floor"])
    floor = {**base.region_floor, "attn": layer * 5 / 8, "mlp": layer * 3 / 8, "layer": layer,
             "embed": mb / 2, "head": mb / 2}
    return base.replace(gemm_efficiency=min(float(k["gemm_efficiency"]), 1.0), gemm_k_half=float(k["gemm_k_half"]),
                        region_floor=floor, phase_floor={**base.phase_floor, "bwd": float(k["bwd_floor"]),
                                                         "bwd_input": float(k["bwd_floor"]) / 2,
                                                         "bwd_weight": float(k["bwd_floor"]) / 2},
                        attention_score_bytes=float(k["attention_score_bytes"]),
                        elementwise_bytes=float(k["elementwise_bytes"]), optim_overhead=float(k["optim_overhead"]),
                        latency={**base.latency, "intra": float(k["intra_latency"])},
                        comm_overhead=float(k["comm_overhead"]))


def knobs_of(cm: CostModel) -> dict[str, float]:
    """The values of :data:`~parashift.cost.fitted.KNOBS` in ``cm``."""
    f = cm.region_floor
    return {"gemm_efficiency": cm.gemm_efficiency, "gemm_k_half": cm.gemm_k_half,
            "layer_floor": f["attn"] + f["mlp"], "bwd_floor": cm.phase_floor["bwd"],
            "microbatch_floor": f["embed"] + f["head"], "attention_score_bytes": cm.attention_score_bytes,
            "elementwise_bytes": cm.elementwise_bytes, "optim_overhead": cm.optim_overhead,
            "intra_latency": cm.latency["intra"], "comm_overhead": cm.comm_overhead}
