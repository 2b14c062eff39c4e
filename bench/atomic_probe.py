# ruff: noqa: B023, N803 - every closure is run and timed right where it is made; Triton constexpr names
"""What adding dQ by atomics inside the dK+dV kernel would cost (issue 13 experiment): a kernel
with the dK+dV kernel's grid (128-key row tiles x heads) whose loop over 32-query tiles only adds a
32 x head-dim fp32 tile into dQ per step, by pointer atomics (red.global) or by TMA reduce
(tensor-descriptor atomic_add), against the dQ kernel's measured 9.2 ms at global 16k.

    python bench/atomic_probe.py      (GPU machine; writes $OUT/atomic_probe.json)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bench.common import bench, environment, warm_up_gpu, write_results


@triton.jit
def _pointer_adds(dq_ptr, seq, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, D: tl.constexpr):
    head = tl.program_id(1)
    r0 = tl.program_id(0) * BLOCK_R
    cols = tl.arange(0, BLOCK_C)
    d = tl.arange(0, D)
    part = tl.full((BLOCK_C, D), 1.0, tl.float32) * (r0 + 1).to(tl.float32)
    base = dq_ptr + head * seq * D
    for start in range(0, seq, BLOCK_C):
        tl.atomic_add(base + (start + cols)[:, None] * D + d[None, :], part, sem="relaxed")


@triton.jit
def _tma_adds(dq_ptr, seq, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, D: tl.constexpr):
    head = tl.program_id(1)
    r0 = tl.program_id(0) * BLOCK_R
    part = tl.full((BLOCK_C, D), 1.0, tl.float32) * (r0 + 1).to(tl.float32)
    desc = tl.make_tensor_descriptor(dq_ptr + head * seq * D, shape=[seq, D], strides=[D, 1],
                                     block_shape=[BLOCK_C, D])
    for start in range(0, seq, BLOCK_C):
        desc.atomic_add([start, 0], part)


def main() -> None:
    warm_up_gpu()
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    rows = []
    heads, d = 32, 128
    for seq in (4096, 16384):
        for block_c in (32, 64):
            dq = torch.zeros(heads, seq, d, device="cuda")
            grid = (seq // 128, heads)
            for name, kernel in (("pointer", _pointer_adds), ("tma", _tma_adds)):
                def run() -> None:
                    kernel[grid](dq, seq, BLOCK_R=128, BLOCK_C=block_c, D=d, num_warps=8)
                try:
                    dq.zero_()
                    run()
                    torch.cuda.synchronize()
                    want = sum(r * 128 + 1 for r in range(seq // 128))
                    ok = bool(torch.allclose(dq, torch.full_like(dq, float(want)), rtol=1e-5))
                    us = bench(run, warmup=3, rep=20)
                    adds = heads * (seq // 128) * seq * d
                    row = {"seq": seq, "block_c": block_c, "kind": name, "us": us, "correct": ok,
                           "adds_per_s": adds / us * 1e6}
                except Exception as exc:  # noqa: BLE001 - a variant that cannot compile is the finding
                    row = {"seq": seq, "block_c": block_c, "kind": name, "error": f"{type(exc).__name__}: {exc}"[:300]}
                print(row, flush=True)
                rows.append(row)
    write_results("atomic_probe", {"env": environment(), "rows": rows})


if __name__ == "__main__":
    main()
