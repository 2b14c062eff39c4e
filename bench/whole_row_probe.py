# ruff: noqa: B023, N803 - every closure is timed right where it is made; Triton constexprs in capitals
"""How fast can a normalised operand be written? RMSNorm / LayerNorm rows (8192 x 4096 fp16) by
hand-written Triton kernels: the row held whole in registers (one read) against two passes (the
second re-reading from L2), and a per-element division against a multiply by the row's reciprocal;
beside our derived operand kernel, a plain copy of the same bytes, torch.compile of the
normalisation, cuBLAS alone, and both routes of the whole RMSNorm / LayerNorm -> matmul.

    python -m bench.whole_row_probe        (GPU machine; writes $OUT/operand_probe.json)
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

import neptune_fusion as nf
from bench.common import bench, environment, rel_err, warm_up_gpu, write_results
from bench.general import torch_layernorm_matmul, torch_rmsnorm_matmul
from bench.library_gemm_probe import ln_operand, rms_operand
from neptune_fusion.library import layernorm_matmul, rmsnorm_matmul


@triton.jit
def _whole_row(x_ptr, y_ptr, n_rows, N: tl.constexpr, ROWS: tl.constexpr, CENTRE: tl.constexpr,
               RECIP: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, N)
    offs = rows[:, None] * N + cols[None, :]
    keep = rows[:, None] < n_rows
    x = tl.load(x_ptr + offs, mask=keep, other=0.0).to(tl.float32)
    if CENTRE:
        x = x - (tl.sum(x, 1) / N)[:, None]
        r = tl.sqrt(tl.sum(x * x, 1) / N + 1e-5)
    else:
        r = tl.sqrt(tl.sum(x * x, 1) / N + 1e-6)
    if RECIP:
        y = x * (1.0 / r)[:, None]
    else:
        y = x / r[:, None]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _two_pass(x_ptr, y_ptr, n_rows, N, ROWS: tl.constexpr, BC: tl.constexpr, RECIP: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    keep = rows[:, None] < n_rows
    acc = tl.zeros([ROWS], tl.float32)
    for start in range(0, N, BC):
        cols = start + tl.arange(0, BC)
        x = tl.load(x_ptr + rows[:, None] * N + cols[None, :], mask=keep, other=0.0).to(tl.float32)
        acc += tl.sum(x * x, 1)
    r = tl.sqrt(acc / N + 1e-6)
    inv = 1.0 / r
    for start in range(0, N, BC):
        cols = start + tl.arange(0, BC)
        offs = rows[:, None] * N + cols[None, :]
        x = tl.load(x_ptr + offs, mask=keep, other=0.0).to(tl.float32)
        if RECIP:
            y = x * inv[:, None]
        else:
            y = x / r[:, None]
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=keep)


def main() -> None:
    warm_up_gpu()
    g = torch.Generator(device="cuda").manual_seed(0)
    m, n = 8192, 4096
    x = torch.randn(m, n, generator=g, device="cuda").to(torch.float16)
    w = (torch.randn(n, n, generator=g, device="cuda") * n ** -0.5).to(torch.float16)
    y = torch.empty_like(x)
    xf = x.float()
    rms_ref = xf / torch.sqrt((xf ** 2).mean(-1, keepdim=True) + 1e-6)
    ln_ref = (xf - xf.mean(-1, keepdim=True)) / torch.sqrt(xf.var(-1, unbiased=False, keepdim=True) + 1e-5)
    rows: list[dict[str, Any]] = []

    def add(what: str, fn, ref=None) -> None:
        fn()
        torch.cuda.synchronize()
        us = bench(fn)
        row = {"what": what, "us": us, "gb_s": 2 * x.numel() * 2 / us / 1e3}
        if ref is not None:
            row["err"] = rel_err(fn().float(), ref)
        print(row, flush=True)
        rows.append(row)

    with torch.no_grad():
        add("copy", lambda: y.copy_(x))
        add("cublas mm", lambda: torch.mm(x, w))
        for name, prog, ref in (("rms", rms_operand, rms_ref), ("ln", ln_operand, ln_ref)):
            fn = nf.compile(prog)
            add(f"{name} derived operand kernel", lambda: fn(x), ref)
            plan = next(iter(fn._cache.values())).plan
            rows[-1]["plan"] = str(plan)
        norm = torch.compile(lambda t: (t.float() / torch.sqrt((t.float() ** 2).mean(-1, keepdim=True) + 1e-6))
                             .to(t.dtype))
        add("rms torch.compile norm", lambda: norm(x), rms_ref)
        for rows_per, warps in ((1, 4), (1, 8), (2, 4), (2, 8), (4, 8), (4, 16), (8, 16)):
            for centre, ref in ((False, rms_ref), (True, ln_ref)):
                for recip in (True, False):
                    def run():
                        _whole_row[(triton.cdiv(m, rows_per),)](x, y, m, n, rows_per, centre, recip, num_warps=warps)
                        return y
                    add(f"whole {'ln' if centre else 'rms'} rows={rows_per} warps={warps} recip={recip}", run, ref)
        for rows_per, bc, warps in ((16, 1024, 8), (8, 1024, 4), (4, 2048, 8), (16, 512, 4)):
            for recip in (True, False):
                def run():
                    _two_pass[(triton.cdiv(m, rows_per),)](x, y, m, n, rows_per, bc, recip, num_warps=warps)
                    return y
                add(f"two-pass rms rows={rows_per} bc={bc} warps={warps} recip={recip}", run, rms_ref)
        for name, prog, plain in (("rmsnorm_matmul", rmsnorm_matmul, torch_rmsnorm_matmul),
                                  ("layernorm_matmul", layernorm_matmul, torch_layernorm_matmul)):
            ref = plain(xf, w.float())
            auto = nf.compile(prog)
            compiled = torch.compile(plain)
            for _ in range(2):  # interleaved reads of both
                add(f"{name} nf auto", lambda: auto(x, w), ref)
                add(f"{name} torch.compile", lambda: compiled(x, w), ref)
    write_results("operand_probe", {"env": environment(), "rows": rows})


if __name__ == "__main__":
    main()
