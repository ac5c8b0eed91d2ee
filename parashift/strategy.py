"""Parallel strategies: parsing, validation and the rank grid (the one place rank order lives)."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

import numpy as np

from .errors import StrategyError
from .fp8 import NAMES as FP8_RECIPES, get as _fp8_recipe
from .schedules import get_schedule as _schedule, schedule_names
from .states import ZeroStage, zero_stage

if TYPE_CHECKING:  # pragma: no cover
    from .models import ModelSpec

__all__ = ["Strategy", "SCHEDULES", "RECOMPUTE", "FP8_RECIPES"]

RECOMPUTE = ("none", "selective", "full")
_INT_FIELDS = ("dp", "tp", "pp", "ep", "zero", "vpp", "mbs", "cp", "shard")
_BOOL_FIELDS = ("sp", "overlap_grad", "overlap_param", "tp_async", "grad_fusion", "fp8_gather")
_KEYS = _INT_FIELDS + _BOOL_FIELDS + ("schedule", "recompute", "fp8")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def __getattr__(name: str):  # SCHEDULES: the schedule registry's names (parashift.schedules), read when asked
    if name == "SCHEDULES":
        return schedule_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class Strategy:
    """A parallel strategy. Ranks are laid out in Megatron order: TP fastest, then CP, then DP, then PP.

    EP subdivides the DP axis: ``ep_rank = dp_rank % ep`` and the expert-data-parallel
    rank is ``dp_rank // ep`` (experts are replicated over ``dp // ep`` ranks).
    ``sp``: Megatron sequence parallelism (norms and dropout sharded along the sequence over the
    TP group; needs tp > 1). ``cp``: context parallelism, each of ``cp`` ranks holds ``seq/cp``
    tokens of every sequence and attention passes K/V around the CP ring; parameters are
    replicated over CP and gradients are reduced (and ZeRO-sharded) over the ``dp x cp`` ranks.
    ``overlap_grad``: each chunk's gradient reduction starts as soon as that chunk's backward is done,
    overlapping the stage's remaining backward (Megatron's ``--overlap-grad-reduce``; a chunk is the
    bucket); off (the default, as Megatron's): every reduction waits for the stage's whole backward.
    ``shard``: hybrid sharding (HSDP; Megatron's ``--num-distributed-optimizer-instances``): ZeRO shards
    over groups of ``shard`` consecutive DP ranks (axis ``shard``) and each shard is replicated over the
    ``dp // shard`` groups (axis ``replica``); gradients are reduce-scattered in the group, then
    all-reduced across replicas. 0 (the default) or ``dp``: ZeRO shards over the whole DP group.
    ``overlap_param`` (ZeRO-1/2): the parameter all-gathers of the optimizer step move to the head of the
    next step, one per bucket (a region, or a chunk where regions are fused or hold experts), a chunk's
    issued together and each waited for only by its bucket's first forward (Megatron's
    ``--overlap-param-gather``); off (the default, as Megatron's): the gathers follow the optimizer, exposed.
    ``tp_async`` (tp > 1): the backward's tensor-parallel reduction of a column-parallel block's input gradient
    (all-reduce; with ``sp`` reduce-scatter) runs on stream ``"tp"`` beside the block's weight-gradient compute,
    which the block's backward then splits off (see :attr:`column_wgrad`; Megatron-LM's asynchronous TP
    all-reduce, default on since September 2021; ``--no-async-tensor-model-parallel-allreduce`` turns it off);
    the next compute waits for it.
    ``grad_fusion``: each weight-gradient GEMM accumulates into the step's gradient buffer (Megatron-LM's
    ``--gradient-accumulation-fusion``, default on since February 2022); off: a separate pass adds each
    micro-batch's gradient into the buffer (priced by the cost model's ``grad_accum_traffic``). Both off by
    default: the 2021 software the SC21 and vTrain anchors ran.
    ``fp8``: the FP8 training recipe (:mod:`parashift.fp8`): ``none`` (BF16 GEMMs), ``delayed``, ``current`` or
    ``mx`` scaling of the transformer's GEMMs; a bare ``fp8`` is ``delayed``. ``fp8_gather``: ZeRO's parameter
    all-gathers move the FP8 copies (half the bytes of BF16; TransformerEngine's and torchao's FP8 all-gather).
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
    cp: int = 1
    sp: bool = False
    overlap_grad: bool = False
    shard: int = 0
    overlap_param: bool = False
    tp_async: bool = False
    grad_fusion: bool = False
    fp8: str = "none"
    fp8_gather: bool = False

    def __post_init__(self) -> None:
        for name in _BOOL_FIELDS:
            v = getattr(self, name)
            if type(v) is not bool:
                if not isinstance(v, np.bool_):
                    raise StrategyError(f"{name}={v!r} must be a boolean; write '{name}' or '{name}=1' to turn it on")
                object.__setattr__(self, name, bool(v))
        for name in _INT_FIELDS:
            v = getattr(self, name)
            if type(v) is not int:
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                    raise StrategyError(f"{name}={v!r} must be an integer; write e.g. '{name}=2'")
                object.__setattr__(self, name, int(v))
            if v < 1 and name not in ("zero", "shard"):
                raise StrategyError(f"{name}={v} must be at least 1")
        z = zero_stage(self.zero)
        self._check_shard()
        sched = _schedule(self.schedule)
        object.__setattr__(self, "schedule", sched.name)     # an alias (zb-1p) names its registered record
        if self.recompute not in RECOMPUTE:
            raise StrategyError(f"unknown recompute {self.recompute!r}; use one of {', '.join(RECOMPUTE)}")
        if self.dp % self.ep:
            raise StrategyError(f"ep={self.ep} must divide dp={self.dp} (experts are spread over DP ranks); "
                                f"pick ep among the divisors of {self.dp}")
        if self.sp and self.tp == 1:
            raise StrategyError("sp (sequence parallelism) shards along the sequence over the TP group and "
                                "needs tp > 1; set tp=2 or more, or drop sp")
        if self.tp_async and self.tp == 1:
            raise StrategyError("tp_async overlaps the backward's tensor-parallel reduction with the weight-gradient "
                                "compute and needs tp > 1; set tp=2 or more, or drop tp_async")
        if self.overlap_param and not z.gathers_after_step:
            raise StrategyError(f"overlap_param overlaps the distributed optimizer's parameter all-gather and needs "
                                f"zero=1 or zero=2 (zero={self.zero}: "
                                + ("ZeRO-3 already gathers each use's parameters" if z.gathers_around_use
                                   else "nothing is gathered") + "); set zero=1 or drop overlap_param")
        _fp8_recipe(self.fp8)
        if self.fp8_gather and (self.fp8 == "none" or self.zero == 0):
            raise StrategyError(f"fp8_gather all-gathers ZeRO's parameters in FP8 and needs an fp8 recipe and zero>=1 "
                                f"(fp8={self.fp8}, zero={self.zero}); set fp8 and zero, or drop fp8_gather")
        if self.cp > 1 and self.ep > 1:
            raise StrategyError(f"cp={self.cp} with ep={self.ep} is not supported (experts would span the "
                                f"dp x cp ranks); use cp=1 for mixture-of-experts strategies")
        problems = sched.vpp_problems(self.vpp)
        if problems:
            raise StrategyError("; ".join(problems))

    def _check_shard(self) -> None:
        n = self.shard
        if n < 0:
            raise StrategyError(f"shard={n} must be at least 1 (the DP ranks one ZeRO shard group spans)")
        if n and self.dp % n:
            raise StrategyError(f"shard={n} must divide dp={self.dp} (ZeRO shards over groups of shard DP ranks, "
                                f"replicated dp/shard times); pick shard among the divisors of {self.dp}")
        if n == self.dp:
            object.__setattr__(self, "shard", 0)      # one group of all dp ranks: plain ZeRO
            return
        if n and not self.zero_stage.sharded:
            raise StrategyError(f"shard={n} shards ZeRO state over groups of {n} DP ranks and needs zero>=1; "
                                f"set zero=1, or drop shard")
        if n and (self.cp > 1 or self.ep > 1):
            raise StrategyError(f"shard={n} (hybrid sharding) with cp={self.cp}, ep={self.ep} is not supported; "
                                f"use cp=1 and ep=1, or drop shard")

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
            if part in _BOOL_FIELDS:
                part += "=1"
            elif part == "fp8":
                part = "fp8=delayed"
            if "=" not in part:
                raise StrategyError(f"strategy item {part!r} is not key=value; write e.g. 'dp=4,tp=2'")
            key, val = part.split("=", 1)
            if key not in _KEYS:
                raise StrategyError(f"unknown strategy key {key!r}; keys are {', '.join(_KEYS)}")
            if key in kw:
                raise StrategyError(f"strategy key {key!r} is given twice in {text!r}")
            if key in _BOOL_FIELDS:
                if val.lower() not in _TRUE + _FALSE:
                    raise StrategyError(f"{key}={val!r} must be on or off; write '{key}' or '{key}=0'")
                kw[key] = val.lower() in _TRUE
            elif key in _INT_FIELDS:
                try:
                    kw[key] = int(val)
                except ValueError:
                    raise StrategyError(f"{key}={val!r} must be an integer") from None
            else:
                kw[key] = val
        if kw.get("schedule") is None and int(kw.get("vpp", 1)) > 1:  # type: ignore[arg-type]
            kw["schedule"] = "interleaved-1f1b"
        if "schedule" in kw and "vpp" not in kw:   # a schedule with a fixed chunk count (zb-v, dualpipev) implies it
            fixed = _schedule(str(kw["schedule"])).chunks
            if fixed not in (None, 1):
                kw["vpp"] = fixed
        return cls(**kw)  # type: ignore[arg-type]

    def __str__(self) -> str:
        text = self.__dict__.get("_text")          # frozen: the text is computed once per instance
        if text is None:
            parts = [f"dp={self.dp}", f"tp={self.tp}", f"pp={self.pp}"]
            for name, default in _TEXT_DEFAULTS:
                v = getattr(self, name)
                if v != default:
                    parts.append(name if name in _BOOL_FIELDS else f"{name}={v}")
            text = ",".join(parts)
            object.__setattr__(self, "_text", text)
        return text

    def replace(self, **changes: object) -> "Strategy":
        return replace(self, **changes)

    # ---- sizes -----------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def column_wgrad(self) -> bool:
        """Whether a block's ``bwd_weight`` holds only its column-parallel GEMM's weight gradient (QKV, the
        first MLP GEMM): ``tp_async`` under a schedule that does not split the backward, with cp=1. The
        row-parallel GEMM's is then computed with the input gradient, before the all-reduce starts, as
        Megatron-LM's backward reaches it."""
        return self.tp_async and self.cp == 1 and not _schedule(self.schedule).split_backward

    @property
    def dpcp(self) -> int:
        """Ranks that hold the same parameters and reduce gradients together: dp x cp."""
        return self.dp * self.cp

    @property
    def grad_axis(self) -> str:
        """Group axis of the dense gradient reduction and ZeRO sharding (``dp``, or ``dpcp`` with cp)."""
        return "dpcp" if self.cp > 1 else "dp"

    @property
    def shard_size(self) -> int:
        """DP ranks of one ZeRO shard group (``shard``, or the whole ``dp`` when not hybrid)."""
        return self.shard or self.dp

    @property
    def zero_stage(self) -> ZeroStage:
        """The ZeRO stage record: what ``zero`` shards and how it moves parameters and gradients."""
        return zero_stage(self.zero)

    @property
    def zero_ways(self) -> int:
        """Ranks one dense ZeRO shard group spans: ``shard``, or ``dp x cp`` (Megatron's distributed optimizer)."""
        return self.shard or self.dpcp

    @property
    def zero_axis(self) -> str:
        """Group axis ZeRO shards over: ``shard`` under hybrid sharding, else :attr:`grad_axis`."""
        return "shard" if self.shard else self.grad_axis

    @property
    def dp_replicas(self) -> int:
        """Copies of each ZeRO shard: ``dp // shard`` (1 without hybrid sharding)."""
        return self.dp // self.shard_size

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
        problems = _schedule(self.schedule).microbatch_problems(self.pp, m)
        if problems:
            raise StrategyError("; ".join(problems))
        return m

    # ---- the rank grid ---------------------------------------------------------------------
    def coords(self, rank: "int | np.ndarray") -> dict:
        """Coordinates of rank(s): tp, cp, dp, pp, ep (= dp % ep), edp (= dp // ep),
        dpcp (= cp + cp_size * dp, the index in the gradient-reduction group), shard (= dp % shard_size,
        the index in the ZeRO shard group) and replica (= dp // shard_size)."""
        r = np.asarray(rank)
        if np.any((r < 0) | (r >= self.world)):
            raise StrategyError(f"rank {rank} is outside the world of {self.world} ranks")
        tp = r % self.tp
        cp = (r // self.tp) % self.cp
        dp = (r // (self.tp * self.cp)) % self.dp
        pp = r // (self.tp * self.cp * self.dp)
        out = {"tp": tp, "dp": dp, "pp": pp, "ep": dp % self.ep, "edp": dp // self.ep, "cp": cp,
               "dpcp": cp + self.cp * dp, "shard": dp % self.shard_size, "replica": dp // self.shard_size}
        if np.ndim(rank) == 0:
            return {k: int(v) for k, v in out.items()}
        return out

    def rank(self, tp: "int | np.ndarray" = 0, dp: "int | np.ndarray" = 0,
             pp: "int | np.ndarray" = 0, cp: "int | np.ndarray" = 0) -> "int | np.ndarray":
        """Rank of coordinates (inverse of :meth:`coords`)."""
        r = np.asarray(tp) + self.tp * (np.asarray(cp) + self.cp * (np.asarray(dp) + self.dp * np.asarray(pp)))
        return int(r) if np.ndim(r) == 0 else r

    def peer(self, rank: "int | np.ndarray", offset: str) -> "int | np.ndarray":
        """Rank(s) ``offset`` steps away along one axis, wrapping: ``"pp+1"`` (next stage), ``"cp-1"``
        (previous context-parallel rank in the ring); the other coordinates stay."""
        axis, step = offset[:2], offset[2:]
        if axis not in ("pp", "cp") or not step[1:].isdigit() or step[:1] not in "+-":
            raise StrategyError(f"peer {offset!r} is not 'pp+k', 'pp-k', 'cp+k' or 'cp-k'")
        c = self.coords(rank)
        size = self.pp if axis == "pp" else self.cp
        moved = {**c, axis: (np.asarray(c[axis]) + int(step)) % size}
        return self.rank(moved["tp"], moved["dp"], moved["pp"], moved["cp"])

    def grid(self) -> np.ndarray:
        """Every rank at its coordinates, indexed ``[pp, dp, cp, tp]``."""
        return np.arange(self.world).reshape(self.pp, self.dp, self.cp, self.tp)

    def group(self, rank: int, axis: str) -> tuple[int, ...]:
        """Members of ``rank``'s group along ``axis`` (tp, cp, dp, dpcp, pp, ep, edp, embed, shard, replica or
        stage), ascending. ``shard``: the DP ranks of its ZeRO shard group; ``replica``: the DP ranks holding the
        same shard; ``stage``: every rank of its pipeline stage."""
        c = self.coords(rank)
        tp, dp, pp, cp = c["tp"], c["dp"], c["pp"], c["cp"]
        if axis == "tp":
            r = self.rank(np.arange(self.tp), dp, pp, cp)
        elif axis == "cp":
            r = self.rank(tp, dp, pp, np.arange(self.cp))
        elif axis == "dp":
            r = self.rank(tp, np.arange(self.dp), pp, cp)
        elif axis == "dpcp":
            r = self.rank(tp, np.arange(self.dp)[:, None], pp, np.arange(self.cp)[None, :]).ravel()
        elif axis == "pp":
            r = self.rank(tp, dp, np.arange(self.pp), cp)
        elif axis == "ep":  # same edp index, all ep ranks
            r = self.rank(tp, c["edp"] * self.ep + np.arange(self.ep), pp, cp)
        elif axis == "edp":  # same ep index, all expert-data-parallel replicas
            r = self.rank(tp, c["ep"] + self.ep * np.arange(self.edp), pp, cp)
        elif axis == "shard":
            S = self.shard_size
            r = self.rank(tp, c["replica"] * S + np.arange(S), pp, cp)
        elif axis == "replica":
            r = self.rank(tp, c["shard"] + self.shard_size * np.arange(self.dp_replicas), pp, cp)
        elif axis == "stage":  # every rank of this pipeline stage (the FP8 amax reduction's group)
            r = self.grid()[pp].ravel()
        elif axis == "embed":  # first and last pipeline stage of this (tp, cp, dp): tied embeddings
            r = np.unique([self.rank(tp, dp, 0, cp), self.rank(tp, dp, self.pp - 1, cp)])
        else:
            raise StrategyError(f"unknown group axis {axis!r}; use tp, cp, dp, dpcp, pp, ep, edp, embed, shard, "
                                f"replica or stage")
        return tuple(int(x) for x in np.atleast_1d(r))

    def groups(self, axis: str) -> np.ndarray:
        """All groups along ``axis`` as a 2-D array (one row per group, ranks ascending)."""
        g = self.grid()  # [pp, dp, cp, tp]
        pp, dp, cp, tp = g.shape
        if axis == "tp":
            return g.reshape(-1, tp)
        if axis == "cp":
            return g.transpose(0, 1, 3, 2).reshape(-1, cp)
        if axis == "dp":
            return g.transpose(0, 2, 3, 1).reshape(-1, dp)
        if axis == "dpcp":
            return g.transpose(0, 3, 1, 2).reshape(-1, dp * cp)
        if axis == "pp":
            return g.transpose(1, 2, 3, 0).reshape(-1, pp)
        if axis in ("ep", "edp"):
            e = g.reshape(pp, self.edp, self.ep, cp, tp)
            if axis == "ep":
                return e.transpose(0, 1, 3, 4, 2).reshape(-1, self.ep)
            return e.transpose(0, 2, 3, 4, 1).reshape(-1, self.edp)
        if axis in ("shard", "replica"):
            h = g.reshape(pp, self.dp_replicas, self.shard_size, cp, tp)
            if axis == "shard":
                return h.transpose(0, 1, 3, 4, 2).reshape(-1, self.shard_size)
            return h.transpose(0, 2, 3, 4, 1).reshape(-1, self.dp_replicas)
        if axis == "stage":
            return g.reshape(pp, -1)
        if axis == "embed":
            return np.unique(g[[0, -1]].transpose(1, 2, 3, 0).reshape(-1, 2), axis=1)
        raise StrategyError(f"unknown group axis {axis!r}; use tp, cp, dp, dpcp, pp, ep, edp, embed, shard, replica "
                           f"or stage")

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
        else:
            out += _schedule(self.schedule).layer_problems(self.pp, self.vpp, model.layers)
        if self.cp > 1 and model.seq_len % (2 * self.cp):
            out.append(f"cp={self.cp} needs the sequence length ({model.seq_len}) to be a multiple of "
                       f"2*cp={2 * self.cp} (each rank holds two balanced causal chunks); pick cp accordingly")
        if devices is not None and devices != self.world:
            out.append(f"dp*cp*tp*pp={self.world} does not match the {devices} devices; "
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
        if _schedule(self.schedule).vshape:
            lap, pos = c // self.pp, c % self.pp
            out = np.where(lap % 2 == 0, pos, self.pp - 1 - pos)
        else:
            out = c % self.pp
        return int(out) if np.ndim(out) == 0 else out


#: (name, default) of every field but dp, tp and pp, in declaration order: what str() leaves out at its default
_TEXT_DEFAULTS = tuple((f.name, f.default) for f in fields(Strategy) if f.name not in ("dp", "tp", "pp"))
