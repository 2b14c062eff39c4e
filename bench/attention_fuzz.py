"""Random attention calls, forward and optionally backward, each against a dense float64 reference
with autograd: the sweep's masks and mods (bench/sweep.py), GQA, head dims that are not powers of
two, lengths 1-70 on the CPU (Triton's interpreter: one key, one query, ragged tiles) and 1-1500 on
a GPU (`--device cuda`, bf16 too).

    TRITON_INTERPRET=1 PYTHONPATH=. python bench/attention_fuzz.py SEED COUNT [--backward] [--only I J ...]
    PYTHONPATH=src:. python -m bench.attention_fuzz SEED COUNT --device cuda [--backward]   (GPU machine)

Prints each case that fails (error above tolerance, a non-finite value, an exception) and a summary.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time

import torch

import neptune_fusion as nf
from bench.sweep import MASKS, SCORES, Case, Mods, make_mods


def dense(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mods: Mods) -> torch.Tensor:
    """Attention in float64 with a safe softmax (rows with no visible key give 0, gradients 0)."""
    group = case.heads_q // case.heads_kv
    kf, vf = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    i = torch.arange(case.len_q, device=q.device)[:, None] + case.len_kv - case.len_q
    j = torch.arange(case.len_kv, device=q.device)[None, :]
    s = q.double() @ kf.transpose(-1, -2) / math.sqrt(case.dim)
    if mods.score is not None:
        s = mods.score(s, i, j)
    visible = torch.ones(case.len_q, case.len_kv, dtype=torch.bool, device=q.device)
    if mods.visible is not None:
        visible = mods.visible(i, j).expand(case.len_q, case.len_kv)
    s = s.masked_fill(~visible, -math.inf)
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros_like(m))) * visible
    return e / e.sum(-1, keepdim=True).clamp_min(1e-300) @ vf


def draw(rng: random.Random, index: int, device: str = "cpu") -> Case:
    gpu = device != "cpu"
    dim = rng.choice((16, 24, 32, 48, 64, 96, 128) if gpu else (16, 24, 32, 48, 64))
    longest = 1500 if gpu else 70
    len_kv = rng.randint(1, longest)
    len_q = rng.randint(1, 4) if rng.random() < 0.35 else (len_kv if rng.random() < 0.5 else rng.randint(1, longest))
    heads_kv = rng.choice((1, 2))
    return Case(index, rng.choice((1, 2)), heads_kv * rng.choice((1, 2, 4)), heads_kv, len_q, len_kv, dim,
                rng.choice((8, 16, 40)) if rng.random() < 0.2 else dim, rng.choice(MASKS), rng.choice(SCORES),
                rng.choice(("float32", "float16", "bfloat16") if gpu else ("float32", "float16")),
                window=rng.choice((3, 8, 20, 300) if gpu else (3, 8, 20)),
                prefix=rng.randint(0, max(1, len_kv // 2)), softcap=rng.choice((2.0, 5.0, 30.0)), docs=rng.randint(1, 5))


def check(case: Case, backward: bool, device: str = "cpu") -> list[str]:
    """What is wrong with the case's result (empty: nothing)."""
    mods = make_mods(case, device)
    dtype = getattr(torch, case.dtype)
    gen = torch.Generator().manual_seed(case.index)
    shapes = ((case.batch, case.heads_q, case.len_q, case.dim), (case.batch, case.heads_kv, case.len_kv, case.dim),
              (case.batch, case.heads_kv, case.len_kv, case.dim_v))
    q, k, v = (torch.randn(s, generator=gen).to(device=device, dtype=dtype).requires_grad_(backward) for s in shapes)
    out = nf.attention(q, k, v, score_mod=mods.score_mod, block_mask=mods.block_mask, mask_mod=mods.mask_mod,
                       enable_gqa=case.heads_q != case.heads_kv)
    exact = [t.detach().double().requires_grad_(backward) for t in (q, k, v)]
    ref = dense(case, *exact, mods)
    tol = {"float32": 2e-4, "float16": 1e-2, "bfloat16": 3e-2}[case.dtype]
    err = ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    wrong = [] if torch.isfinite(out).all() and err <= tol else [f"forward error {err:.2e}"]
    if backward:
        grad_out = torch.randn(out.shape, generator=gen).to(device=device, dtype=dtype)
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
    parser.add_argument("--device", default="cpu", help="cpu (the interpreter) or cuda")
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    rng = random.Random(args.seed)
    start, failures = time.time(), 0
    for n in range(args.count):
        case = draw(rng, args.seed * 10000 + n, args.device)
        if args.only and n not in args.only:
            continue
        try:
            wrong = check(case, args.backward, args.device)
        except Exception as exc:  # noqa: BLE001 - an exception is the case's failure
            wrong = [f"{type(exc).__name__}: {str(exc)[:300]}"]
        if wrong:
            failures += 1
            print("FAIL", n, case, wrong, flush=True)
        else:  # each case as it passes: a run cut short still says how far it got
            print(f"ok {n} {case.mask} {case.score} {case.dtype} b{case.batch} h{case.heads_q}/{case.heads_kv} "
                  f"q{case.len_q} kv{case.len_kv} d{case.dim}/{case.dim_v} {time.time() - start:.0f} s", flush=True)
    print(f"seed {args.seed}: {args.count} cases, {failures} failing, {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
