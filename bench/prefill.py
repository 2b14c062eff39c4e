"""Prefill benchmark (DESIGN.md section 5): pf_global and pf_causal, generated kernel vs baselines.

    python bench/prefill.py [--seqs 1024 4096 16384] [--ops pf_global pf_causal] [--sweep]

Writes $OUT/prefill.json (or bench/results/prefill.json) and prints a table.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import neptune_fusion as nf
from bench.common import bench, environment, rel_err, try_time, warm_up_gpu, write_results
from neptune_fusion.library import attention, causal_attention

OPS = {"pf_global": (attention, False), "pf_causal": (causal_attention, True)}
CONFIGS = [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 4, 4)]
# (config, NEPTUNE_FUSION_TMA, NEPTUNE_FUSION_WS, prefetch_dot) variants timed when not sweeping
VARIANTS = [((128, 128, 8, 3), "auto", "0", False), ((128, 128, 8, 3), "auto", "1", False),
            ((128, 128, 8, 2), "auto", "0", False), ((128, 128, 8, 2), "auto", "0", True)]


def reference_rows(q, k, v, scale, causal, rows):
    """fp32 attention for a subset of query rows (exact, no q x k matrix of the full size)."""
    qs = q[:, :, rows].float()
    s = torch.einsum("bhqd,bhkd->bhqk", qs, k.float()) * scale
    if causal:
        kv = torch.arange(k.shape[2], device=q.device)
        s = s.masked_fill(kv[None, None, None, :] > rows[None, None, :, None], float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, dim=-1), v.float())


def run_case(op: str, seq: int, sweep: bool, heads: int = 32, dim: int = 128) -> dict:
    prog, causal = OPS[op]
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq, dim, device="cuda", dtype=torch.float16) for _ in range(3))
    scale = 1.0 / math.sqrt(dim)
    rows = torch.randperm(seq, device="cuda")[:256].sort().values
    ref = reference_rows(q, k, v, scale, causal, rows)
    result = {"op": op, "seq": seq, "heads": heads, "dim": dim, "configs": {}}
    best = None
    configs = ([(*c, t, "0", False) for c in CONFIGS for t in ("auto", "0")] if sweep
               else [(*c, t, ws, pf) for c, t, ws, pf in VARIANTS])
    for bq, bk, w, st, tma, ws, pf in configs:
        os.environ["NEPTUNE_FUSION_TMA"] = tma
        os.environ["NEPTUNE_FUSION_WS"] = ws
        fn = nf.compile(prog, schedule=nf.flash(block_q=bq, block_k=bk, num_warps=w, num_stages=st, prefetch_dot=pf))
        name = (f"{bq}x{bk}_w{w}_s{st}" + ("_tma" if tma == "auto" else "") + ("_ws" if ws == "1" else "")
                + ("_pf" if pf else ""))
        try:
            out = fn(q, k, v, scale=scale)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001
            print(f"  {op} {seq} {name}: failed {type(exc).__name__}: {str(exc)[:200]}")
            continue
        err = rel_err(out[:, :, rows], ref)
        t = bench(lambda fn=fn: fn(q, k, v, scale=scale))
        result["configs"][name] = {"us": t, "rel_err": err}
        if err < 2e-3 and (best is None or t < best[1]):
            best = (name, t, err, fn)
    assert best is not None, f"{op} {seq}: no correct configuration"
    # what a user gets without a schedule (the figures to quote); nf_us is the best listed schedule
    os.environ["NEPTUNE_FUSION_TMA"] = "auto"
    os.environ["NEPTUNE_FUSION_WS"] = "0"
    default = nf.compile(prog)
    result["default_rel_err"] = rel_err(default(q, k, v, scale=scale)[:, :, rows], ref)
    result["default_us"] = bench(lambda: default(q, k, v, scale=scale))
    result["default_plan"] = str(next(iter(default._cache.values())).plan)
    result["nf_config"], result["nf_us"], result["nf_rel_err"] = best[0], best[1], best[2]
    fn = best[3]
    os.environ["NEPTUNE_FUSION_TMA"] = "auto" if "_tma" in best[0] else "0"
    os.environ["NEPTUNE_FUSION_WS"] = "1" if "_ws" in best[0] else "0"
    # peak extra memory of one call: everything allocated beyond inputs and the output
    out = fn(q, k, v, scale=scale)
    torch.cuda.synchronize()
    del out
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn(q, k, v, scale=scale)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before - out.numel() * out.element_size()
    result["peak_extra_bytes"] = int(extra)
    result["score_matrix_bytes"] = heads * seq * seq * 2
    result["peak_extra_fraction_of_scores"] = extra / result["score_matrix_bytes"]
    del out

    base = {}
    for label, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                           ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def call(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        base[label] = try_time(call)
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
        block_mask = None
        if causal:
            block_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, seq, seq, device="cuda")
        base["flex"] = try_time(lambda: flex(q, k, v, block_mask=block_mask, scale=scale))
    except Exception as exc:  # noqa: BLE001
        print(f"  flex unavailable: {exc}")
        base["flex"] = None
    result["baselines_us"] = base
    os.environ["NEPTUNE_FUSION_TMA"] = "auto"
    os.environ["NEPTUNE_FUSION_WS"] = "0"
    result["speedup_vs"] = {b: (t / result["nf_us"] if t else None) for b, t in base.items()}
    result["default_speedup_vs"] = {b: (t / result["default_us"] if t else None) for b, t in base.items()}
    flops = 4 * heads * seq * seq * dim * (0.5 if causal else 1.0)
    result["nf_tflops"] = flops / (result["nf_us"] * 1e-6) / 1e12
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--ops", nargs="+", default=list(OPS))
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    warm_up_gpu()
    results = []
    for op in args.ops:
        for seq in args.seqs:
            r = run_case(op, seq, args.sweep)
            results.append(r)
            b = r["baselines_us"]
            print(f"{op:10s} {seq:6d}  nf {r['nf_us']:9.1f}us ({r['nf_config']}, {r['nf_tflops']:.0f} TF/s, err {r['nf_rel_err']:.1e})"
                  f"  flash {b.get('sdpa_flash') or 0:9.1f}  cudnn {b.get('sdpa_cudnn') or 0:9.1f}  flex {b.get('flex') or 0:9.1f}"
                  f"  mem {r['peak_extra_fraction_of_scores']:.2e}", flush=True)
            print(f"      default          {r['default_us']:9.1f}us err {r['default_rel_err']:.1e}  {r['default_plan']}")
            for name, c in r["configs"].items():
                print(f"      {name:16s} {c['us']:9.1f}us err {c['rel_err']:.1e}")
    path = write_results("prefill", {"environment": environment(), "results": results})
    print("wrote", path)


if __name__ == "__main__":
    main()
