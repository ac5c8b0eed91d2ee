"""The trainer around the Program: the data each step trains on (:class:`TokenData`) and the optimizer
phase of a step: the global gradient norm, clipping, the step's learning rate, AdamW.

The global norm counts every parameter element exactly once, whatever the layout. Each rank sums the
squares of the gradient elements it *owns* (:func:`owned_ranges`), and one all-reduce over the whole
world adds the sums. A rank owns an element of its optimizer gradient (the reduced buffer, or its
ZeRO shard of it) unless a lower replica holds the same element:

- DP/CP (zero 0): the reduced buffer is the same on every member of its group; member 0 owns it.
  ZeRO >= 1 shards it, so each member owns its shard; under hybrid sharding replica 0 owns it.
- TP: a tensor not split over TP (norm gains) is the same on every TP rank; TP rank 0 owns it.
- EP and PP hold disjoint tensors: each owns its own.

:func:`coverage` maps the owned ranges of every rank back to tensor elements, so tests check the
"exactly once" rule on any strategy without starting a process.
"""
from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from ..errors import DataError
from .reference import OptimConfig

if TYPE_CHECKING:  # pragma: no cover
    from ..models import ModelSpec
    from ..strategy import Strategy
    from .state import StateStore

__all__ = ["owned_ranges", "local_sumsq", "global_grad_norm", "clip_scale", "optimizer_step",
           "coverage", "TokenData", "DataFeed", "with_precision", "TRAIN_PRECISIONS"]


def owned_ranges(store: "StateStore") -> dict[str, list[tuple[int, int]]]:
    """family -> ranges ``[a, b)`` of the optimizer gradient (offsets into it) whose elements this
    rank counts in the global norm (see the module doc)."""
    s = store.strategy
    c = s.coords(store.rank)
    split = {t.name: t.tp_dim is not None for t in store.spec.tensors}
    out: dict[str, list[tuple[int, int]]] = {}
    for fam, b in store.buffers.items():
        keep = c["replica"] == 0 if b.zero_stage.shards_optim else b.index == 0
        lo, hi = b.opt_base, b.opt_base + b.opt_len
        rs = []
        if keep:
            for p in b.pieces:
                if s.tp > 1 and not split[p.name] and c["tp"] != 0:
                    continue
                a, e = max(lo, p.start), min(hi, p.start + p.numel)
                if a < e:
                    rs.append((a - lo, e - lo))
        out[fam] = _merge(rs)
    return out


def _merge(rs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, e in sorted(rs):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], e)
        else:
            out.append((a, e))
    return out


def local_sumsq(store: "StateStore", owned: dict[str, list[tuple[int, int]]] | None = None) -> torch.Tensor:
    """Sum of squares (a float64 scalar on the store's device; no host sync) of the optimizer-gradient
    elements this rank owns."""
    owned = owned if owned is not None else owned_ranges(store)
    dev = next(iter(store.buffers.values())).param.device if store.buffers else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=dev)
    for fam, b in store.buffers.items():
        g = b.opt_grad()
        for a, e in owned.get(fam, ()):
            x = g[a:e].double()
            total += torch.dot(x, x)
    return total


def global_grad_norm(store: "StateStore", group: Any, timeout: float,
                     owned: dict[str, list[tuple[int, int]]] | None = None) -> float:
    """L2 norm of the whole model's gradient: every rank's owned sum of squares, all-reduced over
    ``group`` (the whole world; None for a single rank)."""
    t = local_sumsq(store, owned).reshape(1)
    if group is not None:
        dist.all_reduce(t, group=group, async_op=True).wait(datetime.timedelta(seconds=timeout))
    return math.sqrt(float(t.item()))


def clip_scale(norm: float, max_norm: float) -> float:
    """The factor ``torch.nn.utils.clip_grad_norm_`` multiplies gradients by (1 when not clipping)."""
    if not max_norm:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))


def optimizer_step(store: "StateStore", cfg: OptimConfig, step: int, group: Any, timeout: float,
                   owned: dict[str, list[tuple[int, int]]] | None = None) -> tuple[float, float]:
    """The optimizer phase of training step ``step`` on one rank: the global gradient norm, clipping
    at ``cfg.clip_grad``, AdamW at ``cfg.lr_at(step)`` with decay only where
    :meth:`~parashift.exec.state.Buffer.decay_segments` says. Collective over ``group``. Returns (grad norm before clipping, learning rate)."""
    norm = global_grad_norm(store, group, timeout, owned)
    scale = clip_scale(norm, cfg.clip_grad)
    lr = cfg.lr_at(step)
    at = replace(cfg, lr=lr, schedule=None)
    for b in store.buffers.values():
        b.optimizer_step(at, scale=scale)
    return norm, lr


