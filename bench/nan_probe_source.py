"""Run 54's second look at the K-looped matmul that writes NaN (see bench/nan_probe.py): its
generated Triton source, launched by hand under edits that each change one thing.

    PYTHONPATH=src:. python -m bench.nan_probe_source
"""

import importlib.util
import os
import re
import sys
import tempfile

import torch
import triton

import neptune_fusion as nf

m, k, n = 2747, 5953, 3000
torch.manual_seed(0)
x = (torch.randn(m, k, device="cuda") * 0.5).half()
g = torch.randn(k, device="cuda").half()
w = (torch.randn(k, n, device="cuda") * k ** -0.5).half()
s = torch.rand(m, 1, device="cuda").half() + 1.0
fn = nf.program(lambda x, s, g, w: nf.einsum("ik,ke->ie", nf.exp(x * 0.1) * s * g, w))
text = nf.explain(fn, x, s, g, w)
source = text.split("=== Triton source ===\n", 1)[1].split("\n===", 1)[0]
ref = (torch.exp(x.float() * 0.1) * s.float() * g.float()) @ w.float()
plain_w = "tl.load(w_ptr + {r}[:, None] * stride_w_0 + offs14[None, :], mask=({r}[:, None] < size_k) & v16[None, :], other=0.0)"
EDITS = {
    "as generated": [],
    "exp2 -> 1+x": [(r"tl\.exp2\((v\d+)\)", r"(1.0 + \1)")],
    "no descriptor": [(r"(ld\d+) = desc53\.load\(\[(start_\d+), v10\]\)",
                       lambda mt: f"{mt[1]} = " + plain_w.format(r=f"({mt[2]} + tl.arange(0, BLOCK_C))"))],
    "no where": [(r"(v\d+) = tl\.where\(v\d+\[None, :\], (v\d+), c57\)", r"\1 = \2")],
}
CONFIGS = [(128, 64, 256, 8, 4), (128, 64, 128, 8, 4), (128, 64, 128, 4, 4), (128, 64, 256, 8, 2), (64, 64, 256, 4, 4)]
tmp = tempfile.mkdtemp()
for name, edits in EDITS.items():
    src = source
    for pattern, repl in edits:
        src, count = re.subn(pattern, repl, src)
        assert count, (name, pattern)
    path = os.path.join(tmp, f"k{abs(hash(name))}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"k{abs(hash(name))}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    kernel = mod.nf__lambda_
    for br, bc, be, warps, stages in CONFIGS:
        bad = 0
        for _ in range(3):
            out = torch.empty(m, n, device="cuda", dtype=torch.float16)
            grid = (triton.cdiv(m, br), triton.cdiv(n, be))
            kernel[grid](m, k, x.stride(0), x.stride(1), x, g.stride(0), g, w, w.stride(0), s.stride(0), s,
                         out.stride(0), out.stride(1), out, BLOCK_R=br, BLOCK_C=bc, BLOCK_E=be, SIZE_E=n,
                         num_warps=warps, num_stages=stages)
            bad = max(bad, (~torch.isfinite(out)).any(1).sum().item())
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        print(f"{name:14s} R{br} C{bc} E{be} w{warps} s{stages}: bad rows {bad:5d} err {err:.3g}", flush=True)
