"""rewriters: ParallelPlan -> a runnable torch program and its launch files. Reads planner.plan only."""

from hetpar.rewriters.launchers import PROGRAM
from hetpar.rewriters.torchrun import CompileError, checked_model_file, compile_plan

__all__ = ["PROGRAM", "CompileError", "checked_model_file", "compile_plan"]
