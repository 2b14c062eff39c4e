# ruff: noqa: B023 - every closure is timed right where it is made
"""Loops whose rows share no loaded tile (softmax pooling, softmax, logsumexp): the plan the
schedule derives for them (`AxisRoles.rows_share_loads`) timed beside other tile shapes of the
same template and beside torch.compile of the plain code, each checked against fp32 torch on
random inputs. A plan the derivation should have picked shows up as a faster alternative.

    python bench/streaming.py [--derived-only]    (GPU machine; writes $OUT/streaming.json)
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any, Callable

import torch

import neptune_fusion as nf
from bench.common import bench, environment, rel_err, warm_up_gpu, write_results
from neptune_fusion.library import logsumexp, softmax, softmax_pooling

DEVICE = "cuda"


def torch_softmax_pooling(x, v):
    return (torch.softmax(x.float(), -1) * v.float()).sum(-1)


def torch_softmax(x):
    return torch.softmax(x.float(), -1).to(x.dtype)


def torch_logsumexp(x):
    return torch.logsumexp(x.float(), -1)


def cases() -> list[tuple[str, Any, Callable, tuple]]:
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def randn(*shape, dtype=torch.float16):
        return torch.randn(*shape, generator=g, device=DEVICE, dtype=torch.float32).to(dtype)

    return [("softmax_pooling", softmax_pooling, torch_softmax_pooling, (randn(16384, 8192), randn(16384, 8192))),
            ("softmax_pooling_bf16_long", softmax_pooling, torch_softmax_pooling,
             (randn(2048, 65536, dtype=torch.bfloat16), randn(2048, 65536, dtype=torch.bfloat16))),
            ("softmax", softmax, torch_softmax, (randn(16384, 8192),)),
            ("logsumexp", logsumexp, torch_logsumexp, (randn(16384, 8192),)),
            ("logsumexp_few_rows", logsumexp, torch_logsumexp, (randn(64, 262144),)),
            ("logsumexp_f32", logsumexp, torch_logsumexp, (randn(8192, 8192, dtype=torch.float32),))]


ALTERNATIVES = [*(nf.flash(block_q=r, block_k=c, num_warps=w, num_stages=2)
                  for r, c, w in itertools.product((16, 32, 64), (128, 256, 512), (4, 8))),
                nf.flash(block_q=128, block_k=128, num_warps=8, num_stages=3)]  # the plan before streaming plans


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--derived-only", action="store_true", help="the derived plans only, no alternatives")
    parser.add_argument("--cases", nargs="+", default=None, help="only these cases")
    options = parser.parse_args()
    warm_up_gpu()
    rows = []
    for name, prog, plain, args in cases():
        if options.cases and name not in options.cases:
            continue
        row: dict[str, Any] = {"case": name, "shapes": [list(a.shape) for a in args], "dtype": str(args[0].dtype)}
        with torch.no_grad():
            ref = plain(*(a.float() for a in args)).float()
            try:
                fn = nf.compile(prog)
                out = fn(*args)
                row["rel_err_vs_fp32"] = rel_err(out.float(), ref)
                row["nf_us"] = bench(lambda: fn(*args))
                exe = next(iter(fn._cache.values()))
                row["plan"] = str(exe.plan)
                row["kernels"] = 1 + (exe.combine is not None)
                compiled = torch.compile(plain)
                compiled(*args)
                row["torch_compile_us"] = bench(lambda: compiled(*args))
                row["speedup_vs_torch_compile"] = row["torch_compile_us"] / row["nf_us"]
            except Exception as exc:  # noqa: BLE001 - a failure is the finding
                row["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
            alternatives = []
            if not options.derived_only and name in ("softmax_pooling", "softmax", "logsumexp"):
                for schedule in ALTERNATIVES:
                    alt: dict[str, Any] = {"schedule": str(schedule)}
                    try:
                        other = nf.compile(prog, schedule=schedule)
                        alt["rel_err_vs_fp32"] = rel_err(other(*args).float(), ref)
                        alt["us"] = bench(lambda: other(*args))
                    except Exception as exc:  # noqa: BLE001
                        alt["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    alternatives.append(alt)
                timed = [a for a in alternatives if "us" in a]
                if timed and "nf_us" in row:
                    best = min(timed, key=lambda a: a["us"])
                    row["best_alternative"] = best
                    row["derived_over_best"] = row["nf_us"] / best["us"]
            row["alternatives"] = alternatives
        print({k: v for k, v in row.items() if k != "alternatives"}, flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    print("wrote", write_results("streaming", {"environment": environment(), "results": rows}))


if __name__ == "__main__":
    main()
