"""ALiBi with a causal mask, written exactly as for torch's flex_attention, run by neptune_fusion.

The per-head slopes are a captured tensor: `slopes[h]` inside score_mod becomes a load of an
extra kernel input. Runs on CUDA, or on the CPU under Triton's interpreter (small shapes).

    python examples/alibi.py
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
slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, device=device) / H)  # the ALiBi paper's slopes


def alibi(score, b, h, q_idx, kv_idx):
    return score + slopes[h] * (kv_idx - q_idx)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


q, k, v = (torch.randn(B, H, S, D, device=device, dtype=dtype) for _ in range(3))
out = nf.attention(q, k, v, score_mod=alibi, mask_mod=causal)

# --- the same thing as a plain torch formula, in float64 ---------------------------------------
i = torch.arange(S, device=device)
bias = slopes[:, None, None].double() * (i[None, :] - i[:, None])
scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D) + bias
scores = scores.masked_fill(i[None, :] > i[:, None], -math.inf)
expected = torch.softmax(scores, dim=-1) @ v.double()

err = (out.double() - expected).abs().max().item()
print(f"alibi + causal, {B}x{H}x{S}x{D} {dtype} on {device}: max abs error {err:.2e}")
assert err < 1e-2
