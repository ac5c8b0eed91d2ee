"""Cluster presets: nodes of GPUs with their compute, memory and links.

Names follow ``<gpu>-<nodes>x<per-node>`` (``a800-16x8``, ``h100-pcie-4x8``), with ``<gpu>`` a kind of
:data:`parashift.gpus.GPUS`; any counts parse. ``<gpu>-nvl<N>`` is one NVLink domain of ``N`` devices
where the kind has one that large (``gb200-nvl72``: one NVL72 rack).
``cpu-local`` describes this machine's worker processes for gloo runs. A preset takes overrides
after a colon (``a100-64x8:nic_bw=12.5GB,nics_per_node=4``, see :data:`OVERRIDES`), and a JSON file
describes a whole cluster (``{"gpu": "a100", "nodes": 4, "per_node": 8, "nic_bw": 2.5e10, ...}``).
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass, replace
from functools import cached_property

import numpy as np

from .errors import ClusterError, UnknownPresetError
from .gpus import GPU, GPUS

__all__ = ["Cluster", "GPU", "GPUS", "get", "names", "parse_devices", "format_devices", "OVERRIDES",
           "parse_quantity"]


@dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``per_node`` devices of one GPU kind.

    ``nics_per_node`` NICs of ``nic_bw`` bytes/s each (one direction) connect a node to the others,
    rail-aligned (NIC ``i`` serves local devices ``i, i + nics, ...``); 0 takes the GPU kind's
    defaults. :attr:`inter_bw` is one device's share when every device of a node sends off-node.
    ``node_map``: the node of each device id, for nodes of unequal sizes (a live job's hosts, see
    :meth:`on_hosts`); empty: device ``d`` on node ``d // per_node``.
    """

    name: str
    gpu: GPU
    nodes: int
    per_node: int
    nics_per_node: int = 0
    nic_bw: float = 0.0
    node_map: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.node_map:
            m = np.asarray(self.node_map)
            if m.ndim != 1 or m.min() < 0 or len(np.unique(m)) != self.nodes or m.max() >= self.nodes \
                    or np.bincount(m).max() != self.per_node:
                raise ClusterError(f"cluster {self.name!r}: node_map must number its {self.nodes} nodes 0.."
                                   f"{self.nodes - 1} with at most {self.per_node} devices each; build it with "
                                   f"Cluster.on_hosts")
        if self.nodes < 1 or self.per_node < 1:
            raise ClusterError(f"cluster {self.name!r} needs at least one node of one device")
        if not self.nics_per_node:
            object.__setattr__(self, "nics_per_node", self.gpu.nics_per_node)
        if not self.nic_bw:
            object.__setattr__(self, "nic_bw", self.gpu.nic_bw)
        if self.nics_per_node < 1 or self.nic_bw <= 0:
            raise ClusterError(f"cluster {self.name!r}: nics_per_node and nic_bw must be positive")

    @property
    def devices(self) -> int:
        return len(self.node_map) if self.node_map else self.nodes * self.per_node

    @property
    def memory(self) -> int:
        """Bytes of memory per device."""
        return self.gpu.memory

    @property
    def inter_bw(self) -> float:
        """Bytes/s one device gets off-node when all devices of its node send at once."""
        return self.nic_bw * min(self.nics_per_node, self.per_node) / self.per_node

    @property
    def devices_per_nic(self) -> int:
        """Devices sharing one NIC (1 when every device has its own rail)."""
        return max(1, -(-self.per_node // self.nics_per_node))

    def node_of(self, device: "int | np.ndarray") -> "int | np.ndarray":
        """Node index of device id(s): ``node_map[d]``, or ``d // per_node`` without a map."""
        if isinstance(device, (int, np.integer)) and 0 <= device < self.devices:     # the scalar fast path
            return self.node_map[device] if self.node_map else int(device) // self.per_node
        d = np.asarray(device)
        if np.any((d < 0) | (d >= self.devices)):
            bad = int(np.asarray(d).ravel()[np.argmax(((d < 0) | (d >= self.devices)).ravel())])
            raise ClusterError(f"device {bad} is not in {self.name} (devices 0-{self.devices - 1}); "
                               f"use a bigger cluster such as {self.with_devices(bad + 1).name}")
        n = self._node_array[d] if self.node_map else d // self.per_node
        return int(n) if np.ndim(n) == 0 else n

    @cached_property
    def _node_array(self) -> np.ndarray:
        """``node_map`` as an array (built once per cluster, not per call)."""
        a = np.asarray(self.node_map, dtype=np.int64)
        a.flags.writeable = False
        return a

    def on_hosts(self, node_map: "list[int] | tuple[int, ...] | np.ndarray") -> "Cluster":
        """This cluster's devices placed on hosts of any sizes: device ``d`` on node ``node_map[d]``
        (hosts renumbered 0.. in order of first appearance; ``per_node``: the largest host)."""
        m = np.asarray(node_map, dtype=np.int64).ravel()
        if len(m) == 0 or m.min() < 0:
            raise ClusterError(f"a host map needs a host number >= 0 for every device id, got {list(m)[:16]}")
        _, first, inv = np.unique(m, return_index=True, return_inverse=True)
        rank = np.empty(len(first), dtype=np.int64)
        rank[np.argsort(first, kind="stable")] = np.arange(len(first))
        nm = tuple(int(x) for x in rank[inv.ravel()])
        sizes = np.bincount(nm)
        extra = [kv for kv in self.name.partition(":")[2].split(",")
                 if kv and kv.partition("=")[0] not in ("nodes", "per_node", "hosts")]
        name = ":".join([_name(self.gpu.name, 1, int(sizes.max())),
                         ",".join([f"hosts={'+'.join(str(int(x)) for x in sizes)}", *extra])])
        return replace(self, nodes=len(sizes), per_node=int(sizes.max()), node_map=nm, name=name)

    def with_devices(self, n: int) -> "Cluster":
        """The smallest cluster of this GPU kind with at least ``n`` devices (a host-mapped cluster
        places devices beyond its map on new nodes of ``per_node``)."""
        if self.node_map:
            extra = max(0, n - len(self.node_map))
            return self.on_hosts(list(self.node_map) + [self.nodes + i // self.per_node for i in range(extra)])
        nodes = max(1, -(-n // self.per_node))
        extra = [kv for kv in self.name.partition(":")[2].split(",") if kv and not kv.startswith("nodes=")]
        if self.gpu.name == "cpu" and nodes > 1:   # cpu-local names no node count: give it as an override
            extra.insert(0, f"nodes={nodes}")
        name = _name(self.gpu.name, nodes, self.per_node) + (":" + ",".join(extra) if extra else "")
        return replace(self, nodes=nodes, name=name)

    def to_dict(self) -> dict:
        return {"name": self.name, "nodes": self.nodes, "per_node": self.per_node,
                "nics_per_node": self.nics_per_node, "nic_bw": self.nic_bw, "inter_bw_per_device": self.inter_bw,
                "gpu": asdict(self.gpu), **({"node_map": list(self.node_map)} if self.node_map else {})}


def _name(gpu: str, nodes: int, per_node: int) -> str:
    return "cpu-local" if gpu == "cpu" else f"{gpu}-{nodes}x{per_node}"


_PATTERN = re.compile(r"^([a-z0-9][a-z0-9-]*)-(\d+)x(\d+)$")
_NVL = re.compile(r"^([a-z0-9][a-z0-9-]*)-nvl(\d+)$")

#: Override keys (``preset:key=value,...`` or JSON file fields): key -> (where, field, unit, meaning).
OVERRIDES: dict[str, tuple[str, str, str, str]] = {
    "nodes": ("cluster", "nodes", "count", "nodes"),
    "per_node": ("cluster", "per_node", "count", "devices per node"),
    "nics_per_node": ("cluster", "nics_per_node", "count", "NICs per node (rail-aligned)"),
    "nic_bw": ("cluster", "nic_bw", "bandwidth", "one NIC's bandwidth, one direction (e.g. 25GB or 200Gb)"),
    "inter_bw": ("cluster", "nic_bw", "bandwidth", "same as nic_bw"),
    "inter_latency": ("gpu", "inter_latency", "seconds", "latency of a message between nodes (e.g. 8us)"),
    "intra_bw": ("gpu", "intra_bw", "bandwidth", "NVLink/PCIe bandwidth per device, one direction"),
    "nvlink_bw": ("gpu", "intra_bw", "bandwidth", "same as intra_bw"),
    "intra_latency": ("gpu", "intra_latency", "seconds", "latency of a message inside a node"),
    "memory": ("gpu", "memory", "bytes", "device memory (e.g. 80GiB)"),
    "hbm_bw": ("gpu", "hbm_bw", "bandwidth", "HBM bandwidth (e.g. 2TB)"),
    "peak_flops": ("gpu", "peak_flops", "flops", "dense bf16/fp16 FLOP/s (e.g. 312T)"),
    "peak_bf16": ("gpu", "peak_flops", "flops", "same as peak_flops"),
    "peak_fp16": ("gpu", "peak_flops", "flops", "same as peak_flops"),
    "peak_tf32": ("gpu", "peak_tf32", "flops", "dense tf32 FLOP/s"),
    "peak_fp32": ("gpu", "peak_fp32", "flops", "dense fp32 FLOP/s"),
    "peak_fp8": ("gpu", "peak_fp8", "flops", "dense fp8 FLOP/s"),
    "peak_fp4": ("gpu", "peak_fp4", "flops", "dense fp4 FLOP/s"),
    "sms": ("gpu", "sms", "count", "streaming multiprocessors"),
}

_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15, "ki": 2.0**10, "mi": 2.0**20,
           "gi": 2.0**30, "ti": 2.0**40}
_QTY = re.compile(r"^([0-9]*\.?[0-9]+(?:e[-+]?\d+)?)\s*([kmgtp]i?)?(b|bit|bits|byte|bytes|flops|s|ms|us|ns|/s)?(/s)?$",
                  re.IGNORECASE)


def parse_quantity(text: "str | float | int", unit: str, key: str = "value") -> float:
    """``"12.5GB"`` -> 1.25e10 bytes(/s); ``"200Gb"`` -> 2.5e10 (bits / 8); ``"80GiB"``; ``"312T"``;
    ``"8us"`` -> 8e-6 s; plain numbers are taken in base units (bytes, FLOP/s, seconds)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        v = float(text)
    else:
        m = _QTY.match(str(text).strip().replace("_", ""))
        if not m:
            raise ClusterError(f"cluster key {key}={text!r} is not a number with an optional unit "
                               f"(e.g. 25GB, 200Gb, 80GiB, 312T, 8us)")
        num, pre, suf = float(m.group(1)), (m.group(2) or ""), (m.group(3) or "")
        if suf in ("ms", "us", "ns"):
            if unit != "seconds" or pre:
                raise ClusterError(f"cluster key {key}={text!r}: a time unit is only valid for latencies")
            v = num * {"ms": 1e-3, "us": 1e-6, "ns": 1e-9}[suf]
        else:
            v = num * _SUFFIX[pre.lower()]
            if suf == "b" or suf.lower() in ("bit", "bits"):   # lower-case b: bits
                v /= 8
    if not math.isfinite(v):
        raise ClusterError(f"cluster key {key}={text!r} must be a finite number")
    if unit == "count":
        if v != int(v) or v < 1:
            raise ClusterError(f"cluster key {key}={text!r} must be a positive integer")
        return int(v)
    if not v > 0:
        raise ClusterError(f"cluster key {key}={text!r} must be positive")
    if unit != "seconds" and v < 1:   # under one byte or FLOP a second, times overflow to inf
        raise ClusterError(f"cluster key {key}={text!r} must be at least 1 (in bytes, bytes/s or FLOP/s); "
                           f"check its unit, e.g. 25GB or 312T")
    return v


def _apply(base: Cluster, items: "dict[str, object]", source: str) -> Cluster:
    gpu_kw: dict = {}
    cl_kw: dict = {}
    for k, raw in items.items():
        if k not in OVERRIDES:
            raise ClusterError(f"unknown cluster key {k!r} in {source}; keys are {', '.join(OVERRIDES)}")
        where, fld, unit, _ = OVERRIDES[k]
        v = parse_quantity(raw, unit, k)  # type: ignore[arg-type]
        (gpu_kw if where == "gpu" else cl_kw)[fld] = int(v) if fld == "memory" else v
    gpu = replace(base.gpu, **gpu_kw) if gpu_kw else base.gpu
    nodes = int(cl_kw.pop("nodes", base.nodes))
    per = int(cl_kw.pop("per_node", base.per_node))
    return Cluster(base.name, gpu, nodes, per, int(cl_kw.get("nics_per_node", base.nics_per_node)),
                   float(cl_kw.get("nic_bw", base.nic_bw)))


def _preset(key: str, name: object, domain_check: bool = True) -> Cluster:
    """The preset ``key``; ``domain_check``: a node larger than the kind's NVLink domain raises (a
    host map's name, whose largest host sets its node size, skips it)."""
    if key == "cpu-local":
        return Cluster("cpu-local", GPUS["cpu"], 1, max(8, os.cpu_count() or 1))
    nvl = _NVL.match(key)
    if nvl and nvl.group(1) in GPUS and GPUS[nvl.group(1)].nvlink_domain == int(nvl.group(2)) > 1:
        return Cluster(key, GPUS[nvl.group(1)], 1, int(nvl.group(2)))
    m = _PATTERN.match(key)
    if not m or m.group(1) not in GPUS or m.group(1) == "cpu":
        kinds = [g for g in GPUS if g != "cpu"]
        domains = [f"{g}-nvl{v.nvlink_domain}" for g, v in GPUS.items() if v.nvlink_domain > 8]
        raise UnknownPresetError(
            f"unknown cluster {name!r}; use <gpu>-<nodes>x<per-node> with gpu in {', '.join(kinds)} (e.g. "
            f"a800-16x8), {', '.join(domains + ['cpu-local'])}, a preset with overrides "
            f"(a100-64x8:nic_bw=25GB,nics_per_node=8) or a JSON file")
    nodes, per = int(m.group(2)), int(m.group(3))
    if nodes < 1 or per < 1:
        raise ClusterError(f"cluster {name!r} needs at least one node of one device")
    gpu = GPUS[m.group(1)]
    if domain_check and 1 < gpu.nvlink_domain < per:
        raise ClusterError(f"cluster {name!r}: one {gpu.name} NVLink domain joins at most {gpu.nvlink_domain} devices, "
                           f"so a node of {per} would price them all on NVLink; use "
                           f"{gpu.name}-{-(-nodes * per // gpu.nvlink_domain)}x{gpu.nvlink_domain}, or "
                           f"{gpu.name}-{nodes}x{gpu.nvlink_domain}:per_node={per} to price such a node anyway")
    return Cluster(key, gpu, nodes, per)


def _from_file(path: str) -> Cluster:
    from .validate import read_json
    obj = read_json(path, "cluster file")   # size, encoding and nesting checked
    if not isinstance(obj, dict) or "gpu" not in obj:
        raise ClusterError(f"cluster file {path} must hold a JSON object with at least gpu (one of "
                           f"{', '.join(GPUS)}), nodes and per_node")
    obj = dict(obj)
    gpu = str(obj.pop("gpu")).lower()
    if gpu not in GPUS:
        raise ClusterError(f"cluster file {path}: unknown gpu {gpu!r}; use one of {', '.join(GPUS)} and override "
                           f"its numbers (peak_flops, hbm_bw, memory, ...)")
    name = str(obj.pop("name", None) or "") or os.path.splitext(os.path.basename(path))[0]
    size = {k: int(parse_quantity(obj.pop(k), "count", k)) for k in ("nodes", "per_node") if k in obj}
    hosts = obj.pop("hosts", None)
    if hosts is not None and size:
        raise ClusterError(f"cluster file {path}: hosts gives the nodes and their sizes; drop nodes and per_node")
    if hosts is None and len(size) < 2:
        raise ClusterError(f"cluster file {path} gives no {' or '.join(k for k in ('nodes', 'per_node') if k not in size)}"
                           f": a cluster needs nodes and per_node (or hosts, the devices of each node: [8, 8, 4])")
    base = Cluster(name, GPUS[gpu], size.get("nodes", 1), size.get("per_node", 1))
    out = _apply(base, obj, f"cluster file {path}")
    if hosts is not None:
        text = "+".join(str(h) for h in hosts) if isinstance(hosts, list) else str(hosts)
        out = out.on_hosts(_host_sizes(text, path))
    return replace(out, name=name)


def get(name: "str | Cluster") -> Cluster:
    """A cluster: a preset (``a800-16x8``, ``a100-64x8``, ``h100-4x8``, ``cpu-local``), a preset with
    overrides (``a100-64x8:nic_bw=12.5GB,nics_per_node=4``; keys in :data:`OVERRIDES`, plus
    ``hosts=8+8+4`` for nodes of unequal sizes, see :meth:`Cluster.on_hosts`) or a JSON file."""
    if isinstance(name, Cluster):
        return name
    raw = str(name).strip()
    if raw.lower().endswith(".json") or os.path.sep in raw:
        if not os.path.exists(raw):
            raise ClusterError(f"cluster file {raw} does not exist; give a preset such as a100-4x8 or a JSON file")
        return _from_file(raw)
    key, _, extra = raw.partition(":")
    base = _preset(key.strip().lower(), name, domain_check="hosts=" not in extra.replace(" ", ""))
    if not extra.strip():
        return base
    items: dict[str, object] = {}
    for part in extra.replace(" ", "").split(","):
        if not part:
            continue
        if "=" not in part:
            raise ClusterError(f"cluster override {part!r} in {raw!r} is not key=value; write e.g. "
                               f"{key}:nic_bw=25GB,nics_per_node=8")
        k, v = part.split("=", 1)
        if k in items:
            raise ClusterError(f"cluster key {k!r} is given twice in {raw!r}; give each key once")
        items[k] = v
    hosts = items.pop("hosts", None)
    if hosts is not None and ("nodes" in items or "per_node" in items):
        raise ClusterError(f"{raw!r}: hosts= gives the nodes and their sizes; drop nodes= and per_node=")
    out = _apply(base, items, repr(raw))
    canon = ",".join(f"{k}={v}" for k, v in items.items())
    out = replace(out, name=f"{_name(out.gpu.name, out.nodes, out.per_node)}" + (f":{canon}" if canon else ""))
    return out.on_hosts(_host_sizes(str(hosts), raw)) if hosts is not None else out


#: The most devices a ``hosts=`` cluster lists (its node map holds one entry per device).
MAX_HOST_DEVICES = 1 << 20


def _host_sizes(text: str, raw: str) -> list[int]:
    """The node map of ``hosts=A+B+...`` (hosts of A, B, ... devices, in device-id order)."""
    try:
        sizes = [int(x) for x in text.split("+")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ClusterError(f"cluster key hosts={text!r} in {raw!r} must list each host's device count joined "
                           f"by '+', e.g. hosts=8+8+4")
    if sum(sizes) > MAX_HOST_DEVICES:
        raise ClusterError(f"cluster key hosts= in {raw!r} lists {sum(sizes)} devices; at most {MAX_HOST_DEVICES} "
                           f"(each device's node is stored); describe a bigger cluster with nodes= and per_node=")
    return [h for h, n in enumerate(sizes) for _ in range(n)]


def names() -> list[str]:
    """Example preset names, one or more per GPU kind (any node counts parse; see :data:`GPUS`)."""
    return ["a800-16x8", "a800-128x8", "a100-1x8", "a100-64x8", "a100-40gb-1x8", "h100-16x8", "h100-pcie-1x8",
            "h100-nvl-1x8", "h100-500w-16x8", "h800-16x8", "h200-16x8", "b200-16x8", "gb200-nvl72", "gb200-4x72",
            "v100-1x8", "v100-16gb-1x8", "mi300x-1x8", "cpu-local"]


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
