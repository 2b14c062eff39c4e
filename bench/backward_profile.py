"""Where attention's forward+backward spends its GPU time, kernel by kernel (issue 13): ours beside
cuDNN through SDPA (FlexAttention for masked cases) and FlashAttention-4 where it is importable, one torch.profiler trace each.

    python bench/backward_profile.py [--seqs 4096 16384] [--cases causal global] [--steps 5]

Writes $OUT/backward_profile.json (or bench/results/) and prints, per case and system, each
kernel's mean time per step, its share and its launches per step.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
from typing import Any, Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask
from torch.profiler import ProfilerActivity, profile

import neptune_fusion as nf
from bench.backward import DIM, HEADS, case_mods, fa4, flex, fwd_bwd
from bench.common import bench, environment, warm_up_gpu, write_results


def kernels_of(step: Callable[[], Any], steps: int) -> list[dict[str, Any]]:
    """Each CUDA kernel `step` launches: mean microseconds per step and launches per step."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if device_us <= 0 or event.key.startswith("ProfilerStep"):
            continue
        rows.append({"kernel": event.key[:120], "us": device_us / steps, "calls": event.count / steps})
    rows.sort(key=lambda r: -r["us"])
    return rows


def host_profile(step: Callable[[], Any], steps: int = 3, by: str = "cumulative", lines: int = 25) -> str:
    """The Python functions of `steps` calls, by cumulative time (what the host does between
    kernels) or another pstats key such as "tottime"."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats(by).print_stats(lines)
    return text.getvalue()


def linear_ce_step(tokens: int = 8192, hidden: int = 4096, vocab: int = 128256) -> Callable[[], Any]:
    """Linear cross-entropy fwd+bwd at Llama-3 sizes (bf16), as bench/linear_ce.py runs it."""
    from bench.linear_ce import step
    from neptune_fusion.library import linear_cross_entropy

    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, device="cuda").bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda") * 0.02).bfloat16().requires_grad_()
    target = torch.randint(0, vocab, (tokens,), device="cuda")
    return step(nf.compile(linear_cross_entropy), h, w, target, torch.rand(tokens, device="cuda") + 0.5)


def systems(case: str, seq: int, dtype: torch.dtype) -> dict[str, Callable[[], Any]]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, seq, DIM, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)
    slopes = torch.ones(HEADS, device="cuda")
    score_mod, mask_mod, fa4_args = case_mods(case, seq, slopes)
    block = create_block_mask(mask_mod, None, None, seq, seq, device="cuda") if mask_mod is not None else None
    out = {"ours": fwd_bwd(lambda: nf.attention(q, k, v, score_mod=score_mod, block_mask=block), [q, k, v], grad)}
    if score_mod is None and case in ("causal", "global"):
        def cudnn() -> torch.Tensor:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=case == "causal")
        out["cudnn"] = fwd_bwd(cudnn, [q, k, v], grad)
    if case not in ("causal", "global"):
        out["flex"] = fwd_bwd(lambda: flex(q, k, v, score_mod=score_mod, block_mask=block), [q, k, v], grad)
    if fa4 is not None and fa4_args is not None:
        qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))

        def run_fa4() -> torch.Tensor:
            o = fa4.flash_attn_func(qt, kt, vt, **fa4_args)
            return o[0] if isinstance(o, tuple) else o
        out["fa4"] = fwd_bwd(run_fa4, [qt, kt, vt], grad.transpose(1, 2).contiguous())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--cases", nargs="+", default=["causal", "global"])
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--linear-ce", action="store_true", help="also linear cross-entropy at Llama-3 sizes")
    args = ap.parse_args()
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    warm_up_gpu()
    rows: list[dict[str, Any]] = []

    def record(case: str, seq: int, name: str, step: Callable[[], Any]) -> None:
        kernels = kernels_of(step, args.steps)
        total = sum(r["us"] for r in kernels)
        wall = bench(step, warmup=5, rep=20)
        host = host_profile(step) if name == "ours" else ""
        rows.append({"case": case, "seq": seq, "system": name, "total_us": total, "wall_us": wall,
                     "kernels": kernels, "host_profile": host})
        print(f"== {case} {seq} {name}: {total:.0f} us of kernels a step, {wall:.0f} us a step", flush=True)
        for r in kernels[:8]:
            print(f"   {r['us']:9.1f} us {100 * r['us'] / total:5.1f}%  x{r['calls']:.0f}  {r['kernel']}")
        if wall > 1.2 * total and host:
            print(host, flush=True)
        write_results("backward_profile", {"env": environment(), "dtype": args.dtype, "rows": rows})

    if args.linear_ce:
        record("linear_ce", 8192, "ours", linear_ce_step())
        torch.cuda.empty_cache()
    for seq in args.seqs:
        for case in args.cases:
            for name, step in systems(case, seq, dtype).items():
                record(case, seq, name, step)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
