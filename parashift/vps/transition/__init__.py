"""State transition engine: from a switch plan to a fast, memory-safe, deadlock-free switch Program.

Passes, each a pure function testable alone: :func:`select_sources` (link cost, NIC balance),
:func:`assign_stages` (memory budget, garbage collection of old buffers),
:func:`build_transfers` (coalescing, promotion to broadcast/scatter/gather/all_gather where
cheaper), :func:`p2p_order` (XOR rounds, with the deadlock-freedom proof in :mod:`.order`), and
:func:`lower`, which runs them and emits the Program. :class:`SwitchMeta` is the Program's typed
metadata (one codec), :data:`OPS` what each transfer op means, and :func:`plan_live_switch` /
:func:`place` plan a live job's switch.
"""
from ...collectives import COLLECTIVE_OPS, OPS, Op
from .live import SwitchPlanned, live_cluster, live_fit, place, plan_live_switch
from .lower import Options, lower
from .meta import PieceTable, SwitchMeta, parse_switch_name, switch_name
from .order import collective_order, p2p_order, round_matchings, rounds
from .sources import link_loads, select_sources
from .staging import Buffers, Staging, assign_stages, budget_array, check_fit, stage_peaks, state_buffers
from .transfers import ALIGN, Transfer, Transfers, build_transfers

__all__ = ["lower", "Options", "select_sources", "link_loads", "assign_stages", "state_buffers", "budget_array", "check_fit", "stage_peaks",
           "Buffers", "Staging", "build_transfers", "Transfer", "Transfers", "ALIGN", "p2p_order",
           "collective_order", "round_matchings", "rounds", "SwitchMeta", "PieceTable", "switch_name",
           "parse_switch_name", "OPS", "Op", "COLLECTIVE_OPS", "plan_live_switch", "live_fit", "place", "SwitchPlanned",
           "live_cluster"]
