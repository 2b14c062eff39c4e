"""Tanh softcapping (Gemma 2 / Grok style), written as for torch's flex_attention, run by neptune_fusion.

    python examples/softcap.py
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

# --- the FlexAttention user's code -------------------------------------------------------------
soft_cap = 20.0


def tanh_softcap(score, b, h, q_idx, kv_idx):
    return soft_cap * torch.tanh(score / soft_cap)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


q, k, v = (torch.randn(B, H, S, D, device=device, dtype=dtype) for _ in range(3))
q = q * 4  # large scores, so the cap matters
out = nf.attention(q, k, v, score_mod=tanh_softcap, mask_mod=causal)

# --- the same thing as a plain torch formula, in float64 ---------------------------------------
i = torch.arange(S, device=device)
scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D)
scores = soft_cap * torch.tanh(scores / soft_cap)
scores = scores.masked_fill(i[None, :] > i[:, None], -math.inf)
expected = torch.softmax(scores, dim=-1) @ v.double()

err = (out.double() - expected).abs().max().item()
print(f"tanh softcap {soft_cap} + causal, {B}x{H}x{S}x{D} {dtype} on {device}: max abs error {err:.2e}")
assert err < 1e-2
