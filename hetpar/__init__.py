"""hetpar: the command-line front end over planner, cost_models, rewriters and runtime."""

__version__ = "0.1.0"
