# ruff: noqa: B023 - every closure is timed right where it is made
"""Linear cross-entropy forward+backward at Llama-3 sizes (issue 13): 8192 tokens, hidden 4096,
vocabulary 128256, bf16. `nf.compile(linear_cross_entropy)` with its derived backward (the logits'
gradient materialised a vocabulary chunk at a time, `schedule/materialise.py`) beside Liger's fused
linear cross-entropy, Cut Cross-Entropy and torch.compile of the plain code, in one process: loss
and the gradients of h and w checked against fp32 torch, time (do_bench median) and peak extra
memory of each.

    python bench/linear_ce.py [--tokens 8192] [--hidden 4096] [--vocab 128256]   (GPU machine)
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python bench/linear_ce.py --check-only --tokens 8 --hidden 600 --vocab 300
                                                          (the correctness half on the CPU, fp32)

Liger and Cut Cross-Entropy are not installed there; their wheels travel (pure Python):
    here:   python3 -m pip download --no-deps -d .whl/ce liger-kernel==0.8.5 cut-cross-entropy==25.1.1
    there:  carry [".whl/ce"]; python3 -m pip install -q --no-index --no-deps --target /tmp/ce .whl/ce/*.whl
            && export PYTHONPATH=/tmp/ce:$PYTHONPATH
Writes $OUT/linear_ce.json.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import torch

import neptune_fusion as nf
from bench.common import bench, environment, peak_extra, rel_err, warm_up_gpu, write_results
from neptune_fusion.library import linear_cross_entropy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def baselines() -> dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]]:
    """Per-token losses of each system, by name (those whose package imports)."""
    def plain(h, w, target):  # noqa: ANN001, ANN202
        return torch.nn.functional.cross_entropy((h @ w.T).float(), target, reduction="none")

    found: dict[str, Callable[..., torch.Tensor]] = {"torch_compile": torch.compile(plain)}
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
        liger = LigerFusedLinearCrossEntropyLoss(reduction="none")
        found["liger"] = lambda h, w, target: liger(w, h, target)
    except Exception as exc:  # noqa: BLE001 - a missing baseline is recorded, not fatal
        print("liger not importable:", type(exc).__name__, exc)
    try:
        from cut_cross_entropy import linear_cross_entropy as cce
        found["cce"] = lambda h, w, target: cce(h, w, target, reduction="none")
    except Exception as exc:  # noqa: BLE001
        print("cut_cross_entropy not importable:", type(exc).__name__, exc)
    return found


def step(loss: Callable[..., torch.Tensor], h: torch.Tensor, w: torch.Tensor, target: torch.Tensor,
         seed: torch.Tensor) -> Callable[[], Any]:
    def run() -> Any:
        out = loss(h, w, target)
        return (out, *torch.autograd.grad(out, (h, w), seed))
    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--check-only", action="store_true", help="losses and gradients against fp32 only")
    args = parser.parse_args()
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # the interpreter computes bf16 wrongly
    if DEVICE == "cuda":
        warm_up_gpu()
    g = torch.Generator(device=DEVICE).manual_seed(0)
    h = torch.randn(args.tokens, args.hidden, device=DEVICE, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(args.vocab, args.hidden, device=DEVICE, generator=g) * 0.02).to(dtype).requires_grad_()
    target = torch.randint(0, args.vocab, (args.tokens,), device=DEVICE, generator=g)
    seed = torch.rand(args.tokens, device=DEVICE, generator=g) + 0.5
    hf, wf = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref_loss = torch.nn.functional.cross_entropy(hf @ wf.T, target, reduction="none")
    ref = (ref_loss.detach(), *torch.autograd.grad(ref_loss, (hf, wf), seed))
    del ref_loss
    gradients_bytes = (h.numel() + w.numel()) * h.element_size()
    systems = {"ours": nf.compile(linear_cross_entropy), **({} if args.check_only else baselines())}
    rows = []
    for name, loss in systems.items():
        row: dict[str, Any] = {"system": name}
        try:
            run = step(loss, h, w, target, seed.to(torch.float32))
            got = run()
            row["err"] = {n: rel_err(x.float(), r) for n, x, r in zip(("loss", "h", "w"), got, ref)}
            del got
            if args.check_only:
                print(row, flush=True)
                rows.append(row)
                continue
            row["us"] = bench(run, warmup=5, rep=50)
            row["peak_extra_bytes"] = peak_extra(run)
            row["peak_over_gradients"] = row["peak_extra_bytes"] / gradients_bytes
        except Exception as exc:  # noqa: BLE001 - a failure is the finding
            row["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
        print(row, flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    if args.check_only:
        return
    times = {r["system"]: r["us"] for r in rows if "us" in r}
    if "ours" in times:
        for r in rows:
            if "us" in r:
                r["ours_speedup"] = r["us"] / times["ours"]
    print("wrote", write_results("linear_ce", {"environment": environment(), "args": vars(args), "rows": rows}))


if __name__ == "__main__":
    main()
