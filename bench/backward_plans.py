# ruff: noqa: B023 - every closure is run and timed right where it is made
"""Plans of the derived attention backward's kernels, timed (issue 13): each kernel of the backward
(D, dK+dV, dQ) compiled with candidate plans in place of the schedule's choice, fwd+bwd timed with
each, gradients compared with the schedule's own plan's.

    python bench/backward_plans.py [--seqs 4096 16384] [--cases global causal]

A Gluon candidate is compiled even where the schedule's register estimate declines it (ptxas may
spill); that is the experiment. Writes $OUT/backward_plans.json and prints one line per candidate.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any
from unittest import mock

import torch

import neptune_fusion as nf
from bench.backward import case_inputs, fwd_bwd
from bench.common import bench, environment, rel_err, warm_up_gpu, write_results
from neptune_fusion.codegen import gluon_source
from neptune_fusion.integrations import autograd
from neptune_fusion.runtime.compiled import Compiled
from neptune_fusion.runtime.options import Options

# (kernel index, label, schedule, backend)
CANDIDATES: list[tuple[int, str, Any, str]] = [
    (1, "triton 128x32 w8 s2", nf.flash(128, 32, 8, 2), "triton"),
    (1, "triton 128x32 w8 s3", nf.flash(128, 32, 8, 3), "triton"),
    (1, "triton 128x32 w4 s3", nf.flash(128, 32, 4, 3), "triton"),
    (1, "triton 64x64 w4 s3", nf.flash(64, 64, 4, 3), "triton"),
    (1, "triton 64x32 w4 s3", nf.flash(64, 32, 4, 3), "triton"),
    (1, "triton 128x64 w8 s2", nf.flash(128, 64, 8, 2), "triton"),
    (1, "gluon 128x64", nf.flash(128, 64), "gluon"),
    (2, "gluon 128x128", nf.flash(128, 128), "gluon"),
    (2, "triton 128x64 w8 s2", nf.flash(128, 64, 8, 2), "triton"),
    (2, "triton 128x32 w4 s3", nf.flash(128, 32, 4, 3), "triton"),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--cases", nargs="+", default=["global", "causal"])
    ap.add_argument("--only", nargs="+", default=[], help="candidates whose label contains one of these")
    args = ap.parse_args()
    warm_up_gpu()
    made: list[autograd.Kernels] = []
    init = autograd.Kernels.__init__

    def recording(self: autograd.Kernels, *a: Any, **k: Any) -> None:
        init(self, *a, **k)
        made.append(self)

    rows: list[dict[str, Any]] = []
    by_case: dict[str, autograd.Kernels] = {}
    with mock.patch.object(autograd.Kernels, "__init__", recording):
        for seq in args.seqs:
            for case in args.cases:
                q, k, v, grad, score_mod, _, block = case_inputs(case, seq)
                step = fwd_bwd(lambda: nf.attention(q, k, v, score_mod=score_mod, block_mask=block), [q, k, v], grad)
                before = len(made)
                want = step()
                # one derived backward serves every length of a case: made at its first
                kernels = by_case[case] = made[-1] if len(made) > before else by_case[case]
                base = bench(step, warmup=5, rep=30)
                rows.append({"case": case, "seq": seq, "candidate": "schedule", "us": base})
                print(f"{case:7s} {seq:6d} schedule's plans           {base:9.1f} us", flush=True)
                for index, label, schedule, backend in CANDIDATES:
                    if args.only and not any(f"k{index} {label}".find(o) >= 0 for o in args.only):
                        continue
                    fn = kernels.steps[index][1].at("f16")  # case_inputs are fp16
                    assert isinstance(fn, Compiled)
                    saved = (fn.schedule, fn.options, dict(fn._cache), dict(fn._launchers))
                    row: dict[str, Any] = {"case": case, "seq": seq, "kernel": index, "candidate": label}
                    try:
                        fn.schedule, fn.options = schedule, dataclasses.replace(Options.from_environment(), backend=backend)
                        fn._cache.clear()
                        fn._launchers.clear()
                        with mock.patch.object(gluon_source, "HOPPER_REGISTERS", 400):
                            got = step()
                        row["err"] = max(rel_err(g.float(), w.float()) for g, w in zip(got, want))
                        row["us"] = bench(step, warmup=5, rep=30)
                        row["over_schedule"] = row["us"] / base
                        print(f"{case:7s} {seq:6d} k{index} {label:22s} {row['us']:9.1f} us "
                              f"({row['over_schedule']:.3f}x)  err {row['err']:.1e}", flush=True)
                    except Exception as exc:  # noqa: BLE001 - a candidate that fails is recorded
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                        print(f"{case:7s} {seq:6d} k{index} {label:22s} FAILED {row['error']}", flush=True)
                    finally:
                        fn.schedule, fn.options = saved[0], saved[1]
                        fn._cache.clear()
                        fn._cache.update(saved[2])
                        fn._launchers.clear()
                        fn._launchers.update(saved[3])
                    rows.append(row)
                    write_results("backward_plans", {"env": environment(), "rows": rows})
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
