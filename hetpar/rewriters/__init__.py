"""rewriters: ParallelPlan -> a runnable torch program and its launch files. Reads planner.plan only."""

from hetpar.rewriters.torchrun import CompileError, compile_plan

__all__ = ["CompileError", "compile_plan"]
