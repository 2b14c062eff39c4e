"""Context parallelism on several GPUs: nf.context_parallel_attention against one GPU and torch's
context_parallel with SDPA.

    torchrun --nproc-per-node=4 -m bench.context_parallel        (GPU machine, 2 or 4 GPUs;
                                                                  writes $OUT/context_parallel_4gpu.json)
    torchrun --nproc-per-node=2 -m bench.context_parallel --lengths 48 --heads 2 --kv-heads 1 --dim 16
                                                                 (no GPU: gloo, kernels in Triton's interpreter;
                                                                  a smoke test of this script)
    --backward: also forward+backward through the ring, its gradients against one GPU's.

For each length (default 64k and 128k tokens) and mask (causal; document: causal within packed
documents of random lengths), fp16, batch 1: every rank builds the same full q, k, v; the
single-GPU time is nf.attention on the full tensors (each rank on its own GPU, at once: the same
conditions as the parallel run); the reference output is nf.attention on the tensors gathered
back from the shards. Then each strategy (ring, all_gather) of nf.context_parallel_attention on
the zigzag shards: the time of a call is the slowest rank's, median over repetitions; scaling
efficiency = one-GPU time / (n * n-GPU time); correctness = relative error of the gathered output
against the reference. torch's context_parallel (SDPA, its own load balancing) runs the causal
case on the same inputs; SDPA takes no document mask, so that case has no baseline. Multicast
stays off: NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

for _var, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                     ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_var, _value)
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # no GPU: the generated kernels run in Triton's interpreter

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

import neptune_fusion as nf  # noqa: E402
from neptune_fusion.integrations import context_parallel as cp  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[65536, 131072])
    p.add_argument("--masks", nargs="+", default=["causal", "document"], choices=["causal", "document"])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=32)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--strategies", nargs="+", default=["ring", "all_gather"], choices=["ring", "all_gather"])
    p.add_argument("--warmup", type=int, default=2 if CUDA else 1)
    p.add_argument("--reps", type=int, default=10 if CUDA else 2)
    p.add_argument("--no-baseline", action="store_true", help="skip torch's context_parallel")
    p.add_argument("--backward", action="store_true", help="also time forward+backward and check the gradients")
    return p.parse_args()


# --------------------------------------------------------------------------- helpers


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def local_time(fn: Callable[[], Any], warmup: int, reps: int) -> float:
    """Median seconds of `fn` on this rank alone."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def group_time(fn: Callable[[], Any], warmup: int, reps: int, device: torch.device) -> float:
    """Median seconds of a collective call `fn`, each repetition timed on the slowest rank."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist())


def all_max(x: float, device: torch.device) -> float:
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any():
        return float("nan")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def environment(world: int) -> dict[str, Any]:
    name = torch.cuda.get_device_name() if CUDA else platform.processor() or "cpu"
    names: list[Any] = [None] * world
    dist.all_gather_object(names, name)
    return {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "backend": dist.get_backend(), "world": world, "devices": names,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "multicast_off": {v: os.environ.get(v) for v in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                            "NVSHMEM_DISABLE_NVLS")}}


def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
    return q_idx >= kv_idx


def document_mask(length: int, device: torch.device) -> Callable[..., Any]:
    """Causal within packed documents of random lengths (1/64 to 1/8 of the sequence; seeded)."""
    gen = torch.Generator().manual_seed(1)
    sizes, left = [], length
    while left > 0:
        n = min(left, int(torch.randint(max(1, length // 64), max(2, length // 8), (1,), generator=gen)))
        sizes.append(n)
        left -= n
    doc = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes)).to(device)

    def mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (q_idx >= kv_idx) & (doc[q_idx] == doc[kv_idx])

    return mask


# --------------------------------------------------------------------------- one case


_mesh: Any = None  # one device mesh for every baseline case


def torch_context_parallel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ref: torch.Tensor, args: Any,
                           device: torch.device, world: int) -> dict[str, Any]:
    """torch's context_parallel with SDPA (causal), on the same full inputs, sharded its own way."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._attention import context_parallel_unshard

        global _mesh
        if _mesh is None:
            _mesh = init_device_mesh(device.type, (world,))
        mesh = _mesh
        qb, kb, vb = q.clone(), k.clone(), v.clone()  # the context shards its buffers in place
        gqa = q.shape[1] != k.shape[1]
        with context_parallel(mesh, buffers=[qb, kb, vb], buffer_seq_dims=[2, 2, 2]):
            def call() -> torch.Tensor:
                return F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=gqa)

            seconds = group_time(call, args.warmup, args.reps, device)
            out = call()
        (full,) = context_parallel_unshard(mesh, [out], [2])
        return {"ms": seconds * 1e3, "rel_err": all_max(rel_err(full, ref), device)}
    except Exception as exc:  # noqa: BLE001 - a baseline that cannot run is recorded as missing
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def run_case(length: int, mask: str, args: Any, rank: int, world: int, device: torch.device) -> dict[str, Any]:
    dtype = torch.float16 if CUDA else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)  # the same full tensors on every rank
    shape_q, shape_kv = (1, args.heads, length, args.dim), (1, args.kv_heads, length, args.dim)
    q = torch.randn(shape_q, generator=gen, device=device, dtype=dtype)
    k = torch.randn(shape_kv, generator=gen, device=device, dtype=dtype)
    v = torch.randn(shape_kv, generator=gen, device=device, dtype=dtype)
    mask_mod = causal if mask == "causal" else document_mask(length, device)
    gqa = args.heads != args.kv_heads
    shards = [nf.context_parallel_shard(t) for t in (q, k, v)]
    gathered = [nf.context_parallel_gather(t) for t in shards]
    assert all(torch.equal(a, b) for a, b in zip(gathered, (q, k, v))), "shard/gather round trip"

    def one_gpu() -> torch.Tensor:
        return nf.attention(*gathered, mask_mod=mask_mod, enable_gqa=gqa)

    with torch.no_grad():
        ref = one_gpu()
        one = local_time(one_gpu, args.warmup, args.reps)
        one_times: list[Any] = [None] * world
        dist.all_gather_object(one_times, one)
        one = statistics.median(one_times)
        row: dict[str, Any] = {"length": length, "mask": mask, "heads": [args.heads, args.kv_heads],
                               "dim": args.dim, "dtype": str(dtype), "one_gpu_ms": one * 1e3,
                               "one_gpu_ms_by_rank": [t * 1e3 for t in one_times], "nf": {}}
        for strategy in args.strategies:
            def call(strategy: str = strategy) -> torch.Tensor:
                return nf.context_parallel_attention(*shards, mask_mod=mask_mod, enable_gqa=gqa, strategy=strategy)

            before = cp.kernel_calls
            out = call()
            calls = cp.kernel_calls - before
            err = all_max(rel_err(nf.context_parallel_gather(out), ref), device)
            seconds = group_time(call, args.warmup, args.reps, device)
            row["nf"][strategy] = {"ms": seconds * 1e3, "scaling_efficiency": one / (world * seconds),
                                   "rel_err": err, "ok": err < (1e-2 if CUDA else 1e-5),
                                   "kernel_calls_rank0": calls}
        nf.context_parallel_attention(*shards, mask_mod=mask_mod, enable_gqa=gqa)
        row["auto_choice"] = cp.last_strategy
        if not args.no_baseline and mask == "causal":
            base = torch_context_parallel(q, k, v, ref, args, device, world)
            if "ms" in base:
                base["scaling_efficiency"] = one / (world * base["ms"] / 1e3)
                best = min(r["ms"] for r in row["nf"].values())
                row["faster_than_torch_cp"] = best < base["ms"]
            row["torch_cp_sdpa"] = base
        elif mask != "causal":
            row["torch_cp_sdpa"] = {"error": "SDPA's context parallelism takes no document mask"}
    if args.backward:
        row["backward"] = backward_case(shards, gathered, mask_mod, gqa, args, device, world)
    if rank == 0:
        print(json.dumps(row), flush=True)
    return row