def coverage(spec: "ModelSpec", strategy: "Strategy", owned: Any = None) -> dict[str, np.ndarray]:
    """name -> how many ranks count each element of the tensor in the global norm (all ones when the
    ownership rule ``owned`` (default :func:`owned_ranges`) is right). Builds every rank's store
    layout without values (no processes)."""
    owned = owned or owned_ranges
    from .state import MemoryTracker, StateStore
    counts = {t.name: np.zeros(t.shape, dtype=np.int64) for t in spec.tensors}
    for r in range(strategy.world):
        store = StateStore(spec, strategy, r, torch.device("meta"), init=False, mem=MemoryTracker(),
                           alloc=lambda n, dt, dev: torch.empty(n, dtype=dt, device="meta"))
        for fam, rs in owned(store).items():
            b = store.buffers[fam]
            base = b.opt_base
            for a, e in rs:
                for p in b.pieces:
                    lo, hi = max(a + base, p.start), min(e + base, p.start + p.numel)
                    if lo >= hi:
                        continue
                    local = np.unravel_index(np.arange(lo - p.start, hi - p.start), p.sizes)
                    glob = tuple(i + o for i, o in zip(local, p.offsets))
                    np.add.at(counts[p.name], glob, 1)
    return counts


@dataclass(frozen=True)
class TokenData:
    """A prepared token file to train on (``parashift data prepare``) and the sampler's seed. Every
    rank opens it itself (a memory map); step ``s`` trains on the sampler's global batch ``s``."""

    path: str
    seed: int = 0

    def open(self, seq_len: int, global_batch: int, vocab: int | None = None) -> "DataFeed":
        """The checked feed (one :class:`~parashift.errors.DataError` line when the file is bad, too
        short for one global batch, or holds ids beyond ``vocab``)."""
        from ..data import open_tokens
        tf = open_tokens(self.path, seq_len)
        if vocab is not None and tf.vocab_size > vocab:
            raise DataError(f"token file {self.path}: its vocabulary of {tf.vocab_size} ids does not fit the model's "
                            f"{vocab} embeddings; prepare it with the model's tokenizer or pick a larger model")
        n = tf.num_sequences(seq_len)
        if n < global_batch:
            raise DataError(f"token file {self.path} holds {n} sequences of {seq_len} tokens, fewer than one global "
                            f"batch of {global_batch}; use more text, a shorter --seq-len or a smaller --global-batch")
        return DataFeed(tf, tf.sampler(seq_len, self.seed), seq_len, global_batch)


class DataFeed:
    """One rank's view of a token file: the global batch of every step, as the sampler orders it."""

    def __init__(self, tokens: Any, sampler: Any, seq_len: int, global_batch: int) -> None:
        self.tokens, self.sampler, self.seq_len, self.gb = tokens, sampler, seq_len, global_batch

    def indices(self, step: int) -> list[int]:
        """Sequence indices of step ``step``'s global batch (the same under every strategy)."""
        return [int(i) for i in self.sampler.global_batch(step, self.gb)]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, next-token targets) ``[global_batch, seq_len]`` (int64, CPU) of step ``step``."""
        x = torch.from_numpy(self.tokens.sequences(self.sampler.global_batch(step, self.gb), self.seq_len))
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()

    def position(self, steps_done: int) -> Any:
        """The :class:`~parashift.data.DataPosition` after ``steps_done`` steps."""
        from ..data import DataPosition
        return DataPosition(self.sampler.seed, self.sampler.n, steps_done, steps_done * self.gb, self.sampler.source)


#: what ``--precision`` trains in (the runtime has no fp16 loss scaling)
TRAIN_PRECISIONS = ("fp32", "bf16")


def with_precision(spec: "ModelSpec", precision: str | None) -> "ModelSpec":
    """``spec`` trained in ``precision``: ``fp32``, or ``bf16`` (bf16 parameters and compute, fp32 master
    weights, optimizer states and gradient accumulation); None keeps the model's own dtype."""
    from ..errors import InputError
    if precision is None or precision == spec.dtype:
        return spec
    if precision not in TRAIN_PRECISIONS:
        raise InputError(f"--precision {precision!r} is not one of {', '.join(TRAIN_PRECISIONS)}")
    return replace(spec, dtype=precision)
