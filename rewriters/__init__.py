"""rewriters: ParallelPlan -> a runnable torch program and its launch files. Reads planner.plan only."""
