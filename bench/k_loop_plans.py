# ruff: noqa: B023 - every closure is timed right where it is made
"""The compiler's K-looped kernels (a matmul, norm -> matmul, the linear cross-entropy's forward) at
their derived plan and at wider tiles, with tiles read through tensor descriptors or pointers, on
the H200: which plan the schedule should derive. Explicit plans skip the schedule's register fit
(`fit`), and a grid-tiled axis may be widened past its derived block (GRID_TILE_VALUES), so that
the register estimate's own verdict can be checked against ptxas (registers and spills recorded).
Every result is checked against fp32 torch on random inputs; torch.compile of the plain code and
cuBLAS are timed in the same process.

    python bench/k_loop_plans.py [--cases ...]     (GPU machine; writes $OUT/k_loop_plans.json)
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import replace
from typing import Any, Callable
from unittest import mock

import torch

import neptune_fusion as nf
from bench.common import bench, environment, rel_err, warm_up_gpu, write_results
from bench.general import torch_layernorm_matmul, torch_linear_cross_entropy, torch_rmsnorm_matmul
from neptune_fusion.library import layernorm_matmul, linear_cross_entropy, rmsnorm_matmul
from neptune_fusion.runtime import compiled
from neptune_fusion.runtime.options import Options
from neptune_fusion.schedule import tiles


@nf.program
def matmul(x, w):
    """x @ w, written as an einsum."""
    return nf.einsum("ik,ke->ie", x, w)


def torch_matmul(x, w):
    return x @ w


def _registers(fn: Any) -> list[dict[str, Any]]:
    """(name, registers, spills) of every kernel Triton compiled for `fn`'s executables."""
    out = []
    for exe in fn._cache.values():
        for _, part in exe.groups or ((None, exe),):
            for launch in (part.main, part.combine):
                if launch is None:
                    continue
                for cache in getattr(launch.fn, "device_caches", {}).values():
                    for kernel in cache[0].values():
                        out.append({"kernel": launch.tile.name, "registers": getattr(kernel, "n_regs", None),
                                    "spills": getattr(kernel, "n_spills", None)})
    return out


# (label, changes to the plan of every kernel with a K-loop or a grid-tiled axis, tma setting, grid
# tile values or None); the other kernels (a norm's statistics) keep their derived plans
VARIANTS: dict[str, list[tuple[str, dict[str, int], str, int | None]]] = {
    "k_loop": [
        ("derived", {}, "auto", None),
        ("derived_pointers", {}, "0", None),
        ("128x256_s3", {}, "auto", 128 * 256),
        ("128x256_s4", {"num_stages": 4}, "auto", 128 * 256),
        ("128x128_s4", {"num_stages": 4}, "auto", None),
        ("256x128_s3", {"block_row": 256}, "auto", 256 * 128),
        ("128x256_s4_pointers", {"num_stages": 4}, "0", 128 * 256),
    ],
    "linear_cross_entropy": [
        ("derived", {}, "auto", None),
        ("derived_pointers", {}, "0", None),
        ("128x256_s3", {"block_col": 256}, "auto", None),
        ("128x256_s4", {"block_col": 256, "num_stages": 4}, "auto", None),
        ("128x256_s3_pointers", {"block_col": 256}, "0", None),
        ("64x256_s4_4warps", {"block_row": 64, "block_col": 256, "num_warps": 4, "num_stages": 4}, "auto", None),
        ("128x256_s3_1split", {"block_col": 256, "splits": 1}, "auto", None),
    ],
}


def _overriding(changes: dict[str, int]) -> Callable[..., Any]:
    choose = compiled.choose

    def choose_with_changes(*args: Any, **kwargs: Any) -> Any:
        plan = choose(*args, **kwargs)
        long = not kwargs.get("streams") and (kwargs.get("k_loop") or any(
            n > tiles.MAX_WHOLE for n in kwargs.get("full_sizes", {}).values()))
        return replace(plan, **changes) if long else plan

    return choose_with_changes


def cases() -> list[tuple[str, Any, Callable, tuple, str]]:
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, dtype=torch.float16, scale=1.0):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32).mul_(scale).to(dtype)

    x, w = randn(8192, 4096), randn(4096, 4096, scale=4096 ** -0.5)
    h, wv = randn(8192, 4096, dtype=torch.bfloat16), randn(128256, 4096, dtype=torch.bfloat16, scale=0.02)
    target = torch.randint(0, 128256, (8192,), device="cuda", generator=g)
    return [("matmul", matmul, torch_matmul, (x, w), "k_loop"),
            ("rmsnorm_matmul", rmsnorm_matmul, torch_rmsnorm_matmul, (x, w), "k_loop"),
            ("layernorm_matmul", layernorm_matmul, torch_layernorm_matmul, (x, w), "k_loop"),
            ("linear_cross_entropy", linear_cross_entropy, torch_linear_cross_entropy, (h, wv, target),
             "linear_cross_entropy")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", nargs="*", default=None)
    args = parser.parse_args()
    warm_up_gpu()
    rows: list[dict[str, Any]] = []
    with torch.no_grad():
        for name, prog, plain, inputs, family in cases():
            if args.cases and name not in args.cases:
                continue
            ref = plain(*(a.float() if a.is_floating_point() else a for a in inputs))
            tc = torch.compile(plain)
            tc(*inputs)
            tc_us = bench(lambda: tc(*inputs))
            print(f"{name}: torch.compile {tc_us:.1f} us", flush=True)
            for label, changes, tma, grid_values in VARIANTS[family]:
                row: dict[str, Any] = {"case": name, "variant": label, "changes": changes, "tma": tma,
                                       "grid_tile_values": grid_values, "torch_compile_us": tc_us}
                with contextlib.ExitStack() as stack:
                    if changes:
                        stack.enter_context(mock.patch.object(compiled, "choose", _overriding(changes)))
                    if changes or grid_values:
                        stack.enter_context(mock.patch.object(compiled, "fit", lambda plan, *a, **k: plan))
                    if grid_values is not None:
                        stack.enter_context(mock.patch.object(tiles, "GRID_TILE_VALUES", grid_values))
                    try:
                        # the fused kernels themselves (under `auto`, a matmul at these sizes goes to cuBLAS)
                        schedule = nf.flash() if family == "k_loop" else None
                        fn = nf.compile(prog, schedule=schedule, options=Options(tma=tma))
                        row["rel_err_vs_fp32"] = rel_err(fn(*inputs).float(), ref.float())
                        row["us"] = bench(lambda: fn(*inputs))
                        row["speedup_vs_torch_compile"] = tc_us / row["us"]
                        row["plans"] = [str(e.plan) for e in fn._cache.values()]
                        row["kernels"] = _registers(fn)
                    except Exception as exc:  # noqa: BLE001 - a plan that cannot run is the finding
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                print(row, flush=True)
                rows.append(row)
                torch.cuda.empty_cache()
    print("wrote", write_results("k_loop_plans", {"environment": environment(), "rows": rows}))


if __name__ == "__main__":
    main()
