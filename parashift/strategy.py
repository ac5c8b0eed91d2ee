"""Parallel strategies: parsing, validation and the rank grid (the one place rank order lives)."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

import numpy as np

from .errors import StrategyError

if TYPE_CHECKING:  # pragma: no cover
    from .models import ModelSpec

__all__ = ["Strategy", "SCHEDULES", "RECOMPUTE"]

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "dualpipev")
RECOMPUTE = ("none", "selective", "full")
_INT_FIELDS = ("dp", "tp", "pp", "ep", "zero", "vpp", "mbs")
_KEYS = _INT_FIELDS + ("schedule", "recompute")


@dataclass(frozen=True)
class Strategy:
    """A parallel strategy. Ranks are laid out in Megatron order: TP fastest, then DP, then PP.

    EP subdivides the DP axis: ``ep_rank = dp_rank % ep`` and the expert-data-parallel
    rank is ``dp_rank // ep`` (experts are replicated over ``dp // ep`` ranks).
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero: int = 0
    vpp: int = 1
    mbs: int = 1
    schedule: str = "1f1b"
    recompute: str = "none"

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise StrategyError(f"{name}={v!r} must be an integer; write e.g. '{name}=2'")
            object.__setattr__(self, name, int(v))
            if name != "zero" and v < 1:
                raise StrategyError(f"{name}={v} must be at least 1")
        if not 0 <= self.zero <= 3:
            raise StrategyError(f"zero={self.zero} is not a ZeRO stage; use 0, 1, 2 or 3")
        if self.schedule not in SCHEDULES:
            raise StrategyError(f"unknown schedule {self.schedule!r}; use one of {', '.join(SCHEDULES)}")
        if self.recompute not in RECOMPUTE:
            raise StrategyError(f"unknown recompute {self.recompute!r}; use one of {', '.join(RECOMPUTE)}")
        if self.dp % self.ep:
            raise StrategyError(f"ep={self.ep} must divide dp={self.dp} (experts are spread over DP ranks); "
                                f"pick ep among the divisors of {self.dp}")
        if self.schedule == "interleaved-1f1b" and self.vpp < 2:
            raise StrategyError("schedule interleaved-1f1b needs vpp >= 2; set vpp=2 or use schedule=1f1b")
        if self.schedule in ("gpipe", "1f1b", "zb-h1") and self.vpp != 1:
            raise StrategyError(f"schedule {self.schedule} runs one chunk per stage (vpp=1); "
                                f"use schedule=interleaved-1f1b or dualpipev for vpp={self.vpp}")
        if self.schedule == "dualpipev" and self.vpp % 2:
            raise StrategyError(f"dualpipev needs an even number of chunks per rank (vpp={self.vpp}); set vpp=2")

    # ---- text form -------------------------------------------------------------------------
    @classmethod
    def parse(cls, text: "str | Strategy") -> "Strategy":
        """Parse ``"dp=4,tp=2,pp=2,zero=1"``; omitted fields take their defaults."""
        if isinstance(text, Strategy):
            return text
        kw: dict[str, object] = {}
        for part in str(text).replace(" ", "").split(","):
            if not part:
                continue
            if "=" not in part:
                raise StrategyError(f"strategy item {part!r} is not key=value; write e.g. 'dp=4,tp=2'")
            key, val = part.split("=", 1)
            if key not in _KEYS:
                raise StrategyError(f"unknown strategy key {key!r}; keys are {', '.join(_KEYS)}")
            if key in kw:
                raise StrategyError(f"strategy key {key!r} is given twice in {text!r}")
            if key in _INT_FIELDS:
                try:
                    kw[key] = int(val)
                except ValueError:
                    raise StrategyError(f"{key}={val!r} must be an integer") from None
            else:
                kw[key] = val
        if kw.get("schedule") is None and int(kw.get("vpp", 1)) > 1:  # type: ignore[arg-type]
            kw["schedule"] = "interleaved-1f1b"
        return cls(**kw)  # type: ignore[arg-type]

    def __str__(self) -> str:
        default = Strategy()
        parts = [f"dp={self.dp}", f"tp={self.tp}", f"pp={self.pp}"]
        for f in fields(self):
            if f.name in ("dp", "tp", "pp"):
                continue
            v = getattr(self, f.name)
            if v != getattr(default, f.name):
                parts.append(f"{f.name}={v}")
        return ",".join(parts)

    def replace(self, **changes: object) -> "Strategy":
        return replace(self, **changes)

    # ---- sizes -----------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def edp(self) -> int:
        """Size of the expert-data-parallel group (replicas of one expert shard)."""
        return self.dp // self.ep

    @property
    def stages(self) -> int:
        """Number of model chunks (virtual stages): pp * vpp."""
        return self.pp * self.vpp

    def num_microbatches(self, global_batch: int) -> int:
        """Micro-batches per DP replica for a global batch of sequences."""
        per = self.dp * self.mbs
        if global_batch % per:
            raise StrategyError(f"global batch {global_batch} is not divisible by dp*mbs={per}; "
                                f"use a multiple of {per}")
        m = global_batch // per
        if self.schedule == "interleaved-1f1b" and self.pp > 1 and m % self.pp:
            raise StrategyError(f"interleaved-1f1b needs the micro-batch count ({m}) to be a multiple of "
                                f"pp={self.pp}; change the global batch or mbs")
        return m

    # ---- the rank grid ---------------------------------------------------------------------
    def coords(self, rank: "int | np.ndarray") -> dict:
        """Coordinates of rank(s): tp, dp, pp, ep (= dp % ep) and edp (= dp // ep)."""
        r = np.asarray(rank)
        if np.any((r < 0) | (r >= self.world)):
            raise StrategyError(f"rank {rank} is outside the world of {self.world} ranks")
        tp = r % self.tp
        dp = (r // self.tp) % self.dp
        pp = r // (self.tp * self.dp)
        out = {"tp": tp, "dp": dp, "pp": pp, "ep": dp % self.ep, "edp": dp // self.ep}
        if np.ndim(rank) == 0:
            return {k: int(v) for k, v in out.items()}
        return out

    def rank(self, tp: "int | np.ndarray" = 0, dp: "int | np.ndarray" = 0,
             pp: "int | np.ndarray" = 0) -> "int | np.ndarray":
        """Rank of coordinates (inverse of :meth:`coords`)."""
        r = np.asarray(tp) + self.tp * (np.asarray(dp) + self.dp * np.asarray(pp))
        return int(r) if np.ndim(r) == 0 else r

    def group(self, rank: int, axis: str) -> tuple[int, ...]:
        """Members of ``rank``'s group along ``axis`` (tp, dp, pp, ep, edp, or mp = tp x pp)."""
        c = self.coords(rank)
        if axis == "tp":
            return tuple(int(x) for x in self.rank(np.arange(self.tp), c["dp"], c["pp"]))
        if axis == "dp":
            return tuple(int(x) for x in self.rank(c["tp"], np.arange(self.dp), c["pp"]))
        if axis == "pp":
            return tuple(int(x) for x in self.rank(c["tp"], c["dp"], np.arange(self.pp)))
        if axis == "ep":  # same edp index, all ep ranks
            return tuple(int(x) for x in self.rank(c["tp"], c["edp"] * self.ep + np.arange(self.ep), c["pp"]))
        if axis == "edp":  # same ep index, all expert-data-parallel replicas
            return tuple(int(x) for x in self.rank(c["tp"], c["ep"] + self.ep * np.arange(self.edp), c["pp"]))
        if axis == "embed":  # first and last pipeline stage of this (tp, dp): tied embeddings
            return tuple(sorted({int(self.rank(c["tp"], c["dp"], 0)), int(self.rank(c["tp"], c["dp"], self.pp - 1))}))
        raise StrategyError(f"unknown group axis {axis!r}; use tp, dp, pp, ep, edp or embed")

    def groups(self, axis: str) -> np.ndarray:
        """All groups along ``axis`` as a 2-D array (one row per group, ranks ascending)."""
        g = np.arange(self.world).reshape(self.pp, self.dp, self.tp)  # [pp, dp, tp]
        if axis == "tp":
            return g.reshape(-1, self.tp)
        if axis == "dp":
            return g.transpose(0, 2, 1).reshape(-1, self.dp)
        if axis == "pp":
            return g.transpose(1, 2, 0).reshape(-1, self.pp)
        if axis == "ep":
            e = g.reshape(self.pp, self.edp, self.ep, self.tp)
            return e.transpose(0, 1, 3, 2).reshape(-1, self.ep)
        if axis == "edp":
            e = g.reshape(self.pp, self.edp, self.ep, self.tp)
            return e.transpose(0, 2, 3, 1).reshape(-1, self.edp)
        if axis == "embed":
            return np.unique(g[[0, -1]].transpose(1, 2, 0).reshape(-1, 2), axis=1)
        raise StrategyError(f"unknown group axis {axis!r}; use tp, dp, pp, ep or edp")

    # ---- model-dependent checks ------------------------------------------------------------
    def validate(self, model: "ModelSpec", devices: int | None = None) -> "Strategy":
        """Raise StrategyError listing every reason this strategy cannot run ``model``."""
        problems = self.problems(model, devices)
        if problems:
            raise StrategyError(f"strategy {self} cannot run {model.name}: " + "; ".join(problems))
        return self

    def problems(self, model: "ModelSpec", devices: int | None = None) -> list[str]:
        """Every violation, each with its fix (empty when the strategy is valid)."""
        out: list[str] = []
        tp = self.tp
        for name, n in (("attention heads", model.heads), ("KV heads", model.kv_heads),
                        ("FFN size", model.ffn), ("vocabulary", model.vocab)):
            if n and n % tp:
                out.append(f"tp={tp} must divide the {name} ({n})")
        if model.experts:
            if model.expert_ffn % tp:
                out.append(f"tp={tp} must divide the expert FFN size ({model.expert_ffn})")
            if model.shared_ffn and model.shared_ffn % tp:
                out.append(f"tp={tp} must divide the shared-expert FFN size ({model.shared_ffn})")
            if model.experts % self.ep:
                out.append(f"ep={self.ep} must divide the expert count ({model.experts})")
        elif self.ep > 1:
            out.append(f"ep={self.ep} needs a mixture-of-experts model; {model.name} is dense, set ep=1")
        if self.stages > model.layers:
            out.append(f"pp*vpp={self.stages} exceeds the {model.layers} layers; lower pp or vpp")
        if devices is not None and devices != self.world:
            out.append(f"dp*tp*pp={self.world} does not match the {devices} devices; "
                       f"choose sizes whose product is {devices}")
        return out

    def layer_stages(self, layers: int) -> np.ndarray:
        """Virtual stage (chunk) of each layer: as even as possible, earlier stages take the extra layer."""
        s = self.stages
        base, extra = divmod(layers, s)
        sizes = np.full(s, base)
        sizes[:extra] += 1
        return np.repeat(np.arange(s), sizes)

    def chunk_rank_stage(self, chunk: int | np.ndarray) -> "int | np.ndarray":
        """Pipeline stage that holds virtual stage ``chunk``.

        Interleaved: chunk c lives on stage c % pp. DualPipeV (vpp=2): chunks go down the
        stages then back up, so stage s holds chunks s and 2*pp-1-s.
        """
        c = np.asarray(chunk)
        if self.schedule == "dualpipev":
            lap, pos = c // self.pp, c % self.pp
            out = np.where(lap % 2 == 0, pos, self.pp - 1 - pos)
        else:
            out = c % self.pp
        return int(out) if np.ndim(out) == 0 else out
