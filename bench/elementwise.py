"""Programs with no reduction (a gated product `silu(a) * b`, a scaled shift) at shapes from a
vector to a 3-axis tensor, beside torch eager, torch.compile and a copy of one operand: error
against fp32 and do_bench medians.

    PYTHONPATH=src:. python -m bench.elementwise

Writes $OUT/elementwise.json.
"""

from __future__ import annotations

import functools

import torch

import neptune_fusion as nf
from bench.common import bench, environment, warm_up_gpu, write_results

SHAPES = ((8192, 4096), (8192, 14336), (10_000_000,), (4, 1_000_000), (2747, 5953), (64, 128, 96))
PROGRAMS = {"gated": lambda a, b: torch.nn.functional.silu(a) * b,
            "shift": lambda a, b: a * 0.5 - b}


def main() -> None:
    warm_up_gpu()
    rows = []
    for shape in SHAPES:
        for name, fn in PROGRAMS.items():
            torch.manual_seed(0)
            a, b = (torch.randn(*shape, device="cuda", dtype=torch.float16) for _ in range(2))
            ref = fn(a.float(), b.float())
            ours = nf.compile(fn)
            out = ours(a, b)
            row = {"program": name, "shape": list(shape), "dtype": "float16",
                   "rel_err": float(((out.float() - ref).abs().max() / ref.abs().max()).item()),
                   "dtype_ok": out.dtype == fn(a, b).dtype,
                   "ours_us": bench(functools.partial(ours, a, b)),
                   "torch_eager_us": bench(functools.partial(fn, a, b)),
                   "torch_compile_us": bench(functools.partial(torch.compile(fn), a, b)),
                   "copy_us": bench(functools.partial(torch.clone, a))}
            row["vs_torch_compile"] = row["torch_compile_us"] / row["ours_us"]
            print(row, flush=True)
            rows.append(row)
    write_results("elementwise", {"environment": environment(), "results": rows})


if __name__ == "__main__":
    main()
