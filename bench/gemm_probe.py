# ruff: noqa: B023, N803, N806 - closures timed where made; kernel parameters named as in Triton's tutorials
"""How fast a Triton matmul can be on this GPU, as a ceiling for the compiler's K-looped kernels:
one hand-written kernel (a probe, not a code path of the compiler) timed at the tile shapes, stage
counts, tile orders and load paths (pointers or tensor descriptors) the schedule could choose,
beside cuBLAS, for 8192 x 4096 @ 4096 x 4096 fp16 (the norm -> matmul size of issue #12) and the
linear cross-entropy's 8192 x 4096 @ 4096 x 16384 slice (bf16). Each result is checked against
fp32 torch.

    python bench/gemm_probe.py      (GPU machine; writes $OUT/gemm_probe.json)
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import triton
import triton.language as tl

from bench.common import bench, environment, rel_err, warm_up_gpu, write_results
from neptune_fusion.runtime.compiled import install_allocator


@triton.jit
def _matmul(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, TMA: tl.constexpr,
            COL_FIRST: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    if GROUP > 1:
        per_group = GROUP * tiles_n
        group = pid // per_group
        first = group * GROUP
        size = min(tiles_m - first, GROUP)
        pm = first + (pid % per_group) % size
        pn = (pid % per_group) // size
    elif COL_FIRST:
        pm = pid // tiles_n
        pn = pid % tiles_n
    else:
        pm = pid % tiles_m
        pn = pid // tiles_m
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if TMA:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[BM, BK])
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[stride_bk, 1], block_shape=[BK, BN])
        for k in range(0, tl.cdiv(K, BK)):
            a = a_desc.load([pm * BM, k * BK])
            b = b_desc.load([k * BK, pn * BN])
            acc = tl.dot(a, b, acc)
    else:
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        a_p = a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak
        b_p = b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn
        for _ in range(0, tl.cdiv(K, BK)):
            a = tl.load(a_p)
            b = tl.load(b_p)
            acc = tl.dot(a, b, acc)
            a_p += BK * stride_ak
            b_p += BK * stride_bk
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    tl.store(c_ptr + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc.to(c_ptr.dtype.element_ty))


def run(a: torch.Tensor, b: torch.Tensor, bm: int, bn: int, bk: int, warps: int, stages: int, group: int,
        tma: bool, col_first: bool = True) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty(m, n, dtype=a.dtype, device=a.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _matmul[grid](a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
                  BM=bm, BN=bn, BK=bk, GROUP=group, TMA=tma, COL_FIRST=col_first, num_warps=warps, num_stages=stages)
    return c


CONFIGS = [  # (BM, BN, BK, warps, stages)
    (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4),
    (256, 128, 64, 8, 3), (128, 256, 32, 8, 5), (128, 128, 128, 8, 3), (64, 256, 64, 4, 4),
]


def main() -> None:
    warm_up_gpu()
    install_allocator()
    g = torch.Generator(device="cuda").manual_seed(0)
    problems = {
        "8192x4096x4096_f16": (torch.randn(8192, 4096, generator=g, device="cuda").half(),
                                (torch.randn(4096, 4096, generator=g, device="cuda") * 4096 ** -0.5).half()),
        "8192x4096x16384_bf16": (torch.randn(8192, 4096, generator=g, device="cuda").bfloat16(),
                                  (torch.randn(16384, 4096, generator=g, device="cuda") * 0.02).bfloat16().T.contiguous()),
    }
    rows: list[dict[str, Any]] = []
    cublas: dict[str, float] = {}
    for name, (a, b) in problems.items():
        ref = a.float() @ b.float()
        flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
        cublas[name] = bench(lambda: a @ b)
        print(f"{name}: cuBLAS {cublas[name]:.1f} us ({flops / cublas[name] / 1e6:.0f} TFLOP/s)", flush=True)
        for (bm, bn, bk, warps, stages), tma, group in itertools.product(CONFIGS, (False, True), (1, 8)):
            row: dict[str, Any] = {"problem": name, "bm": bm, "bn": bn, "bk": bk, "warps": warps, "stages": stages,
                                   "tma": tma, "group": group}
            try:
                row["rel_err_vs_fp32"] = rel_err(run(a, b, bm, bn, bk, warps, stages, group, tma).float(), ref)
                row["us"] = bench(lambda: run(a, b, bm, bn, bk, warps, stages, group, tma))
                row["tflops"] = flops / row["us"] / 1e6
                row["cublas_over_probe"] = cublas[name] / row["us"]
            except Exception as exc:  # noqa: BLE001 - a configuration that cannot run is the finding
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            print(row, flush=True)
            rows.append(row)
    print("wrote", write_results("gemm_probe", {"environment": environment(), "cublas_us": cublas, "results": rows}))


if __name__ == "__main__":
    main()
