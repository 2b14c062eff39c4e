"""Document masking (packed sequences), written as for torch's flex_attention, run by neptune_fusion.

`document_id[q_idx] == document_id[kv_idx]` gathers from a captured tensor, which becomes an
extra kernel input; the mask is combined with causal masking by torch's own `and_masks`.

    python examples/document_mask.py
"""

import math
import os

import torch

# no GPU, or TRITON_INTERPRET=1 asked for (CI does): the kernels run in Triton's interpreter, on the
# CPU, at small sizes
on_gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
if not on_gpu:
    os.environ["TRITON_INTERPRET"] = "1"

from torch.nn.attention.flex_attention import and_masks  # noqa: E402

import neptune_fusion as nf  # noqa: E402

device = "cuda" if on_gpu else "cpu"
dtype = torch.float16
B, H, S, D = (1, 16, 4096, 64) if device == "cuda" else (1, 4, 128, 32)

# --- the FlexAttention user's code -------------------------------------------------------------
lengths = torch.tensor([S // 4, S // 8, S // 2, S - S // 4 - S // 8 - S // 2])
document_id = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(device)


def document_mask(b, h, q_idx, kv_idx):
    return document_id[q_idx] == document_id[kv_idx]


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


q, k, v = (torch.randn(B, H, S, D, device=device, dtype=dtype) for _ in range(3))
out = nf.attention(q, k, v, mask_mod=and_masks(document_mask, causal))

# --- the same thing as a plain torch formula, in float64 ---------------------------------------
i = torch.arange(S, device=device)
visible = (document_id[:, None] == document_id[None, :]) & (i[:, None] >= i[None, :])
scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D)
expected = torch.softmax(scores.masked_fill(~visible, -math.inf), dim=-1) @ v.double()

err = (out.double() - expected).abs().max().item()
print(f"document mask ({len(lengths)} documents) + causal, {B}x{H}x{S}x{D} {dtype} on {device}: "
      f"max abs error {err:.2e}")
assert err < 1e-2
