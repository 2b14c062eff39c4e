# ruff: noqa: B023 - every closure is timed right where it is made
"""What the empty-row guards of attention's backward cost (issue 13): `nf.attention` (whose output
is `where(max == -inf, 0, o)`, so every term of its backward carries a guard) beside the same
attention written plainly (`library.attention` / `causal_attention`, no guard), fwd+bwd, fp16,
32 heads x 128, with SDPA's cuDNN backend (and `nf_before`, an earlier version, where importable)
in the same process. Gradients checked against fp32.

    python -m bench.guard_probe          (GPU machine; writes $OUT/guard_probe.json)
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import neptune_fusion as nf
from bench.common import bench, environment, rel_err, warm_up_gpu, write_results
from neptune_fusion.library import attention, causal_attention

try:
    import nf_before  # type: ignore[import-not-found]
except ImportError:
    nf_before = None


def main() -> None:
    warm_up_gpu()
    rows: list[dict[str, Any]] = []
    plain_fns = {"global": nf.compile(attention), "causal": nf.compile(causal_attention)}
    for case, seq in (("global", 4096), ("causal", 4096), ("global", 16384), ("causal", 16384)):
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 32, seq, 128, device="cuda", dtype=torch.float16, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn_like(q)
        scale = 1 / math.sqrt(128)
        mask = (lambda b, h, qi, ki: qi >= ki) if case == "causal" else None
        calls = {
            "guarded": lambda: nf.attention(q, k, v, mask_mod=mask),
            "plain": lambda: plain_fns[case](q, k, v, scale),
        }

        def cudnn() -> torch.Tensor:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=case == "causal")

        calls["cudnn"] = cudnn
        if nf_before is not None:  # the package before a change (bench/ab_baseline.sh), same process
            calls["before"] = lambda: nf_before.attention(q, k, v, mask_mod=mask)
        ref_grads = None
        if seq <= 4096:  # fp32 reference of the gradients on the first 2 heads
            qf, kf, vf = (t.detach()[:, :2].float().requires_grad_() for t in (q, k, v))
            s = qf @ kf.transpose(-1, -2) * scale
            if case == "causal":
                s = s.masked_fill(~torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril(), -math.inf)
            ref_grads = torch.autograd.grad(torch.softmax(s, -1) @ vf, (qf, kf, vf), grad[:, :2].float())
        row: dict[str, Any] = {"case": case, "seq": seq}
        for name, call in calls.items():
            def step() -> Any:
                return torch.autograd.grad(call(), (q, k, v), grad)

            grads = step()
            if ref_grads is not None:
                row[f"{name}_grad_err"] = max(rel_err(g[:, :2].float(), r) for g, r in zip(grads, ref_grads))
            row[f"{name}_us"] = bench(step)
        row["plain_over_guarded"] = row["plain_us"] / row["guarded_us"]
        row["guarded_vs_cudnn"] = row["cudnn_us"] / row["guarded_us"]
        if "before_us" in row:
            row["guarded_over_before"] = row["guarded_us"] / row["before_us"]
        print(row, flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    print("wrote", write_results("guard_probe", {"environment": environment(), "results": rows}))


if __name__ == "__main__":
    main()
