"""Prefix-LM masking (bidirectional prefix, causal after it), written as for torch's flex_attention.

`or_masks` is torch's own helper; the union of two affine masks is analysed as two boxes of
visible tiles.

    python examples/prefix_lm.py
"""

import math
import os

import torch

# no GPU, or TRITON_INTERPRET=1 asked for (CI does): the kernels run in Triton's interpreter, on the
# CPU, at small sizes
on_gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
if not on_gpu:
    os.environ["TRITON_INTERPRET"] = "1"

from torch.nn.attention.flex_attention import or_masks  # noqa: E402

import neptune_fusion as nf  # noqa: E402

device = "cuda" if on_gpu else "cpu"
dtype = torch.float16
B, H, S, D = (2, 16, 2048, 64) if device == "cuda" else (1, 4, 128, 32)

# --- the FlexAttention user's code -------------------------------------------------------------
prefix_length = S // 4


def prefix_mask(b, h, q_idx, kv_idx):
    return kv_idx <= prefix_length


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


prefix_lm_causal = or_masks(prefix_mask, causal)

q, k, v = (torch.randn(B, H, S, D, device=device, dtype=dtype) for _ in range(3))
out, lse = nf.attention(q, k, v, mask_mod=prefix_lm_causal, return_lse=True)

# --- the same thing as a plain torch formula, in float64 ---------------------------------------
i = torch.arange(S, device=device)
visible = (i[None, :] <= prefix_length) | (i[:, None] >= i[None, :])
scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D)
scores = scores.masked_fill(~visible, -math.inf)
expected = torch.softmax(scores, dim=-1) @ v.double()
expected_lse = torch.logsumexp(scores, dim=-1)

err = (out.double() - expected).abs().max().item()
lse_err = (lse.double() - expected_lse).abs().max().item()
print(f"prefix-LM (prefix {prefix_length}), {B}x{H}x{S}x{D} {dtype} on {device}: "
      f"max abs error {err:.2e}, logsumexp {lse_err:.2e}")
assert err < 1e-2 and lse_err < 5e-2
