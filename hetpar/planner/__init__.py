"""planner: model file -> ModelGraph -> search -> ParallelPlan. Imports cost_models and runtime's graph capture."""
