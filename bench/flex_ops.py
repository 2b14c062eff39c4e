"""FlexAttention-style operators (issue 4): the same score_mod / mask_mod functions given to
torch's flex_attention (compiled) and to nf.attention, correct against fp32, timed in one run.

    python bench/flex_ops.py [--seqs 1024 4096 16384] [--ops pf_alibi pf_softcap ... dc_lengths]

`dc_lengths` is decode over a padded KV cache with per-sequence lengths (a data-dependent mask:
split-K over the block map's tile lists).

Writes $OUT/flex_ops.json (or bench/results/flex_ops.json) and prints a table.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import neptune_fusion as nf
from bench.common import bench, environment, rel_err, warm_up_gpu, write_results

WINDOW = 4096
SOFTCAP = 50.0


def make_case(op: str, seq: int, device: str = "cuda"):
    """(q, k, v, score_mod, mask_mod, gqa) exactly as a FlexAttention user writes them.

    `dc_lengths`: decode (one query token) for a batch of 4 sequences of different lengths in one
    padded KV cache of `seq` slots, the mask reading a per-sequence length tensor."""
    heads = {"pf_alibi": (32, 32), "pf_softcap": (32, 16), "pf_window": (32, 8), "pf_gqa": (64, 8),
             "pf_document": (32, 32), "pf_prefix_lm": (32, 32), "dc_lengths": (32, 8)}[op]
    hq, hkv = heads
    batch, q_len = (4, 1) if op.startswith("dc_") else (1, seq)
    q = torch.randn(batch, hq, q_len, 128, device=device, dtype=torch.float16)
    k, v = (torch.randn(batch, hkv, seq, 128, device=device, dtype=torch.float16) for _ in range(2))
    kv_lengths = torch.tensor([seq, seq // 2 + 3, seq // 4 - 5, seq - 77], device=device)
    slopes = torch.exp2(-8.0 * torch.arange(1, hq + 1, device=device, dtype=torch.float32) / hq)
    g = torch.Generator(device="cpu").manual_seed(seq)
    lengths = torch.randint(seq // 16, seq // 2, (64,), generator=g)
    doc_id = torch.repeat_interleave(torch.arange(64), lengths)[:seq]
    doc_id = torch.cat([doc_id, torch.full((seq - doc_id.numel(),), 64)]).to(device)
    prefix = seq // 4

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return SOFTCAP * torch.tanh(score / SOFTCAP)

    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)

    def document(b, h, q_idx, kv_idx):
        return (doc_id[q_idx] == doc_id[kv_idx]) & (q_idx >= kv_idx)

    def prefix_lm(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | (q_idx >= kv_idx)

    def by_length(b, h, q_idx, kv_idx):
        return kv_idx < kv_lengths[b]

    table = {
        "pf_alibi": (alibi, causal), "pf_softcap": (softcap, causal), "pf_window": (softcap, window),
        "pf_gqa": (None, causal), "pf_document": (None, document), "pf_prefix_lm": (None, prefix_lm),
        "dc_lengths": (None, by_length),
    }
    score_mod, mask_mod = table[op]
    return q, k, v, score_mod, mask_mod, hq != hkv


def reference_rows(q, k, v, score_mod, mask_mod, rows, scale):
    """fp32 attention for a subset of query rows, applying the mods elementwise with torch."""
    hq, hkv = q.shape[1], k.shape[1]
    kf, vf = k.float().repeat_interleave(hq // hkv, 1), v.float().repeat_interleave(hq // hkv, 1)
    s = torch.einsum("bhqd,bhkd->bhqk", q[:, :, rows].float(), kf) * scale
    b = torch.arange(q.shape[0], device=q.device)[:, None, None, None]
    h = torch.arange(hq, device=q.device)[None, :, None, None]
    qi = rows[None, None, :, None]
    ki = torch.arange(k.shape[2], device=q.device)[None, None, None, :]
    if score_mod is not None:
        s = score_mod(s, b, h, qi, ki)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(b, h, qi, ki), float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, -1).nan_to_num(0.0), vf)


def run_case(op: str, seq: int) -> dict:
    torch.manual_seed(0)
    q, k, v, score_mod, mask_mod, gqa = make_case(op, seq)
    scale = 1.0 / math.sqrt(q.shape[-1])
    rows = torch.randperm(q.shape[2], device="cuda")[:128].sort().values
    ref = reference_rows(q, k, v, score_mod, mask_mod, rows, scale)
    out = nf.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, enable_gqa=gqa)
    torch.cuda.synchronize()
    result = {"op": op, "seq": seq, "heads_q": q.shape[1], "heads_kv": k.shape[1]}
    result["nf_rel_err"] = rel_err(out[:, :, rows], ref)
    result["nf_us"] = bench(lambda: nf.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, enable_gqa=gqa))
    flex = torch.compile(flex_attention, dynamic=False)
    block_mask = None
    if mask_mod is not None:
        batch = q.shape[0] if q.shape[0] > 1 else None  # masks may read the batch index
        block_mask = create_block_mask(mask_mod, batch, None, q.shape[2], seq, device="cuda")
    fout = flex(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa)
    result["flex_rel_err"] = rel_err(fout[:, :, rows], ref)
    result["flex_us"] = bench(lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa))
    result["speedup_vs_flex"] = result["flex_us"] / result["nf_us"]
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--ops", nargs="+", default=["pf_alibi", "pf_softcap", "pf_window", "pf_gqa", "pf_document",
                                                 "pf_prefix_lm", "dc_lengths"])
    args = ap.parse_args()
    warm_up_gpu()
    results = []
    for op in args.ops:
        for seq in args.seqs:
            try:
                r = run_case(op, seq)
            except Exception as exc:  # noqa: BLE001 - record and go on with the other cases
                print(f"{op:12s} {seq:6d} FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                results.append({"op": op, "seq": seq, "error": f"{type(exc).__name__}: {exc}"})
                continue
            results.append(r)
            print(f"{op:12s} {seq:6d} nf {r['nf_us']:9.1f}us err {r['nf_rel_err']:.1e} | flex {r['flex_us']:9.1f}us "
                  f"err {r['flex_rel_err']:.1e} | x{r['speedup_vs_flex']:.2f}", flush=True)
    path = write_results("flex_ops", {"environment": environment(), "results": results})
    print("wrote", path)


if __name__ == "__main__":
    main()
