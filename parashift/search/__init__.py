"""Strategy search (Optuna over the simulator), trace-aware switch planning and deploy plans.

``tune`` searches the strategies of a model on a device count; ``enumerate_space`` lists every
valid one; ``plan_trace`` plans a job over a resource trace (per device count the best
strategy, per change the switch cost, and a dynamic program that maximizes tokens trained).
"""
from __future__ import annotations

from .evaluate import CachedEvaluator, Evaluator, Outcome, SimEvaluator
from .exhaustive import ExhaustiveResult, exhaustive
from .measure import MEASURE_COLUMNS, measure, ranking_held, runner_up
from .memory import state_bytes_lower_bound, state_bytes_per_stage
from .result import PLAN_FORMAT, Candidate, SearchResult, pareto_mask, plan_json
from .space import Space, canonical, divisors, enumerate_space, make_space, neighbor, params_of
from .policies import IDLE, START, PathResult, best_path, greedy_path, run_path
from .switch_cost import HotSwitchCost, RestartCost, SwitchCost
from .trace_plan import MAX_PATH_STEPS, POLICIES, TracePlan, plan_trace, plan_work, trace_segments
from .tune import OBJECTIVES, SearchError, tune

__all__ = [
    "tune", "enumerate_space", "make_space", "Space", "neighbor", "params_of", "canonical", "divisors", "SearchResult", "Candidate",
    "Outcome", "Evaluator", "SimEvaluator", "CachedEvaluator", "SearchError", "OBJECTIVES", "pareto_mask",
    "plan_json", "PLAN_FORMAT", "state_bytes_lower_bound", "state_bytes_per_stage",
    "plan_trace", "TracePlan", "trace_segments", "plan_work", "MAX_PATH_STEPS", "POLICIES", "PathResult", "run_path", "best_path", "greedy_path",
    "START", "IDLE", "measure", "ranking_held", "runner_up", "MEASURE_COLUMNS", "SwitchCost", "HotSwitchCost", "RestartCost", "exhaustive", "ExhaustiveResult",
]
