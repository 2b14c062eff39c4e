"""Random small attention calls on the CPU (Triton's interpreter), forward and optionally backward,
each against a dense float64 reference with autograd: the sweep's masks and mods (bench/sweep.py),
GQA, head dims that are not powers of two, lengths 1-70 (one key, one query, ragged tiles).

    TRITON_INTERPRET=1 PYTHONPATH=. python bench/cpu_fuzz.py SEED COUNT [--backward] [--only I J ...]

Prints each case that fails (error above tolerance, a non-finite value, an exception) and a summary.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import neptune_fusion as nf  # noqa: E402
from bench.sweep import MASKS, SCORES, Case, Mods, make_mods  # noqa: E402


def dense(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mods: Mods) -> torch.Tensor:
    """Attention in float64 with a safe softmax (rows with no visible key give 0, gradients 0)."""
    group = case.heads_q // case.heads_kv
    kf, vf = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    i = torch.arange(case.len_q)[:, None] + case.len_kv - case.len_q
    j = torch.arange(case.len_kv)[None, :]
    s = q.double() @ kf.transpose(-1, -2) / math.sqrt(case.dim)
    if mods.score is not None:
        s = mods.score(s, i, j)
    visible = torch.ones(case.len_q, case.len_kv, dtype=torch.bool)
    if mods.visible is not None:
        visible = mods.visible(i, j).expand(case.len_q, case.len_kv)
    s = s.masked_fill(~visible, -math.inf)
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m))) * visible
    return e / e.sum(-1, keepdim=True).clamp_min(1e-300) @ vf


def draw(rng: random.Random, index: int) -> Case:
    dim = rng.choice((16, 24, 32, 48, 64))
    len_kv = rng.randint(1, 70)
    len_q = rng.randint(1, 4) if rng.random() < 0.35 else (len_kv if rng.random() < 0.5 else rng.randint(1, 70))
    heads_kv = rng.choice((1, 2))
    return Case(index, rng.choice((1, 2)), heads_kv * rng.choice((1, 2, 4)), heads_kv, len_q, len_kv, dim,
                rng.choice((8, 16, 40)) if rng.random() < 0.2 else dim, rng.choice(MASKS), rng.choice(SCORES),
                rng.choice(("float32", "float16")), window=rng.choice((3, 8, 20)),
                prefix=rng.randint(0, max(1, len_kv // 2)), softcap=rng.choice((2.0, 5.0, 30.0)), docs=rng.randint(1, 5))


def check(case: Case, backward: bool) -> list[str]:
    """What is wrong with the case's result (empty: nothing)."""
    mods = make_mods(case, "cpu")
    dtype = getattr(torch, case.dtype)
    gen = torch.Generator().manual_seed(case.index)
    shapes = ((case.batch, case.heads_q, case.len_q, case.dim), (case.batch, case.heads_kv, case.len_kv, case.dim),
              (case.batch, case.heads_kv, case.len_kv, case.dim_v))
    q, k, v = (torch.randn(s, generator=gen).to(dtype).requires_grad_(backward) for s in shapes)
    out = nf.attention(q, k, v, score_mod=mods.score_mod, block_mask=mods.block_mask, mask_mod=mods.mask_mod,
                       enable_gqa=case.heads_q != case.heads_kv)
    exact = [t.detach().double().requires_grad_(backward) for t in (q, k, v)]
    ref = dense(case, *exact, mods)
    tol = 2e-4 if case.dtype == "float32" else 1e-2
    err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    wrong = [] if torch.isfinite(out).all() and err <= tol else [f"forward error {err:.2e}"]
    if backward:
        grad_out = torch.randn(out.shape, generator=gen).to(dtype)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        refs = torch.autograd.grad(ref, exact, grad_out.double())
        scale = max(r.norm().item() for r in refs)  # a gradient that is 0 exactly (one key) holds only rounding
        for name, g, r in zip("qkv", grads, refs):
            diff = (g.double() - r).norm().item()
            if not torch.isfinite(g).all() or not (diff <= 5 * tol * r.norm().item() or diff <= 5e-2 * tol * scale):
                wrong.append(f"d{name} error {diff / max(r.norm().item(), 1e-30):.2e}")
    return wrong


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("seed", type=int)
    parser.add_argument("count", type=int)
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--only", type=int, nargs="*", help="these case numbers only (0..count-1)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    start, failures = time.time(), 0
    for n in range(args.count):
        case = draw(rng, args.seed * 10000 + n)
        if args.only and n not in args.only:
            continue
        try:
            wrong = check(case, args.backward)
        except Exception as exc:  # noqa: BLE001 - an exception is the case's failure
            wrong = [f"{type(exc).__name__}: {str(exc)[:300]}"]
        if wrong:
            failures += 1
            print("FAIL", n, case, wrong, flush=True)
    print(f"seed {args.seed}: {args.count} cases, {failures} failing, {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
