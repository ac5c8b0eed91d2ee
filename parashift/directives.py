"""The directives a user programs a training job with (``from parashift import directives as d``).

``d.Place``, ``d.Replicate``, ``d.Shard``, ``d.Split``, ``d.Order``, ``d.Stream``, ``d.Recompute``:
see :mod:`parashift.ir.user_directives`. Pass a list to ``parashift.exec.run_user_model(model,
directives=[...])`` or ``parashift run --model MODULE:NAME --directives FILE``;
:func:`strategy_directives` shows the list a Strategy expands to (``parashift schedule --directives``).
"""
from .ir.user_directives import (Order, Place, Recompute, Replicate, Shard, Split, Stream, format_directives,
                                 parse_directives, strategy_directives)

__all__ = ["Place", "Replicate", "Shard", "Split", "Order", "Stream", "Recompute", "strategy_directives",
           "format_directives", "parse_directives"]
