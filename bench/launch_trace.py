"""Which kernel faults: a SwiGLU MLP's forward and backward (fp16, sizes from the command line) with
every launch printed, the arguments' shapes, strides and dtypes at each kernel's first launch, and
a sync after every launch.

    CUDA_LAUNCH_BLOCKING=1 PYTHONPATH=.:src python bench/launch_trace.py 4096 2048 5632   (GPU)

NOTES item 61: that backward faulted with an illegal memory access.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any

import torch

import neptune_fusion as nf
from bench.block_step import mlp
from neptune_fusion.runtime import compiled

_call, _first = compiled._FastLaunch.__call__, compiled._FastLaunch._first


def _describe(value: Any) -> Any:
    return (tuple(value.shape), tuple(value.stride()), str(value.dtype)) if isinstance(value, torch.Tensor) else value


def traced_call(self: Any, slots: list[Any]) -> None:
    print("launch", self.fn.__name__, self.grid, flush=True)
    _call(self, slots)
    torch.cuda.synchronize()


def traced_first(self: Any, slots: list[Any]) -> None:
    print("first", self.fn.__name__, self.grid, self.constexprs, flush=True)
    print("   args", [_describe(a) for a in self.bind(slots)[:self.n_args]], flush=True)
    _first(self, slots)
    torch.cuda.synchronize()


def main(tokens: int, width: int, hidden: int) -> None:
    compiled._FastLaunch.__call__, compiled._FastLaunch._first = traced_call, traced_first
    torch.manual_seed(0)
    args = [torch.randn(tokens, width), 1 + 0.1 * torch.randn(width), torch.randn(2 * hidden, width) / width**0.5,
            torch.randn(width, hidden) / hidden**0.5]
    leaves = [a.cuda().half().requires_grad_() for a in args]
    try:
        nf.compile(mlp)(*leaves).backward(torch.randn(tokens, width, device="cuda", dtype=torch.float16))
        torch.cuda.synchronize()
        print("backward ok", flush=True)
    except Exception:  # noqa: BLE001 - the trace is the finding
        traceback.print_exc()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
