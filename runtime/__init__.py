"""runtime: what a generated program imports. Depends on torch only, never on planner, cost_models or rewriters."""
