"""The training-step Program's metadata as a type, with its one codec.

The compilers store ``StepMeta.encode()`` (plain JSON) in ``Program.meta``; the simulator, the runtime
and the command line read it back with :meth:`StepMeta.of`. A Program is complete: it carries the
model's full :class:`~parashift.models.ModelSpec` (``meta["model_spec"]``), so nothing looks a model
up by name again. A traced user model (named ``"custom"`` unless the user names it) has no spec: its torch module
cannot be serialized, so its runner is given the module (``exec.run_user_model``) and the Program
carries the region -> chunk map (``regions``) and the chunk -> stage map (``chunk_stages``) instead.

The flat keys (``model``, ``strategy``, ``schedule``, ``global_batch``, ``seq_len``, ``microbatches``,
``mbs``, ``kind``, ``directives``, ``regions``, ``chunk_stages``, ``placement``) keep the names and
values they had before the type existed, so JSON readers of a Program see the same shape.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import ProgramError
from ..models.spec import ModelSpec
from ..schedules import get_schedule

__all__ = ["StepMeta", "PRECISIONS", "CUSTOM", "spec_json", "spec_of"]

#: The numeric recipes a training step can run (``ModelSpec.dtype`` today; open to more).
PRECISIONS = ("fp32", "bf16", "fp16")
#: ``meta["model"]`` of a Program compiled from a traced user model (no spec).
CUSTOM = "custom"

_RECOMPILE = ("recompile it with this parashift: `parashift search ... --out plan.json`, "
              "`parashift schedule ... --out plan.json` or parashift.ir.compile(...)")

# Encoding a spec writes one JSON object per tensor: a spec shared by many Programs (a search) is
# encoded to text once (each Program gets its own copy), and a Program compiled in this process
# decodes back to the very spec it was given.
_ENCODED: dict[int, tuple[ModelSpec, str]] = {}
_DECODED: dict[int, tuple[dict, ModelSpec]] = {}
_MEMO = 32


def _remember(memo: dict, key: int, value: tuple) -> None:
    if len(memo) >= _MEMO:
        memo.pop(next(iter(memo)))
    memo[key] = value


def spec_json(spec: ModelSpec) -> dict:
    """``spec.to_json()`` (a fresh object; the encoding is done once per spec object)."""
    hit = _ENCODED.get(id(spec))
    if hit is None or hit[0] is not spec:
        hit = (spec, json.dumps(spec.to_json(), separators=(",", ":")))
        _remember(_ENCODED, id(spec), hit)
    obj = json.loads(hit[1])
    _remember(_DECODED, id(obj), (obj, spec))
    return obj


def spec_of(meta: Mapping[str, Any]) -> "ModelSpec | None":
    """The model spec a Program's ``meta`` carries (``model_spec``), or None when it carries none."""
    obj = meta.get("model_spec")
    if obj is None:
        return None
    hit = _DECODED.get(id(obj))
    if hit is not None and hit[0] is obj:
        return hit[1]
    spec = ModelSpec.from_json(obj)
    _remember(_DECODED, id(obj), (obj, spec))
    return spec


