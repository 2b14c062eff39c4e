"""A Llama block's non-attention parts, written as plain torch model code, compiled by neptune_fusion.

`nf.compile` traces the torch code below as it is: `F.rms_norm`, rotary embeddings with
`rotate_half` (slices and `torch.cat`), the fused gate/up projection split by `chunk`, `F.silu` and
`F.linear`. Each function becomes fused kernels (the projection through cuBLAS where the compiler
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


# --- the model code, as in a transformers modeling file ---------------------------------------
def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(q, cos, sin):
    return q * cos + rotate_half(q) * sin


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

# --- forward: equal to the same code run by torch in fp32 ---------------------------------------
for name, fn, args in (("mlp", mlp, (x, norm_weight, gate_up, down)), ("rope", apply_rope, (q, cos, sin))):
    ours = nf.compile(fn)(*args)
    want = fn(*(a.float() for a in args))
    err = ((ours.float() - want).abs().max() / want.abs().max()).item()
    print(f"{name}: output {tuple(ours.shape)} {ours.dtype}, max error relative to the largest value {err:.1e}")
    assert err < (2e-2 if dtype == torch.float16 else 1e-4), err

# --- backward: the derived gradients equal torch autograd's --------------------------------------
if not on_gpu:  # in the interpreter: small shapes, fp32
    leaves = [a.clone().requires_grad_() for a in (x, norm_weight, gate_up, down)]
    reference = [a.clone().requires_grad_() for a in (x, norm_weight, gate_up, down)]
    seed = torch.randn(T, D)
    (nf.compile(mlp)(*leaves) * seed).sum().backward()
    (mlp(*reference) * seed).sum().backward()
    for name, a, b in zip(("x", "norm_weight", "gate_up", "down"), leaves, reference):
        err = ((a.grad - b.grad).abs().max() / b.grad.abs().max()).item()
        print(f"gradient of {name}: max error relative to the largest value {err:.1e}")
        assert err < 1e-4, (name, err)
