"""runtime: what a generated program imports. Depends on torch only, never on planner, cost_models or rewriters.

Modules, in the order a program uses them:

- ``cli``: the program's options and the world-size check.
- ``distributed``: process group, this rank's place in the plan, its groups and pipeline peers, teardown.
- ``model_file``: the model-file contract (build, loss, data).
- ``graph``: fx capture, layers, and stage cuts.
- ``shard``: this rank's stage, tensor parallel, its micro-batches.
- ``schedule``: pipeline schedules as data (``1F0``), generators and a deadlock simulator.
- ``executor``: runs a stage's action list with point-to-point sends and receives.
- ``training``: optimizer, data-parallel gradient averaging, reported loss, metrics, final state_dict.
"""
