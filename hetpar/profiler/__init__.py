"""profiler: what ``hetpar profile`` measures on this host. Imports torch, runtime and the vocabulary only.

It times the host's devices, links and a reference training step through ``runtime``
(as a generated program runs it) and returns raw numbers; cost_models/calibrate.py fits
them into a device profile. Modules, leaves first:

- ``clock``: devices and timers that are true on a CPU and a GPU ([Note: profiler timing]).
- ``micro``: matmuls, memory bandwidth, per-op overhead, optimizer step, attention.
- ``reference_model``: the fixed training workload (a model file), in a CPU and a GPU size.
- ``reference``: that workload timed as a loop and as the program's training step.
- ``layers``: a user's model file's layers timed as the program runs them (``--model``).
- ``collectives``: collectives, late pipeline receives and the per-step overhead, between workers.
- ``workers``: the spawned workers that run all of the above at once (``host_measurements``).
"""

from hetpar.profiler.clock import fingerprint
from hetpar.profiler.workers import WorkerDied, WorkerFailed, host_measurements, median_record, progress_steps

__all__ = ["WorkerDied", "WorkerFailed", "fingerprint", "host_measurements", "median_record", "progress_steps"]
