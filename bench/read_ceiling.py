"""How fast can any kernel read the K/V bytes of each decode case, timed the way the benchmarks time?

Decode is memory-bound, so its GB/s targets are only meaningful next to the fastest plain read of the
same number of bytes under the same timing: `do_bench` clears the L2 before every repetition (it
writes a 256 MB buffer, leaving the L2 full of dirty lines that must be written back while the timed
kernel reads) and each timing includes one launch. This script times (a) a Triton kernel that only
reads a buffer of that size and sums it, best of a few grid shapes, (b) `torch.sum` of it, and (c) an
almost empty kernel: the fixed cost of one timed launch.

Usage (GPU machine): python -m bench.read_ceiling   (writes $OUT/read_ceiling.json)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bench.common import bench, environment, warm_up_gpu, write_results
from bench.decode import OPS as DECODE_OPS


@triton.jit
def _read_sum(x_ptr, out_ptr, n, per_program, block: tl.constexpr, evict: tl.constexpr = ""):
    base = tl.program_id(0).to(tl.int64) * per_program * block
    acc = tl.zeros([block], tl.float32)
    for i in tl.range(0, per_program, num_stages=3):
        offs = base + i * block + tl.arange(0, block)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0, eviction_policy=evict).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc))


def triton_read_us(x: torch.Tensor, evict: str = "") -> tuple[float, str]:
    """Best median time of a read-and-sum of `x` over a few program counts and tile sizes
    (`evict`: the loads' eviction policy, "" or "evict_first")."""
    best = (float("inf"), "")
    n = x.numel()
    for block in (2048, 4096, 8192):
        for programs in (132, 264, 528, 1056, 2112):
            per = triton.cdiv(n, programs * block)
            grid = (triton.cdiv(n, per * block),)
            out = torch.empty(grid[0], device=x.device, dtype=torch.float32)
            def fn(per=per, block=block, grid=grid, out=out) -> None:
                _read_sum[grid](x, out, n, per, block=block, evict=evict, num_warps=8)
            fn()
            t = bench(fn)
            if t < best[0]:
                best = (t, f"{grid[0]} programs x {per} tiles of {block}")
    return best


def main() -> None:
    warm_up_gpu()
    tiny = torch.zeros(1, device="cuda")
    launch_us = bench(lambda: tiny.add_(1))
    print(f"one timed launch of an almost empty kernel: {launch_us:.1f} us")
    rows = []
    seen: dict[int, dict] = {}
    for op, (_hq, hkv, _kind) in DECODE_OPS.items():
        for seq in (1024, 4096, 16384, 32768):
            nbytes = 2 * hkv * seq * 128 * 2
            if nbytes not in seen:
                x = torch.randn(nbytes // 2, device="cuda", dtype=torch.float16)
                tri_us, config = triton_read_us(x)
                torch_us = bench(lambda x=x: x.sum(dtype=torch.float32))
                seen[nbytes] = {"bytes": nbytes, "triton_read_us": tri_us, "triton_config": config,
                                "torch_sum_us": torch_us, "read_gbps": nbytes / (min(tri_us, torch_us) * 1e-6) / 1e9}
                del x
            row = {"op": op, "seq": seq, **seen[nbytes]}
            rows.append(row)
            print(f"{op:10s} {seq:6d} {nbytes / 1e6:7.1f} MB  read {row['triton_read_us']:7.1f} us "
                  f"(torch.sum {row['torch_sum_us']:7.1f})  ceiling {row['read_gbps']:6.0f} GB/s", flush=True)
    path = write_results("read_ceiling", {"environment": environment(), "launch_us": launch_us, "rows": rows})
    print("wrote", path)


if __name__ == "__main__":
    main()
