"""The cost model shared by the planners (switch sources and staging), the simulator and calibration.

It sits below ``vps``, ``ir`` and ``sim``: planning code prices transfers with it and the
simulator advances its clock with it, so neither has to import the other.
"""
from .compute import Workload, gemm_time
from .model import ALGORITHMS, LINK_CLASSES, CostModel, CostModelError, Phase, link_class, region_units, topology

__all__ = ["CostModel", "CostModelError", "Phase", "LINK_CLASSES", "ALGORITHMS", "link_class", "topology",
           "region_units",
           "Workload", "gemm_time"]
