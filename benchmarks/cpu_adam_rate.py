"""How fast torch steps AdamW on host tensors: the rate [Note: offload costs] prices offloaded optimizer steps at.

    .venv/bin/python benchmarks/cpu_adam_rate.py

Steps AdamW over 20 M fp32 parameters (20 tensors of 1 M) on one thread with each of
torch's implementations (for-each, fused, one tensor at a time), median of 5 steps after
one warm-up, and times a 320 MB ``Tensor.copy_`` for the host's streaming rate. The
bytes per parameter are cost_models/memory.py's ``OPTIMIZER_BYTES_PER_PARAM`` (28 for
AdamW): read the gradient, read and write the weight and both moments.
"""

from __future__ import annotations

import time

import torch

N = 20_000_000


def median_s(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[repeats // 2]


def main() -> None:
    torch.set_num_threads(1)
    for kw in ({"foreach": True}, {"fused": True}, {"foreach": False}):
        params = [torch.nn.Parameter(torch.randn(1_000_000)) for _ in range(N // 1_000_000)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-3, **kw)
        opt.step()
        t = median_s(opt.step)
        print(f"| AdamW {kw} | {t * 1e3:.1f} ms | {N / t / 1e6:.0f} M params/s | {28 * N / t / 1e9:.2f} GB/s at 28 B/param |")
    a = torch.randn(N * 4)
    b = torch.empty_like(a)
    t = median_s(lambda: b.copy_(a))
    print(f"| copy_ of {a.numel() * 4 / 1e6:.0f} MB | {t * 1e3:.1f} ms | | {2 * a.numel() * 4 / t / 1e9:.2f} GB/s read + written |")


if __name__ == "__main__":
    main()
