# ruff: noqa: N803, N806, B023 - Gluon constexpr names; every closure is timed right where it is made
"""Probe: how fast is a warp-specialised matmul on the H200 when written in Gluon (a producer warp
copying both operands' K-steps by TMA into a ring, two consumer warpgroups of 64 rows each running
asynchronous wgmma with one group in flight)? Triton 3.6 does not warp-specialise on sm_90, and the
compiler's K-looped kernels (Triton) reach 0.87x cuBLAS (NOTES item 53): this decides whether the
Gluon backend should grow K-loops. A hand-written kernel, not a code path of the compiler.
8192 x 4096 @ 4096 x 4096 fp16 and 8192 x 4096 @ 4096 x 16384 bf16, checked against fp32 torch.

    python -m bench.gluon_matmul_probe      (GPU machine; writes $OUT/gluon_matmul_probe.json)
"""

from __future__ import annotations

from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def _producer(a_desc, b_desc, a_smem, b_smem, ready, free, off_m, off_n, k_tiles,
              NUM_BUF: gl.constexpr, BK: gl.constexpr, HALF: gl.constexpr):
    for j in range(k_tiles):
        slot = j % NUM_BUF
        phase = (j // NUM_BUF) & 1
        # a fresh barrier passes a wait for parity 1: the first round finds every slot free
        mbarrier.wait(free.index(slot), phase ^ 1)
        mbarrier.expect(ready.index(slot), 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [off_m, j * BK], ready.index(slot), a_smem.index(2 * slot))
        tma.async_copy_global_to_shared(a_desc, [off_m + HALF, j * BK], ready.index(slot), a_smem.index(2 * slot + 1))
        tma.async_copy_global_to_shared(b_desc, [j * BK, off_n], ready.index(slot), b_smem.index(slot))


@gluon.jit
def _consumer(a_smem, b_smem, ready, free, c_ptr, stride_cm, row0, off_n, k_tiles, H: gl.constexpr,
              NUM_BUF: gl.constexpr, BN: gl.constexpr, HALF: gl.constexpr):
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    acc = gl.zeros([HALF, BN], gl.float32, layout)
    for j in range(k_tiles):
        slot = j % NUM_BUF
        phase = (j // NUM_BUF) & 1
        mbarrier.wait(ready.index(slot), phase)
        acc = warpgroup_mma(a_smem.index(2 * slot + H), b_smem.index(slot), acc, is_async=True)
        # one group stays in flight: the previous step's is done, so its slot goes back
        acc = warpgroup_mma_wait(1, deps=(acc, ))
        if j > 0:
            mbarrier.arrive(free.index((j - 1) % NUM_BUF), count=1)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    rows = row0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, layout))
    cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    ptrs = c_ptr + gl.expand_dims(rows.to(gl.int64) * stride_cm, 1) + gl.expand_dims(cols, 0)
    gl.store(ptrs, acc.to(c_ptr.dtype.element_ty))


@gluon.jit
def _matmul_kernel(a_desc, b_desc, c_ptr, M, N, K, stride_cm, NUM_BUF: gl.constexpr, BN: gl.constexpr,
                   BK: gl.constexpr, HALF: gl.constexpr, GROUP: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    pid = gl.program_id(0)
    tiles_m = gl.cdiv(M, 2 * HALF)
    tiles_n = gl.cdiv(N, BN)
    per_group = GROUP * tiles_n
    first = (pid // per_group) * GROUP
    size = gl.minimum(tiles_m - first, GROUP)
    pm = first + (pid % per_group) % size
    pn = (pid % per_group) // size
    off_m = pm * 2 * HALF
    off_n = pn * BN
    k_tiles = gl.cdiv(K, BK)
    dtype: gl.constexpr = a_desc.dtype
    a_smem = gl.allocate_shared_memory(dtype, [2 * NUM_BUF, HALF, BK], a_desc.layout)
    b_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BK, BN], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(free.index(i), count=2)
    gl.warp_specialize([
        (_consumer, (a_smem, b_smem, ready, free, c_ptr, stride_cm, off_m, off_n, k_tiles, 0, NUM_BUF, BN, HALF)),
        (_consumer, (a_smem, b_smem, ready, free, c_ptr, stride_cm, off_m + HALF, off_n, k_tiles, 1, NUM_BUF, BN,
                     HALF)),
        (_producer, (a_desc, b_desc, a_smem, b_smem, ready, free, off_m, off_n, k_tiles, NUM_BUF, BK, HALF)),
    ], [4, 1], [CONSUMER_REGS, 24])


def gluon_matmul(a: torch.Tensor, b: torch.Tensor, num_buf: int = 4, block_n: int = 256, block_k: int = 64,
                 group: int = 8, consumer_regs: int = 232) -> torch.Tensor:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    m, k = a.shape
    n = b.shape[1]
    assert m % 128 == 0 and n % block_n == 0 and k % block_k == 0 and a.is_contiguous() and b.is_contiguous()
    half = 64
    gdtype = gl.float16 if a.dtype == torch.float16 else gl.bfloat16
    a_desc = TensorDescriptor(a, list(a.shape), list(a.stride()), [half, block_k],
                              gl.NVMMASharedLayout.get_default_for([half, block_k], gdtype))
    b_desc = TensorDescriptor(b, list(b.shape), list(b.stride()), [block_k, block_n],
                              gl.NVMMASharedLayout.get_default_for([block_k, block_n], gdtype))
    c = torch.empty(m, n, dtype=a.dtype, device=a.device)
    grid = ((m // 128) * (n // block_n),)
    _matmul_kernel[grid](a_desc, b_desc, c, m, n, k, c.stride(0), NUM_BUF=num_buf, BN=block_n, BK=block_k, HALF=half,
                         GROUP=group, CONSUMER_REGS=consumer_regs, num_warps=4)
    return c


CONFIGS = [  # (ring slots, BN, BK, group)
    (4, 256, 64, 8), (3, 256, 64, 8), (4, 256, 64, 1), (5, 128, 64, 8), (4, 128, 64, 8), (6, 256, 32, 8),
]


def main() -> None:
    from bench.common import bench, environment, rel_err, warm_up_gpu, write_results

    warm_up_gpu()
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
        for num_buf, bn, bk, group in CONFIGS:
            row: dict[str, Any] = {"problem": name, "ring": num_buf, "bn": bn, "bk": bk, "group": group}
            try:
                row["rel_err_vs_fp32"] = rel_err(gluon_matmul(a, b, num_buf, bn, bk, group).float(), ref)
                row["us"] = bench(lambda: gluon_matmul(a, b, num_buf, bn, bk, group))
                row["tflops"] = flops / row["us"] / 1e6
                row["cublas_over_probe"] = cublas[name] / row["us"]
            except Exception as exc:  # noqa: BLE001 - a configuration that cannot run is the finding
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(row, flush=True)
            rows.append(row)
    print("wrote", write_results("gluon_matmul_probe", {"environment": environment(), "cublas_us": cublas,
                                                        "results": rows}))


if __name__ == "__main__":
    main()
