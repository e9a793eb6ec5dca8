"""planner.search: the fastest plan under the cost model, with proof of optimality.

Outer candidates (candidates, [Note: search space]) are ordered and pruned by bounds
(bounds, [Note: candidate bound]); each one's layer split and stage modes are one
CP-SAT model (split_model, [Note: cut formulation]; its bound split_bound) over the
cost tables of planner.costing; solve runs them and assemble turns the best into a
ParallelPlan ([Note: plan prediction]).
"""

from hetpar.planner.search.assemble import stage_sharding
from hetpar.planner.search.bounds import lower_bound_s, memory_may_fit
from hetpar.planner.search.candidates import enumerate_candidates
from hetpar.planner.search.solve import search, solve_candidate, solve_split, solve_type_orders
from hetpar.planner.search.split_model import may_beat, objective_floor

__all__ = [
    "enumerate_candidates",
    "lower_bound_s",
    "may_beat",
    "memory_may_fit",
    "objective_floor",
    "search",
    "solve_candidate",
    "solve_split",
    "solve_type_orders",
    "stage_sharding",
]
