"""Context parallelism: one causal, document-masked sequence with ALiBi, split across 2 processes.

Each process holds a zigzag shard of q, k and v; `nf.context_parallel_attention` runs ring
attention over them (the mods see global positions) and the shards of the output are gathered
and checked against a float64 torch formula over the whole sequence. On a machine with 2 GPUs
it runs over NCCL, otherwise over gloo on the CPU with the kernels in Triton's interpreter.

    python examples/context_parallel.py
"""

import math
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# NVLink multicast stays off in multi-GPU runs (set before any process group starts)
for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(var, value)
GPUS = torch.cuda.device_count() >= 2
if not GPUS:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # no GPUs: run the generated kernels in Triton's interpreter

WORLD = 2
B, H, S, D = (1, 8, 8192, 64) if GPUS else (1, 2, 96, 16)


def run(rank: int, store: str) -> None:
    import neptune_fusion as nf

    device = torch.device("cuda", rank) if GPUS else torch.device("cpu")
    if GPUS:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if GPUS else "gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    dtype = torch.float16 if GPUS else torch.float32

    # --- the FlexAttention user's code, over global positions -----------------------------------
    lengths = torch.tensor([S // 3, S // 4, S // 6, S - S // 3 - S // 4 - S // 6])
    document_id = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(device)
    slopes = torch.exp2(-torch.arange(1.0, H + 1)).to(device)

    def document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (document_id[q_idx] == document_id[kv_idx])

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    gen = torch.Generator(device=device).manual_seed(0)  # the same full tensors on every rank
    q, k, v = (torch.randn(B, H, S, D, device=device, dtype=dtype, generator=gen) for _ in range(3))

    # --- context parallel: shard, attend, gather ----------------------------------------------------
    shards = [nf.context_parallel_shard(t) for t in (q, k, v)]           # zigzag: chunks r and 3 - r of 4
    for strategy in ("ring", "all_gather"):
        out_local = nf.context_parallel_attention(*shards, score_mod=alibi, mask_mod=document_causal,
                                                  strategy=strategy)
        out = nf.context_parallel_gather(out_local)

        # --- the same thing as a plain torch formula, in float64, on rank 0 ---------------------------
        if rank == 0:
            i = torch.arange(S, device=device)
            visible = (i[:, None] >= i[None, :]) & (document_id[:, None] == document_id[None, :])
            scores = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D)
            scores = scores + slopes.double()[:, None, None] * (i[None, :] - i[:, None])
            expected = torch.softmax(scores.masked_fill(~visible, -math.inf), dim=-1) @ v.double()
            err = (out.double() - expected).abs().max().item()
            print(f"{strategy}: {WORLD} ranks, {B}x{H}x{S}x{D} {dtype} on {device.type}, document mask + causal + "
                  f"ALiBi over global positions: max abs error {err:.2e}", flush=True)
            assert err < (1e-2 if GPUS else 1e-4)
    dist.destroy_process_group()


if __name__ == "__main__":
    store = os.path.join(tempfile.mkdtemp(), "store")
    mp.spawn(run, args=(store,), nprocs=WORLD)
