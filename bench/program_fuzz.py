"""Random small programs that are not attention on the CPU (Triton's interpreter): a row statistic
(mean, max, root mean square, standard deviation, logsumexp, max |x|; none, a program with no
reduction when the output is the map; the mean of all of x, an output wider than its reduction), an element-wise map of it
and the row (a normalisation, an affine mix, an exponential, a sigmoid), optionally times a
per-column weight, then a matmul, a row sum, a column sum, a max, or the map itself as the output,
each reading x, g and w whole, through a slice of the model dimension, every other position, or
the model dimension interleaved by reshapes (split in two, swapped, merged back);
fp32 and fp16, sizes drawn so no axis need be a multiple of a tile, output widths on both sides of
the cuBLAS break-even (schedule/library.py). Each against the reference executor.

    TRITON_INTERPRET=1 PYTHONPATH=. python bench/program_fuzz.py SEED COUNT [cpu [grad]]
    PYTHONPATH=src:. python -m bench.program_fuzz SEED COUNT cuda     (GPU machine: sizes up to
                                                                      4096 x 8192, bf16 too)

With `grad`, each case also runs backward (x, g and w require grad; a random seed gradient) and
the derived gradients are checked against torch autograd of the reference executor in float64.

Prints each case that fails (an error above tolerance, an exception other than a FusionError),
each FusionError (a refusal: right, or a fusion missed, to be read), and a summary.
"""

from __future__ import annotations

import os
import random
import sys
from typing import Any

if sys.argv[3:4] in ([], ["cpu"]):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import neptune_fusion as nf  # noqa: E402

STATISTICS = ("mean", "max", "rms", "std", "logsumexp", "absmax", "none", "total")
MAPS = ("norm", "affine", "exp", "sigmoid")
TAILS = ("matmul", "rowsum", "colsum", "max", "out")
VIEWS = ("whole", "whole", "slice", "step", "interleave")  # how the program reads the model dimension of x, g and w


