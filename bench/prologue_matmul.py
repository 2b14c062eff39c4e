"""Matmuls whose left operand is computed in the kernel (`exp(0.1 x) * g @ w`, a SwiGLU
down-projection `silu(a) * b @ w`), before and after a change, in one run: rows with NaN, error
against fp32, time beside torch.compile of the same code and cuBLAS on the operand made beforehand.
Then each operand alone (an element-wise program) beside torch eager and torch.compile.

    bash bench/ab_baseline.sh REV; PYTHONPATH=src:.:.baseline python -m bench.prologue_matmul --before nf_before

Writes $OUT/prologue_matmul.json.
"""

from __future__ import annotations

import argparse
import functools
import importlib

import torch

import neptune_fusion as nf
from bench.common import bench, environment, warm_up_gpu, write_results

SHAPES = ((2747, 5953, 3000), (8192, 4096, 4096))


def programs(mod):
    return {"exp_prologue": mod.program(lambda x, g, w: mod.einsum("ik,ke->ie", mod.exp(x * 0.1) * g, w)),
            "swiglu_down": mod.program(lambda a, b, w: mod.einsum("ik,ke->ie", a / (1.0 + mod.exp(-a)) * b, w))}


OPERANDS = {"exp_prologue": lambda x, g: torch.exp(x * 0.1) * g,
            "swiglu_down": lambda a, b: torch.nn.functional.silu(a) * b}


def torch_matmul(operand, x, other, w):
    return operand(x, other) @ w


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", default=None)
    args = parser.parse_args()
    mods = {"after": nf, **({"before": importlib.import_module(args.before)} if args.before else {})}
    warm_up_gpu()
    rows = []
    for dtype in (torch.float16, torch.bfloat16):
        for m, k, n in SHAPES:
            torch.manual_seed(0)
            x = (torch.randn(m, k, device="cuda") * 0.5).to(dtype)
            g = torch.randn(k, device="cuda").to(dtype)
            w = (torch.randn(k, n, device="cuda") * k ** -0.5).to(dtype)
            for name, operand in OPERANDS.items():
                other = g if name == "exp_prologue" else (torch.randn(m, k, device="cuda") * 0.5).to(dtype)
                ref = torch_matmul(operand, x.float(), other.float(), w.float())
                row = {"program": name, "shape": [m, k, n], "dtype": str(dtype).split(".")[-1]}
                compiled = torch.compile(functools.partial(torch_matmul, operand))
                row["torch_compile_us"] = bench(functools.partial(compiled, x, other, w))
                row["cublas_operand_made_us"] = bench(functools.partial(torch.matmul, operand(x, other), w))
                padded = torch.empty(m, -(-k // 8) * 8, device="cuda", dtype=dtype)[:, :k]
                padded.copy_(operand(x, other))
                row["cublas_operand_padded_us"] = bench(functools.partial(torch.matmul, padded, w))
                for label, mod in mods.items():
                    fn = mod.compile(programs(mod)[name])
                    out = fn(x, other, w).float()
                    row[f"{label}_bad_rows"] = int((~torch.isfinite(out)).any(1).sum().item())
                    row[f"{label}_rel_err"] = float(((out - ref).abs().max() / ref.abs().max()).item())
                    row[f"{label}_us"] = bench(functools.partial(fn, x, other, w))
                print(row, flush=True)
                rows.append(row)
                rows.append(elementwise_row(name, operand, x, other, mods))
    write_results("prologue_matmul", {"environment": environment(), "results": rows})


def elementwise_row(name, operand, x, other, mods):
    """The operand alone: a program with no reduction."""
    row = {"program": f"{name}_operand", "shape": list(x.shape), "dtype": str(x.dtype).split(".")[-1]}
    ref = operand(x.float(), other.float())
    row["torch_eager_us"] = bench(functools.partial(operand, x, other))
    row["torch_compile_us"] = bench(functools.partial(torch.compile(operand), x, other))
    row["copy_us"] = bench(functools.partial(torch.clone, x))
    for label, mod in mods.items():
        try:
            fn = mod.compile(mod.program(lambda x, y: operand(x, y)))
            out = fn(x, other).float()
        except Exception as exc:  # the package before may refuse a program with no reduction
            row[f"{label}_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            continue
        row[f"{label}_rel_err"] = float(((out - ref).abs().max() / ref.abs().max()).item())
        row[f"{label}_us"] = bench(functools.partial(fn, x, other))
    print(row, flush=True)
    return row


if __name__ == "__main__":
    main()
