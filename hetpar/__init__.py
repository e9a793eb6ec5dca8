"""hetpar: the command-line front end (cli.py, commands/) over planner, cost_models, rewriters, runtime and
profiler, which share the names in vocabulary.py (docs/architecture.md)."""

__version__ = "0.1.0"
