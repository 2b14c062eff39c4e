# ruff: noqa: B023 - every closure is timed right where it is made
"""RMSNorm / LayerNorm -> matmul (8192x4096 @ 4096x4096, fp16) and the normalised operand kernels
alone, in interleaved rounds (host and clock drift hit every system alike): ours, the package
before (`nf_before`, bench/ab_baseline.sh, where importable), torch.compile of the plain code,
cuBLAS's matmul alone and a plain copy of the operand's bytes. Each output is checked against fp32.

    python -m bench.operand_probe [--rounds 5]     (GPU machine; writes $OUT/operand_probe.json)
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Callable

import torch

import neptune_fusion as nf
from bench.common import bench, environment, rel_err, warm_up_gpu, write_results
from bench.general import torch_layernorm_matmul, torch_rmsnorm_matmul
from bench.general_check import torch_norm
from bench.streaming import torch_softmax
from neptune_fusion.library import layernorm_matmul, rmsnorm_matmul, softmax

try:
    import nf_before  # type: ignore[import-not-found]
    from nf_before import library as before_library  # type: ignore[import-not-found]
except ImportError:
    nf_before = None


def rms_operand(x):  # methods and operators only: either package traces it
    return x / ((x * x).sum(axis=-1, keepdims=True) / x.shape[-1] + 1e-6) ** 0.5


def ln_operand(x):
    mean = x.sum(axis=-1, keepdims=True) / x.shape[-1]
    var = ((x - mean) * (x - mean)).sum(axis=-1, keepdims=True) / x.shape[-1]
    return (x - mean) / (var + 1e-5) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    warm_up_gpu()
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8192, 4096, generator=g, device="cuda").to(torch.float16)
    w = (torch.randn(4096, 4096, generator=g, device="cuda") * 4096 ** -0.5).to(torch.float16)
    xs = torch.randn(16384, 8192, generator=g, device="cuda").to(torch.float16)
    xf = x.float()
    y = torch.empty_like(x)
    operand_refs = {"rms_operand": torch_norm(xf, False), "ln_operand": torch_norm(xf, True)}
    # case -> system -> (call, reference or None)
    cases: dict[str, dict[str, tuple[Callable[[], Any], torch.Tensor | None]]] = {}
    with torch.no_grad():
        cases["copy"] = {"copy": (lambda: y.copy_(x), None)}
        cases["mm"] = {"cublas": (lambda: torch.mm(x, w), None)}
        for name, prog in (("rms_operand", rms_operand), ("ln_operand", ln_operand)):
            fn = nf.compile(nf.program(prog))
            cases[name] = {"nf": (lambda fn=fn: fn(x), operand_refs[name])}
            if nf_before is not None:
                before = nf_before.compile(nf_before.program(prog))
                cases[name]["before"] = (lambda before=before: before(x), operand_refs[name])
        for name, prog, plain in (("rmsnorm_matmul", rmsnorm_matmul, torch_rmsnorm_matmul),
                                  ("layernorm_matmul", layernorm_matmul, torch_layernorm_matmul)):
            ref = plain(xf, w.float())
            fn, compiled = nf.compile(prog), torch.compile(plain)
            cases[name] = {"nf": (lambda fn=fn: fn(x, w), ref), "torch_compile": (lambda c=compiled: c(x, w), ref)}
            if nf_before is not None:
                before = nf_before.compile(getattr(before_library, name))
                cases[name]["before"] = (lambda before=before: before(x, w), ref)
        sm, sm_compiled = nf.compile(softmax), torch.compile(torch_softmax)
        cases["softmax_16384x8192"] = {"nf": (lambda: sm(xs), torch.softmax(xs.float(), -1)),
                                       "torch_compile": (lambda: sm_compiled(xs), torch.softmax(xs.float(), -1))}
        if nf_before is not None:
            sm_before = nf_before.compile(before_library.softmax)
            cases["softmax_16384x8192"]["before"] = (lambda: sm_before(xs), torch.softmax(xs.float(), -1))
        results: dict[str, dict[str, Any]] = {}
        for case, systems in cases.items():
            for system, (call, ref) in systems.items():
                out = call()
                torch.cuda.synchronize()
                entry = results.setdefault(case, {}).setdefault(system, {"us": []})
                if ref is not None:
                    entry["rel_err_vs_fp32"] = rel_err(out.float(), ref.float())
        for r in range(rounds):
            for case, systems in cases.items():
                for system, (call, _) in systems.items():
                    results[case][system]["us"].append(bench(call))
            print(f"round {r + 1} of {rounds}", flush=True)
        for case, systems in results.items():
            for entry in systems.values():
                entry["median_us"] = statistics.median(entry["us"])
                entry["best_us"] = min(entry["us"])
            nf_us = systems.get("nf", {}).get("median_us")
            for system, entry in systems.items():
                if nf_us and system != "nf":
                    entry["over_nf"] = entry["median_us"] / nf_us  # above 1: ours is faster
            print(case, {s: (round(e["median_us"], 1), e.get("rel_err_vs_fp32"), round(e.get("over_nf", 1.0), 3))
                         for s, e in systems.items()}, flush=True)
    write_results("operand_probe", {"environment": environment(), "rounds": rounds, "results": results})


if __name__ == "__main__":
    main()
