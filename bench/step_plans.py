"""The kernels of a training step of `bench/block_step.py`'s parts, planned and compiled for sm_90
on a machine without a GPU (an H200 stood in for: `bench/sweep.py` `stand_in_h200`): each kernel's
blocks, warps, stages, registers, spill bytes and shared memory, in launch order. Nothing runs.

    PYTHONPATH=.:src python bench/step_plans.py mlp|attention OUT.json [--tokens 4096 --width 2048 --hidden 5632]
"""

from __future__ import annotations

import argparse
import json
from typing import Any
from unittest import mock

import torch
import triton

import neptune_fusion as nf
from bench.block_step import mlp, self_attention
from bench.sweep import stand_in_h200
from neptune_fusion.runtime import compiled

FIELDS = ("kernel", "backend", "blocks", "warps", "stages", "registers", "spill_bytes", "shared", "global_accesses")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=("mlp", "attention"))
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=5632)
    a = ap.parse_args()
    t, d, h = a.tokens, a.width, a.hidden
    if a.part == "mlp":
        fn, args = mlp, [torch.randn(t, d), 1 + 0.1 * torch.randn(d), torch.randn(2 * h, d) / d**0.5,
                         torch.randn(d, h) / h**0.5]
    else:
        fn, args = self_attention, [torch.randn(t, d)] + [torch.randn(d, d) / d**0.5 for _ in range(4)]
    leaves = [x.half().requires_grad_() for x in args]
    record: list[dict[str, Any]] = []
    empty, materialised = torch.empty, compiled._materialised

    def on_cpu(*shape: Any, **kw: Any) -> torch.Tensor:  # the stand-in device's memory is the CPU's
        if str(kw.get("device", "")).startswith("cuda"):
            kw["device"] = "cpu"
        return empty(*shape, **kw)

    with stand_in_h200(record), mock.patch.object(torch, "empty", on_cpu), mock.patch.object(
            compiled, "_materialised", lambda p, g, s, dev: materialised(p, g, s, torch.device("cpu"))):
        nf.compile(fn)(*leaves).backward(torch.randn(t, d).half())
    kernels = [{k: r.get(k) for k in FIELDS} for r in record]
    env = {"torch": torch.__version__, "triton": triton.__version__, "device": "sm_90 stood in for, no GPU",
           "part": a.part, "tokens": t, "width": d, "hidden": h}
    with open(a.out, "w") as f:
        json.dump({"environment": env, "kernels": kernels}, f, indent=1)
    for k in kernels:
        print(json.dumps(k))


if __name__ == "__main__":
    main()
