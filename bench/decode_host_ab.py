# ruff: noqa: B023 - every closure is timed right where it is made
"""dc_gqa before and after a change: per-kernel device time (CUPTI) beside do_bench and host time.

    PYTHONPATH=src:.:.baseline python bench/decode_host_ab.py      (after bench/ab_baseline.sh REV)

Tells a slower kernel from a slower host path in a short decode case (bench/NOTES.md item 33).
"""

from __future__ import annotations

import importlib
import math

import torch

import neptune_fusion as nf
from bench.common import bench, host_us
from bench.decode import plain


def main() -> None:
    mods = {"before": importlib.import_module("nf_before"), "after": nf}
    for seq in (1024, 4096):
        q = torch.randn(1, 64, 1, 128, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(1, 8, seq, 128, device="cuda", dtype=torch.float16) for _ in range(2))
        slopes = torch.ones(64, device="cuda")
        scale = 1 / math.sqrt(128)
        for name, mod in mods.items():
            fn = mod.compile(plain("plain", mod))

            def call() -> torch.Tensor:
                return fn(q, k, v, slopes, scale)

            for _ in range(5):
                call()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    call()
                torch.cuda.synchronize()
            kernels = {e.key: round(e.device_time_total / e.count, 1) for e in prof.key_averages()
                       if e.device_time_total > 0}
            print(seq, name, "bench", round(bench(call), 1), "host", round(host_us(call), 1), kernels, flush=True)


if __name__ == "__main__":
    main()
