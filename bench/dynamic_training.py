"""Training through torch.compile with automatic dynamic shapes, on the GPU's torch: three lengths,
gradients against eager (the interpreter test's case, tests/test_torch_integration.py).

    PYTHONPATH=src:. python -m bench.dynamic_training
"""

import torch

import neptune_fusion as nf


def causal(b, h, q, k):
    return q >= k


torch.manual_seed(0)
lin = torch.nn.Linear(64, 64, device="cuda")
pool = nf.compile(nf.program(lambda x, w: nf.einsum("ij,jk->ik", nf.exp(x - x.max(axis=-1, keepdims=True)), w)))


def step(x, w):
    return nf.attention(lin(x), x, x, mask_mod=causal).square().sum() + pool(lin(x[0, 0]), w).square().sum()


compiled = torch.compile(step, fullgraph=True)
for n in (256, 384, 300):
    x, w = torch.randn(1, 4, n, 64, device="cuda"), torch.randn(64, 32, device="cuda").requires_grad_()
    want = torch.autograd.grad(step(x, w), [lin.weight, w])
    got = torch.autograd.grad(compiled(x, w), [lin.weight, w])
    print(n, torch.__version__, [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want)], flush=True)
