"""Command line: `neptune-fusion demo | explain | bench | tune`.

Example:
    $ neptune-fusion demo
    $ neptune-fusion bench --suite decode --seqs 4096 16384 --out bench/results/decode
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any


def _device_and_shape() -> tuple[str, tuple[int, int, int, int]]:
    import torch

    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return "cuda", (1, 32, 4096, 128)
    os.environ["TRITON_INTERPRET"] = "1"
    return "cpu", (1, 2, 128, 32)


def demo(args: argparse.Namespace) -> int:
    """Compile plain attention, print the repair terms and the kernel, run and check it."""
    device, (b, h, n, d) = _device_and_shape()
    import torch

    import neptune_fusion as nf
    from neptune_fusion.ir.printer import format_program
    from neptune_fusion.library import causal_attention as attention

    dtype = torch.float16
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device=device, dtype=dtype) for _ in range(3))
    scale = 1 / math.sqrt(d)
    print(f"# plain causal attention, shape {(b, h, n, d)}, {dtype}, on {device}"
          + (" (Triton interpreter)" if device == "cpu" else ""))
    fn = nf.compile(attention)
    named = dict(fn.program_def.bind(q, k, v, scale))
    exe = fn.executable_for(fn.program_def.trace(**named), named)
    print("\n## input program")
    print(format_program(exe.steps[0].program))
    print("\n## fused program (derived repair terms)")
    print(format_program(exe.steps[-1].program))
    print(f"\n## schedule: {exe.plan}")
    if args.source:
        print("\n## generated Triton kernel")
        print(exe.main.source)
    else:
        print(f"\n## generated Triton kernel: {len(exe.main.source.splitlines())} lines (--source to print it)")
    t0 = time.perf_counter()
    out = fn(q, k, v, scale=scale)
    if device == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    ref = nf.run_reference(exe.steps[0].program, {"q": q.float(), "k": k.float(), "v": v.float(), "scale": scale})
    err = ((out.float() - ref).norm() / ref.norm()).item()
    print(f"\nrelative error vs the fp32 reference executor: {err:.2e} (first call incl. compile {first:.2f}s)")
    if device == "cuda":
        import torch.nn.functional as F
        import triton

        t_nf = triton.testing.do_bench(lambda: fn(q, k, v, scale=scale), return_mode="median") * 1000
        t_sdpa = triton.testing.do_bench(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale), return_mode="median") * 1000
        print(f"time: neptune_fusion {t_nf:.1f} us, torch SDPA {t_sdpa:.1f} us ({t_sdpa / t_nf:.2f}x)")
    ok = err < 2e-3
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


def explain_cmd(args: argparse.Namespace) -> int:
    """Print every compilation stage of plain attention (or softmax) for a small shape."""
    device, (b, h, n, d) = _device_and_shape()
    import torch

    import neptune_fusion as nf
    from neptune_fusion.library import attention

    q, k, v = (torch.randn(b, h, n if args.query_len is None else args.query_len, d, device=device,
                           dtype=torch.float16) if i == 0 else torch.randn(b, h, n, d, device=device, dtype=torch.float16)
               for i in range(3))
    print(nf.explain(attention, q, k, v, scale=1 / math.sqrt(d)))
    return 0


def _attention_inputs(args: argparse.Namespace) -> tuple[Any, ...]:
    import torch

    device, (b, h, n, d) = _device_and_shape()
    if device == "cuda":
        h, n, d = args.heads, args.seq, args.dim
    lq = n if args.query_len is None else args.query_len
    dtype = torch.float16
    q = torch.randn(b, h, lq, d, device=device, dtype=dtype)
    k, v = (torch.randn(b, h, n, d, device=device, dtype=dtype) for _ in range(2))
    return device, q, k, v, 1 / math.sqrt(d)


def bench_cmd(args: argparse.Namespace) -> int:
    """The benchmark (DESIGN.md section 5 and beyond): results.json, results.md and speedups.png in one folder."""
    from pathlib import Path

    from neptune_fusion.benchmarks import run

    return run(args.suite, ops=args.ops, seqs=args.seqs, rounds=args.rounds, quick=args.quick,
               out=Path(args.out) if args.out else None, before=args.before)


def tune_cmd(args: argparse.Namespace) -> int:
    """Autotune compiled plain attention for one shape and print the candidates timed."""
    import neptune_fusion as nf
    from neptune_fusion.library import attention, causal_attention
    from neptune_fusion.runtime import autotune

    device, q, k, v, scale = _attention_inputs(args)
    fn = nf.compile(causal_attention if args.causal else attention, schedule=nf.autotune())
    fn(q, k, v, scale)
    if not autotune.last_report:
        print("a tuned choice for this shape was already remembered (delete autotune.json in the cache to retune)")
    for entry in autotune.last_report:
        plan = entry["plan"]
        result = f"{entry['us']:10.1f} us" if "us" in entry else f"rejected: {entry['rejected']}"
        print(f"  block {plan['block_row']}x{plan['block_col']} warps {plan['num_warps']} stages {plan['num_stages']} "
              f"splits {plan['splits']}: {result}")
    if device != "cuda":
        print("(timed under the Triton interpreter: only the mechanism is meaningful here)")
    return 0


def _interpreter_from_the_start(argv: list[str] | None) -> None:
    """Without a GPU the commands run kernels in Triton's interpreter, which must be chosen before
    Triton is imported; importing this package imports it (through torch._dynamo), so a process
    that has not chosen it starts again with TRITON_INTERPRET=1."""
    import torch

    if os.environ.get("TRITON_INTERPRET", "0") == "1" or torch.cuda.is_available():
        return
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton" in sys.modules:
        os.execv(sys.executable, [sys.executable, "-m", "neptune_fusion", *(sys.argv[1:] if argv is None else argv)])


def _bench_parser(sub: Any) -> None:
    from neptune_fusion.benchmarks.cases import SUITES, select

    p = sub.add_parser(
        "bench", help="the benchmark: every case checked against fp32 and timed beside its baselines",
        description="Every case of the selected suites, checked against fp32 and timed beside its baselines "
                    "(FlashAttention-4 and FlexAttention's FLASH backend where importable) in one process. "
                    "Writes results.json, results.md and speedups.png into one folder per run. Without a GPU "
                    "it runs the --quick cases under the Triton interpreter.")
    p.add_argument("--suite", nargs="+", choices=SUITES, default=list(SUITES), metavar="SUITE",
                   help=f"suites to run, of {', '.join(SUITES)} (default: all)")
    ops = ", ".join(dict.fromkeys(c.op for c in select(SUITES)))
    p.add_argument("--ops", nargs="+", default=None, help=f"only these operators, of {ops}")
    p.add_argument("--seqs", type=int, nargs="+", default=None,
                   help="only these key lengths (the general suite's sizes are its own)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds, best median kept "
                                                             "(default 3; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="a few tiny cases (what CI runs under the interpreter)")
    p.add_argument("--out", default=None, help="results folder (default: $OUT, else bench/results/<date>-<n>)")
    p.add_argument("--before", default=None, metavar="MODULE",
                   help="an earlier neptune_fusion importable under this name (bench/ab_baseline.sh), timed "
                        "beside ours as 'before'")
    p.set_defaults(func=bench_cmd)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `neptune-fusion`; returns the exit status."""
    _interpreter_from_the_start(argv)
    parser = argparse.ArgumentParser(prog="neptune-fusion", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="compile plain attention, show repair terms and kernel, run and check")
    p_demo.add_argument("--source", action="store_true", help="print the generated Triton source")
    p_demo.set_defaults(func=demo)
    p_exp = sub.add_parser("explain", help="print every compilation stage for plain attention")
    p_exp.add_argument("--query-len", type=int, default=None, help="query length (1 for decode)")
    p_exp.set_defaults(func=explain_cmd)
    _bench_parser(sub)
    p = sub.add_parser("tune", help="autotune plain attention for one shape")
    p.add_argument("--seq", type=int, default=4096, help="key length (and query length unless --query-len)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--query-len", type=int, default=None, help="query length (1 for decode)")
    p.add_argument("--causal", action="store_true")
    p.set_defaults(func=tune_cmd)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