def backward_case(shards: list[torch.Tensor], full: list[torch.Tensor], mask_mod: Any, gqa: bool, args: Any,
                  device: torch.device, world: int) -> dict[str, Any]:
    """Forward+backward: the ring's gradients of q, k, v against one GPU's on the full tensors
    (relative error of the gathered gradients), the time of both beside each other."""
    gen = torch.Generator(device=device).manual_seed(1)
    seed = torch.randn((*full[0].shape[:3], full[2].shape[3]), generator=gen, device=device, dtype=full[0].dtype)
    local_seed = nf.context_parallel_shard(seed)
    leaves = [t.detach().requires_grad_() for t in shards]
    full_leaves = [t.detach().requires_grad_() for t in full]

    def one_gpu() -> Any:
        return torch.autograd.grad(nf.attention(*full_leaves, mask_mod=mask_mod, enable_gqa=gqa), full_leaves, seed)

    out: dict[str, Any] = {"one_gpu_ms": local_time(one_gpu, args.warmup, args.reps) * 1e3}
    want = one_gpu()
    for strategy in args.strategies:
        def step(strategy: str = strategy) -> Any:
            o = nf.context_parallel_attention(*leaves, mask_mod=mask_mod, enable_gqa=gqa, strategy=strategy)
            return torch.autograd.grad(o, leaves, local_seed)

        got = [nf.context_parallel_gather(g) for g in step()]
        err = all_max(max(rel_err(g, w) for g, w in zip(got, want)), device)
        seconds = group_time(step, args.warmup, args.reps, device)
        out[strategy] = {"ms": seconds * 1e3, "scaling_efficiency": out["one_gpu_ms"] / (world * seconds * 1e3),
                         "rel_err": err, "ok": err < (2e-2 if CUDA else 1e-4)}
    return out


def main() -> None:
    args = parse()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if CUDA:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group("nccl" if CUDA else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    env = environment(world)
    cases = [run_case(n, m, args, rank, world, device) for n in args.lengths for m in args.masks]
    if rank == 0:
        out_dir = Path(os.environ.get("OUT", "bench/results"))
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"context_parallel_{world}{'gpu' if CUDA else 'cpu'}.json"
        path.write_text(json.dumps({"env": env, "config": vars(args), "cases": cases}, indent=2))
        print(f"wrote {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
