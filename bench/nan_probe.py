"""The one GPU failure of run 53's fuzzing, taken apart (GPU machine).

program_fuzz seed 12 case 6, `(exp(0.1 x) * (max|x| + 1) * g) @ w` with x 2747 x 5953, w 5953 x
3000 (fp16 and bf16), gave NaN in most rows, differently from run to run. Run 54 showed the
second kernel alone (the K-looped matmul, 128 x 64 x 256 tiles, 8 warps, 4 stages) writes them.
This runs that kernel under variants of its plan and of its program, each in a fresh process.

    PYTHONPATH=src:. python -m bench.nan_probe
"""

import os
import subprocess
import sys

import torch

VARIANTS = {
    "auto": ({}, None),
    "tma0": ({"NEPTUNE_FUSION_TMA": "0"}, None),
    "stages3": ({}, dict(block_q=128, block_k=64, num_stages=3)),
    "stages2": ({}, dict(block_q=128, block_k=64, num_stages=2)),
    "warps4": ({}, dict(block_q=128, block_k=64, num_warps=4)),
    "tma0_stages2": ({"NEPTUNE_FUSION_TMA": "0"}, dict(block_q=128, block_k=64, num_stages=2)),
}
PROGRAMS = {
    "exp_g": lambda nf: (lambda x, s, g, w: nf.einsum("ik,ke->ie", nf.exp(x * 0.1) * s * g, w)),
    "g": lambda nf: (lambda x, s, g, w: nf.einsum("ik,ke->ie", x * s * g, w)),
}


def one(variant: str, program: str) -> None:
    import neptune_fusion as nf

    m, k, n = 2747, 5953, 3000
    torch.manual_seed(0)
    x = (torch.randn(m, k, device="cuda") * 0.5).half()
    g = torch.randn(k, device="cuda").half()
    w = (torch.randn(k, n, device="cuda") * k ** -0.5).half()
    s = torch.rand(m, 1, device="cuda").half() + 1.0
    fn = PROGRAMS[program](nf)
    a = x.float() * s.float() * g.float() if program == "g" else torch.exp(x.float() * 0.1) * s.float() * g.float()
    ref = a @ w.float()
    sched = VARIANTS[variant][1]
    c = nf.compile(nf.program(fn), schedule=None if sched is None else nf.flash(**sched))
    worst = 0
    for _ in range(5):
        out = c(x, s, g, w).float()
        worst = max(worst, (~torch.isfinite(out)).any(1).sum().item())
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    plan = [ln for ln in nf.explain(nf.program(fn), x, s, g, w, schedule=None if sched is None else nf.flash(**sched))
            .splitlines() if ln.startswith(("template", "descriptor_loads"))]
    print(f"{program:6s} {variant:13s} bad rows (worst of 5) {worst:5d} err {err:.3g} {plan}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3:
        one(sys.argv[1], sys.argv[2])
    else:
        for program in PROGRAMS:
            for variant, (env, _) in VARIANTS.items():
                subprocess.run([sys.executable, "-m", "bench.nan_probe", variant, program], env={**os.environ, **env},
                               timeout=120)
