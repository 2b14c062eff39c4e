"""Forward+backward of attention (issue 13): nf.attention with its derived backward against cuDNN
and flash through SDPA, FlexAttention (Triton and FLASH backends) and FlashAttention-4 where it is
importable, in one process; gradients of q, k, v (and of learnable ALiBi slopes) checked against
an fp32 dense reference on a few heads; peak extra memory of each backward recorded.

    python bench/backward.py [--seqs 4096 16384] [--cases causal global ...] [--dtypes fp16 bf16]
    TRITON_INTERPRET=1 python bench/backward.py --check-only --seqs 64 --heads 2 --dim 16 --dtypes fp32
                                                 (the correctness half on the CPU, under the interpreter)

With an earlier version importable as `nf_before` (bench/ab_baseline.sh REV, .baseline on
PYTHONPATH) it is timed beside. Writes $OUT/<name>.json (--name, default backward; or under
bench/results/) and prints one line per case.
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import neptune_fusion as nf
from bench.common import bench, environment, peak_extra, rel_err, warm_up_gpu, write_results

HEADS, DIM, WINDOW, SOFTCAP = 32, 128, 1024, 50.0
CHECK_HEADS = 2  # heads compared against the fp32 dense reference (its score matrix is L x L per head)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
flex = torch.compile(flex_attention, dynamic=False)

try:
    import nf_before  # type: ignore[import-not-found]  # an earlier version: bench/ab_baseline.sh REV
except ImportError:
    nf_before = None

try:
    import flash_attn.cute.interface as fa4  # type: ignore[import-not-found]
except Exception:  # noqa: BLE001 - FA4 travels as wheels (../shared/tools/fa4-baseline.sh); absent: skipped
    fa4 = None


def case_mods(case: str, seq: int, slopes: torch.Tensor) -> tuple[Any, Any, dict[str, Any]]:
    """(score_mod, mask_mod, FA4 keyword arguments or None) of a case, as a FlexAttention user writes them."""
    g = torch.Generator().manual_seed(seq)
    lengths = torch.randint(seq // 16, seq // 4, (64,), generator=g)
    doc = torch.repeat_interleave(torch.arange(64), lengths)[:seq]
    doc = torch.cat([doc, torch.full((seq - doc.numel(),), 64)]).to(DEVICE)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)

    def document(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return SOFTCAP * torch.tanh(score / SOFTCAP)

    return {
        "global": (None, None, {}),
        "causal": (None, causal, {"causal": True}),
        "alibi": (alibi, causal, None),
        "softcap": (softcap, causal, {"causal": True, "softcap": SOFTCAP}),
        "window": (None, window, {"causal": True, "window_size": (WINDOW - 1, 0)}),
        "document": (None, document, None),
    }[case]


def dense(q, k, v, score_mod, mask_mod, heads):  # noqa: ANN001, ANN201 - fp32 reference on `heads`
    q, k, v = (t[:, :heads].float() for t in (q, k, v))
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    n = q.shape[2]
    i = torch.arange(n, device=q.device)[:, None]
    j = torch.arange(n, device=q.device)[None]
    h = torch.arange(heads, device=q.device)[:, None, None]
    if score_mod is not None:
        s = score_mod(s, 0, h, i, j)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(0, h, i, j), -math.inf)
    return torch.softmax(s, -1).nan_to_num(0.0) @ v


def fwd_bwd(run: Callable[[], torch.Tensor], inputs: list[torch.Tensor], grad: torch.Tensor) -> Callable[[], Any]:
    def step() -> Any:
        return torch.autograd.grad(run(), inputs, grad)
    return step


def case_inputs(case: str, seq: int, dtype: torch.dtype = torch.float16) -> tuple[Any, ...]:
    """(q, k, v, the output's gradient, score_mod, mask_mod, its BlockMask or None) of a case on the
    GPU (ALiBi slopes all 1), seeded."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, seq, DIM, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    score_mod, mask_mod, _ = case_mods(case, seq, torch.ones(HEADS, device="cuda"))
    block = create_block_mask(mask_mod, None, None, seq, seq, device="cuda") if mask_mod is not None else None
    return q, k, v, torch.randn_like(q), score_mod, mask_mod, block


def measure(case: str, seq: int, dtype: torch.dtype, check_only: bool = False) -> dict[str, Any]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, seq, DIM, device=DEVICE, dtype=dtype, requires_grad=True) for _ in range(3))
    slopes = torch.exp2(-8.0 * torch.arange(1, HEADS + 1, device=DEVICE) / HEADS).requires_grad_(case == "alibi")
    score_mod, mask_mod, fa4_args = case_mods(case, seq, slopes)
    grad = torch.randn(1, HEADS, seq, DIM, device=DEVICE, dtype=dtype)
    inputs = [q, k, v, *([slopes] if case == "alibi" else [])]
    block = (create_block_mask(mask_mod, None, None, seq, seq, device=DEVICE, BLOCK_SIZE=min(128, seq))
             if mask_mod is not None else None)
    ours = fwd_bwd(lambda: nf.attention(q, k, v, score_mod=score_mod, block_mask=block), inputs, grad)
    row: dict[str, Any] = {"case": case, "seq": seq, "dtype": str(dtype).split(".")[-1]}
    got = ours()
    ref_inputs = [t.detach().clone().float().requires_grad_() for t in inputs]
    rq, rk, rv = ref_inputs[:3]
    rs = ref_inputs[3] if case == "alibi" else slopes.detach()
    ref_score, ref_mask, _ = case_mods(case, seq, rs)
    want = torch.autograd.grad(dense(rq, rk, rv, ref_score, ref_mask, CHECK_HEADS), ref_inputs,
                               grad[:, :CHECK_HEADS].float(), allow_unused=True)
    row["err"] = {n: rel_err(g[:, :CHECK_HEADS] if g.dim() == 4 else g[:CHECK_HEADS], w[:, :CHECK_HEADS]
                             if w.dim() == 4 else w[:CHECK_HEADS])
                  for n, g, w in zip("qkvs", got, want) if w is not None}
    if check_only:
        print(f"{case:9s} {seq:6d} {row['dtype']:9s} err " + " ".join(f"{n}={e:.1e}" for n, e in row["err"].items()),
              flush=True)
        return row
    row["ours_us"] = bench(ours)
    row["ours_peak_mb"] = peak_extra(ours) / 2**20
    base: dict[str, Callable[[], Any]] = {}
    if nf_before is not None:
        base["nf_before"] = fwd_bwd(lambda: nf_before.attention(q, k, v, score_mod=score_mod, block_mask=block),
                                    inputs, grad)
    if score_mod is None and mask_mod is None or case == "causal":
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            def sdpa(backend=backend) -> torch.Tensor:  # noqa: ANN001
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=case == "causal")
            base[name] = fwd_bwd(sdpa, inputs, grad)
    base["flex"] = fwd_bwd(lambda: flex(q, k, v, score_mod=score_mod, block_mask=block), inputs, grad)
    base["flex_flash"] = fwd_bwd(lambda: flex(q, k, v, score_mod=score_mod, block_mask=block,
                                              kernel_options={"BACKEND": "FLASH"}), inputs, grad)
    if fa4 is not None and fa4_args is not None:
        qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        gt = grad.transpose(1, 2).contiguous()
        def run_fa4() -> torch.Tensor:
            out = fa4.flash_attn_func(qt, kt, vt, **fa4_args)
            return out[0] if isinstance(out, tuple) else out
        base["fa4"] = fwd_bwd(run_fa4, [qt, kt, vt], gt)
    for name, step in base.items():
        try:
            step()
            torch.cuda.synchronize()
            row[f"{name}_us"] = bench(step)
            row[f"{name}_peak_mb"] = peak_extra(step) / 2**20
        except Exception as exc:  # noqa: BLE001 - a baseline that cannot run this case is recorded missing
            row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    times = {n: row[f"{n}_us"] for n in base if f"{n}_us" in row}
    row["speedup"] = {n: t / row["ours_us"] for n, t in times.items()}
    print(f"{case:9s} {seq:6d} {row['dtype']:9s} ours {row['ours_us']:9.1f} us  err "
          + " ".join(f"{n}={e:.1e}" for n, e in row["err"].items()) + "  "
          + " ".join(f"{n} {t:9.1f} ({t / row['ours_us']:.2f}x)" for n, t in times.items()), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--cases", nargs="+", default=["causal", "global", "alibi", "softcap", "window", "document"])
    parser.add_argument("--dtypes", nargs="+", default=["fp16", "bf16"])
    parser.add_argument("--heads", type=int, default=HEADS)
    parser.add_argument("--dim", type=int, default=DIM)
    parser.add_argument("--check-only", action="store_true", help="gradients against fp32 only, no timing")
    parser.add_argument("--name", default="backward", help="the results file's name (two runs in one call keep both)")
    args = parser.parse_args()
    globals().update(HEADS=args.heads, DIM=args.dim)
    if DEVICE == "cuda":
        warm_up_gpu()
    rows = []
    for dtype in args.dtypes:
        for seq in args.seqs:
            for case in args.cases:
                try:
                    rows.append(measure(case, seq, DTYPES[dtype], args.check_only))
                except Exception as exc:  # noqa: BLE001 - one failing case must not hide the others
                    print(f"{case} {seq} {dtype} FAILED: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    rows.append({"case": case, "seq": seq, "dtype": dtype, "error": f"{type(exc).__name__}: {exc}"})
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()
                    # after every case, so a run stopped at its time limit still leaves what it measured
                    write_results(args.name, {"env": environment(), "fa4": fa4 is not None, "rows": rows})


if __name__ == "__main__":
    main()
