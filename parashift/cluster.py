"""Cluster presets: nodes of GPUs with their compute, memory and links.

Names follow ``<gpu>-<nodes>x<per-node>`` (``a800-16x8``, ``h100-64x8``); any counts parse.
``cpu-local`` describes this machine's worker processes for gloo runs.
"""
from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, replace

import numpy as np

from .errors import ClusterError, UnknownPresetError

__all__ = ["Cluster", "GPUS", "get", "names", "parse_devices", "format_devices"]

GB = 1e9
GiB = 2**30


@dataclass(frozen=True)
class GPU:
    """One accelerator kind, from public datasheets (dense bf16, unidirectional link bandwidths)."""

    name: str
    memory: int            # bytes of device memory
    peak_flops: float      # dense bf16 FLOP/s
    hbm_bw: float          # bytes/s
    intra_bw: float        # bytes/s one direction per device over NVLink
    intra_latency: float   # seconds
    inter_bw: float        # bytes/s one direction per device over the NIC(s)
    inter_latency: float   # seconds
    interconnect: str
    duplex: bool = True    # sending and receiving at once each get the full bandwidth (False: they share it)


GPUS: dict[str, GPU] = {
    # A800: A100 with NVLink cut to 400 GB/s bidirectional; 4x200 Gb/s HDR NICs per node in the testbed.
    "a800": GPU("a800", 80 * GiB, 312e12, 2.0e12, 200 * GB, 3e-6, 100e9 / 8 * 1.0, 8e-6, "NVLink 400 GB/s, HDR IB"),
    # A100-80GB SXM: NVLink3 600 GB/s bidirectional, one HDR 200 Gb/s NIC per GPU.
    "a100": GPU("a100", 80 * GiB, 312e12, 2.0e12, 300 * GB, 3e-6, 25 * GB, 8e-6, "NVLink 600 GB/s, HDR IB"),
    # H100 SXM: NVLink4 900 GB/s bidirectional, one NDR 400 Gb/s NIC per GPU.
    "h100": GPU("h100", 80 * GiB, 989e12, 3.35e12, 450 * GB, 2.5e-6, 50 * GB, 6e-6, "NVLink 900 GB/s, NDR IB"),
    # H200 SXM: H100 compute with 141 GB HBM3e at 4.8 TB/s.
    "h200": GPU("h200", 141 * GB, 989e12, 4.8e12, 450 * GB, 2.5e-6, 50 * GB, 6e-6, "NVLink 900 GB/s, NDR IB"),
    # This machine's worker processes: one core each, gloo over loopback TCP/shared memory.
    # Both directions are copies by the same cores, so a process's sends and receives share them.
    "cpu": GPU("cpu", 2 * GiB, 2.0e10, 1.0e10, 1.5 * GB, 6e-5, 1.5 * GB, 6e-5, "gloo over loopback", duplex=False),
}


@dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``per_node`` devices of one GPU kind."""

    name: str
    gpu: GPU
    nodes: int
    per_node: int

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.per_node < 1:
            raise ClusterError(f"cluster {self.name!r} needs at least one node of one device")

    @property
    def devices(self) -> int:
        return self.nodes * self.per_node

    @property
    def memory(self) -> int:
        """Bytes of memory per device."""
        return self.gpu.memory

    def node_of(self, device: "int | np.ndarray") -> "int | np.ndarray":
        """Node index of device id(s); device d sits on node d // per_node."""
        d = np.asarray(device)
        if np.any((d < 0) | (d >= self.devices)):
            bad = int(np.asarray(d).ravel()[np.argmax(((d < 0) | (d >= self.devices)).ravel())])
            raise ClusterError(f"device {bad} is not in {self.name} (devices 0-{self.devices - 1}); "
                               f"use a bigger cluster such as {self.gpu.name}-{self.nodes * 2}x{self.per_node}")
        n = d // self.per_node
        return int(n) if np.ndim(n) == 0 else n

    def with_devices(self, n: int) -> "Cluster":
        """The smallest cluster of this GPU kind with at least ``n`` devices."""
        nodes = max(1, -(-n // self.per_node))
        return replace(self, nodes=nodes, name=_name(self.gpu.name, nodes, self.per_node))

    def to_dict(self) -> dict:
        return {"name": self.name, "nodes": self.nodes, "per_node": self.per_node, "gpu": asdict(self.gpu)}


def _name(gpu: str, nodes: int, per_node: int) -> str:
    return "cpu-local" if gpu == "cpu" else f"{gpu}-{nodes}x{per_node}"


_PATTERN = re.compile(r"^([a-z0-9]+)-(\d+)x(\d+)$")


def get(name: "str | Cluster") -> Cluster:
    """A cluster by name: ``a800-16x8``, ``a100-64x8``, ``h100-4x8``, ``h200-1x8``, ``cpu-local``."""
    if isinstance(name, Cluster):
        return name
    key = str(name).strip().lower()
    if key == "cpu-local":
        return Cluster("cpu-local", GPUS["cpu"], 1, max(8, os.cpu_count() or 1))
    m = _PATTERN.match(key)
    if not m or m.group(1) not in GPUS or m.group(1) == "cpu":
        raise UnknownPresetError(
            f"unknown cluster {name!r}; use <gpu>-<nodes>x<per-node> with gpu in "
            f"{', '.join(g for g in GPUS if g != 'cpu')} (e.g. a800-16x8), or cpu-local")
    nodes, per = int(m.group(2)), int(m.group(3))
    if nodes < 1 or per < 1:
        raise ClusterError(f"cluster {name!r} needs at least one node of one device")
    return Cluster(key, GPUS[m.group(1)], nodes, per)


def names() -> list[str]:
    """Example preset names (any node counts parse)."""
    return ["a800-16x8", "a800-128x8", "a100-1x8", "a100-64x8", "h100-16x8", "h200-16x8", "cpu-local"]


def parse_devices(text: "str | list[int] | tuple[int, ...] | np.ndarray | None", default: int | None = None) -> tuple[int, ...]:
    """Parse a device list such as ``"0-39,48-127"`` into sorted-as-given unique ids."""
    if text is None:
        if default is None:
            raise ClusterError("no device list given and no default size")
        return tuple(range(default))
    if not isinstance(text, str):
        out = tuple(int(x) for x in text)
    else:
        out_l: list[int] = []
        for part in text.replace(" ", "").split(","):
            if not part:
                continue
            try:
                if "-" in part:
                    a, b = part.split("-", 1)
                    lo, hi = int(a), int(b)
                    if hi < lo:
                        raise ValueError
                    out_l.extend(range(lo, hi + 1))
                else:
                    out_l.append(int(part))
            except ValueError:
                from .errors import DeviceListError
                raise DeviceListError(f"bad device list item {part!r} in {text!r}; write ids and ranges "
                                      f"such as '0-39,48-127'") from None
        out = tuple(out_l)
    from .errors import DeviceListError
    if any(d < 0 for d in out):
        raise DeviceListError(f"device ids must be non-negative, got {min(out)}")
    if len(set(out)) != len(out):
        raise DeviceListError(f"device list {text!r} names a device twice; list each device once")
    return out


def format_devices(devices: "tuple[int, ...] | list[int]") -> str:
    """Inverse of :func:`parse_devices` for ascending runs: ``(0,1,2,5)`` -> ``"0-2,5"``."""
    parts: list[str] = []
    i = 0
    d = list(devices)
    while i < len(d):
        j = i
        while j + 1 < len(d) and d[j + 1] == d[j] + 1:
            j += 1
        parts.append(str(d[i]) if i == j else f"{d[i]}-{d[j]}")
        i = j + 1
    return ",".join(parts)
