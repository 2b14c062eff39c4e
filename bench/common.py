"""Shared helpers of the GPU benchmarks: timing, environment record, result files.

Run on the GPU machine only. Every benchmark checks correctness against an fp32
reference on random inputs in the same run, and times with triton.testing.do_bench
(median, after warm-up).
"""

from __future__ import annotations

import json
import os
import platform
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch._inductor.config
import triton

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


def warm_up_gpu(seconds: float = 1.0) -> None:
    """Run matmuls for a while so clocks have left their idle state before the first timing (the
    first case of a process measured up to 1.5x slow otherwise, bench/NOTES.md)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def bench(fn: Callable[[], Any], warmup: int = 25, rep: int = 100) -> float:
    """Median time in microseconds."""
    ms = triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    return ms * 1000.0


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any():
        return float("nan")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def try_time(fn: Callable[[], Any], **kw: Any) -> float | None:
    try:
        fn()
        torch.cuda.synchronize()
        return bench(fn, **kw)
    except Exception as exc:  # noqa: BLE001 - a baseline that cannot run is recorded as missing
        print(f"    (baseline failed: {type(exc).__name__}: {str(exc)[:120]})")
        return None


def write_results(name: str, payload: dict[str, Any]) -> Path:
    out_dir = Path(os.environ.get("OUT", "bench/results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path


def host_us(call: Callable[[], Any], n: int = 300) -> float:
    """Host time of one call while the GPU keeps up (the launches queue without waiting)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        call()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / n * 1e6


@contextmanager
def environment_switches(env: dict[str, str]) -> Iterator[None]:
    """Set environment switches for one variant (they are read when a kernel is compiled), then
    restore what was there."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