@dataclass(frozen=True)
class StepMeta:
    """What one training step is: the model itself (None for a traced user model), the strategy
    text, the schedule (a registered name), the micro-batching (``microbatches`` of ``mbs``
    sequences, ``global_batch`` sequences per step, ``seq_len`` tokens each; None for a user
    model), the numeric ``precision`` (one of :data:`PRECISIONS`; None for a user model: its
    module's own), and what the user's directives made of it: their text, a user model's
    ``regions`` (region -> chunk) and ``chunk_stages`` (chunk -> stage), and an explicit
    ``placement`` (``chunk_starts``/``chunk_stages``, see :mod:`parashift.ir.placement`)."""

    model: "ModelSpec | None"
    strategy: str
    schedule: str
    global_batch: int
    seq_len: "int | None"
    microbatches: int
    mbs: int
    precision: "str | None" = "bf16"
    kind: str = "train_step"
    name: str = ""
    directives: "str | None" = None
    regions: "Mapping[str, int] | None" = None
    chunk_stages: "tuple[int, ...] | None" = None
    placement: "Mapping[str, Any] | None" = None

    def __post_init__(self) -> None:
        if self.kind != "train_step":
            raise ProgramError(f"step meta kind {self.kind!r} is not 'train_step'")
        if self.precision not in PRECISIONS and not (self.precision is None and self.model is None):
            raise ProgramError(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        get_schedule(self.schedule)
        if not self.name:
            object.__setattr__(self, "name", self.model.name if self.model is not None else CUSTOM)
        if self.model is None and self.regions is None:
            raise ProgramError(f"step meta of model {self.name!r} carries neither its spec nor a traced model's "
                               f"regions; {_RECOMPILE}")

    @classmethod
    def build(cls, model: "ModelSpec | None", strategy: Any, *, global_batch: int, seq_len: "int | None",
              microbatches: int, directives: "str | None" = None, **kw: Any) -> "StepMeta":
        """The meta of a step of ``model`` (None: a traced user model) under ``strategy``."""
        return cls(model, str(strategy), strategy.schedule, int(global_batch),
                   None if seq_len is None else int(seq_len), int(microbatches), int(strategy.mbs),
                   precision=model.dtype if model is not None else None, directives=directives, **kw)

    @property
    def is_custom(self) -> bool:
        """A traced user model (no spec; its runner is given the torch module)."""
        return self.model is None

    def encode(self) -> dict:
        """The JSON-able ``Program.meta`` of a training step (keys of the module doc, plus
        ``model_spec`` and ``precision``; optional ones only when set)."""
        out: dict[str, Any] = {"model": self.name, "strategy": self.strategy, "schedule": self.schedule,
                               "global_batch": self.global_batch, "seq_len": self.seq_len,
                               "microbatches": self.microbatches, "mbs": self.mbs, "kind": self.kind,
                               "precision": self.precision}
        if self.model is not None:
            out["model_spec"] = spec_json(self.model)
        if self.regions is not None:
            out["regions"] = dict(self.regions)
        if self.chunk_stages is not None:
            out["chunk_stages"] = list(self.chunk_stages)
        if self.directives is not None:
            out["directives"] = self.directives
        if self.placement is not None:
            out["placement"] = dict(self.placement)
        return out

    @classmethod
    def decode(cls, meta: Mapping[str, Any]) -> "StepMeta":
        """The StepMeta ``meta`` encodes; ProgramError naming the fix when it is not a complete
        training step's (an older parashift's plan, a switch or rollout Program)."""
        kind = meta.get("kind")
        if kind != "train_step":
            raise ProgramError(f"not a training-step Program (meta kind {kind!r}); compile one with "
                               f"parashift.ir.compile")
        name = meta.get("model")
        if "model_spec" not in meta and "regions" not in meta:
            raise ProgramError(f"this plan of {name!r} was written by an older parashift (no step meta: "
                               f"it names its model instead of carrying it); {_RECOMPILE}")
        need = ("strategy", "schedule", "global_batch", "seq_len", "microbatches", "mbs")
        lack = [k for k in need if k not in meta]
        if lack:
            raise ProgramError(f"training-step meta lacks {', '.join(map(repr, lack))}; {_RECOMPILE}")
        cs = meta.get("chunk_stages")
        seq = meta["seq_len"]
        spec = spec_of(meta)
        if spec is not None and spec.name != name:
            raise ProgramError(f"the plan names model {name!r} but carries the spec of {spec.name!r} (was it edited?); "
                               f"{_RECOMPILE}")
        return cls(spec, str(meta["strategy"]), str(meta["schedule"]), int(meta["global_batch"]),
                   None if seq is None else int(seq), int(meta["microbatches"]), int(meta["mbs"]),
                   precision=meta.get("precision", "bf16"), kind=kind, name=str(name),
                   directives=meta.get("directives"), regions=meta.get("regions"),
                   chunk_stages=None if cs is None else tuple(int(c) for c in cs),
                   placement=meta.get("placement"))

    @classmethod
    def of(cls, program: Any) -> "StepMeta":
        """The decoded metadata of training-step ``program``."""
        return cls.decode(program.meta)

    @classmethod
    def maybe(cls, program: Any) -> "StepMeta | None":
        """:meth:`of` for a complete training-step Program, else None (a switch, a rollout, a
        hand-made Program without step meta)."""
        meta = program.meta
        if meta.get("kind") != "train_step" or ("model_spec" not in meta and "regions" not in meta):
            return None
        return cls.decode(meta)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepMeta):
            return NotImplemented
        return self.encode() == other.encode()

    __hash__ = None  # type: ignore[assignment]

