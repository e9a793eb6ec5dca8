"""How long a pipeline receive waits, by what the two ranks are doing around the send.

Rank 0 sends a 64 KiB message to rank 1 (gloo), as a pipeline stage hands on a small
model's boundary tensor, in three situations, each ``--repeats`` times after a barrier:

- ``posted``: rank 1 has posted its receive and waits; rank 0 computes 2 ms, sends, and
  computes on. The wait is timed from the send (rank 1 waits from the start, so its
  wait less the 2 ms).
- ``late, sender idle``: rank 0 sends and sleeps; rank 1 computes 2 ms, then receives.
- ``late, sender computing``: rank 0 sends and computes 6 ms (128 x 128 matmuls, as
  ``hetpar profile`` does, profiler/collectives.py ``late_receive_times``); rank 1 computes
  2 ms, then receives. The case [Note: late receives] in runtime/schedule.py charges.

Prints the median and mean wait of each and how many took over 1 ms:

    .venv/bin/torchrun --nproc_per_node 2 benchmarks/late_receive_probe.py
    .venv/bin/torchrun --nproc_per_node 2 benchmarks/late_receive_probe.py --width 256 --repeats 200

Results: docs/benchmarks/late-receive_cpu-2core_2026-12-03.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hetpar.profiler.collectives import (  # noqa: E402
    LATE_RECEIVE_BYTES, LATE_RECEIVE_LEAD_S, LATE_RECEIVE_SENDER_BUSY_S, LATE_RECEIVE_WIDTH, compute_for)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--width", type=int, default=LATE_RECEIVE_WIDTH, help="n of the n x n matmuls the ranks compute")
    ns = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    if dist.get_world_size() != 2:
        sys.exit("late_receive_probe: run with torchrun --nproc_per_node 2")
    a = torch.randn(ns.width, ns.width)
    message = torch.ones(LATE_RECEIVE_BYTES // 4)

    def compute(seconds: float) -> None:
        compute_for(seconds, a)

    for case in ("posted", "late, sender idle", "late, sender computing") * 2:
        waits = []
        for k in range(ns.repeats + 2):
            dist.barrier()
            if rank == 0:
                if case == "posted":
                    compute(LATE_RECEIVE_LEAD_S)
                sent = dist.isend(message, 1, tag=k)
                if case == "late, sender idle":
                    time.sleep(LATE_RECEIVE_SENDER_BUSY_S)
                else:
                    compute(LATE_RECEIVE_SENDER_BUSY_S)
                sent.wait()
            else:
                if case != "posted":
                    compute(LATE_RECEIVE_LEAD_S)
                start = time.perf_counter()
                dist.irecv(message, 0, tag=k).wait()
                wait = time.perf_counter() - start - (LATE_RECEIVE_LEAD_S if case == "posted" else 0.0)
                if k >= 2:
                    waits.append(max(0.0, wait))
        if rank == 1:
            slow = sum(w > 1e-3 for w in waits)
            print(f"{case:24s} median {statistics.median(waits) * 1e3:6.3f} ms  mean {statistics.mean(waits) * 1e3:6.3f} ms  "
                  f"over 1 ms: {slow}/{len(waits)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
