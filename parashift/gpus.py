"""One record per GPU kind: what the cluster presets, the cost model, the simulator, the search and
a live job's device detection all read.

Peak rates, memory, HBM and link bandwidths are datasheet figures (each named in
``traces/gpus/PROVENANCE.md``); link bandwidths are one direction per device (half the
bidirectional figure datasheets print). ``gemm_sustained`` is the fraction of peak a dense GEMM
holds at the board's power limit, which the cost model's tile/wave GEMM model
(:mod:`parashift.cost.compute`) uses as its ceiling for every shape; ``clock`` scales every compute
rate of a part held below its rated power. A kind whose cost-model tuning
was measured names it in ``family`` (``a100``, ``h100``, ``h200``); new kinds use ``datasheet``
(the generic GPU defaults of :mod:`parashift.cost.model`, nothing fitted).

This module sits below ``cluster`` and ``cost`` and imports nothing of parashift but its errors.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from .errors import ClusterError, UnknownGPUError

__all__ = ["GPU", "GPUS", "DTYPES", "get", "by_device_name", "power_capped"]

GB = 1e9
GiB = 2**30

#: The dtypes a record rates: fp32 (vector), tf32, bf16/fp16, fp8 and fp4 (tensor cores, dense).
DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8", "fp4")


@dataclass(frozen=True)
class GPU:
    """One accelerator kind (dense peaks; link bandwidths one direction per device).

    ``nics_per_node`` NICs of ``nic_bw`` bytes/s serve a node of ``node`` devices (the kind's
    standard server or rack), rail-aligned; ``nvlink_domain``: devices one NVLink/NVSwitch domain
    joins at ``intra_bw`` (1: the devices of a node talk over PCIe, ``intra_bw`` is then PCIe's).
    A peak of 0 means the kind has no such units (fp8, fp4; see :meth:`peak`).
    """

    name: str
    memory: int            # bytes of device memory
    peak_flops: float      # dense bf16/fp16 FLOP/s (fp16 where the kind has no bf16: V100)
    hbm_bw: float          # bytes/s
    intra_bw: float        # bytes/s one direction per device over NVLink (or PCIe, see nvlink_domain)
    intra_latency: float   # seconds
    nic_bw: float          # bytes/s one direction of one NIC
    inter_latency: float   # seconds
    interconnect: str
    duplex: bool = True    # sending and receiving at once each get the full bandwidth (False: they share it)
    peak_fp32: float = 0.0
    peak_tf32: float = 0.0
    peak_fp8: float = 0.0
    peak_fp4: float = 0.0
    sms: int = 108          # streaming multiprocessors (compute units): the waves of a GEMM's tiles
    nics_per_node: int = 8  # NICs of a node (rail-aligned: NIC i serves the devices i, i + nics, ...)
    node: int = 8           # devices of the kind's standard node (HGX board: 8; NVL72 rack: 72)
    nvlink_domain: int = 8  # devices one NVLink/NVSwitch domain joins
    power: float = 0.0      # watts the peaks are rated at (board TDP)
    gemm_sustained: float = 1.0  # fraction of peak a dense GEMM holds at the power limit
    clock: float = 1.0      # fraction of the rated clock the part runs at (below 1: held under a power cap)
    family: str = "datasheet"    # cost-model tuning: measured (a100, h100, h200, cpu) or datasheet
    aliases: tuple[str, ...] = ()  # device names as torch.cuda.get_device_name reports them

    @property
    def inter_bw(self) -> float:
        """Bytes/s one device gets off-node when all ``node`` devices of a node send at once."""
        return self.nic_bw * min(self.nics_per_node, self.node) / self.node

    def has(self, dtype: str) -> bool:
        """Whether the kind has a rate for ``dtype`` (fp8 on Hopper and later, fp4 on Blackwell; the others on all)."""
        if dtype not in DTYPES:
            raise ClusterError(f"unknown dtype {dtype!r} for GPU {self.name}; use one of {', '.join(DTYPES)}")
        return {"fp8": self.peak_fp8, "fp4": self.peak_fp4}.get(dtype, 1.0) > 0

    def peak(self, dtype: str) -> float:
        """Dense FLOP/s of one device in ``dtype`` (bf16/fp16 at ``peak_flops``; fp32 and tf32 default
        to 1/16 and 1/2 of it). A dtype the kind has no units for (fp8 on an A100) raises."""
        if not self.has(dtype):
            raise ClusterError(f"GPU {self.name} has no {dtype} units (kinds with them: "
                               f"{', '.join(g for g, v in GPUS.items() if v.has(dtype))}); run {dtype} on one of "
                               f"those or give the cluster peak_{dtype}=...")
        if dtype == "fp32":
            return self.peak_fp32 or self.peak_flops / 16
        if dtype == "tf32":
            return self.peak_tf32 or self.peak_flops / 2
        return {"fp8": self.peak_fp8, "fp4": self.peak_fp4}.get(dtype, self.peak_flops)

    def sustained(self, dtype: str) -> float:
        """FLOP/s a large dense GEMM in ``dtype`` holds at the power limit (the tile model's ceiling)."""
        return self.peak(dtype) * self.clock * self.gemm_sustained


def power_capped(gpu: GPU, watts: float, name: str, reference: GPU) -> GPU:
    """``gpu`` held to ``watts`` below its rated power. Its clock falls as a power law of the power per
    SM, whose exponent comes from two datasheet operating points of the same die (``gpu`` and
    ``reference``: peak per SM, which is proportional to the clock, against power per SM). The
    datasheet peaks stay (MFU is quoted against them); ``clock`` carries the loss, which the cost
    model applies to every compute rate."""
    if not 0 < watts < gpu.power or not reference.power or gpu.power / gpu.sms == reference.power / reference.sms:
        raise ClusterError(f"cannot cap {gpu.name} ({gpu.power:g} W) at {watts:g} W against {reference.name}; "
                              f"give a cap between 0 and the rated power and a reference part of another power")
    k = math.log((reference.power / reference.sms) / (gpu.power / gpu.sms)) / \
        math.log((reference.peak_flops / reference.sms) / (gpu.peak_flops / gpu.sms))
    return replace(gpu, name=name, power=float(watts), aliases=(), clock=gpu.clock * (watts / gpu.power) ** (1 / k))


#: A100 SXM: the best-shape bf16 matmul reaches 271.2 of 312 TFLOP/s at the 1410 MHz boost clock, and a
#: GPU at its 400 W limit on dense math holds about 1305 MHz (the clock NVIDIA rates A100 HPL at).
_A100_SUSTAINED = 271.2 / 312 * 1305 / 1410

_A100 = GPU("a100", 80 * GiB, 312e12, 2.0e12, 300 * GB, 3e-6, 25 * GB, 8e-6, "NVLink 600 GB/s, HDR IB",
            peak_fp32=19.5e12, peak_tf32=156e12, sms=108, nics_per_node=8, power=400,
            gemm_sustained=_A100_SUSTAINED, family="a100", aliases=("NVIDIA A100-SXM4-80GB",))
_H100 = GPU("h100", 80 * GiB, 989e12, 3.35e12, 450 * GB, 2.5e-6, 50 * GB, 6e-6, "NVLink 900 GB/s, NDR IB",
            peak_fp32=67e12, peak_tf32=494e12, peak_fp8=1979e12, sms=132, nics_per_node=8, power=700,
            family="h100", aliases=("NVIDIA H100 80GB HBM3", "NVIDIA H100"))
_H100_PCIE = GPU("h100-pcie", 80 * GiB, 756e12, 2.0e12, 64 * GB, 2.5e-6, 50 * GB, 6e-6, "PCIe Gen5 x16, NDR IB",
                 peak_fp32=51e12, peak_tf32=378e12, peak_fp8=1513e12, sms=114, nics_per_node=8, nvlink_domain=1,
                 power=350, family="h100", aliases=("NVIDIA H100 PCIe",))
_B200 = GPU("b200", 180 * GB, 2.25e15, 8.0e12, 900 * GB, 2.5e-6, 50 * GB, 6e-6, "NVLink5 1.8 TB/s, NDR IB",
            peak_fp32=75e12, peak_tf32=1.125e15, peak_fp8=4.5e15, peak_fp4=9e15, sms=148, nics_per_node=8,
            power=1000, aliases=("NVIDIA B200",))
_V100 = GPU("v100", 32 * GiB, 125e12, 900 * GB, 150 * GB, 3e-6, 12.5 * GB, 8e-6, "NVLink2 300 GB/s, EDR IB",
            peak_fp32=15.7e12, peak_tf32=15.7e12, sms=80, nics_per_node=4, power=300,
            aliases=("Tesla V100-SXM2-32GB", "Tesla V100-SXM2-32GB-LS"))

#: The GPU kinds by preset name (the ``<gpu>`` of ``<gpu>-<nodes>x<per-node>``).
GPUS: dict[str, GPU] = {g.name: g for g in (
    _A100,
    replace(_A100, name="a100-40gb", memory=40 * GiB, hbm_bw=1.555e12, aliases=("NVIDIA A100-SXM4-40GB",)),
    # A800: A100 with NVLink cut to 400 GB/s bidirectional; 4x200 Gb/s HDR NICs per node in the testbed.
    replace(_A100, name="a800", intra_bw=200 * GB, nics_per_node=4, interconnect="NVLink 400 GB/s, HDR IB",
            aliases=("NVIDIA A800-SXM4-80GB",)),
    _H100,
    _H100_PCIE,
    replace(_H100, name="h100-nvl", memory=94 * GB, peak_flops=835e12, hbm_bw=3.9e12, intra_bw=64 * GB,
            peak_fp32=60e12, peak_tf32=417.5e12, peak_fp8=1671e12, nvlink_domain=1, power=400,
            interconnect="PCIe Gen5 x16 (NVLink bridge pairs not priced), NDR IB", aliases=("NVIDIA H100 NVL",)),
    power_capped(_H100, 500, "h100-500w", _H100_PCIE),
    # H800: H100 SXM compute with NVLink cut to 400 GB/s bidirectional.
    replace(_H100, name="h800", intra_bw=200 * GB, interconnect="NVLink 400 GB/s, NDR IB",
            aliases=("NVIDIA H800", "NVIDIA H800 80GB HBM3")),
    replace(_H100, name="h200", memory=141 * GB, hbm_bw=4.8e12, family="h200", aliases=("NVIDIA H200",)),
    _B200,
    # GB200 NVL72: 72 Blackwell GPUs at 1200 W in one NVLink domain, one 400 Gb/s NIC per GPU.
    replace(_B200, name="gb200", memory=186 * GB, peak_flops=2.5e15, peak_fp32=80e12, peak_tf32=1.25e15,
            peak_fp8=5e15, peak_fp4=10e15, nics_per_node=72, node=72, nvlink_domain=72, power=1200,
            interconnect="NVLink5 1.8 TB/s (NVL72 rack), NDR IB", aliases=("NVIDIA GB200",)),
    _V100,
    replace(_V100, name="v100-16gb", memory=16 * GiB, aliases=("Tesla V100-SXM2-16GB",)),
    # MI300X: 8 per node, each joined to the 7 others by Infinity Fabric links (896 GB/s aggregate, bidirectional).
    GPU("mi300x", 192 * GB, 1307.4e12, 5.3e12, 448 * GB, 3e-6, 50 * GB, 6e-6, "Infinity Fabric 896 GB/s, 400 Gb/s NICs",
        peak_fp32=163.4e12, peak_tf32=653.7e12, peak_fp8=2614.9e12, sms=304, nics_per_node=8, power=750,
        aliases=("AMD Instinct MI300X", "AMD Instinct MI300X VF")),
    # This machine's worker processes: one core each, gloo over loopback TCP/shared memory.
    # Both directions are copies by the same cores, so a process's sends and receives share them.
    GPU("cpu", 2 * GiB, 2.0e10, 1.0e10, 1.5 * GB, 6e-5, 12 * GB, 6e-5, "gloo over loopback", duplex=False,
        peak_fp32=2.0e10, peak_tf32=2.0e10, sms=1, nics_per_node=1, nvlink_domain=1, family="cpu"),
)}


def get(kind: str) -> GPU:
    """The record of a GPU kind by its preset name (``h100``, ``b200``, ...)."""
    g = GPUS.get(str(kind).strip().lower())
    if g is None:
        raise UnknownGPUError(f"unknown GPU kind {kind!r}; use one of {', '.join(k for k in GPUS if k != 'cpu')}")
    return g


def _norm(name: str) -> str:
    return re.sub(r"[\s_-]+", " ", name.strip().upper())


_BY_ALIAS = {_norm(a): g for g in GPUS.values() for a in g.aliases}


def by_device_name(name: str, fix: str = "") -> GPU:
    """The record whose alias is ``name`` as the runtime reports it (``torch.cuda.get_device_name``;
    case, spaces, ``-`` and ``_`` ignored). An unknown name raises :class:`UnknownGPUError`, ending
    with ``fix`` (how the caller lets the user name the cluster instead); it is never priced as another kind."""
    g = _BY_ALIAS.get(_norm(name))
    if g is None:
        raise UnknownGPUError(f"GPU {name!r} is not in parashift's GPU table (known: "
                              f"{', '.join(a for g in GPUS.values() for a in g.aliases)}); "
                              + (fix or "describe its cluster as a preset of a known kind with overrides or a JSON file"))
    return g
