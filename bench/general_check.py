"""A random sweep of the programs that are not attention on the GPU: matmuls, norm -> matmul,
linear -> logsumexp, linear cross-entropy, softmax pooling, at sizes drawn so that no axis need be
a multiple of any block (K-steps, grid tiles and loop tiles with ragged last tiles, read through
tensor descriptors where the strides allow), in fp16 and bf16, each against fp32 torch on random
inputs. Cases whose rows are not 16-byte aligned read through pointers (the descriptor check).

    python bench/general_check.py [--cases 40] [--seed 0] [--backward]   (GPU machine; writes $OUT/general_check.json)
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any, Callable

import torch

import neptune_fusion as nf
from bench.common import environment, rel_err, write_results
from neptune_fusion.library import (
    layernorm,
    layernorm_matmul,
    linear_cross_entropy,
    linear_logsumexp,
    rmsnorm,
    rmsnorm_matmul,
    softmax,
    softmax_pooling,
)

TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 3e-2}


@nf.program
def matmul(x, w):
    """x @ w, written as an einsum."""
    return nf.einsum("ik,ke->ie", x, w)


@nf.program
def centred_matmul(x, c, w):
    """(x - c) @ w with c a per-row input: the distributed contraction."""
    return nf.einsum("ik,ke->ie", x - c[:, None], w)


def torch_norm(x: torch.Tensor, centred: bool) -> torch.Tensor:
    """LayerNorm (`centred`) or RMSNorm of the last axis, no affine, in torch."""
    if centred:
        return (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5)
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)


def gated_down(a, b, w):
    """A SwiGLU down-projection written in torch."""
    return (torch.nn.functional.silu(a) * b) @ w


def gated(a, b):
    """Its operand alone: a program with no reduction."""
    return torch.nn.functional.silu(a) * b


def norm_linear(x, g, bias, w):
    """torch's layer_norm with an affine, then a linear layer (w as nn.Linear holds it)."""
    return torch.nn.functional.linear(torch.nn.functional.layer_norm(x, (x.shape[-1],), g, bias), w)


def globally_centred(x):
    """An output wider than its reduction (a later element-wise kernel)."""
    return x - x.mean()


# name -> (program, (rows, inner, cols) -> float inputs, fp32 reference of the float inputs)
PROGRAMS: dict[str, tuple[Any, Callable[..., tuple[torch.Tensor, ...]], Callable[..., torch.Tensor]]] = {
    "matmul": (matmul, lambda g, m, k, n: (g(m, k), g(k, n) * k ** -0.5), lambda x, w: x @ w),
    "centred_matmul": (centred_matmul, lambda g, m, k, n: (g(m, k) + 3.0, g(m) + 3.0, g(k, n) * k ** -0.5),
                       lambda x, c, w: (x - c[:, None]) @ w),
    "rmsnorm_matmul": (rmsnorm_matmul, lambda g, m, k, n: (g(m, k), g(k, n) * k ** -0.5),
                       lambda x, w: torch_norm(x, False) @ w),
    "layernorm_matmul": (layernorm_matmul, lambda g, m, k, n: (g(m, k) * 2.0 + 1.0, g(k, n) * k ** -0.5),
                         lambda x, w: torch_norm(x, True) @ w),
    "linear_logsumexp": (linear_logsumexp, lambda g, m, k, n: (g(m, k), g(n, k) * 0.05),
                         lambda h, w: torch.logsumexp(h @ w.T, -1)),
    "softmax_pooling": (softmax_pooling, lambda g, m, k, n: (g(m, k) * 2.0, g(m, k)),
                        lambda x, v: (torch.softmax(x, -1) * v).sum(-1)),
    # rows written by a second pass: held whole (read once) up to 16384 columns, looped beyond
    "softmax": (softmax, lambda g, m, k, n: (g(m, n * 3) * 3.0,), lambda x: torch.softmax(x, -1)),
    "rmsnorm": (rmsnorm, lambda g, m, k, n: (g(m, n * 3), g(n * 3) + 1.0),
                lambda x, w: torch_norm(x, False) * w),
    "layernorm": (layernorm, lambda g, m, k, n: (g(m, n * 3) * 2.0 + 1.0,), lambda x: torch_norm(x, True)),
    # written in torch (torch.nn.functional traced)
    "gated_down": (nf.program(gated_down), lambda g, m, k, n: (g(m, k), g(m, k), g(k, n) * k ** -0.5), gated_down),
    "gated": (nf.program(gated), lambda g, m, k, n: (g(m, n * 3), g(m, n * 3)), gated),
    "norm_linear": (nf.program(norm_linear), lambda g, m, k, n: (g(m, k) * 2.0 + 1.0, g(k) + 1.0, g(k), g(n, k) * k ** -0.5),
                    norm_linear),
    "globally_centred": (nf.program(globally_centred), lambda g, m, k, n: (g(m, n) + 1.0,), globally_centred),
}


