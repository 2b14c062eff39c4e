"""RMSNorm then a projection, written as plain code, compiled by neptune_fusion: the row statistic
runs once, and the contraction goes to cuBLAS (the normalised rows written once by our kernel)
where the estimate says that beats the fused K-loop kernel, which an explicit schedule keeps.

    python examples/norm_matmul.py
"""

import os

import torch

# no GPU, or TRITON_INTERPRET=1 asked for (CI does): the kernels run in Triton's interpreter, on the
# CPU, at small sizes
on_gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
if not on_gpu:
    os.environ["TRITON_INTERPRET"] = "1"

import neptune_fusion as nf  # noqa: E402

device = "cuda" if on_gpu else "cpu"
dtype = torch.float16
tokens, hidden, out_features = (8192, 4096, 4096) if device == "cuda" else (32, 96, 3000)


# --- the program, written the plain way --------------------------------------------------------
@nf.program
def rmsnorm_projection(x, g, w):
    r = nf.sqrt((x * x).sum(axis=-1, keepdims=True) / x.shape[-1] + 1e-6)
    return nf.einsum("ik,ke->ie", x / r * g, w)


x = torch.randn(tokens, hidden, device=device, dtype=dtype)
g = torch.rand(hidden, device=device, dtype=dtype) + 0.5
w = (torch.randn(hidden, out_features, device=device) * hidden ** -0.5).to(dtype)

auto = nf.compile(rmsnorm_projection)  # the route chosen from the shapes
fused = nf.compile(rmsnorm_projection, schedule=nf.flash())  # always the fused K-loop kernel
out_auto, out_fused = auto(x, g, w), fused(x, g, w)

# --- the same thing in float64 -------------------------------------------------------------------
xd = x.double()
expected = (xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-6) * g.double()) @ w.double()
scale = expected.abs().max().item()
for name, out in (("auto", out_auto), ("fused K-loop", out_fused)):
    err = (out.double() - expected).abs().max().item() / scale
    print(f"RMSNorm -> matmul {tokens}x{hidden} @ {hidden}x{out_features} {dtype} on {device}, {name}: "
          f"relative error {err:.2e}")
    assert err < 1e-2

route = [line for line in nf.explain(rmsnorm_projection, x, g, w).splitlines() if "cuBLAS" in line]
print("auto's route:", route[0] if route else "the fused kernel")
