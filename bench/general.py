# ruff: noqa: B023 - every closure is timed right where it is made
"""Reduction chains that are not attention, at the sizes of issue #12, on the H200: each checked
against fp32 torch on random inputs and timed beside torch.compile of the same plain code.

    python bench/general.py          (GPU machine; writes $OUT/general.json)

With an earlier version importable as `nf_before` (bench/ab_baseline.sh REV, .baseline on
PYTHONPATH), each case also times that version's kernels in the same process (`before_us`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

import neptune_fusion as nf
from bench.common import bench, environment, rel_err, warm_up_gpu, write_results
from neptune_fusion.library import layernorm_matmul, linear_cross_entropy, rmsnorm_matmul, softmax_pooling

DEVICE = "cuda"
try:
    import nf_before  # type: ignore[import-not-found]
    from nf_before import library as before_library  # type: ignore[import-not-found]
except ImportError:
    nf_before = None


def torch_rmsnorm_matmul(x, w):
    return (x.float() / torch.sqrt((x.float() ** 2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) @ w


def torch_layernorm_matmul(x, w):
    xf = x.float()
    return ((xf - xf.mean(-1, keepdim=True)) / torch.sqrt(xf.var(-1, unbiased=False, keepdim=True) + 1e-5)).to(x.dtype) @ w


def torch_linear_cross_entropy(h, w, target):
    return torch.nn.functional.cross_entropy((h @ w.T).float(), target, reduction="none")


def torch_softmax_pooling(x, v):
    return (torch.softmax(x.float(), -1) * v.float()).sum(-1)


def _cross_entropy_forwards() -> dict[str, Callable]:
    """Liger's and Cut Cross-Entropy's per-token losses (forward only), those that import."""
    from bench.linear_ce import baselines

    return {n: f for n, f in baselines().items() if n != "torch_compile"}


FORWARD_BASELINES: dict[str, Callable[[], dict[str, Callable]]] = {"linear_cross_entropy": _cross_entropy_forwards}


def cases() -> list[tuple[str, Any, Callable, tuple]]:
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def randn(*shape, dtype=torch.float16, scale=1.0):
        return torch.randn(*shape, generator=g, device=DEVICE, dtype=torch.float32).mul_(scale).to(dtype)

    x, w = randn(8192, 4096), randn(4096, 4096, scale=4096 ** -0.5)
    h, wv = randn(8192, 4096, dtype=torch.bfloat16), randn(128256, 4096, dtype=torch.bfloat16, scale=0.02)
    target = torch.randint(0, 128256, (8192,), device=DEVICE, generator=g)
    xs, vs = randn(16384, 8192), randn(16384, 8192)
    return [("rmsnorm_matmul", rmsnorm_matmul, torch_rmsnorm_matmul, (x, w)),
            ("layernorm_matmul", layernorm_matmul, torch_layernorm_matmul, (x, w)),
            ("linear_cross_entropy", linear_cross_entropy, torch_linear_cross_entropy, (h, wv, target)),
            ("softmax_pooling", softmax_pooling, torch_softmax_pooling, (xs, vs))]


def main() -> None:
    warm_up_gpu()
    rows = []
    for name, prog, plain, args in cases():
        row: dict[str, Any] = {"case": name, "shapes": [list(a.shape) for a in args]}
        try:
            with torch.no_grad():
                ref = plain(*(a.float() if a.is_floating_point() else a for a in args)).float()
                fn = nf.compile(prog)
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                out = fn(*args)
                torch.cuda.synchronize()
                row["peak_extra_bytes"] = torch.cuda.max_memory_allocated() - before
                row["rel_err_vs_fp32"] = rel_err(out.float(), ref)
                row["nf_us"] = bench(lambda: fn(*args))
                compiled = torch.compile(plain)
                compiled(*args)
                row["torch_compile_us"] = bench(lambda: compiled(*args))
                row["speedup_vs_torch_compile"] = row["torch_compile_us"] / row["nf_us"]
                if name in FORWARD_BASELINES:  # other systems' forward of the same loss, where importable
                    for system, loss in FORWARD_BASELINES[name]().items():
                        row[f"{system}_rel_err_vs_fp32"] = rel_err(loss(*args).float(), ref)
                        row[f"{system}_us"] = bench(lambda: loss(*args))
                        row[f"speedup_vs_{system}"] = row[f"{system}_us"] / row["nf_us"]
                if nf_before is not None:
                    earlier = nf_before.compile(getattr(before_library, name))
                    row["before_rel_err_vs_fp32"] = rel_err(earlier(*args).float(), ref)
                    row["before_us"] = bench(lambda: earlier(*args))
                    row["after_over_before"] = row["nf_us"] / row["before_us"]
                library = [e.library.plan for e in fn._cache.values() if getattr(e, "library", None) is not None]
                exe = next(iter(fn._cache.values()))
                row["plan"] = str(exe.plan)
                row["kernels"] = 1 + (exe.combine is not None) + len(getattr(exe, "groups", ()) or ())
                if library:  # the output contracted by cuBLAS, the operands written by our kernels
                    row["library"] = library[0].describe()
        except Exception as exc:  # noqa: BLE001 - a failure is the finding
            row["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
        print(row, flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    print("wrote", write_results("general", {"environment": environment(), "results": rows}))


if __name__ == "__main__":
    main()
