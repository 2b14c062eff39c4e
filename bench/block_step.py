"""A training step (forward + backward) of a Llama block's parts written as plain torch, compiled by
`nf.compile`, beside the same code run by torch eager and by torch.compile, in one process.

    PYTHONPATH=.:src python bench/block_step.py mlp|attention [--tokens 4096 --width 2048 --hidden 5632]
        [--dtype float16|bfloat16] [--profile]   (GPU)

Each part's gradients (fp16 or bf16) are checked against torch autograd of the same code in fp32 on random
inputs, beside torch eager's own error in that dtype; the step is timed with do_bench (median after
warm-up). Writes $OUT/block_step_<part>.json.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable

import torch
import torch.nn.functional as F  # noqa: N812

import neptune_fusion as nf
from bench.backward_profile import host_profile
from bench.common import bench, environment, warm_up_gpu, write_results
from bench.host_step import host_us

HEAD_DIM = 128


def self_attention(x, wq, wk, wv, wo):
    t, d = x.shape
    q, k, v = (F.linear(x, w).view(t, d // HEAD_DIM, HEAD_DIM).transpose(0, 1) for w in (wq, wk, wv))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.linear(o.transpose(0, 1).reshape(t, d), wo)


def mlp(x, norm_weight, gate_up, down):
    h = F.rms_norm(x, (x.shape[-1],), norm_weight, eps=1e-6)
    gate, up = F.linear(h, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def inputs(part: str, tokens: int, width: int, hidden: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    if part == "mlp":
        cpu = [torch.randn(tokens, width), 1 + 0.1 * torch.randn(width), torch.randn(2 * hidden, width) / width**0.5,
               torch.randn(width, hidden) / hidden**0.5]
    else:
        cpu = [torch.randn(tokens, width)] + [torch.randn(width, width) / width**0.5 for _ in range(4)]
    return [a.cuda() for a in cpu]


def gradients(fn: Callable, args: list[torch.Tensor], seed: torch.Tensor) -> list[torch.Tensor]:
    leaves = [a.detach().clone().requires_grad_() for a in args]
    fn(*leaves).backward(seed)
    return [leaf.grad for leaf in leaves]


def max_rel(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[float]:
    return [((g.float() - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want)]


def profile(step: Callable[[], Any], part: str) -> None:
    """Each GPU kernel's total time over 5 steps (torch.profiler), the largest first; with $OUT set,
    the trace (each launch's grid and block) goes to $OUT/block_step_<part>_trace.json."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=60), flush=True)
    if os.environ.get("OUT"):
        prof.export_chrome_trace(os.path.join(os.environ["OUT"], f"block_step_{part}_trace.json"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("part", choices=("mlp", "attention"))
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=5632)
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    parser.add_argument("--profile", action="store_true", help="print the time of each kernel of our step")
    parser.add_argument("--host", action="store_true",
                        help="each system's host time per step (the GPU's queue kept full) and our step's Python by own time")
    a = parser.parse_args()
    dtype = getattr(torch, a.dtype)
    warm_up_gpu()
    fn = mlp if a.part == "mlp" else self_attention
    args32 = inputs(a.part, a.tokens, a.width, a.hidden)
    args16 = [t.to(dtype) for t in args32]
    seed = torch.randn(a.tokens, a.width, device="cuda")
    want = gradients(fn, args32, seed)
    steps = {"nf": nf.compile(fn), "eager": fn, "torch.compile": torch.compile(fn)}
    result: dict[str, Any] = {"part": a.part, "tokens": a.tokens, "width": a.width, "hidden": a.hidden,
                              "dtype": a.dtype, "env": environment()}
    for name, step in steps.items():
        got = gradients(step, args16, seed.to(dtype))
        errors = max_rel(got, want)
        leaves = [t.detach().clone().requires_grad_() for t in args16]
        us = bench(lambda step=step, leaves=leaves: step(*leaves).backward(seed.to(dtype)))
        result[name] = {"step_us": us, "grad_max_rel_err": errors}
        print(f"{a.part} {name}: fwd+bwd {us:.0f} us, gradient errors {[f'{e:.1e}' for e in errors]}", flush=True)
        if a.profile and name == "nf":
            profile(lambda step=step, leaves=leaves: step(*leaves).backward(seed.to(dtype)), a.part)
        if a.host:
            one = lambda step=step, leaves=leaves: step(*leaves).backward(seed.to(dtype))  # noqa: E731
            result[name]["host_us"] = host_us(one)
            print(f"{a.part} {name}: host {result[name]['host_us']:.0f} us a step", flush=True)
            if name == "nf":
                print(host_profile(one, steps=10, by="tottime", lines=30), flush=True)
    for name in ("eager", "torch.compile"):
        print(f"  nf speed-up over {name}: {result[name]['step_us'] / result['nf']['step_us']:.2f}x")
    bad = [e for e in result["nf"]["grad_max_rel_err"] if not e < 2e-2]
    result["correct"] = not bad
    write_results(f"block_step_{a.part}" + ("" if a.dtype == "float16" else f"_{a.dtype}"), result)
    assert not bad, result["nf"]["grad_max_rel_err"]


if __name__ == "__main__":
    main()
