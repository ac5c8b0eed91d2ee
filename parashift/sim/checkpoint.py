"""The checkpoint-restart baseline: save under the old strategy, restart, load and reshard.

A closed-form estimate with every parameter explicit in :class:`StorageModel`, for comparing
against a simulated hot switch. It follows what Megatron-style distributed checkpointing does:
each state element is written once (DP replicas deduplicated), writers are spread over the
source nodes; after the job restarts, every destination rank reads the states it will hold
(parameters once per DP replica unless ZeRO-3 shards them) and reshards them in host memory.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..cluster import Cluster, get as get_cluster
from ..models import ModelSpec, get as get_model
from ..strategy import Strategy

__all__ = ["StorageModel", "CheckpointRestart", "estimate_checkpoint_restart"]


@dataclass(frozen=True)
class StorageModel:
    """Shared checkpoint storage and job restart costs.

    ``write_bw_per_node`` / ``read_bw_per_node``: bytes/s one node reaches to the shared file
    system; ``aggregate_bw``: the file system's total bytes/s (a cap on all nodes together);
    ``file_overhead``: seconds per file opened (one file per writing rank; nodes open files in parallel);
    ``restart_seconds``: tearing the job down and starting it again (process launch, CUDA and
    NCCL initialization, data loader); ``reshard_bw``: bytes/s per rank of host-side resharding
    (copying loaded slices into the new layout).
    """

    write_bw_per_node: float = 2.0e9
    read_bw_per_node: float = 4.0e9
    aggregate_bw: float = 100e9
    file_overhead: float = 0.05
    restart_seconds: float = 60.0
    reshard_bw: float = 5.0e9


@dataclass(frozen=True)
class CheckpointRestart:
    """Seconds of each part of the baseline, and the bytes written and read."""

    save_seconds: float
    restart_seconds: float
    load_seconds: float
    total_seconds: float
    bytes_written: float
    bytes_read: float

    def to_dict(self) -> dict:
        return asdict(self)


def _state_bytes(model: ModelSpec) -> tuple[float, float, float, float]:
    """(dense param bytes, expert param bytes, dense optimizer bytes, expert optimizer bytes)."""
    opt_per_elem = sum(model.kind_bytes(k) for k in model.state_kinds if k not in ("param", "grad"))
    dense = sum(t.numel for t in model.tensors if t.ep_dim is None)
    expert = sum(t.numel for t in model.tensors if t.ep_dim is not None)
    pb = model.dtype_bytes
    return dense * pb, expert * pb, dense * opt_per_elem, expert * opt_per_elem


def _read_bytes(model: ModelSpec, s: Strategy) -> float:
    """Bytes all ranks of ``s`` read: every rank its parameters (replicated over DP unless
    ZeRO-3) and its optimizer shard."""
    dpb, epb, dob, eob = _state_bytes(model)
    params = (dpb + epb) if s.zero_stage.shards_params else (dpb * s.dp + epb * s.edp)
    return params + dob + eob


def estimate_checkpoint_restart(model: "ModelSpec | str", src: "Strategy | str", dst: "Strategy | str",
                                cluster: "Cluster | str", storage: StorageModel = StorageModel()) -> CheckpointRestart:
    """Seconds to save under ``src``, restart, and load under ``dst`` on ``cluster``."""
    model = get_model(model)
    src, dst = Strategy.parse(src), Strategy.parse(dst)
    cluster = get_cluster(cluster)
    dpb, epb, dob, eob = _state_bytes(model)
    written = dpb + epb + dob + eob
    src_nodes = max(1, -(-src.world // cluster.per_node))
    dst_nodes = max(1, -(-dst.world // cluster.per_node))
    w_bw = min(storage.aggregate_bw, src_nodes * storage.write_bw_per_node)
    writers = src.world // src.dp_replicas if src.zero_stage.sharded else src.tp * src.pp  # ZeRO: every distinct shard
    save = written / w_bw + storage.file_overhead * -(-writers // src_nodes)
    read = _read_bytes(model, dst)
    r_bw = min(storage.aggregate_bw, dst_nodes * storage.read_bw_per_node)
    per_rank = read / dst.world
    load = read / r_bw + per_rank / storage.reshard_bw + storage.file_overhead * -(-dst.world // dst_nodes)
    total = save + storage.restart_seconds + load
    return CheckpointRestart(save, storage.restart_seconds, load, total, written, read)
