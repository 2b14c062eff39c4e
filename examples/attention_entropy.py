"""Attention and the entropy of its weights in one fused pass, written as plain code.

The entropy -sum_k p log p needs the final max and normaliser inside every term; the compiler splits
it into basis sums that keep the exp(s - max) shift (repaired by rescaling, like the output) and
recombines them after the loop. No attention-specific code is involved.

    python examples/attention_entropy.py
"""

import math
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
B, H, S, D = (2, 16, 2048, 64) if device == "cuda" else (1, 4, 128, 32)


@nf.program
def attention_with_entropy(q, k, v, scale):
    s = nf.einsum("bhqd,bhkd->bhqk", q, k) * scale
    s = nf.where(nf.index(s, -2) >= nf.index(s, -1), s, -nf.inf)  # causal
    e = nf.exp(s - s.max(axis=-1, keepdims=True))
    p = e / e.sum(axis=-1, keepdims=True)
    entropy = -nf.where(nf.index(s, -2) >= nf.index(s, -1), p * nf.log(p), 0.0).sum(axis=-1)
    return nf.einsum("bhqk,bhkd->bhqd", p, v), entropy


q, k, v = (torch.randn(B, H, S, D, device=device, dtype=dtype) for _ in range(3))
out, entropy = nf.compile(attention_with_entropy)(q, k, v, 1 / math.sqrt(D))

# --- the same thing in float64 torch -------------------------------------------------------------
i = torch.arange(S, device=device)
scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D)
scores = scores.masked_fill(i[None, :] > i[:, None], -math.inf)
p = torch.softmax(scores, dim=-1)
expected_entropy = -(p * torch.log_softmax(scores, dim=-1)).nan_to_num(0.0).sum(-1)

err = max((out.double() - p @ v.double()).abs().max().item(), (entropy.double() - expected_entropy).abs().max().item())
print(f"attention + entropy of its weights, causal, {B}x{H}x{S}x{D} {dtype} on {device}: max abs error {err:.2e}")
assert err < 2e-2
