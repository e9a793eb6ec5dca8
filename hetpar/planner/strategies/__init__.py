"""planner.strategies: plans built over the search.

- hetero_dp: replicas of one device type each, with uneven batch shares
  (heterogeneous data parallelism), estimated and balanced.
- objective: the cheapest plan per step, or the least energy, over sub-clusters, with a
  throughput target.
- subcluster: the sub-clusters those objectives choose among (its own module's names).
- sync_methods: how data-parallel replicas agree (compression, robust aggregation,
  local SGD), checked and priced.
"""

from hetpar.planner.strategies.hetero_dp import (
    balance_shares, estimate_shares, hetero_dp_plan, replica_classes, replica_sizes, sync_floor_s,
)
from hetpar.planner.strategies.objective import (
    Objective, cheapest_plan, least_energy_plan, resolve_prices, step_energy, usd_per_step, with_energy,
)
from hetpar.planner.strategies.sync_methods import LOSSY_CHOICES, LOSSY_MIN_GAIN, DataParallelSync, cost_method, matrix_width

__all__ = [
    "DataParallelSync",
    "LOSSY_CHOICES",
    "LOSSY_MIN_GAIN",
    "Objective",
    "balance_shares",
    "cheapest_plan",
    "cost_method",
    "estimate_shares",
    "hetero_dp_plan",
    "least_energy_plan",
    "matrix_width",
    "replica_classes",
    "replica_sizes",
    "resolve_prices",
    "step_energy",
    "sync_floor_s",
    "usd_per_step",
    "with_energy",
]
