"""Periodic snapshots of a multi-host live job, written with torch.distributed.checkpoint (DCP).

Every ``every`` steps each process hands a copy of its flat state buffers (:data:`..switch.stores.STATE_KINDS`
of every family) to ``dcp.async_save`` (one checkpoint per rank, ``<dir>/step<s>/rank<r>``, no
collective: a snapshot never waits for a peer that may be gone) and training goes on while a
thread writes it. Once written, the writer records ``hosts/snap/<s>/<device>`` (its strategy, rank
and optimizer step) in the job's store and the same beside the checkpoint (``<dir>/step<s>/rank<r>.json``,
with the model); a snapshot is whole when every rank of its strategy has recorded it (:func:`latest`
in the store, :func:`latest_on_disk` for a job restarted with ``--resume`` after its store is gone). Restoring (:func:`restore`, :func:`read_snapshot`) goes through the VPS:
the new rank's boxes are intersected with the snapshot's layout (:func:`snapshot_pieces`, each element
from one holder), and only the source ranks holding a part of them are read with ``dcp.load``, one at a
time: any layout restores from any other, and no rank assembles the whole model.

The directory must be one that every host reaches (a shared filesystem on a real cluster; on
loopback any local directory). Each process keeps its last :data:`KEEP` written snapshots and removes
older step folders, those of processes lost since included. A write that fails (a full disk, a read-only
or blocked path) is not recorded: the process says so on stderr, records the cause under
``hosts/snap_failed/<s>/<device>`` and trains on; a recovery then uses an older whole snapshot.
"""
from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import threading
import warnings
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from ...errors import RuntimeFailure
from ...models import ModelSpec
from ...strategy import Strategy
from ...vps.boxes import exactly_once, intersect_pairs
from ...vps.layout import layout

__all__ = ["Snapshotter", "latest", "latest_on_disk", "restore", "read_snapshot", "snapshot_pieces", "KEEP"]

#: snapshots each process keeps on disk (the newest may be incomplete when a host is lost)
KEEP = 3

try:       # DCP's error for a failed write (ENOSPC from a full disk included) derives from BaseException
    from torch.distributed.checkpoint.api import CheckpointException as _CheckpointException
except ImportError:  # pragma: no cover - older torch
    _CheckpointException = Exception
_WRITE_ERRORS = (Exception, _CheckpointException)


def _path(root: str, step: int, rank: int) -> str:
    return os.path.join(root, f"step{step}", f"rank{rank}")


# DCP warns that it saves and loads without a process group: each rank's checkpoint is its own, on purpose
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)


