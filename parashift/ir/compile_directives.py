"""Compile a preset model programmed with the user's directives (``ir.compile(..., directives=[...])``).

The directives of :mod:`parashift.ir.user_directives` refine a base strategy: ``Place`` puts whole
layers on chunks and chunks on stages (a preset's regions shard by layer, so the regions of one layer
share a chunk), ``Replicate``/``Shard`` set dp, the ZeRO level, ``grad_fusion``, ``overlap_grad``
and ``overlap_param`` (and, model-wide, tp/sp/cp/ep and ``tp_async``), ``Split`` the micro-batches
and the split backward, ``Recompute`` the recompute mode, ``Order`` each stage's order (default: the
schedule's recipe, or for a placement no schedule has, the list scheduler of
:func:`~parashift.ir.placement.placement_order`), and ``Stream`` moves collectives to named streams.
"""
from __future__ import annotations

from typing import Any, Sequence

from .. import models as _models
from ..errors import ProgramError
from ..strategy import Strategy
from .memory import static_memory
from .model_graph import model_graph
from .directives import Split, apply_all
from .ordering import Order
from .placement import PlacedStrategy, base_strategy, placed, placement_order
from .recipe import base_graph, step_costs
from .recipe import directives as recipe
from .program import Program
from .scheduler import lower
from .step_meta import StepMeta
from .schedules import split_backward
from .user_directives import PRESET_AXES, format_directives, resolve

__all__ = ["compile_preset"]


def _layer_chunks(names: list[str], region_chunk: dict[str, int], layers: int, chunks: int,
                  place: Any) -> tuple[int, ...]:
    from .annotate import _LAYER
    of: dict[int, set] = {}
    for r in names:
        m = _LAYER.search(r)
        if m:
            of.setdefault(int(m.group(1)), set()).add(region_chunk[r])
    split = [(k, sorted(v)) for k, v in sorted(of.items()) if len(v) > 1]
    if split:
        k, cs = split[0]
        raise ProgramError(f"{place} puts the regions of layer {k} on chunks {cs}; a preset shards by whole "
                           f"layers: place 'layers.{k}' on one chunk")
    if region_chunk.get("embed", 0) != 0 or region_chunk.get("head", chunks - 1) != chunks - 1:
        raise ProgramError(f"{place}: a preset keeps 'embed' on chunk 0 and 'head' on the last chunk ({chunks - 1})")
    return tuple(next(iter(of[k])) for k in range(layers))


def compile_preset(model: "str | _models.ModelSpec", strategy: "str | Strategy", directives: Sequence[Any], *,
                   global_batch: int, seq_len: "int | None" = None, costs: Any = None,
                   validate: bool = False) -> Program:
    """One training step of preset ``model`` under ``strategy`` refined by ``directives``."""
    spec = _models.get(model)
    names = list(model_graph(spec).col("region"))
    res = resolve(list(directives), Strategy.parse(strategy), names, global_batch=global_batch,
                  param_regions=names, axes=PRESET_AXES)
    s: Strategy = res.strategy
    if res.region_chunk is not None:
        place = next(d for d in directives if type(d).__name__ == "Place")
        lc = _layer_chunks(names, res.region_chunk, spec.layers, len(res.chunk_stages), place)
        s = placed(s, lc, res.chunk_stages)
    # a placement of its own is not its schedule label's: only the label's generic rules apply
    (base_strategy(s).replace(vpp=1, schedule="1f1b") if isinstance(s, PlacedStrategy) else s).validate(spec)
    seq = spec.seq_len if seq_len is None else seq_len
    m = s.num_microbatches(global_batch)
    own = split_backward(s.schedule)
    split = res.split_backward or own
    order = res.order
    if order is None and (isinstance(s, PlacedStrategy) or split != own):   # no recipe fits: list-schedule it
        order = Order(placement_order([int(s.chunk_rank_stage(c)) for c in range(s.stages)], m, split))
    steps = recipe(spec, s, global_batch=global_batch, seq_len=seq, order=order, costs=costs)
    if split and not own:       # every backward split into I and W actions (tp_async's own split is then moot)
        steps = [d for d in steps if not (isinstance(d, Split) and d.keep_action)]
        steps.insert(1, Split(backward=True))
    at = next(i for i, d in enumerate(steps) if isinstance(d, Order))
    steps[at:at] = list(res.streams)                         # user streams, before the order (as compile's own)
    g = apply_all(base_graph(spec, s, seq), steps)
    meta = StepMeta.build(spec, s, global_batch=global_batch, seq_len=seq, microbatches=m,
                          directives=format_directives(list(directives))).encode()
    timing = step_costs(spec, s, seq, costs).of if s.tp > 1 or s.ep > 1 or s.cp > 1 else None
    prog = lower(g, s, static_memory=static_memory(spec, s), meta=meta, step_time=timing)
    if validate:
        prog.validate()
    return prog
