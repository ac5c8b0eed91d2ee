"""Source selection: pick, for every moved piece, the holder whose links finish earliest.

Link cost orders the candidates: the destination device itself (the piece stays, nothing
moves), then a holder on the destination's node (NVLink), then any holder (the NIC). Among
remote holders the pass balances load greedily (largest pieces first, LPT): each piece goes to
the holder whose busiest link would finish first, counting both the holder's own NIC share and
its node's NICs together, so that the slowest link finishes early. On half-duplex devices
(``cluster.gpu.duplex`` False: CPU processes, whose sends and receives are copies by the same
cores) a device's links start loaded with what it receives, so senders are chosen to even out
sends plus receives.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...cluster import Cluster
from ..plan import SwitchPlan

if TYPE_CHECKING:  # pragma: no cover - the simulator is heavy; import it only when lowering
    from ...cost import CostModel

__all__ = ["select_sources", "link_loads"]


def link_loads(plan: SwitchPlan, cost: CostModel) -> dict[str, float]:
    """Seconds the busiest sender needs on each link class (intra, inter per device, inter per node)."""
    m = plan.moved
    src, dst, b = plan.src[m], plan.dst[m], plan.nbytes[m].astype(float)
    node = np.asarray(plan.cluster.node_of(np.arange(max(src.max(initial=0), dst.max(initial=0)) + 1)))
    inter = node[src] != node[dst]
    out = {}
    for name, sel, bw in (("intra", ~inter, cost.link_bw("intra")), ("inter", inter, cost.link_bw("inter"))):
        load = np.bincount(src[sel], weights=b[sel]) if sel.any() else np.zeros(1)
        out[name] = float(load.max()) / bw
    nic = np.bincount(node[src[inter]], weights=b[inter]) if inter.any() else np.zeros(1)
    out["inter_node"] = float(nic.max()) / (cost.link_bw("inter") * plan.cluster.per_node)
    return out


def select_sources(plan: SwitchPlan, cluster: Cluster, cost: CostModel) -> SwitchPlan:
    """A plan whose moved pieces come from the cheapest, least-loaded holders (a new plan)."""
    if plan.holders is None:
        return plan
    moved = np.flatnonzero(plan.moved)
    if len(moved) == 0:
        return plan
    per = cluster.per_node
    bw_intra, bw_inter = cost.link_bw("intra"), cost.link_bw("inter")
    bw_nic = bw_inter * per
    hs_ptr, hs_dev = plan.hs_ptr.tolist(), plan.hs_dev.tolist()
    order = moved[np.lexsort((plan.dst[moved], -plan.nbytes[moved]))]
    dst_l = plan.dst[order].tolist()
    size_l = plan.nbytes[order].astype(float).tolist()
    hold_l = plan.holders[order].tolist()
    src_l = plan.src[order].tolist()
    n_dev = int(max(plan.hs_dev.max(initial=0), plan.dst.max(initial=0), plan.src.max(initial=0))) + 1
    node_a = np.asarray(cluster.node_of(np.arange(n_dev)), dtype=np.int64)
    node = node_a.tolist()
    intra = [0.0] * n_dev
    inter = [0.0] * n_dev
    nic = [0.0] * (int(node_a.max()) + 1)
    if not cluster.gpu.duplex:      # receives are fixed by the destinations; they share the senders' links
        m = plan.moved
        local = node_a[plan.src[m]] == node_a[plan.dst[m]]
        got = plan.nbytes[m].astype(float)
        intra = (np.bincount(plan.dst[m][local], weights=got[local], minlength=n_dev)[:n_dev] / bw_intra).tolist()
        inter = (np.bincount(plan.dst[m][~local], weights=got[~local], minlength=n_dev)[:n_dev] / bw_inter).tolist()
    out = list(src_l)
    for i, (d, b, h) in enumerate(zip(dst_l, size_l, hold_l)):
        cands = hs_dev[hs_ptr[h]:hs_ptr[h + 1]]
        nd = node[d]
        local = [c for c in cands if node[c] == nd]
        if local:
            best = min(local, key=lambda c: (intra[c], c))
            intra[best] += b / bw_intra
        else:
            best, score = -1, float("inf")
            for c in cands:
                s = max(inter[c] + b / bw_inter, nic[node[c]] + b / bw_nic)
                if s < score:
                    best, score = c, s
            inter[best] += b / bw_inter
            nic[node[best]] += b / bw_nic
        out[i] = best
    src = plan.src.copy()
    src[order] = out
    return plan.replace(src=src)