class Snapshotter:
    """One process's snapshots: ``maybe(kv, state, strategy, rank, device, steps_done)`` after each step."""

    def __init__(self, root: str, every: int, keep: int | None = KEEP) -> None:
        """``keep``: snapshots kept on disk (None: all)."""
        self.root, self.every, self.keep = root, int(every), keep
        self.pending: tuple[int, Future, threading.Event] | None = None
        self.kept: list[tuple[int, int]] = []        # (step, rank) of the snapshots written, oldest first
        self.record_error: OSError | None = None

    def maybe(self, kv: Any, state: Any, strategy: Any, rank: int, device: int, steps_done: int,
              data_position: dict | None = None, *, force: bool = False, extra: dict | None = None) -> bool:
        """Start a snapshot of ``state`` when ``steps_done`` is a multiple of ``every`` (or ``force``; after the
        previous one is on disk); returns whether one was started. It is recorded in ``kv`` as soon as it is
        written; ``data_position`` (a :class:`~parashift.data.DataPosition` as a dict) and ``extra`` (JSON: the
        trainer's state) go into the record beside it."""
        due = force or (self.every > 0 and steps_done % self.every == 0)
        try:
            self.finish(wait=due)
        except RuntimeFailure as e:
            self._failed(kv, device, e.step, e)
        if not due:
            return False
        from ..switch.stores import STATE_KINDS
        import torch.distributed.checkpoint as dcp
        arrays = {}
        opt = 0
        for fam, b in state.buffers.items():
            opt = max(opt, int(b.step))
            for kind in STATE_KINDS:
                t = getattr(b, kind)
                if t is not None:
                    arrays[f"{fam}.{kind}"] = t.detach().clone()      # the state of this step, not of later ones
        path = _path(self.root, steps_done, rank)
        try:
            os.makedirs(path, exist_ok=True)
            fut = dcp.async_save(arrays, checkpoint_id=path, no_dist=True)
        except _WRITE_ERRORS as e:     # the folder cannot be made, or the write cannot start
            self._drop(steps_done, rank)
            self._failed(kv, device, steps_done, RuntimeFailure(self._why(steps_done, e)))
            return False
        meta = pickle.dumps((str(strategy), rank, opt))
        model = getattr(getattr(state, "spec", None), "name", None)
        record = json.dumps({**(extra or {}), "strategy": str(strategy), "rank": rank, "opt_step": opt, "model": model,
                             **({"data_position": data_position} if data_position is not None else {})})

        recorded = threading.Event()

        def written(f: Future) -> None:        # the writer thread: record it, drop this rank's oldest
            try:
                if f.exception() is not None:
                    self._drop(steps_done, rank)         # a write cut short leaves no half checkpoint
                    return
                with open(path + ".json", "w") as fh:
                    fh.write(record)
                kv.set(f"hosts/snap/{steps_done}/{device}", meta)
                self.kept.append((steps_done, rank))
                if self.keep is not None:
                    while len(self.kept) > self.keep:
                        self._drop(*self.kept.pop(0))
                    self._sweep(self.kept[0][0])
            except OSError as e:                         # the record could not be written: not whole
                self._drop(steps_done, rank)
                self.record_error = e
            finally:
                recorded.set()
        fut.add_done_callback(written)
        self.record_error = None
        self.pending = (steps_done, fut, recorded)
        return True

    def _drop(self, step: int, rank: int) -> None:
        """Remove rank ``rank``'s checkpoint of ``step`` and its record (and the step's folder once empty)."""
        old = _path(self.root, step, rank)
        shutil.rmtree(old, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.remove(old + ".json")
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(old))           # the last rank out removes the step

    def _sweep(self, oldest: int) -> None:
        """Remove step folders older than ``oldest`` (this process's oldest kept snapshot): those of ranks whose
        process was lost, or that changed rank in a switch, are never dropped by their writer."""
        with contextlib.suppress(OSError):
            for n in os.listdir(self.root):
                if n.startswith("step") and n[4:].isdigit() and int(n[4:]) < oldest:
                    shutil.rmtree(os.path.join(self.root, n), ignore_errors=True)

    def _why(self, step: int, e: BaseException) -> str:
        lines = str(e).strip().splitlines() or [""]
        cause = lines[-1].strip(" )") if len(lines) > 1 else lines[0]     # DCP's: a rank's traceback, the error last
        return (f"writing the snapshot of step {step} to {self.root} failed ({type(e).__name__}: {cause}); check that "
                f"--snapshot-dir is writable and has space on every host")

    def _failed(self, kv: Any, device: int, step: int, e: RuntimeFailure) -> None:
        """The snapshot of ``step`` could not be written: said on stderr and recorded in the store; training
        goes on (it is not recorded as written, so no recovery uses it)."""
        import sys
        print(f"parashift: device {device}: {e}; training goes on, the snapshot is not used", file=sys.stderr,
              flush=True)
        with contextlib.suppress(Exception):
            kv.set(f"hosts/snap_failed/{step}/{device}", str(e))

    def finish(self, wait: bool = False) -> None:
        """Raise if the pending snapshot failed (``wait``: block until it is written)."""
        if self.pending is None:
            return
        s, fut, recorded = self.pending
        if not wait and not recorded.is_set():
            return
        self.pending = None
        try:
            fut.result()
            recorded.wait()             # its record is written too (the callback runs after the result is set)
            if self.record_error is not None:
                raise self.record_error
        except _WRITE_ERRORS as e:     # a snapshot that failed is not recorded
            err = RuntimeFailure(self._why(s, e))
            err.step = s
            raise err from e


def latest(kv: Any, devices: int, every: int, before: int) -> tuple[int, str, int] | None:
    """The newest whole snapshot at or before step ``before``: (step, strategy, optimizer step), or None.
    ``devices``: device ids ever registered (0..devices-1)."""
    if every <= 0:
        return None
    for s in range(before - before % every, 0, -every):
        got = [pickle.loads(kv.get(k)) for k in (f"hosts/snap/{s}/{d}" for d in range(devices)) if kv.check([k])]
        by: dict[str, dict[int, int]] = {}
        for st, rank, opt in got:
            by.setdefault(st, {})[rank] = opt
        for st, ranks in by.items():
            if len(ranks) == Strategy.parse(st).world:
                return s, st, max(ranks.values())
    return None


def latest_on_disk(root: str, model: str | None = None) -> tuple[int, str, int]:
    """The newest whole snapshot under ``root`` from the records beside its checkpoints: (step, strategy,
    optimizer step). Whole: every rank of one strategy recorded it (and its checkpoint is there); ``model``:
    only snapshots of that model. Raises RuntimeFailure naming what was found when there is none."""
    from ...errors import StrategyError
    if not os.path.isdir(root):
        raise RuntimeFailure(f"--resume: the snapshot directory {root} does not exist; give the --snapshot-dir "
                             f"the job wrote its snapshots to (run with --snapshot-every N)")
    steps = sorted((int(n[4:]) for n in os.listdir(root) if n.startswith("step") and n[4:].isdigit()), reverse=True)
    seen = []
    for s in steps:
        by: dict[str, dict[int, int]] = {}
        models_seen = set()
        for n in os.listdir(os.path.join(root, f"step{s}")):
            if not (n.startswith("rank") and n.endswith(".json")):
                continue
            try:
                with open(os.path.join(root, f"step{s}", n)) as fh:
                    rec = json.load(fh)
                st, rank, opt = str(rec["strategy"]), int(rec["rank"]), int(rec["opt_step"])
                world = Strategy.parse(st).world
            except (OSError, ValueError, KeyError, TypeError, StrategyError):
                continue                      # a record cut short (this rank did not finish) or not ours
            models_seen.add(rec.get("model"))
            if model is not None and rec.get("model") not in (None, model):
                continue
            if os.path.isdir(_path(root, s, rank)):
                by.setdefault((st, world), {})[rank] = opt
        for (st, world), ranks in by.items():
            if set(ranks) == set(range(world)):
                return s, st, max(ranks.values())
        seen.append(f"step {s}: " + (", ".join(f"{len(r)} of {world} ranks of {st}"
                                                 for (st, world), r in by.items()) or
                                     (f"snapshots of {', '.join(sorted(map(str, models_seen)))}" if models_seen
                                      else "no records")))
    raise RuntimeFailure(f"--resume: no whole snapshot{f' of {model}' if model else ''} in {root}"
                         + (f" ({'; '.join(seen[:4])})" if seen else " (it holds no step<N> folders)")
                         + "; resume from the directory the job wrote with --snapshot-every N")


