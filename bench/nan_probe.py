"""The one GPU failure of run 53's fuzzing, taken apart (GPU machine; not yet run in this form).

program_fuzz seed 12 case 6, `(exp(0.1 x) * (max|x| + 1) * g) @ w` with x 2747 x 5953, w 5953 x
3000 (fp16 and bf16), gave NaN in most rows, differently from run to run (unwritten or garbage
memory), through `auto` and through `nf.flash(block_q=128, block_k=64)`; correct with 128 x 32 or
64 x 64 tiles, with 128 rows, with 200 output columns or with k = 300 (k = 5952: 5 rows). The
program runs as two kernels (the row statistic, split-K under auto, then the matmul reading it).
This runs each kernel's program alone under both plans, to tell which one writes the NaN.

    PYTHONPATH=src:. python -m bench.nan_probe
"""

import torch

import neptune_fusion as nf

m, k, n = 2747, 5953, 3000
torch.manual_seed(0)
x = (torch.randn(m, k, device="cuda") * 2.0 + 3.0).half()
g = torch.randn(k, device="cuda").half()
w = (torch.randn(k, n, device="cuda") * k ** -0.5).half()
s_ref = x.float().abs().amax(-1, keepdim=True) + 1.0
stat = nf.program(lambda x: nf.abs_(x).max(axis=-1, keepdims=True) + 1.0)
second = nf.program(lambda x, s, g, w: nf.einsum("ik,ke->ie", nf.exp(x * 0.1) * s * g, w))
ref = (torch.exp(x.float() * 0.1) * s_ref * g.float()) @ w.float()
for sched in (None, nf.flash(block_q=128, block_k=64)):
    st = nf.compile(stat, schedule=sched)(x).float()
    print("stat", sched, "bad", (~torch.isfinite(st)).sum().item(), "err", (st - s_ref).abs().max().item(), flush=True)
    out = nf.compile(second, schedule=sched)(x, s_ref.half(), g, w).float()
    bad = ~torch.isfinite(out)
    print("second", sched, "bad rows", bad.any(1).sum().item(), "err", ((out - ref).abs().max() / ref.abs().max()).item(), flush=True)
    for name, p, a in (("stat", stat, (x,)), ("second", second, (x, s_ref.half(), g, w))):
        t = nf.explain(p, *a, schedule=sched)
        print(name, [ln for ln in t.splitlines() if ln.startswith(("template", "backend used", "tiling", "plan:"))], flush=True)
