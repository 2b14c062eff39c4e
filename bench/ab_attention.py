"""The attention benchmark of DESIGN.md section 5 (34 points), before and after a change, in one run.

    python bench/ab_attention.py --before nf_before [--seqs ...] [--ops ...] [--rounds 3]

`--before` names a copy of an earlier neptune_fusion importable under another name (made by
`bench/ab_baseline.sh REV`); every point is timed with both packages in interleaved rounds (best
do_bench median of each kept), and both outputs are checked against an fp32 reference on random
inputs. Writes $OUT/ab_attention.json and prints a table with after/before ratios of time.
"""

from __future__ import annotations

import argparse
import importlib
import math
from typing import Any, Callable

import torch

import neptune_fusion as nf
from bench.common import bench, environment, rel_err, warm_up_gpu, write_results
from neptune_fusion.benchmarks.cases import DECODE_OPS, make_case, plain, reference_rows, torch_plain

DEVICE = "cuda"
PREFILL_SEQS = (1024, 4096, 16384)
DECODE_SEQS = (1024, 4096, 16384, 32768)
PREFILL_FLEX = ("pf_alibi", "pf_gqa", "pf_softcap", "pf_window")


def point(op: str, seq: int, mods: dict[str, Any]) -> tuple[dict[str, Callable[[], torch.Tensor]], Callable]:
    """(call per package, check(out) -> relative error against fp32) for one benchmark point."""
    torch.manual_seed(0)
    if op in ("pf_global", "pf_causal"):
        q, k, v = (torch.randn(1, 32, seq, 128, device=DEVICE, dtype=torch.float16) for _ in range(3))
        scale = 1 / math.sqrt(128)
        rows = torch.randperm(seq, device=DEVICE)[:128].sort().values
        mask = (lambda b, h, qi, ki: qi >= ki) if op == "pf_causal" else None
        ref = reference_rows(q, k, v, None, mask, rows, scale)
        calls = {}
        for name, mod in mods.items():
            lib = importlib.import_module(f"{mod.__name__}.library")
            fn = mod.compile(lib.causal_attention if op == "pf_causal" else lib.attention)
            calls[name] = lambda fn=fn: fn(q, k, v, scale)
        return calls, lambda out: rel_err(out[:, :, rows], ref)
    if op in PREFILL_FLEX:
        q, k, v, score_mod, mask_mod, gqa = make_case(op, seq, DEVICE)
        rows = torch.randperm(seq, device=DEVICE)[:128].sort().values
        ref = reference_rows(q, k, v, score_mod, mask_mod, rows, 1 / math.sqrt(128))
        calls = {name: (lambda mod=mod: mod.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, enable_gqa=gqa))
                 for name, mod in mods.items()}
        return calls, lambda out: rel_err(out[:, :, rows], ref)
    hq, hkv, kind = DECODE_OPS[op]
    q = torch.randn(1, hq, 1, 128, device=DEVICE, dtype=torch.float16)
    k, v = (torch.randn(1, hkv, seq, 128, device=DEVICE, dtype=torch.float16) for _ in range(2))
    slopes = torch.exp2(-8.0 * torch.arange(1, hq + 1, device=DEVICE, dtype=torch.float32) / hq)
    scale = 1 / math.sqrt(128)
    ref = torch_plain(q.float(), k.float(), v.float(), slopes, scale, kind).float()
    calls = {}
    for name, mod in mods.items():
        fn = mod.compile(plain(kind, mod))
        calls[name] = lambda fn=fn: fn(q, k, v, slopes, scale)
    return calls, lambda out: rel_err(out, ref)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="importable name of the earlier package")
    ap.add_argument("--ops", nargs="+", default=["pf_global", "pf_causal", *PREFILL_FLEX, *DECODE_OPS])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefill-seqs", type=int, nargs="+", default=list(PREFILL_SEQS))
    ap.add_argument("--decode-seqs", type=int, nargs="+", default=list(DECODE_SEQS))
    args = ap.parse_args()
    mods = {"before": importlib.import_module(args.before), "after": nf}
    warm_up_gpu()
    results = []
    for op in args.ops:
        for seq in args.decode_seqs if op.startswith("dc_") else args.prefill_seqs:
            calls, check = point(op, seq, mods)
            r: dict[str, Any] = {"op": op, "seq": seq}
            for name, call in calls.items():
                with torch.no_grad():
                    out = call()
                torch.cuda.synchronize()
                r[f"{name}_rel_err"] = check(out)
            rounds: dict[str, list[float]] = {name: [] for name in calls}
            for k in range(args.rounds):
                # which package is timed first alternates by round and by point: a cell timed second
                # measured up to 5% apart from the first with byte-identical kernels (bench/NOTES.md 67)
                order = list(calls) if (k + len(results)) % 2 == 0 else list(calls)[::-1]
                for name in order:
                    rounds[name].append(bench(calls[name]))
            for name, ts in rounds.items():
                r[f"{name}_us"], r[f"{name}_rounds_us"] = min(ts), ts
            r["after_over_before"] = r["after_us"] / r["before_us"]
            results.append(r)
            write_results("ab_attention", {"environment": environment(), "before": args.before, "partial": True,
                                           "results": results})  # what a timed-out run still returns
            print(f"{op:11s} {seq:6d} before {r['before_us']:9.1f}us (err {r['before_rel_err']:.1e})  after "
                  f"{r['after_us']:9.1f}us (err {r['after_rel_err']:.1e})  after/before {r['after_over_before']:.3f}",
                  flush=True)
    ratios = [r["after_over_before"] for r in results]
    summary = {"points": len(results), "geomean_after_over_before": math.exp(sum(map(math.log, ratios)) / len(ratios)),
               "worst_after_over_before": max(ratios), "all_correct": all(r["after_rel_err"] < 2e-3 for r in results)}
    print(summary)
    path = write_results("ab_attention", {"environment": environment(), "before": args.before, "summary": summary,
                                          "results": results})
    print("wrote", path)


if __name__ == "__main__":
    main()
