"""A model layer calling nf.attention inside torch.compile(fullgraph=True): one op in the graph.

The BlockMask (document ids and causal) and the ALiBi slopes are made outside the compiled
function, so torch.compile passes the tensors they hold into the graph on every call: changing them
in place, or replacing the BlockMask, changes the result without a stale kernel. Runs on CUDA, or on
the CPU under Triton's interpreter (small shapes).

    python examples/torch_compile.py
"""

import os

import torch

# no GPU, or TRITON_INTERPRET=1 asked for (CI does): the kernels run in Triton's interpreter, on the
# CPU, at small sizes
on_gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
if not on_gpu:
    os.environ["TRITON_INTERPRET"] = "1"

from torch.nn.attention.flex_attention import create_block_mask  # noqa: E402

import neptune_fusion as nf  # noqa: E402

device = "cuda" if on_gpu else "cpu"
B, H, S, D = (1, 16, 4096, 64) if device == "cuda" else (1, 4, 128, 32)
slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, device=device) / H)
doc_id = torch.arange(S, device=device) // (S // 4)  # four documents packed in one sequence


def alibi(score, b, h, q_idx, kv_idx):
    return score + slopes[h] * (kv_idx - q_idx)


def document_causal(b, h, q_idx, kv_idx):
    return (doc_id[q_idx] == doc_id[kv_idx]) & (q_idx >= kv_idx)


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(D, 3 * D, device=device)

    def forward(self, x: torch.Tensor, block_mask) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return nf.attention(q, k, v, score_mod=alibi, block_mask=block_mask)


block_mask = create_block_mask(document_causal, None, None, S, S, device=device)
layer = Attention()
compiled = torch.compile(layer, fullgraph=True)
x = torch.randn(B, H, S, D, device=device)
with torch.no_grad():  # inference here (in grad mode the call gets its derived backward: README, Training)
    out = compiled(x, block_mask)
    torch.testing.assert_close(out, layer(x, block_mask), atol=1e-5, rtol=1e-5)
    slopes.mul_(2.0)  # seen by the next call
    torch.testing.assert_close(compiled(x, block_mask), layer(x, block_mask), atol=1e-5, rtol=1e-5)
print("torch.compile(fullgraph=True) matches eager:", tuple(out.shape))