def restore(root: str, spec: Any, snap_strategy: str, step: int, strategy: Any, rank: int, opt_step: int) -> Any:
    """Rank ``rank`` of ``strategy``'s StateStore from the snapshot of step ``step`` (taken under ``snap_strategy``)."""
    return read_snapshot(root, spec, snap_strategy, step, strategy, rank, opt_step)


def snapshot_pieces(spec: ModelSpec, src: Strategy, dst: Strategy, rank: int, kinds: tuple[str, ...]):
    """The boxes rank ``rank`` of ``dst`` reads from a checkpoint written under ``src``: per source rank,
    a list of (tensor, kind, lo, hi), covering the rank's state exactly once (RuntimeFailure otherwise)."""
    lq, lp = layout(spec, dst), layout(spec, src)
    names = lq.table.names
    need = lq.regions([rank], kinds=kinds)
    have = lp.regions(None, kinds=kinds)
    kq = np.array([kinds.index(lq.kinds[k]) for k in need.kind], dtype=np.int64)
    kp = np.array([kinds.index(lp.kinds[k]) for k in have.kind], dtype=np.int64)
    # identical copies (replicas) collapse to the lowest rank that holds them (rows come in rank order)
    _, first = np.unique(np.concatenate([(have.tensor * len(kinds) + kp)[:, None], have.lo, have.hi], axis=1),
                         axis=0, return_index=True)
    first.sort()
    h_t, h_k, h_lo, h_hi, h_r = have.tensor[first], kp[first], have.lo[first], have.hi[first], have.rank[first]
    ia, jb, lo, hi = intersect_pairs(need.lo, need.hi, h_lo, h_hi, need.tensor * len(kinds) + kq,
                                     h_t * len(kinds) + h_k)
    cov = exactly_once(need.lo, need.hi, np.arange(len(need.lo)), lo, hi, ia)
    if not cov.ok:
        t = int(need.tensor[cov.group]) if cov.group >= 0 else 0
        raise RuntimeFailure(f"the checkpoint written under {src} does not hold rank {rank}'s part of {names[t]!r} "
                             f"under {dst} exactly once ({cov.reason}); it is not a checkpoint of this model")
    out: dict[int, list] = {}
    for i, j, a, b in zip(ia.tolist(), jb.tolist(), lo.tolist(), hi.tolist()):
        t = int(need.tensor[i])
        n = int(lq.table.ndim[t])
        out.setdefault(int(h_r[j]), []).append((names[t], kinds[int(kq[i])], tuple(a[:n]), tuple(b[:n])))
    return out


def read_snapshot(root: str, spec: ModelSpec, snap_strategy: str, step: int, strategy: Strategy, rank: int,
                  opt_step: int, device: torch.device = torch.device("cpu")):
    """Rank ``rank`` of ``strategy``'s StateStore from the snapshot of step ``step`` under ``snap_strategy``:
    only the source ranks holding a part of it are read, one at a time (DCP, their needed buffers only)."""
    import torch.distributed.checkpoint as dcp
    from ..state import StateStore
    from ..switch.stores import STATE_KINDS, piece_view
    src = Strategy.parse(snap_strategy)
    store = StateStore(spec, strategy, rank, device, init=False)
    kinds = tuple(k for k in STATE_KINDS if k != "master" or spec.dtype != "fp32")
    for r, pieces in sorted(snapshot_pieces(spec, src, strategy, rank, kinds).items()):
        path = _path(root, step, r)
        if not os.path.isdir(path):
            raise RuntimeFailure(f"the checkpoint of step {step} has no files for rank {r} at {path}; every rank "
                                 f"must write where the others read (a shared directory)")
        skel = StateStore(spec, src, r, torch.device("cpu"), init=False)
        want = {f"{skel.pieces[t].group}.{k}" for t, k, _, _ in pieces}
        dcp.load({key: getattr(skel.buffers[key.split(".")[0]], key.split(".")[1]) for key in sorted(want)},
                 checkpoint_id=path, no_dist=True)
        for t, k, lo, hi in pieces:
            piece_view(store, t, k, lo, hi).copy_(piece_view(skel, t, k, lo, hi))
        del skel
    for b in store.buffers.values():
        b.step = opt_step
    return store
