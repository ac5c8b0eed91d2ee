"""Checkpoints a user keeps: ``--save DIR --save-every N``, ``--resume DIR`` in any strategy, ``--export-hf DIR``.

A saved checkpoint is a snapshot of :mod:`.job.snapshot` (one DCP checkpoint per rank of its flat state
buffers: ``param``, ``master``, ``exp_avg``, ``exp_avg_sq``; ``step<s>/rank<r>.json`` beside it with the
strategy, the optimizer step and the trainer's state: the step, the optimizer settings with the LR
schedule, the data position (:class:`~parashift.data.DataPosition`, a function of the step that resuming
checks against ``--data``) and whatever :meth:`Checkpointing.provide` registers). Resuming reads
it through the VPS (:func:`.job.snapshot.read_snapshot`): each rank of the new layout intersects its boxes with the
checkpoint's layout and reads only the source ranks that hold a part of them, one at a time, so the
whole model is never assembled. Exporting writes Hugging Face safetensors (:func:`.weights.export_hf`).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any, Callable

import torch

from ..models import ModelSpec
from ..strategy import Strategy

__all__ = ["CheckpointOptions", "Checkpointing"]


@dataclass(frozen=True)
class CheckpointOptions:
    """What a run keeps: ``save`` (a folder) every ``save_every`` steps and at the end, ``resume`` from a
    folder's newest whole checkpoint, ``export_hf`` (a folder) at the end."""

    save: str | None = None
    save_every: int = 0
    resume: str | None = None
    export_hf: str | None = None

    def __post_init__(self) -> None:
        from ..errors import InputError
        if self.save_every and not self.save:
            raise InputError("--save-every needs --save DIR (where the checkpoints go)")
        if self.save_every < 0:
            raise InputError(f"--save-every {self.save_every} must be 0 (only at the end) or more")

    @property
    def any(self) -> bool:
        return bool(self.save or self.resume or self.export_hf)

    def check(self, spec: ModelSpec, steps: int, data: Any = None, global_batch: int = 0, seq_len: int = 0) -> None:
        """Refuse, before any process starts, an export the model cannot have, a resume with nothing to do, or
        one whose data position does not continue on ``data`` (a :class:`~.train.TokenData`)."""
        from ..errors import DataError, InputError
        if self.export_hf:
            from ..models.hf import hf_config
            from .hf import check_convertible
            hf_config(spec)             # the more precise message first
            check_convertible(spec)
        if self.resume:
            from .job.snapshot import latest_on_disk
            if not os.path.isdir(self.resume):
                raise InputError(f"--resume {self.resume}: no such folder; give the --save DIR of an earlier run")
            step = latest_on_disk(os.path.abspath(self.resume), model=spec.name)[0]
            if step >= steps:
                raise InputError(f"--resume {self.resume}: its newest checkpoint is at step {step}, and --steps "
                                 f"{steps} counts from step 0; ask for more steps than {step}")
            from .job.snapshot import _path
            with open(_path(os.path.abspath(self.resume), step, 0) + ".json") as fh:
                saved = json.load(fh).get("data_position")
            if saved is not None:
                from ..data import DataPosition
                pos = DataPosition.from_dict(saved)
                if data is None:
                    raise DataError(f"--resume {self.resume}: the checkpoint trained on a token file; give the same "
                                    f"--data (and --data-seed {pos.seed}) to continue its sequence order")
                data.open(seq_len, global_batch, spec.vocab).sampler.check(pos)
                if pos.consumed != pos.step * global_batch:
                    raise DataError(f"--resume {self.resume}: the checkpoint consumed {pos.consumed} sequences in "
                                    f"{pos.step} steps; resume with its global batch "
                                    f"{pos.consumed // max(pos.step, 1)}, not {global_batch}, so that no sample is "
                                    f"skipped or repeated")


class _NoStore:
    """The job store a snapshot records itself in, for a run without one (its records are on disk)."""

    def set(self, key: str, value: bytes) -> None:
        pass


class Checkpointing:
    """One rank's checkpoints for a run: :meth:`start` (resume), :meth:`after_step`, :meth:`finish`.

    ``provide(name, get, put)`` registers trainer state saved with every checkpoint (``get()``: a JSON
    value) and handed back on resume (``put(value)``): the data position and the LR schedule plug in here."""

    def __init__(self, opts: CheckpointOptions | None, spec: ModelSpec, strategy: Strategy, rank: int,
                 optim: dict | None = None) -> None:
        self.opts = opts or CheckpointOptions()
        self.spec, self.strategy, self.rank = spec, strategy, rank
        # the optimizer settings as JSON (the LR schedule a dict: with the step, all of its state)
        self.optim = {k: asdict(v) if is_dataclass(v) else v for k, v in (optim or {}).items()}
        self.providers: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        self.resumed: dict[str, Any] | None = None
        self.snaps = None
        self.saved_at = -1
        if self.opts.save:
            from .job.snapshot import Snapshotter
            self.snaps = Snapshotter(os.path.abspath(self.opts.save), self.opts.save_every, keep=None)

    def provide(self, name: str, get: Callable[[], Any], put: Callable[[Any], None]) -> None:
        self.providers[name] = (get, put)
        if self.resumed is not None and name in self.resumed.get("trainer", {}):
            put(self.resumed["trainer"][name])

    def start(self, device: torch.device):
        """The store to start from (None: start from initial values or weights) and the step to start at."""
        if not self.opts.resume:
            return None, 0
        from .job.snapshot import _path, latest_on_disk, read_snapshot
        root = os.path.abspath(self.opts.resume)
        step, st, opt = latest_on_disk(root, model=self.spec.name)
        with open(_path(root, step, 0) + ".json") as fh:
            self.resumed = json.load(fh)
        store = read_snapshot(root, self.spec, st, step, self.strategy, self.rank, opt, device)
        return store, step

    def _trainer(self, steps_done: int) -> dict:
        return {"step": steps_done, "optim": self.optim, "trainer": {k: g() for k, (g, _) in self.providers.items()}}

    def after_step(self, rt, *, last: bool = False) -> None:
        """Save when the step is due (``last``: at the end of the run, unless this step is saved already),
        in the background; ``last`` waits until it is on disk."""
        if self.snaps is None:
            return
        due = self.snaps.every > 0 and rt.steps_done % self.snaps.every == 0
        if (due or last) and self.saved_at != rt.steps_done:
            rt.sync_params()            # overlap_param: a checkpoint holds whole parameters
            pos = rt.data_position()
            self.snaps.maybe(_NoStore(), rt.store, self.strategy, self.rank, self.rank, rt.steps_done,
                             pos.to_dict() if pos is not None else None, force=True,
                             extra=self._trainer(rt.steps_done))
            self.saved_at = rt.steps_done
        if last:
            self.snaps.finish(wait=True)

    def finish(self, rt) -> dict:
        """At the end of the run: the last checkpoint and the Hugging Face export; what was written."""
        out: dict[str, Any] = {}
        self.after_step(rt, last=True)
        if self.opts.save:
            out["saved"] = {"dir": os.path.abspath(self.opts.save), "step": rt.steps_done}
        if self.opts.export_hf:
            from .weights import export_hf
            rt.sync_params()
            export_hf(rt.store, os.path.abspath(self.opts.export_hf))
            out["export_hf"] = os.path.abspath(self.opts.export_hf)
        if self.resumed is not None:
            out["resumed"] = {"dir": os.path.abspath(self.opts.resume), "step": self.resumed["step"],
                              "strategy": self.resumed["strategy"]}
        return out
