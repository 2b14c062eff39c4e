"""Sliding-window causal attention with GQA, written as for torch's flex_attention, run by neptune_fusion.

The mask is affine in (q_idx, kv_idx), so the compiler derives per-tile loop bounds: tiles
outside the window are never visited and tiles fully inside it skip the mask arithmetic.

    python examples/sliding_window.py
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
B, HQ, HKV, S, D, WINDOW = (1, 32, 8, 4096, 64, 1024) if device == "cuda" else (1, 4, 2, 128, 32, 24)

# --- the FlexAttention user's code -------------------------------------------------------------
SLIDING_WINDOW = WINDOW


def sliding_window_causal(b, h, q_idx, kv_idx):
    causal_mask = q_idx >= kv_idx
    window_mask = q_idx - kv_idx <= SLIDING_WINDOW
    return causal_mask & window_mask


q = torch.randn(B, HQ, S, D, device=device, dtype=dtype)
k, v = (torch.randn(B, HKV, S, D, device=device, dtype=dtype) for _ in range(2))
out = nf.attention(q, k, v, mask_mod=sliding_window_causal, enable_gqa=True)

# --- the same thing as a plain torch formula, in float64 ---------------------------------------
i = torch.arange(S, device=device)
visible = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] <= SLIDING_WINDOW)
kk = k.double().repeat_interleave(HQ // HKV, dim=1)
vv = v.double().repeat_interleave(HQ // HKV, dim=1)
scores = (q.double() @ kk.transpose(-1, -2)) / math.sqrt(D)
expected = torch.softmax(scores.masked_fill(~visible, -math.inf), dim=-1) @ vv

err = (out.double() - expected).abs().max().item()
print(f"sliding window {SLIDING_WINDOW} + GQA {HQ}/{HKV}, {B}x{HQ}x{S}x{D} {dtype} on {device}: "
      f"max abs error {err:.2e}")
assert err < 1e-2
