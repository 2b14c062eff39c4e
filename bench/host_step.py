# ruff: noqa: B023 - every closure is run and timed right where it is made
"""Host time of one attention training step (issue 13): whether fwd+bwd is host-bound at a length,
and where the host spends it.

    python bench/host_step.py [--seqs 4096] [--cases causal document] [--fresh-block-mask]

Per case: the step's wall time (do_bench median), the GPU time of its kernels (CUDA events around a
step already queued behind others, so the host is not on the path), the host's time per step with
the GPU kept busy (steps issued back to back, one synchronisation at the end, garbage collection on
and off), and the Python functions by own time (cProfile). With --fresh-block-mask: a step that
makes its BlockMask anew (as a training loop does for each batch of packed documents), beside
create_block_mask alone and, where importable, `nf_before`. Writes $OUT/host_step.json.
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import torch
from torch.nn.attention.flex_attention import create_block_mask

import neptune_fusion as nf
from bench.backward import case_inputs, fwd_bwd
from bench.backward_profile import host_profile
from bench.common import bench, environment, warm_up_gpu, write_results

try:
    import nf_before  # type: ignore[import-not-found]  # an earlier version: bench/ab_baseline.sh REV
except ImportError:
    nf_before = None


def host_us(step: Any, n: int = 30) -> float:
    """Host microseconds per step, the queue kept full (one synchronisation for all `n`)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        step()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    return (issued - start) / n * 1e6


def fresh_block_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, score_mod: Any,
                     mask_mod: Any, seq: int) -> dict[str, float]:
    """Step times (us) where every step makes its BlockMask: ours, nf_before's, create_block_mask's alone."""
    def make() -> Any:
        return create_block_mask(mask_mod, None, None, seq, seq, device="cuda")

    systems: dict[str, Any] = {"create_block_mask": make}
    for name, lib in (("ours", nf), ("nf_before", nf_before)):
        if lib is not None:
            systems[name] = fwd_bwd(lambda lib=lib: lib.attention(q, k, v, score_mod=score_mod, block_mask=make()),
                                    [q, k, v], grad)
    out = {}
    for name, step in systems.items():
        step()
        out[name] = bench(step, warmup=3, rep=20)
    print(f"fresh BlockMask {seq}: " + "  ".join(f"{n} {t:.0f} us" for n, t in out.items()), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[4096])
    ap.add_argument("--cases", nargs="+", default=["causal", "document"])
    ap.add_argument("--fresh-block-mask", action="store_true", help="a BlockMask made anew in every step")
    args = ap.parse_args()
    warm_up_gpu()
    rows = []
    for seq in args.seqs:
        for case in args.cases:
            q, k, v, grad, score_mod, mask_mod, block = case_inputs(case, seq)
            row: dict[str, Any] = {"case": case, "seq": seq}
            if args.fresh_block_mask:
                row["fresh"] = fresh_block_mask(q, k, v, grad, score_mod, mask_mod, seq)
                rows.append(row)
                write_results("host_step", {"env": environment(), "rows": rows})
                continue
            for label, kwargs in (("block_mask", {"block_mask": block}), ("mask_mod", {"mask_mod": mask_mod})):
                if mask_mod is None and label == "mask_mod":
                    continue
                step = fwd_bwd(lambda kwargs=kwargs: nf.attention(q, k, v, score_mod=score_mod, **kwargs),
                               [q, k, v], grad)
                step()
                wall = bench(step, warmup=10, rep=50)
                # the GPU time of one step: queued behind a long one, so host gaps do not show
                busy = [step() for _ in range(3)]
                del busy
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                torch.cuda.synchronize()
                gc_on = host_us(step)
                gc.disable()
                gc_off = host_us(step)
                gc.enable()
                own = host_profile(step, 10, by="tottime", lines=18)
                row[label] = {"wall_us": wall, "event_us": start.elapsed_time(end) * 1e3, "host_us": gc_on,
                              "host_us_gc_off": gc_off, "own_time": own}
                print(f"{case} {seq} {label}: wall {wall:.0f} us, events {row[label]['event_us']:.0f} us, "
                      f"host {gc_on:.0f} us a step (gc off {gc_off:.0f})", flush=True)
                print(own, flush=True)
            rows.append(row)
            write_results("host_step", {"env": environment(), "rows": rows})


if __name__ == "__main__":
    main()