def viewed(kind: str, t: Any, axis: int) -> Any:
    """`t` along `axis` whole, a slice of its middle, every other position, or its halves
    interleaved (views; no copies)."""
    n = t.shape[axis]
    if kind == "whole" or (kind == "interleave" and n % 2):
        return t
    if kind == "interleave":
        shape = list(t.shape)
        halves = t.reshape(*shape[:axis], 2, n // 2, *shape[axis + 1:]).transpose(axis, axis + 1)
        return halves.reshape(shape)
    lo = n // 4
    key = slice(lo, max(lo + 1, n - n // 5)) if kind == "slice" else slice(n % 2, None, 2) if n > 1 else slice(None)
    return t[(slice(None),) * axis + (key,)]


def statistic(kind: str, x: Any) -> Any:
    if kind == "none":
        return 1.0
    if kind == "total":
        return x.sum() / (x.shape[0] * x.shape[1])
    if kind == "mean":
        return x.sum(axis=-1, keepdims=True) / x.shape[-1]
    if kind == "max":
        return x.max(axis=-1, keepdims=True)
    if kind == "rms":
        return nf.sqrt((x * x).sum(axis=-1, keepdims=True) / x.shape[-1] + 1e-5)
    if kind == "std":
        m = x.sum(axis=-1, keepdims=True) / x.shape[-1]
        return nf.sqrt(((x - m) * (x - m)).sum(axis=-1, keepdims=True) / x.shape[-1] + 1e-5)
    if kind == "logsumexp":
        m = x.max(axis=-1, keepdims=True)
        return m + nf.log(nf.exp(x - m).sum(axis=-1, keepdims=True))
    return nf.abs_(x).max(axis=-1, keepdims=True) + 1.0


def mapped(kind: str, stat: str, x: Any, s: Any) -> Any:
    signed = stat in ("mean", "max", "logsumexp", "total")  # statistics of either sign
    if kind == "norm":
        return x / (nf.abs_(s) + 1.0) if signed else x / s
    if kind == "affine":
        return x * 0.5 + s
    if kind == "exp":
        return nf.exp(x - s) if stat in ("max", "logsumexp") else nf.exp(x * 0.1) * s
    return nf.sigmoid(x) * s


def make(rng: random.Random) -> tuple[Any, tuple[str, str, str, bool, str]]:
    """A random program (x, g, w) and what it is made of."""
    stat, kind, tail, weighted = rng.choice(STATISTICS), rng.choice(MAPS), rng.choice(TAILS), rng.random() < 0.4
    view = rng.choice(VIEWS)

    def body(x, g, w):  # noqa: ANN001, ANN202 - traced by nf.program
        x, g, w = viewed(view, x, 1), viewed(view, g, 0), viewed(view, w, 0)
        a = mapped(kind, stat, x, statistic(stat, x))
        if weighted:
            a = a * g
        if tail == "matmul":
            return nf.einsum("ik,ke->ie", a, w)
        if tail == "rowsum":
            return a.sum(axis=-1)
        if tail == "colsum":
            return a.sum(axis=0)
        if tail == "max":
            return a.max(axis=-1)
        return a

    return nf.program(body), (stat, kind, tail, weighted, view)


def gradient_error(prog: Any, leaves: tuple[Any, ...], out: Any) -> float:
    """The largest relative error of the gradients of x, g, w through `out` (nf's) against torch
    autograd of the reference executor in float64, for one random seed gradient."""
    seed = torch.randn(out.shape, device=out.device)
    got = torch.autograd.grad(out, leaves, seed.to(out.dtype), allow_unused=True)
    exact = tuple(t.detach().float().requires_grad_() for t in leaves)  # computed in float64 by the executor
    ref = nf.run_reference(prog.trace(*exact), dict(prog.bind(*exact)), dtype=torch.float64)
    want = torch.autograd.grad(ref, exact, seed.to(ref.dtype), allow_unused=True)
    err = 0.0
    for a, b in zip(got, want):
        a = torch.zeros_like(b) if a is None else a.double()
        b = torch.zeros_like(a) if b is None else b
        # floored: a gradient that is zero analytically (of a softmax's sum) is rounding noise
        err = max(err, (a - b).abs().max().item() / max(b.abs().max().item(), 1e-4))
    return err


def main(seed: int, count: int, device: str = "cpu", mode: str = "forward") -> None:
    rng = random.Random(seed)
    bad = refused = 0
    gpu = device != "cpu"
    tolerance = {torch.float32: 1e-4, torch.float16: 3e-2, torch.bfloat16: 6e-2}
    for case in range(count):
        prog, what = make(rng)
        if gpu:
            m, k, n = rng.randint(1, 4096), rng.randint(1, 8192), rng.choice([16, 200, 3000, 8192])
            dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
        else:
            m, k, n = rng.randint(1, 48), rng.randint(1, 700), rng.choice([16, 200, 3000])
            dtype = rng.choice([torch.float32, torch.float16])
        x = (torch.randn(m, k, device=device) * rng.choice([0.5, 2.0]) + rng.choice([0.0, 3.0])).to(dtype)
        g = torch.randn(k, device=device).to(dtype)
        w = (torch.randn(k, n, device=device) * k ** -0.5).to(dtype)
        label = f"{case} {what} {(m, k, n)} {dtype}"
        try:
            leaves = tuple(t.requires_grad_(mode == "grad") for t in (x, g, w))
            out = nf.compile(prog)(*leaves)
            floats = tuple(t.detach().float() for t in (x, g, w))
            ref = nf.run_reference(prog.trace(*floats), dict(prog.bind(*floats))).double()
            err = (out.detach().double() - ref).abs().max().item() / (ref.abs().max().item() + 1e-6)
            if mode == "grad":
                grad_err = gradient_error(prog, leaves, out)
                label += f" (gradients {grad_err:.1e})"
                err = max(err, grad_err)
            if not err <= tolerance[dtype]:
                bad += 1
                print("BAD", label, f"err {err:.2e}", flush=True)
        except nf.FusionError as exc:
            refused += 1
            print("REFUSED", label, str(exc)[:200], flush=True)
        except Exception as exc:  # noqa: BLE001 - a crash is the finding
            bad += 1
            print("ERR", label, type(exc).__name__, str(exc)[:200], flush=True)
    print(f"seed {seed}: {count} cases, {bad} failed, {refused} refused")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:5])
