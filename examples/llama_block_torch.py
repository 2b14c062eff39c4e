"""A Llama block written as plain torch model code, compiled by neptune_fusion.

`nf.compile` traces the torch code below as it is: `F.rms_norm`, rotary embeddings with
`rotate_half` (slices and `torch.cat`), the fused gate/up projection split by `chunk`, `F.silu`,
`F.linear`, and self-attention whose projections are split into heads by `view` and merged back by
`reshape`. Each function becomes fused kernels (the projection through cuBLAS where the compiler
routes it there), and each is trained through the derived backward: the gradients below are
checked against torch autograd. Runs on CUDA, or on the CPU under Triton's interpreter (small shapes).

    python examples/llama_block_torch.py
"""

import os

import torch
import torch.nn.functional as F  # noqa: N812

on_gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
if not on_gpu:
    os.environ["TRITON_INTERPRET"] = "1"

import neptune_fusion as nf  # noqa: E402

device = "cuda" if on_gpu else "cpu"
dtype = torch.float16 if on_gpu else torch.float32
T, D, F_, HD = (4096, 2048, 5632, 128) if on_gpu else (32, 64, 96, 16)
H = D // HD


# --- the model code, as in a transformers modeling file ---------------------------------------
def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(q, cos, sin):
    return q * cos + rotate_half(q) * sin


def self_attention(x, wq, wk, wv, wo):
    t, d = x.shape
    q, k, v = (F.linear(x, w).view(t, d // HD, HD).transpose(0, 1) for w in (wq, wk, wv))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.linear(o.transpose(0, 1).reshape(t, d), wo)


def mlp(x, norm_weight, gate_up, down):
    h = F.rms_norm(x, (x.shape[-1],), norm_weight, eps=1e-6)
    gate, up = F.linear(h, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


# --- inputs --------------------------------------------------------------------------------------
torch.manual_seed(0)
x = torch.randn(T, D, device=device, dtype=dtype)
norm_weight = 1 + 0.1 * torch.randn(D, device=device, dtype=dtype)
gate_up = torch.randn(2 * F_, D, device=device, dtype=dtype) / D**0.5
down = torch.randn(D, F_, device=device, dtype=dtype) / F_**0.5
q = torch.randn(T, HD, device=device, dtype=dtype)
angles = torch.arange(T, device=device)[:, None] * torch.exp2(-torch.arange(HD // 2, device=device) / 4)[None]
cos, sin = (torch.cat((f(angles), f(angles)), -1).to(dtype) for f in (torch.cos, torch.sin))
projections = [torch.randn(D, D, device=device, dtype=dtype) / D**0.5 for _ in range(4)]

# --- forward: equal to the same code run by torch in fp32 ---------------------------------------
cases = (("mlp", mlp, (x, norm_weight, gate_up, down)), ("rope", apply_rope, (q, cos, sin)),
         ("attention", self_attention, (x, *projections)))
for name, fn, args in cases:
    ours = nf.compile(fn)(*args)
    want = fn(*(a.float() for a in args))
    err = ((ours.float() - want).abs().max() / want.abs().max()).item()
    print(f"{name}: output {tuple(ours.shape)} {ours.dtype}, max error relative to the largest value {err:.1e}")
    assert err < (2e-2 if dtype == torch.float16 else 1e-4), err

# --- backward: the derived gradients equal torch autograd's --------------------------------------
if not on_gpu:  # in the interpreter: small shapes, fp32
    for name, fn, args in (cases[0], cases[2]):
        leaves = [a.clone().requires_grad_() for a in args]
        reference = [a.clone().requires_grad_() for a in args]
        seed = torch.randn(T, D)
        (nf.compile(fn)(*leaves) * seed).sum().backward()
        (fn(*reference) * seed).sum().backward()
        for k, (a, b) in enumerate(zip(leaves, reference)):
            err = ((a.grad - b.grad).abs().max() / b.grad.abs().max()).item()
            print(f"{name}: gradient of argument {k}: max error relative to the largest value {err:.1e}")
            assert err < 1e-4, (name, k, err)
else:  # on the GPU: time against the same code run by torch, eager and torch.compile'd
    from triton.testing import do_bench

    def report(what: str, ms: list[float]) -> None:
        print(f"{what}: {ms[0] * 1e3:.0f} us, torch eager {ms[1] * 1e3:.0f} us ({ms[1] / ms[0]:.2f}x), "
              f"torch.compile {ms[2] * 1e3:.0f} us ({ms[2] / ms[0]:.2f}x)")

    for name, fn, args in cases:
        ours, inductor = nf.compile(fn), torch.compile(fn)
        report(name, [do_bench(lambda f=f: f(*args)) for f in (ours, fn, inductor)])  # noqa: B023
