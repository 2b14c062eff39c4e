# ruff: noqa: B023 - every closure is timed right where it is made
"""Where a fused norm -> matmul loses to torch.compile: the plain matmul through the compiler beside
cuBLAS, and both programs under tile shapes other than the derived one (8192 x 4096 @ 4096 x 4096,
fp16), each checked against fp32 torch on random inputs.

    python bench/gemm.py        (GPU machine; writes $OUT/gemm.json)
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

import neptune_fusion as nf
from bench.common import bench, environment, rel_err, warm_up_gpu, write_results
from neptune_fusion.library import rmsnorm_matmul


@nf.program
def matmul(x, w):
    """x @ w, written as an einsum."""
    return nf.einsum("ik,ke->ie", x, w)


def torch_rmsnorm_matmul(x, w):
    return (x.float() / torch.sqrt((x.float() ** 2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) @ w


# None: what `auto` does (cuBLAS with the operand written, schedule/library.py); nf.flash(): the fused
# K-loop kernel with the derived plan; then explicit plans of it
SCHEDULES = [None, nf.flash(), *(nf.flash(block_q=r, block_k=c, num_warps=w, num_stages=s)
                     for r, c, w, s in itertools.product((64, 128), (64, 128), (4, 8), (3, 4)))]


def main() -> None:
    warm_up_gpu()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8192, 4096, generator=g, device="cuda").half()
    w = (torch.randn(4096, 4096, generator=g, device="cuda") * 4096 ** -0.5).half()
    rows: list[dict[str, Any]] = []
    with torch.no_grad():
        cublas_us = bench(lambda: x @ w)
        compiled = torch.compile(torch_rmsnorm_matmul)
        compiled(x, w)
        compile_us = bench(lambda: compiled(x, w))
        print(f"cuBLAS matmul {cublas_us:.1f} us, torch.compile rmsnorm->matmul {compile_us:.1f} us", flush=True)
        for name, prog, ref in (("matmul", matmul, x.float() @ w.float()),
                                ("rmsnorm_matmul", rmsnorm_matmul, torch_rmsnorm_matmul(x.float(), w.float()))):
            for schedule in SCHEDULES:
                row: dict[str, Any] = {"program": name, "schedule": str(schedule) if schedule else "derived"}
                try:
                    fn = nf.compile(prog, schedule=schedule)
                    row["rel_err_vs_fp32"] = rel_err(fn(x, w).float(), ref)
                    row["us"] = bench(lambda: fn(x, w))
                    row["plan"] = str(next(iter(fn._cache.values())).plan)
                    row["tflops"] = 2 * 8192 * 4096 * 4096 / row["us"] / 1e6
                    row["cublas_over_ours"] = cublas_us / row["us"]
                    row["torch_compile_over_ours"] = compile_us / row["us"]
                except Exception as exc:  # noqa: BLE001 - a failure is the finding
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(row, flush=True)
                rows.append(row)
    print("wrote", write_results("gemm", {"environment": environment(), "cublas_us": cublas_us,
                                          "torch_compile_rmsnorm_matmul_us": compile_us, "results": rows}))


if __name__ == "__main__":
    main()
