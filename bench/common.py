"""Shared helpers of the GPU scripts in bench/ (ab_attention, integration, models, general,
decode_check): timing, environment record, result files, an fp32 attention reference, CUDA-graph
capture. `neptune-fusion bench` (src/neptune_fusion/benchmarks) is the benchmark itself.

Run on the GPU machine only. Every script checks correctness against an fp32 reference on random
inputs in the same run, and times with triton.testing.do_bench (median, after warm-up).
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch._inductor.config
import triton

from neptune_fusion.benchmarks.cases import rel_err
from neptune_fusion.benchmarks.runner import host_us, warm_up_gpu

__all__ = ["bench", "captured", "environment", "host_us", "peak_extra", "reference", "rel_err", "try_time",
           "warm_up_gpu", "write_results"]

# many shapes and mods are compiled in one process: let FlexAttention recompile for each instead of
# silently falling back to eager after the default limit of 8
torch._dynamo.config.recompile_limit = 256
torch._dynamo.config.accumulated_recompile_limit = 4096
# no background compile workers: they compete with the host side of the launches being timed
torch._inductor.config.compile_threads = 1


def environment() -> dict[str, Any]:
    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name, "sms": props.multi_processor_count, "l2_bytes": props.L2_cache_size, "torch": torch.__version__,
        "triton": triton.__version__, "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def bench(fn: Callable[[], Any], warmup: int = 25, rep: int = 100) -> float:
    """Median time in microseconds."""
    ms = triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    return ms * 1000.0


def try_time(fn: Callable[[], Any], **kw: Any) -> float | None:
    try:
        fn()
        torch.cuda.synchronize()
        return bench(fn, **kw)
    except Exception as exc:  # noqa: BLE001 - a baseline that cannot run is recorded as missing
        print(f"    (baseline failed: {type(exc).__name__}: {str(exc)[:120]})")
        return None


def peak_extra(fn: Callable[[], Any]) -> int:
    """Bytes of GPU memory `fn()` allocates beyond what is held before it, at its peak."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def write_results(name: str, payload: dict[str, Any]) -> Path:
    out_dir = Path(os.environ.get("OUT", "bench/results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path


def reference(q, k, v, score_mod, mask_mod, scale):
    """fp32 attention with the mods applied elementwise; rows with no visible key give 0 and LSE -inf."""
    hq, hkv = q.shape[1], k.shape[1]
    kf, vf = k.float().repeat_interleave(hq // hkv, 1), v.float().repeat_interleave(hq // hkv, 1)
    s = torch.einsum("bhqd,bhkd->bhqk", q.float(), kf) * scale
    b = torch.arange(q.shape[0], device=q.device)[:, None, None, None]
    h = torch.arange(hq, device=q.device)[None, :, None, None]
    qi = torch.arange(q.shape[2], device=q.device)[None, None, :, None]
    ki = torch.arange(k.shape[2], device=q.device)[None, None, None, :]
    if score_mod is not None:
        s = score_mod(s, b, h, qi, ki)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(b, h, qi, ki), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, -1).nan_to_num(0.0), vf), lse


def captured(call: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Capture `call` in a CUDA graph (after warm-up calls on a side stream, as torch's docs ask)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph, out
