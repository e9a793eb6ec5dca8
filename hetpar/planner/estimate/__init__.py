"""planner.estimate: one configuration's step time, memory per stage, throughput and MFU, without searching.

``estimate(model, cluster, config)`` lays the ranks out, costs every layer on its
stage's device, plays the pipeline schedule action by action and counts memory per
rank; ``hetpar estimate`` wraps it, and the search predicts its plans with it
([Note: plan prediction] in planner.search.assemble). Modules, in the order they build
on each other: config, layer_split ([Note: default stage split]), layout ([Note:
estimate rank layout]), step_costs, schedule_play, memory, report ([Note: estimate time
breakdown]), estimator.
"""

from hetpar.planner.estimate.config import EstimateConfig, EstimateError
from hetpar.planner.estimate.layer_split import StageSplit, block_run, bounds_from_sizes, default_split, equal_split
from hetpar.planner.estimate.estimator import estimate
from hetpar.planner.estimate.layout import StageLayout, stage_devices_of, stage_layout, stage_split
from hetpar.planner.estimate.report import Estimate, StageEstimate, TimeBreakdown

__all__ = [
    "Estimate",
    "EstimateConfig",
    "EstimateError",
    "StageEstimate",
    "StageLayout",
    "StageSplit",
    "TimeBreakdown",
    "block_run",
    "bounds_from_sizes",
    "default_split",
    "equal_split",
    "estimate",
    "stage_devices_of",
    "stage_layout",
    "stage_split",
]
