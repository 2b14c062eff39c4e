# ruff: noqa: B023 - every closure is timed right where it is made
"""Where the microseconds of a decode call go: per-kernel device durations and the gaps between
them, under the same conditions as `do_bench` (the L2 cleared by writing 256 MB before each call),
next to cuDNN and a plain read of the same K/V bytes; then split-K variants timed interleaved.

    python -m bench.decode_profile [--cases dc_gqa:1024 dc_gqa:32768 ...] [--rounds 3]

Kernel durations come from the CUDA profiler (CUPTI), so they exclude the event and launch overhead
that `do_bench` includes; `do_bench` medians are reported beside them. Writes $OUT/decode_profile.json.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Callable

import torch
import torch.nn.functional as F
import triton
from torch.autograd import DeviceType
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import neptune_fusion as nf
from bench.common import bench, environment, environment_switches, host_us, rel_err, warm_up_gpu, write_results
from bench.decode import OPS, plain
from bench.explore import decode_case
from bench.read_ceiling import _read_sum

FLUSH_BYTES = 256 * 2**20


def kernel_breakdown(call: Callable[[], object], iters: int = 30) -> dict:
    """Median device time of each kernel `call` launches, the gap from the flush to the first of
    them, the gaps between them, and the span from the first start to the last end."""
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    for _ in range(3):
        flush.zero_()
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush.zero_()
            call()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    # group: each iteration starts with the flush kernel (the one that writes 256 MB)
    groups: list[list] = []
    for e in kernels:
        # the flush writes 256 MB (tens of microseconds); a short fill belongs to the call itself
        if "fill" in e.name.lower() and e.time_range.end - e.time_range.start > 20:
            groups.append([e])
        elif groups:
            groups[-1].append(e)
    names: dict[str, list[float]] = {}
    lead, span, between = [], [], []
    for g in groups:
        if len(g) < 2:
            continue
        flush_e, rest = g[0], g[1:]
        lead.append(rest[0].time_range.start - flush_e.time_range.end)
        span.append(rest[-1].time_range.end - rest[0].time_range.start)
        between.extend(b.time_range.start - a.time_range.end for a, b in zip(rest, rest[1:]))
        for e in rest:
            names.setdefault(e.name[:60], []).append(e.time_range.end - e.time_range.start)
    med = statistics.median
    return {"kernels_us": {n: med(v) for n, v in names.items()}, "lead_us": med(lead) if lead else None,
            "span_us": med(span) if span else None, "between_us": med(between) if between else None,
            "iterations": len(groups)}


def read_call(nbytes: int, programs: int) -> Callable[[], None]:
    """A plain read-and-sum of `nbytes` over about `programs` programs (bench/read_ceiling.py)."""
    x = torch.randn(nbytes // 2, device="cuda", dtype=torch.float16)
    block = 4096
    per = triton.cdiv(x.numel(), programs * block)
    grid = (triton.cdiv(x.numel(), per * block),)
    out = torch.empty(grid[0], device="cuda", dtype=torch.float32)
    return lambda: _read_sum[grid](x, out, x.numel(), per, block=block, num_warps=8)


VARIANTS: list[tuple[str, nf.SplitK | None, dict[str, str]]] = [
    ("auto", None, {}),
    ("auto_fused", None, {"NEPTUNE_FUSION_FUSED_COMBINE": "1"}),
    ("auto_no_pdl", None, {"NEPTUNE_FUSION_PDL": "0"}),
    ("s16_k64_st2", nf.split_k(splits=16, block_k=64, num_warps=4, num_stages=2), {}),
    ("s8_k64_st2", nf.split_k(splits=8, block_k=64, num_warps=4, num_stages=2), {}),
    ("s16_k64_st3", nf.split_k(splits=16, block_k=64, num_warps=4, num_stages=3), {}),
]


def run_case(op: str, seq: int, rounds: int) -> dict:
    hq, hkv, kind = OPS[op]
    q, k, v, slopes, scale, ref = decode_case(op, seq)
    nbytes = 2 * hkv * seq * 128 * 2
    calls: dict[str, Callable[[], object]] = {}
    row: dict = {"op": op, "seq": seq, "kv_bytes": nbytes, "variants": {}}
    if kind != "softcap":
        def cudnn() -> torch.Tensor:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=hq != hkv)
        calls["cudnn"] = cudnn
        row["variants"]["cudnn"] = {"rel_err": rel_err(cudnn(), ref)}
    for programs in (132, 528):
        name = f"read_{programs}"
        calls[name] = read_call(nbytes, programs)
        row["variants"][name] = {}
    envs: dict[str, dict[str, str]] = {}
    for name, schedule, env in VARIANTS:
        if schedule is not None and seq < schedule.splits * (schedule.block_k or 64):
            continue
        fn = nf.compile(plain(kind), schedule=schedule)
        with environment_switches(env):
            try:
                err = rel_err(fn(q, k, v, slopes, scale), ref)
            except Exception as exc:  # noqa: BLE001 - a variant that cannot compile is recorded
                print(f"{op} {seq} {name} FAILED {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                continue
        exe = next(iter(fn._cache.values()))
        row["variants"][name] = {"rel_err": err, "plan": str(exe.plan), "fused_combine": exe.combine is None}
        calls[name] = lambda fn=fn: fn(q, k, v, slopes, scale)
        envs[name] = env
    for name in ("auto", "auto_fused", "auto_no_pdl", "s16_k64_st2", "cudnn", "read_528"):
        if name in calls:
            with environment_switches(envs.get(name, {})):
                row["variants"][name]["profile"] = kernel_breakdown(calls[name])
                row["variants"][name]["host_us"] = host_us(calls[name])
    for name in calls:
        row["variants"][name]["us_rounds"] = []
    for _ in range(rounds):
        for name, call in calls.items():
            with environment_switches(envs.get(name, {})):
                row["variants"][name]["us_rounds"].append(bench(call))
    for name, r in row["variants"].items():
        r["us"] = min(r["us_rounds"])
        r["gbps"] = nbytes / (r["us"] * 1e-6) / 1e9
        prof = r.get("profile")
        extra = ""
        if prof:
            ks = " + ".join(f"{n[:28]} {t:.1f}" for n, t in prof["kernels_us"].items())
            extra = f" | host {r['host_us']:.1f} lead {prof['lead_us']:.1f} span {prof['span_us']:.1f} [{ks}]"
        print(f"{op:10s} {seq:6d} {name:16s} {r['us']:7.1f}us {r['gbps']:6.0f} GB/s err {r.get('rel_err', 0):.1e} "
              f"rounds {[round(x, 1) for x in r['us_rounds']]} {r.get('plan', '')}{extra}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["dc_softcap:1024", "dc_softcap:4096", "dc_gqa:4096", "dc_gqa:1024"])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    warm_up_gpu()
    rows = []
    for case in args.cases:
        op, seq = case.split(":")
        try:
            rows.append(run_case(op, int(seq), args.rounds))
        except Exception as exc:  # noqa: BLE001 - keep what the other cases measured
            print(f"{case} FAILED {type(exc).__name__}: {exc}", flush=True)
        write_results("decode_profile", {"environment": environment(), "rows": rows})
    print("wrote decode_profile.json")


if __name__ == "__main__":
    main()
