# ruff: noqa: B023 - every closure is timed right where it is made
"""Host-side cost of one call (decode-sized problem): where the microseconds go.

    python bench/overhead.py
"""

from __future__ import annotations

import cProfile
import io
import math
import pstats
import time

import torch
import torch.nn.functional as F

import neptune_fusion as nf
from bench.common import environment, write_results
from neptune_fusion.library import attention


def host_us(fn, n=300):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def main() -> None:
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(1, 32, 1024, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    scale = 1 / math.sqrt(128)
    fn = nf.compile(attention)
    out = {}
    out["nf_call_host_us"] = host_us(lambda: fn(q, k, v, scale))
    out["sdpa_call_host_us"] = host_us(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale))
    out["torch_empty_host_us"] = host_us(lambda: torch.empty(1, 32, 1, 128, device="cuda", dtype=torch.float16))
    out["current_stream_host_us"] = host_us(lambda: torch.cuda.current_stream().cuda_stream)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        fn(q, k, v, scale)
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
    out["profile"] = text.getvalue()
    # where the GPU time of a grouped-query decode call goes (kernel by kernel)
    qg = torch.randn(1, 64, 1, 128, device="cuda", dtype=torch.float16)
    kg, vg = (torch.randn(1, 8, 16384, 128, device="cuda", dtype=torch.float16) for _ in range(2))

    @nf.program
    def gqa(q, k, v, scale):
        k = nf.repeat_interleave(k, 8, 1)
        v = nf.repeat_interleave(v, 8, 1)
        s = nf.einsum("bhqd,bhkd->bhqk", q, k) * scale
        p = nf.exp(s - s.max(axis=-1, keepdims=True))
        return nf.einsum("bhqk,bhkd->bhqd", p, v) / p.sum(axis=-1, keepdims=True)

    gfn = nf.compile(gqa)
    for _ in range(5):
        gfn(qg, kg, vg, scale)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof_gpu:
        for _ in range(20):
            gfn(qg, kg, vg, scale)
        torch.cuda.synchronize()
    out["gqa_decode_kernels"] = prof_gpu.key_averages().table(sort_by="cuda_time_total", row_limit=8)
    # host cost of nf.attention with FlexAttention-style mods (tracing keys, block-map lookup), and of
    # compiled FlexAttention itself, on the document-mask benchmark (4k)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from bench.flex_ops import make_case

    for op in ("pf_document", "pf_alibi"):
        qd, kd, vd, score_mod, mask_mod, _ = make_case(op, 4096)
        out[f"nf_attention_{op}_host_us"] = host_us(
            lambda: nf.attention(qd, kd, vd, score_mod=score_mod, mask_mod=mask_mod), n=50)
        flex = torch.compile(flex_attention, dynamic=False)
        block_mask = create_block_mask(mask_mod, None, None, 4096, 4096, device="cuda")
        out[f"flex_{op}_host_us"] = host_us(lambda: flex(qd, kd, vd, score_mod=score_mod, block_mask=block_mask), n=50)
    for key, value in out.items():
        print(key, value if isinstance(value, str) else f"{value:.1f}")
    write_results("overhead", {"environment": environment(), **out})


if __name__ == "__main__":
    main()