def _gradient_error(fn: Any, plain: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...],
                    randn: Callable[..., torch.Tensor]) -> list[float]:
    """Relative error of each input's gradient of `(out * r).sum()` (r random) against torch
    autograd of the plain code on the inputs in fp32."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    weight = randn(*out.shape)
    (out.float() * weight).sum().backward()
    refs = [t.detach().float().requires_grad_() for t in inputs]
    (plain(*refs).float() * weight).sum().backward()
    return [rel_err(a.grad.float(), b.grad) for a, b in zip(leaves, refs)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backward", action="store_true",
                        help="also the gradients of every float input (a random weighting of the output), against "
                             "torch autograd of the fp32 reference")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    rows: list[dict[str, Any]] = []
    start = time.time()
    names = [*PROGRAMS, "linear_cross_entropy"]
    for case in range(args.cases):
        name = names[case % len(names)]
        dtype = rng.choice([torch.float16, torch.bfloat16])
        # output widths past ~2600 send a contraction with a written operand to cuBLAS (schedule/library.py)
        m, k, n = rng.randint(1, 3000), rng.randint(1, 3000), rng.randint(1, rng.choice([3000, 8000]))
        if rng.random() < 0.5:  # 16-byte-aligned rows: the descriptor reads
            k, n = -(-k // 8) * 8, -(-n // 8) * 8
        row: dict[str, Any] = {"case": case, "program": name, "dtype": str(dtype).split(".")[-1], "m": m, "k": k, "n": n}

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, device="cuda")

        try:
            if name == "linear_cross_entropy":
                h, w = randn(m, k), randn(n, k) * 0.05
                target = torch.randint(-1, n, (m,), generator=gen, device="cuda")
                inputs = (h.to(dtype), w.to(dtype), target)
                hf, wf = inputs[0].float(), inputs[1].float()
                kept = (target >= 0) & (target < n)
                ref = torch.nn.functional.cross_entropy(hf @ wf.T, target.clamp(min=0), reduction="none") * kept
                prog = linear_cross_entropy
            else:
                prog, make, plain = PROGRAMS[name]
                floats = make(randn, m, k, n)
                inputs = tuple(t.to(dtype) for t in floats)
                ref = plain(*(t.float() for t in inputs))
            fn = nf.compile(prog)
            with torch.no_grad():
                out = fn(*inputs)
            row["library"] = any(getattr(e, "library", None) is not None for e in fn._cache.values())
            torch.cuda.synchronize()
            row["rel_err_vs_fp32"] = rel_err(out.float(), ref.float())
            row["ok"] = bool(torch.isfinite(out.float()).all()) and row["rel_err_vs_fp32"] < TOLERANCE[dtype]
            if args.backward and name != "linear_cross_entropy":
                row["grad_rel_err_vs_fp32"] = _gradient_error(fn, plain, inputs, randn)
                row["ok"] = row["ok"] and max(row["grad_rel_err_vs_fp32"]) < TOLERANCE[dtype]
        except Exception as exc:  # noqa: BLE001 - a failure is the finding
            row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
            row["ok"] = False
        print(row, flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    ok = sum(r["ok"] for r in rows)
    summary = {"cases": len(rows), "ok": ok, "library": sum(bool(r.get("library")) for r in rows),
               "seconds": round(time.time() - start, 1)}
    print(summary)
    print("wrote", write_results("general_check", {"environment": environment(), "summary": summary, "rows": rows}))


if __name__ == "__main__":
    main()
