# ruff: noqa: B023 - every closure is timed right where it is made
"""Is a normalised operand written once and handed to cuBLAS faster than one fused K-loop kernel?
RMSNorm / LayerNorm then matmul (8192x4096 @ 4096x4096, fp16) on the H200: the fused kernel, the
operand kernel alone, cuBLAS alone, both in sequence, and torch.compile, in one process.

    python -m bench.library_gemm_probe          (GPU machine; writes $OUT/library_gemm_probe.json)

Then the operand kernel alone under other plans (explicit `nf.flash` schedules), beside a plain
copy of the same bytes and torch.compile of the normalisation alone: how far its bandwidth is from
what the machine gives a read-and-write.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

import neptune_fusion as nf
from bench.common import bench, environment, rel_err, warm_up_gpu, write_results
from bench.general import torch_layernorm_matmul, torch_rmsnorm_matmul
from neptune_fusion.lang.ops import sqrt
from neptune_fusion.library import layernorm_matmul, rmsnorm_matmul


@nf.program
def rms_operand(x):
    r = sqrt((x * x).sum(axis=-1, keepdims=True) / x.shape[-1] + 1e-6)
    return x / r


@nf.program
def ln_operand(x):
    mean = x.sum(axis=-1, keepdims=True) / x.shape[-1]
    var = ((x - mean) * (x - mean)).sum(axis=-1, keepdims=True) / x.shape[-1]
    return (x - mean) / sqrt(var + 1e-5)


def main() -> None:
    warm_up_gpu()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8192, 4096, generator=g, device="cuda").to(torch.float16)
    w = (torch.randn(4096, 4096, generator=g, device="cuda") * 4096 ** -0.5).to(torch.float16)
    rows: list[dict[str, Any]] = []
    with torch.no_grad():
        mm_us = bench(lambda: torch.mm(x, w))
        for name, fused, operand, plain in (("rmsnorm_matmul", rmsnorm_matmul, rms_operand, torch_rmsnorm_matmul),
                                            ("layernorm_matmul", layernorm_matmul, ln_operand, torch_layernorm_matmul)):
            ref = plain(x.float(), w.float())
            # the fused K-loop kernel (an explicit schedule keeps it) and what `auto` runs (cuBLAS)
            fused_fn, auto_fn, operand_fn = nf.compile(fused, schedule=nf.flash()), nf.compile(fused), nf.compile(operand)
            compiled = torch.compile(plain)
            compiled(x, w)

            def two_step():
                return torch.mm(operand_fn(x), w)

            row = {"case": name, "cublas_mm_us": mm_us,
                   "fused_us": bench(lambda: fused_fn(x, w)), "fused_err": rel_err(fused_fn(x, w).float(), ref),
                   "auto_us": bench(lambda: auto_fn(x, w)), "auto_err": rel_err(auto_fn(x, w).float(), ref),
                   "operand_us": bench(lambda: operand_fn(x)), "operand_dtype": str(operand_fn(x).dtype),
                   "operand_plan": str(next(iter(operand_fn._cache.values())).plan),
                   "two_step_us": bench(two_step), "two_step_err": rel_err(two_step().float(), ref),
                   "torch_compile_us": bench(lambda: compiled(x, w))}
            row["two_step_vs_torch_compile"] = row["torch_compile_us"] / row["two_step_us"]
            row["fused_vs_torch_compile"] = row["torch_compile_us"] / row["fused_us"]
            row["operand_gb_s"] = 2 * x.numel() * 2 / row["operand_us"] / 1e3
            print(row, flush=True)
            rows.append(row)
        plans = []
        ref = x / torch.sqrt((x.float() ** 2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)
        y = torch.empty_like(x)
        plans.append({"what": "copy (read + write of the same bytes)", "us": bench(lambda: y.copy_(x))})
        norm = torch.compile(lambda t: (t.float() / torch.sqrt((t.float() ** 2).mean(-1, keepdim=True) + 1e-6)).to(t.dtype))
        norm(x)
        plans.append({"what": "torch.compile of the normalisation", "us": bench(lambda: norm(x))})
        default = nf.compile(rms_operand)
        default(x)
        plans.append({"what": f"operand kernel, derived plan {next(iter(default._cache.values())).plan}",
                      "us": bench(lambda: default(x))})
        for (block_q, block_k, warps, stages), prog in itertools.product(
                ((16, 128, 4, 2), (16, 256, 4, 2), (16, 256, 8, 2), (16, 512, 4, 2), (16, 1024, 8, 2), (32, 128, 8, 2),
                 (16, 4096, 8, 1)), (rms_operand, ln_operand)):
            entry: dict[str, Any] = {"what": f"{prog.name} kernel {block_q}x{block_k}, {warps} warps, {stages} stages"}
            try:
                fn = nf.compile(prog, schedule=nf.flash(block_q, block_k, warps, stages))
                if prog is rms_operand:
                    entry["rel_err"] = rel_err(fn(x).float(), ref.float())
                entry["us"] = bench(lambda: fn(x))
            except Exception as exc:  # noqa: BLE001 - a plan that fails is the finding
                entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(entry, flush=True)
            plans.append(entry)
        for entry in plans:
            if "us" in entry:
                entry["gb_s"] = 2 * x.numel() * 2 / entry["us"] / 1e3
    print("wrote", write_results("library_gemm_probe", {"environment": environment(), "results": rows,
                                                        "operand_plans": plans}))


if __name__ == "__main__":
    main()
