"""Directives as the user's programming interface: what runs where, and when, on a traced model.

A user writes a list of directives about *regions* (the names given with ``parashift.region``);
:func:`resolve` turns it, with a base :class:`~parashift.strategy.Strategy`, into what
:func:`~parashift.ir.compile_graph.compile_graph` builds the Program from:

- :class:`Place` maps regions to chunks and chunks to pipeline stages (``stages=(0, 1, 1, 0)``: a V);
- :class:`Replicate` / :class:`Shard` say how regions train over the ``dp`` axis: replicated
  (gradients all-reduced) or ZeRO-sharded at ``level`` 1, 2 or 3, over ``ways`` ranks; ``fuse_accum``:
  weight-gradient GEMMs accumulate into the gradient buffer (the strategy's ``grad_fusion``);
  ``overlap_reduce``: each chunk's gradient reduction starts when its backward is done (``overlap_grad``);
  ``overlap_gather`` (Shard, level 1 or 2): the parameter gathers run in the next step's forward
  (``overlap_param``). On a
  preset, ``Shard('*', over='tp'|'sp', ways=n, async_bwd=True)``: the backward's TP reduction runs on
  stream ``tp`` beside the weight gradients (the strategy's ``tp_async``);
- ``Split(microbatches=m, backward=True)`` (:class:`~parashift.ir.directives.Split`): m micro-batches,
  backward split into input- and weight-gradient halves;
- ``Order({stage: "0F0 0F1 0B0 ..."})`` (:class:`~parashift.ir.ordering.Order`): each stage's order;
- ``Recompute("full")``: re-run forwards before their backward;
- ``Stream(name, ops=..., tag_prefix=...)``: move the matching collectives of the ``comm`` stream
  (gradient syncs, ZeRO gathers; tags such as ``dp.grad.c0``) to a stream of their own (its own
  communicator in the runtime, its own CUDA stream under NCCL, its own lane in the simulator and the
  timeline).

A Strategy is sugar for such a list: :func:`strategy_directives` prints what it expands to, and
compiling that list gives the strategy's own Program. Region patterns are a region name, a dotted
prefix (``"layers.1"`` covers ``"layers.1.attn"``), a layer range ``"layers.0-3"`` or ``"*"``; where
several match, the most specific wins. Pure planning code: no torch.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from ..collectives import PROGRAM_OPS
from ..errors import ProgramError
from ..states import ZERO
from ..strategy import Strategy
from .actions import format_order
from .directives import Recompute, Split
from .ordering import Order, Stream

__all__ = ["Place", "Replicate", "Shard", "Split", "Order", "Stream", "Recompute", "Resolved", "resolve",
           "strategy_directives", "matches", "format_directives", "parse_directives"]

_RANGE = re.compile(r"^(?P<pre>.*?)(?P<a>\d+)-(?P<b>\d+)(?P<post>(\..*)?)$")
#: the collectives a user Stream may move: a training step's, over a group with no root
_COLLECTIVES = tuple(n for n, o in PROGRAM_OPS.items() if o.collective and not o.rooted)


def _expand(pattern: str) -> list[str]:
    m = _RANGE.match(pattern)
    if not m or int(m["b"]) < int(m["a"]):
        return [pattern]
    return [f"{m['pre']}{k}{m['post']}" for k in range(int(m["a"]), int(m["b"]) + 1)]


def matches(pattern: str, region: str) -> int:
    """How specifically ``pattern`` covers ``region``: 0 no match, 1 ``"*"``, else 2 + dotted depth."""
    if pattern == "*":
        return 1
    for p in _expand(pattern):
        if region == p or region.startswith(p + "."):
            return 2 + p.count(".") + (region == p)
    return 0


def _regions_of(spec: "str | Sequence[str]") -> tuple[str, ...]:
    return (spec,) if isinstance(spec, str) else tuple(spec)


def _best(patterns: Iterable[str], region: str) -> "str | None":
    scored = [(matches(p, region), p) for p in patterns]
    scored = [x for x in scored if x[0]]
    return max(scored)[1] if scored else None


@dataclass(frozen=True)
class Place:
    """``regions``: region pattern -> chunk (or one chunk per region, in model order); ``stages``:
    pipeline stage of every chunk (default chunk c on stage c; ``(0, 1, 1, 0)`` is a V)."""

    regions: "Mapping[str, int] | tuple[int, ...]"
    stages: "tuple[int, ...] | None" = None

    def __post_init__(self) -> None:
        r = self.regions
        object.__setattr__(self, "regions", tuple(int(x) for x in r) if not isinstance(r, Mapping)
                           else tuple((str(k), int(v)) for k, v in r.items()))
        if self.stages is not None:
            object.__setattr__(self, "stages", tuple(int(x) for x in self.stages))

    def chunk_of(self, names: Sequence[str]) -> dict[str, int]:
        """Chunk of every region in ``names`` (model order); raises naming an unplaced region."""
        if self.regions and isinstance(self.regions[0], int):
            if len(self.regions) != len(names):
                raise ProgramError(f"{self} lists {len(self.regions)} chunks but the model has {len(names)} regions "
                                   f"({', '.join(names)}); give one chunk per region or map region names")
            return dict(zip(names, self.regions))
        table = dict(self.regions)
        dead = [p for p in table if not any(matches(p, n) for n in names)]
        if dead:
            raise ProgramError(f"{self}: entry {dead[0]!r} matches no region; the regions are "
                               f"{', '.join(names[:12])}{' ...' if len(names) > 12 else ''}")
        out = {}
        for n in names:
            p = _best(table, n)
            if p is None:
                raise ProgramError(f"{self} places no chunk for region {n!r}; add an entry for it (e.g. "
                                   f"'{n}': 0) or a '*' entry")
            out[n] = table[p]
        return out

    def chunk_stages(self, chunks: int) -> tuple[int, ...]:
        cs = self.stages if self.stages is not None else tuple(range(chunks))
        if len(cs) != chunks:
            raise ProgramError(f"{self} places regions on {chunks} chunks but stages= lists {len(cs)}; give "
                               f"one stage per chunk")
        return cs

    def __str__(self) -> str:
        if self.regions and isinstance(self.regions[0], int):
            body = repr(tuple(self.regions))
        else:
            body = "{" + ", ".join(f"{k!r}: {v}" for k, v in self.regions) + "}"
        return f"Place({body}" + (f", stages={self.stages}" if self.stages is not None else "") + ")"


@dataclass(frozen=True)
class Replicate:
    """Train ``regions`` replicated over ``over`` (gradients all-reduced); ``ways``: the axis size
    (None: the base strategy's); ``fuse_accum``: each weight-gradient GEMM accumulates into the
    gradient buffer (Megatron's gradient-accumulation fusion; the strategy's ``grad_fusion``);
    ``overlap_reduce``: a chunk's gradient reduction starts when that chunk's backward is done, not
    after the stage's whole backward (a chunk is the bucket; the strategy's ``overlap_grad``)."""

    regions: "str | tuple[str, ...]" = "*"
    over: str = "dp"
    ways: "int | None" = None
    fuse_accum: bool = False
    overlap_reduce: bool = False

    level = 0
    async_bwd = False
    overlap_gather = False

    def __str__(self) -> str:
        return (f"Replicate({self.regions!r}, over={self.over!r}" + (f", ways={self.ways}" if self.ways else "")
                + _flags(self) + ")")


@dataclass(frozen=True)
class Shard:
    """ZeRO-shard ``regions`` over ``over`` at ``level`` (1: optimizer states, 2: + gradients,
    3: + parameters, gathered before each use); ``group``: hybrid sharding, the shards span groups of
    ``group`` consecutive dp ranks and are replicated across the groups (the strategy's ``shard``);
    ``fuse_accum``, ``overlap_reduce`` (over dp): as :class:`Replicate`'s; ``overlap_gather`` (level 1
    or 2): the parameter all-gathers after the optimizer move to the next step, each chunk's (a
    preset's: each region's) waited for by its first forward (the strategy's ``overlap_param``).
    ``async_bwd`` (over tp or sp, ways > 1): the
    backward's TP reduction of a column-parallel block's input gradient runs on stream ``"tp"`` beside
    the block's weight-gradient compute (Megatron's asynchronous TP all-reduce; the strategy's ``tp_async``)."""

    regions: "str | tuple[str, ...]" = "*"
    level: int = 1
    over: str = "dp"
    ways: "int | None" = None
    group: "int | None" = None
    async_bwd: bool = False
    fuse_accum: bool = False
    overlap_reduce: bool = False
    overlap_gather: bool = False

    def __str__(self) -> str:
        level = f", level={self.level}" if self.over == "dp" else ""
        return (f"Shard({self.regions!r}{level}, over={self.over!r}" + (f", ways={self.ways}" if self.ways else "")
                + (f", group={self.group}" if self.group else "") + (", async_bwd=True" if self.async_bwd else "")
                + _flags(self) + ")")


def _flags(d: "Replicate | Shard") -> str:
    """The dp options a Replicate or Shard prints (those on), in field order."""
    return "".join(f", {k}=True" for k in ("fuse_accum", "overlap_reduce", "overlap_gather") if getattr(d, k))


@dataclass(frozen=True)
class OffComm:
    """A user ``Stream`` as compiled: it moves the matching collectives of the ``comm`` stream (gradient
    syncs, ZeRO gathers); collectives a compute step waits on in line (TP, EP) stay where they are."""

    stream: Stream

    def apply(self, g: Any) -> Any:
        out = g.copy()
        c, d = out.cols, self.stream
        for i in range(len(out)):
            if c["stream"][i] == "comm" and c["op"][i] in d.ops and (c["tag"][i] or "").startswith(d.tag_prefix):
                c["stream"][i] = d.stream
        return out


@dataclass(frozen=True)
class Resolved:
    """A directive list resolved against a model's regions and a base strategy."""

    strategy: Strategy
    microbatches: int
    region_chunk: "dict[str, int] | None" = None     # None: the strategy's own placement
    chunk_stages: "tuple[int, ...] | None" = None
    split_backward: bool = False
    order: "Order | None" = None
    streams: tuple[OffComm, ...] = ()


def _fmt(d: Any) -> str:
    if isinstance(d, Split):
        parts = ([f"microbatches={d.microbatches}"] if d.microbatches is not None else []) + \
                (["backward=True"] if d.backward else [])
        return f"Split({', '.join(parts)})"
    if isinstance(d, Order):
        return "Order({" + ", ".join(f"{st}: {format_order(o)!r}" for st, o in sorted(d.steps().items())) + "})"
    if isinstance(d, Stream):
        return f"Stream({d.stream!r}, ops={tuple(d.ops)!r}" + (f", tag_prefix={d.tag_prefix!r}" if d.tag_prefix else "") + ")"
    if isinstance(d, Recompute):
        return f"Recompute({d.mode!r})"
    return str(d)


def format_directives(ds: Sequence[Any]) -> str:
    """One directive per line, as Python a user can paste back (see :func:`parse_directives`)."""
    return "\n".join(_fmt(d) for d in ds)


def parse_directives(text: str) -> list:
    """Directives from Python source: one directive expression per line (what
    :func:`format_directives` prints), a list expression, or statements that bind ``directives``.

    The names of this module (Place, Replicate, Shard, Split, Order, Stream, Recompute) are in scope."""
    import ast
    ns: dict[str, Any] = {k: globals()[k] for k in ("Place", "Replicate", "Shard", "Split", "Order", "Stream",
                                                    "Recompute")}
    out: list = []
    try:
        tree = ast.parse(text, "<directives>")
        if all(isinstance(st, ast.Expr) for st in tree.body):
            for st in tree.body:
                v = eval(compile(ast.Expression(st.value), "<directives>", "eval"), ns)  # noqa: S307 - user's own
                out += list(v) if isinstance(v, (list, tuple)) else [v]
        else:
            exec(compile(tree, "<directives>", "exec"), ns)           # noqa: S102 - the user's own program
            if not isinstance(ns.get("directives"), (list, tuple)):
                raise ValueError("the file binds no list called `directives`")
            out = list(ns["directives"])
    except Exception as e:  # noqa: BLE001 - reported as the user's directive error
        raise ProgramError(f"cannot read the directives: {type(e).__name__}: {e}; write one directive per line "
                           f"or `directives = [...]`, e.g. Place({{'embed': 0, 'layers.0-1': 0, 'layers.2-3': 1, "
                           f"'head': 1}})") from e
    bad = [x for x in out if not isinstance(x, (Place, Replicate, Shard, Split, Order, Stream, Recompute))]
    if bad:
        raise ProgramError(f"{bad[0]!r} is not a directive; use Place, Replicate, Shard, Split, Order, Stream, "
                           f"Recompute")
    return out


#: axes a preset model's regions shard over besides dp (the model says how); "sp": tp with sequence parallelism
PRESET_AXES = ("tp", "sp", "cp", "ep")


def resolve(directives: Sequence[Any], base: Strategy, regions: Sequence[str], *, global_batch: int,
            param_regions: "Sequence[str] | None" = None, axes: Sequence[str] = ()) -> Resolved:
    """Resolve ``directives`` for a model with ``regions`` (model order) under ``base``; ``axes``: the
    axes besides ``dp`` that Shard may use (a preset's: :data:`PRESET_AXES`, model-wide).

    Raises ProgramError naming the directive and the region when the list cannot describe one job."""
    of = _by_kind(directives)
    syncs = of[Replicate] + of[Shard]
    s = base.replace(**_dp_sizes([d for d in syncs if d.over == "dp"], regions, param_regions))
    axis = _axis_sizes([d for d in syncs if d.over != "dp"], regions, axes)
    if axis:
        s = s.replace(**axis)
    splits = of[Split]
    split_bw = any(d.backward for d in splits)
    counts = {d.microbatches for d in splits if d.microbatches is not None}
    if len(counts) > 1:
        raise ProgramError(f"Split gives {sorted(counts)} micro-batches; give one count")
    if counts:
        m = counts.pop()
        if m < 1 or global_batch % (s.dp * m):
            raise ProgramError(f"Split(microbatches={m}): the global batch {global_batch} does not divide into "
                               f"dp={s.dp} x {m} micro-batches; pick m dividing {global_batch // max(s.dp, 1)}")
        s = s.replace(mbs=global_batch // (s.dp * m))
    m = s.num_microbatches(global_batch)
    if of[Recompute]:
        s = s.replace(recompute=of[Recompute][0].mode)
    region_chunk = chunk_stages = None
    if of[Place]:
        region_chunk, chunk_stages = _placement(of[Place][0], regions)
        chunks, pp = len(chunk_stages), max(chunk_stages) + 1
        vpp = chunks // pp if chunks % pp == 0 else 1
        vshape = vpp == 2 and chunk_stages == tuple(c if c < pp else 2 * pp - 1 - c for c in range(chunks))
        s = s.replace(pp=pp, vpp=vpp, schedule=_label(s.schedule, vpp, vshape, split_bw))
    elif split_bw:
        from .schedules import get_schedule
        s = s.replace(schedule=_label(s.schedule, s.vpp, get_schedule(s.schedule).vshape, True))
    return Resolved(s, m, region_chunk, chunk_stages, split_bw, of[Order][0] if of[Order] else None,
                    tuple(OffComm(x) for x in of[Stream]))


def _by_kind(directives: Sequence[Any]) -> dict[type, list]:
    """The directives by class, checked one by one (unknown ones, bad streams, doubled ones)."""
    known = (Place, Split, Order, Replicate, Shard, Recompute, Stream)
    of: dict[type, list] = {k: [] for k in known}
    for d in directives:
        if not isinstance(d, known):
            raise ProgramError(f"{d!r} is not a directive a user model takes; use "
                               f"{', '.join(k.__name__ for k in known)} (parashift.directives)")
        of[type(d)].append(d)
    for d in of[Stream]:
        if not isinstance(d.stream, str) or not d.stream.isidentifier() or d.stream == "p2p":
            raise ProgramError(f"{_fmt(d)}: a stream name is an identifier other than 'p2p' (e.g. 'grads')")
        bad = [op for op in d.ops if op not in _COLLECTIVES]
        if not d.ops or bad:
            raise ProgramError(f"{_fmt(d)}: a user Stream moves collectives ({', '.join(_COLLECTIVES)}); "
                               f"{', '.join(bad) or 'no ops'} cannot move (compute runs one action at a time on "
                               f"'compute', send/recv pair up on 'p2p')")
    for kind in (Place, Order, Recompute):
        if len(of[kind]) > 1:
            raise ProgramError(f"{len(of[kind])} {kind.__name__} directives; give one "
                               f"({', '.join(map(_fmt, of[kind]))})")
    return of


def _unmatched(d: Any, patterns: Sequence[str], regions: Sequence[str]) -> None:
    dead = [p for p in patterns if not any(matches(p, r) for r in regions)]
    if dead and regions:
        raise ProgramError(f"{d}: {dead[0]!r} matches no region; the regions are "
                           f"{', '.join(list(regions)[:12])}{' ...' if len(regions) > 12 else ''}")


def _axis_sizes(syncs: list, regions: Sequence[str], axes: Sequence[str]) -> dict[str, Any]:
    """Model-wide sizes a preset's ``Shard('*', over='tp', ways=2)`` set."""
    out: dict[str, Any] = {}
    for d in syncs:
        if d.over not in axes or not isinstance(d, Shard):
            raise ProgramError(f"{_fmt(d)}: a user model's regions replicate or shard over 'dp' only (tp, ep "
                               f"and cp need a preset model that says how a region shards)" if not axes else
                               f"{_fmt(d)}: use Shard over one of dp, {', '.join(axes)}")
        missed = [r for r in regions if not any(matches(p, r) for p in _regions_of(d.regions))]
        if missed:
            raise ProgramError(f"{_fmt(d)} leaves region {missed[0]!r} out; a preset shards every region over "
                               f"{d.over} alike: use Shard('*', over={d.over!r}, ways=...)")
        if not d.ways or d.ways < 1:
            raise ProgramError(f"{_fmt(d)}: give ways= (the size of the {d.over} group)")
        if d.fuse_accum:
            raise ProgramError(f"{_fmt(d)}: fuse_accum is how gradients accumulate, an option of the dp directive; "
                               f"write Replicate('*', fuse_accum=True) or Shard('*', level=..., fuse_accum=True)")
        if d.overlap_reduce or d.overlap_gather:
            k = "overlap_reduce" if d.overlap_reduce else "overlap_gather"
            raise ProgramError(f"{_fmt(d)}: {k} overlaps the data-parallel "
                               f"{'gradient reduction' if d.overlap_reduce else 'parameter gathers'}, an option of "
                               f"the dp directive; write "
                               + ("Replicate('*', overlap_reduce=True) or Shard('*', level=..., overlap_reduce=True)"
                                  if d.overlap_reduce else "Shard('*', level=1 or 2, overlap_gather=True)"))
        if d.async_bwd and d.over not in ("tp", "sp"):
            raise ProgramError(f"{_fmt(d)}: async_bwd overlaps the backward's tensor-parallel reduction; give it "
                               f"on Shard('*', over='tp' or 'sp', ways=...), not over {d.over}")
        if d.async_bwd and d.ways == 1:
            raise ProgramError(f"{_fmt(d)}: async_bwd overlaps the backward's tensor-parallel reduction and needs "
                               f"ways > 1; set ways=2 or more, or drop async_bwd")
        out.update({"tp": d.ways, "sp": True} if d.over == "sp" else {d.over: d.ways})
        if d.over in ("tp", "sp"):
            out["tp_async"] = bool(d.async_bwd)
    return out


def _dp_sizes(syncs: list, regions: Sequence[str], param_regions: "Sequence[str] | None") -> dict[str, int]:
    """dp and the ZeRO level that Replicate/Shard over dp set (every region with parameters covered,
    the most specific pattern deciding; one level per job)."""
    if not syncs:
        return {}
    for d in syncs:
        if isinstance(d, Shard) and d.level not in [z.level for z in ZERO if z.sharded]:
            raise ProgramError(f"{_fmt(d)}: level must be 1, 2 or 3 (ZeRO stage); use Replicate for none")
        if d.async_bwd:
            raise ProgramError(f"{_fmt(d)}: async_bwd overlaps the backward's tensor-parallel reduction, an option "
                               f"of Shard('*', over='tp' or 'sp', ways=...), not of the dp directive")
        if d.overlap_gather and d.level not in [z.level for z in ZERO if z.gathers_after_step]:
            raise ProgramError(f"{_fmt(d)}: overlap_gather moves the ZeRO-1/2 parameter gathers into the next "
                               f"step's forward; at level 3 every use already gathers its parameters: use level=1 "
                               f"or 2, or drop overlap_gather")
        _unmatched(_fmt(d), _regions_of(d.regions), regions)
    flags = {}
    for k, what in (("fuse_accum", "fuses gradient accumulation"), ("overlap_reduce", "overlaps the gradient "
                    "reduction"), ("overlap_gather", "overlaps the parameter gathers")):
        given = [d for d in syncs if k != "overlap_gather" or isinstance(d, Shard)]   # Replicate gathers nothing
        on = [d for d in given if getattr(d, k)]
        if on and len(on) < len(given):
            off = next(d for d in given if not getattr(d, k))
            raise ProgramError(f"{_fmt(on[0])} {what} but {_fmt(off)} does not; the runtime does it one way per "
                               f"job: give {k}=True on every {'dp Shard' if k == 'overlap_gather' else 'dp directive'} or none")
        flags[k] = bool(on)
    ways = {d.ways for d in syncs if d.ways is not None}
    if len(ways) > 1:
        raise ProgramError(f"{', '.join(map(_fmt, syncs))} give dp sizes {sorted(ways)}; one job has one dp size")
    first: dict[int, tuple[str, Any]] = {}          # level -> (first region at it, its directive)
    for r in (param_regions if param_regions is not None else regions):
        score, d = max(((matches(p, r), d) for d in syncs for p in _regions_of(d.regions)), key=lambda x: x[0],
                       default=(0, None))
        if not score:
            raise ProgramError(f"region {r!r} is neither replicated nor sharded by "
                               f"{', '.join(map(_fmt, syncs))}; cover it (e.g. Replicate('*'))")
        first.setdefault(d.level, (r, d))
    if len(first) > 1:
        (r1, d1), (r2, d2) = list(first.values())[:2]
        raise ProgramError(f"region {r1!r} trains at ZeRO level {d1.level} ({_fmt(d1)}) but region {r2!r} at "
                           f"{d2.level} ({_fmt(d2)}); the runtime keeps one ZeRO level per job: give every "
                           f"region the same level")
    if flags["overlap_gather"] and 0 in first:
        on = next(d for d in syncs if d.overlap_gather)
        raise ProgramError(f"{_fmt(on)} overlaps parameter gathers but the regions with parameters are replicated "
                           f"(nothing is gathered); shard them at level 1 or 2, or drop overlap_gather")
    groups = {d.group for d in syncs if isinstance(d, Shard) and d.group}
    if len(groups) > 1:
        raise ProgramError(f"{', '.join(map(_fmt, syncs))} give shard groups {sorted(groups)}; one job has one")
    # no region with parameters (or none given): the level is moot; the highest named keeps the options valid
    return {"zero": next(iter(first), max(d.level for d in syncs)), "grad_fusion": flags["fuse_accum"], "overlap_grad": flags["overlap_reduce"],
            "overlap_param": flags["overlap_gather"], **({"dp": ways.pop()} if ways else {}),
            **({"shard": groups.pop()} if groups else {})}


def _placement(p: Place, regions: Sequence[str]) -> tuple[dict[str, int], tuple[int, ...]]:
    """Every region's chunk and every chunk's stage, checked (chunks 0..n-1 used, stages 0..pp-1 used)."""
    region_chunk = p.chunk_of(regions)
    chunks = max(region_chunk.values()) + 1
    missing = sorted(set(range(chunks)) - set(region_chunk.values()))
    if missing:
        raise ProgramError(f"{p}: chunks {missing} hold no region; number chunks 0..n-1 in model order")
    chunk_stages = p.chunk_stages(chunks)
    pp = max(chunk_stages) + 1
    if sorted(set(chunk_stages)) != list(range(pp)):
        raise ProgramError(f"{p}: stages {sorted(set(chunk_stages))} leave a stage without a chunk; use "
                           f"stages 0..{pp - 1}")
    return region_chunk, tuple(chunk_stages)


def _label(base: str, vpp: int, vshape: bool, split: bool) -> str:
    """The registered schedule whose placement and backward match (``base`` when it does): the label
    a Program compiled from directives carries (its order is the directives' own)."""
    from .schedules import get_schedule, schedule_names
    names = [base] + [n for n in schedule_names() if n != base]
    for n in names:
        sch = get_schedule(n)
        if sch.vpp_problems(vpp) or sch.vshape != vshape or (split and not sch.split_backward):
            continue
        if n != base and sch.split_backward != split:
            continue
        return n
    return "interleaved-1f1b" if vpp > 1 else "1f1b"


def strategy_directives(strategy: "str | Strategy", *, layers: int, global_batch: int,
                        embed: bool = True, head: bool = True, order: "Order | None" = None) -> list:
    """The directive list ``strategy`` expands to for a model of ``layers`` layers named
    ``layers.{i}`` (plus ``embed`` and ``head``): compiling it gives the strategy's Program.
    ``order``: the schedule's Order when it was planned with durations (default: unit costs)."""
    from .schedules import schedule_order, split_backward
    s = Strategy.parse(strategy)
    m = s.num_microbatches(global_batch)
    lc = [int(x) for x in s.layer_stages(layers)]
    table: dict[str, int] = {}
    if embed:
        table["embed"] = 0
    start = 0
    for k in range(1, layers + 1):
        if k == layers or lc[k] != lc[start]:
            table[f"layers.{start}" if k - start == 1 else f"layers.{start}-{k - 1}"] = lc[start]
            start = k
    if head:
        table["head"] = s.stages - 1
    out: list = [Place(table, stages=tuple(int(s.chunk_rank_stage(c)) for c in range(s.stages)))]
    out.append(Split(microbatches=m, backward=split_backward(s.schedule)))
    out.append(Replicate("*", over="dp", ways=s.dp, fuse_accum=s.grad_fusion, overlap_reduce=s.overlap_grad)
               if not s.zero_stage.sharded else
               Shard("*", level=s.zero, over="dp", ways=s.dp, group=s.shard or None, fuse_accum=s.grad_fusion,
                     overlap_reduce=s.overlap_grad, overlap_gather=s.overlap_param))
    for axis, ways in (("sp" if s.sp else "tp", s.tp), ("cp", s.cp), ("ep", s.ep)):
        if ways > 1:
            out.append(Shard("*", over=axis, ways=ways, async_bwd=s.tp_async and axis in ("tp", "sp")))
    if s.recompute != "none":
        out.append(Recompute(s.recompute))
    out.append(order if order is not None else schedule_order(s, m))
    return out
