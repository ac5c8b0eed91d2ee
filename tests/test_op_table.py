"""The one op table (parashift.collectives): the IR, the tag grammar and the cost model read the same
ops and phases."""
from __future__ import annotations

import math

import pytest

from parashift import cluster as clusters
from parashift.collectives import (COLLECTIVE_OPS, COLLECTIVES, COMM_OPS, OPS, PHASES, PROGRAM_OPS, TWO_ENDED_OPS,
                                   op)
from parashift.cost import CostModel
from parashift.ir import program as P, tags as T
from parashift.ir.program import Instr


def test_the_ir_names_are_the_tables():
    assert (P.COMPUTE, P.COMM_OPS, P.COLLECTIVES, P.PHASES) == ("compute", COMM_OPS, COLLECTIVES, PHASES)
    assert set(COMM_OPS) == set(PROGRAM_OPS) - {"compute"}
    assert set(COMM_OPS) == {"send", "recv", "copy", *COLLECTIVES}
    assert list(OPS) == ["send", "broadcast", "scatter", "gather", "all_gather"]
    assert COLLECTIVE_OPS == ("broadcast", "scatter", "gather", "all_gather")
    assert op("recv") is OPS["send"]
    assert T.TP_PHASES == T.EP_PHASES == ("fwd", "bwd", "bwd_input")
    assert T.TRANSFER_LETTERS == {"send": "s", "broadcast": "b", "scatter": "s", "gather": "g", "all_gather": "a"}


@pytest.mark.parametrize("name", COMM_OPS)
def test_the_cost_model_prices_every_comm_op(name):
    c = clusters.get("a800-2x8")
    cm = CostModel.for_cluster(c).replace(algorithm="ring")
    where = {"peer": 8} if name in TWO_ENDED_OPS else {"group": tuple(range(16)), "root": 0}
    ins = Instr(0, name, nbytes=2**20, **where)
    assert Instr(0, name).is_p2p == (name in ("send", "recv")) and Instr(0, name).is_collective == (name in COLLECTIVES)
    t = cm.time(ins, c, (0, 8) if name in TWO_ENDED_OPS else tuple(range(16)))
    assert math.isfinite(t) and t > cm.comm_overhead

