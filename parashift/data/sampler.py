"""The global order of sequences: a function of the seed and the step only, never of the strategy.

The sampler reads the sequences as one endless stream of epochs. Epoch ``e`` visits all ``n`` sequences
once, in the permutation drawn by ``numpy.random.default_rng([seed, e])``. Position ``p`` of the stream
is sequence ``perm(p // n)[p % n]``. Step ``s`` at global batch ``gb`` trains on positions
``[s*gb, s*gb + gb)``. A batch that crosses an epoch boundary takes the end of one permutation and the
start of the next, so each epoch still uses every sequence exactly once.

How the ranks of a strategy read a step's global batch ``B`` (``gb`` sequence indices):

- **dp**: DP rank ``d`` of ``dp`` takes the contiguous rows ``B[d*gb/dp : (d+1)*gb/dp]``. Its micro-batch
  ``m`` is rows ``[m*mbs, (m+1)*mbs)`` of that block. This is the runtime's ``microbatch_rows`` rule.
  Expert parallelism splits the DP axis, so EP ranks read as DP ranks do.
- **tp**: every tensor-parallel rank of a DP replica reads the same rows.
- **cp**: every context-parallel rank reads the same rows and keeps only its own token positions of
  each sequence.
- **pp**: every stage reads the same rows. The first stage uses the inputs and the last stage the
  targets.

None of this changes which sequences make up ``B``. A hot switch, a shrink or a grow changes only how
``B`` is cut up. The data position (:class:`DataPosition`) is the count of steps and of sequences consumed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import DataError

__all__ = ["Sampler", "DataPosition", "rank_rows"]


@dataclass(frozen=True)
class DataPosition:
    """Where training stands in the stream: ``step`` steps done, ``consumed`` sequences used by them.

    ``seed``, ``num_sequences`` and ``source`` (the token file's SHA-256, or "") identify the stream.
    Resuming from a position made for another seed or another file is refused."""

    seed: int
    num_sequences: int
    step: int = 0
    consumed: int = 0
    source: str = ""

    @property
    def epoch(self) -> int:
        return self.consumed // self.num_sequences

    @property
    def offset(self) -> int:
        """Sequences of the current epoch already consumed."""
        return self.consumed % self.num_sequences

    def advance(self, global_batch: int) -> "DataPosition":
        return DataPosition(self.seed, self.num_sequences, self.step + 1, self.consumed + global_batch, self.source)

    def to_dict(self) -> dict:
        return {"seed": self.seed, "num_sequences": self.num_sequences, "step": self.step,
                "consumed": self.consumed, "epoch": self.epoch, "offset": self.offset, "source": self.source}

    @classmethod
    def from_dict(cls, d: dict) -> "DataPosition":
        try:
            pos = cls(int(d["seed"]), int(d["num_sequences"]), int(d["step"]), int(d["consumed"]),
                      str(d.get("source", "")))
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"a data position needs integer seed, num_sequences, step and consumed; got {d!r}") from e
        if pos.num_sequences < 1 or pos.step < 0 or pos.consumed < 0:
            raise DataError(f"data position {d!r} is out of range (num_sequences >= 1, step and consumed >= 0)")
        if ("epoch" in d and int(d["epoch"]) != pos.epoch) or ("offset" in d and int(d["offset"]) != pos.offset):
            raise DataError(f"data position {d!r}: epoch/offset disagree with consumed={pos.consumed}")
        return pos


class Sampler:
    """Sequence indices of every step, from ``seed`` over ``num_sequences`` sequences (see the module doc);
    ``source`` names the token file (its SHA-256) so that positions from another file are refused."""

    def __init__(self, num_sequences: int, seed: int = 0, source: str = "") -> None:
        if num_sequences < 1:
            raise DataError(f"the data holds {num_sequences} sequences; it needs at least one")
        self.n, self.seed, self.source = int(num_sequences), int(seed), str(source)
        self._perms: dict[int, np.ndarray] = {}

    def order(self, epoch: int) -> np.ndarray:
        """The permutation of ``range(n)`` that epoch ``epoch`` visits (read-only, int64)."""
        p = self._perms.get(epoch)
        if p is None:
            p = np.random.default_rng([self.seed, epoch]).permutation(self.n).astype(np.int64)
            p.flags.writeable = False
            if len(self._perms) >= 2:      # a batch spans at most two epochs once gb <= n
                self._perms.pop(next(iter(self._perms)))
            self._perms[epoch] = p
        return p

    def take(self, start: int, count: int) -> np.ndarray:
        """Sequence indices at stream positions ``[start, start + count)``."""
        if start < 0 or count < 0:
            raise DataError(f"stream positions [{start}, {start + count}) are out of range")
        pos = np.arange(start, start + count, dtype=np.int64)
        epochs, within = np.divmod(pos, self.n)
        out = np.empty(count, dtype=np.int64)
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self.order(int(e))[within[sel]]
        return out

    def global_batch(self, step: int, global_batch: int) -> np.ndarray:
        """Sequence indices of step ``step`` at global batch ``global_batch`` (the same for every strategy)."""
        if global_batch < 1:
            raise DataError(f"global batch {global_batch} must be at least 1")
        return self.take(step * global_batch, global_batch)

    def batch_at(self, position: DataPosition, global_batch: int) -> np.ndarray:
        """Sequence indices of the step after ``position`` (its stream must be this sampler's)."""
        self.check(position)
        return self.take(position.consumed, global_batch)

    def start(self) -> DataPosition:
        return DataPosition(self.seed, self.n, source=self.source)

    def check(self, position: DataPosition) -> None:
        """Refuse a position made for another stream (seed, sequence count or token file)."""
        if position.source and self.source and position.source != self.source:
            raise DataError(f"the data position was saved for token file {position.source[:16]}..., but --data is "
                            f"{self.source[:16]}...; resume with the same token file")
        if (position.seed, position.num_sequences) != (self.seed, self.n):
            raise DataError(f"the data position was saved for seed {position.seed} over {position.num_sequences} "
                            f"sequences, but this run has seed {self.seed} over {self.n}; resume with the same "
                            f"--data, --seq-len and data seed")


def rank_rows(global_batch: int, dp: int, dp_rank: int, mbs: int | None = None, mb: int = 0) -> slice:
    """Rows of a step's global batch that DP rank ``dp_rank`` reads: its whole block, or with ``mbs``
    only micro-batch ``mb`` of it."""
    if dp < 1 or global_batch % dp:
        raise DataError(f"global batch {global_batch} is not divisible by dp={dp}")
    if not 0 <= dp_rank < dp:
        raise DataError(f"dp rank {dp_rank} is outside 0..{dp - 1}")
    per = global_batch // dp
    lo = dp_rank * per
    if mbs is None:
        return slice(lo, lo + per)
    if mbs < 1 or per % mbs or not 0 <= mb < per // mbs:
        raise DataError(f"micro-batch {mb} of size {mbs} does not fit the {per} rows of a dp rank")
    return slice(lo + mb * mbs, lo + (mb + 1) * mbs)
