# ruff: noqa: B023 - every closure is timed right where it is made
"""A/B timing of compiler options in one run: each variant correct against fp32, timed against the
baselines measured in the same process. Used to decide defaults (bench/NOTES.md records the outcome).

    python bench/explore.py [--parts decode prefill flex decode_tiles] [--decode-ops ...]
        [--decode-seqs ...] [--fused 0 1] [--flex-ops ...] [--flex-seqs ...]

Variants are schedules (`PREFILL_VARIANTS`, `DECODE_TILES`) or environment switches
(`FLEX_VARIANTS`); edit those lists for the question at hand.

Writes $OUT/explore.json (or bench/results/explore.json) and prints one line per variant.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import neptune_fusion as nf
from bench.common import bench, environment, environment_switches, rel_err, try_time, warm_up_gpu, write_results
from bench.decode import OPS as DECODE_OPS
from bench.decode import plain, torch_plain
from bench.flex_ops import make_case
from bench.flex_ops import reference_rows as flex_reference
from bench.prefill import reference_rows
from neptune_fusion.integrations.attention import clear_cache
from neptune_fusion.library import attention, causal_attention


def grid_group(group: int) -> dict[str, str]:
    return {"NEPTUNE_FUSION_GRID_GROUP": str(group)}


WS = {"NEPTUNE_FUSION_WS": "1"}
# run 27: does Triton 3.6's Hopper warp specialisation apply with one warpgroup per program (it did
# nothing at 8 warps, item 4), and do four warpgroups sharing each key tile (256 rows) overlap better?
PREFILL_VARIANTS = [("128x128_w8_s3", nf.flash(128, 128, 8, 3), {}), ("128x128_w4_s3_ws", nf.flash(128, 128, 4, 3), WS),
                    ("128x128_w4_s2_ws", nf.flash(128, 128, 4, 2), WS), ("128x128_w8_s3_ws", nf.flash(128, 128, 8, 3), WS),
                    ("256x64_w16_s3", nf.flash(256, 64, 16, 3), {}), ("256x64_w16_s4", nf.flash(256, 64, 16, 4), {}),
                    ("256x128_w16_s2", nf.flash(256, 128, 16, 2), {}), ("128x64_w8_s4", nf.flash(128, 64, 8, 4), {}),
                    ("128x128_w8_s3_again", nf.flash(128, 128, 8, 3), {})]


def kernel_stats(fn: object) -> dict:
    """Registers, spills, shared memory and whether warp specialisation applied, of the main kernel
    of the first executable compiled by `fn` (an nf.compile result). Variants whose sources are equal
    share one Triton function: the compiled kernel is the one with this plan's warps and score tile."""
    try:
        exe = next(iter(fn._cache.values()))
        plan = exe.plan
        tile = f"tensor<{plan.block_row}x{plan.block_col}xf32"
        kernels = [k for cache in exe.main.fn.device_caches.values() for k in cache[0].values()]
        compiled = next(k for k in kernels if k.metadata.num_warps == plan.num_warps
                        and k.metadata.num_stages == plan.num_stages and tile in k.asm.get("ttgir", ""))
        meta = compiled.metadata
        return {"n_regs": compiled.n_regs, "n_spills": compiled.n_spills, "shared": meta.shared,
                "num_warps": meta.num_warps, "ws_applied": "ttg.warp_specialize" in compiled.asm.get("ttgir", "")}
    except Exception as exc:  # noqa: BLE001 - statistics are a bonus, never fatal
        return {"error": f"{type(exc).__name__}: {exc}"}


def timed(label: str, call: Callable[[], torch.Tensor], check: Callable[[torch.Tensor], float]) -> dict | None:
    """{"us", "rel_err"} of one variant (its output checked first), or None after printing why it failed."""
    try:
        err = check(call())
        return {"us": bench(call), "rel_err": err}
    except Exception as exc:  # noqa: BLE001 - record and go on with the other variants
        print(f"{label} FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        return None


def prefill(seqs: list[int], ops: list[str]) -> list[dict]:
    out = []
    for op, prog, causal in (("pf_global", attention, False), ("pf_causal", causal_attention, True)):
        for seq in seqs if op in ops else ():
            torch.manual_seed(0)
            q, k, v = (torch.randn(1, 32, seq, 128, device="cuda", dtype=torch.float16) for _ in range(3))
            scale = 1 / math.sqrt(128)
            rows = torch.randperm(seq, device="cuda")[:256].sort().values
            ref = reference_rows(q, k, v, scale, causal, rows)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                cudnn = try_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale))
            row = {"op": op, "seq": seq, "cudnn_us": cudnn, "variants": {}}
            for name, schedule, env in PREFILL_VARIANTS:
                fn = nf.compile(prog, schedule=schedule)
                with environment_switches(env):
                    r = timed(f"{op} {seq} {name}", lambda fn=fn: fn(q, k, v, scale=scale),
                              lambda o: rel_err(o[:, :, rows], ref))
                if r is None:
                    continue
                t = r["us"]
                exe = next(iter(fn._cache.values()))
                group = exe.main.tile.constexprs.get("GROUP_B", 1)
                stats = kernel_stats(fn)
                row["variants"][name] = {**r, "vs_cudnn": (cudnn / t) if cudnn else None, "plan": str(exe.plan),
                                         "grid_group": group, "kernel": stats}
                print(f"{op:10s} {seq:6d} {name:16s} {t:9.1f}us err {r['rel_err']:.1e}  x{(cudnn or 0) / t:.3f} cuDNN "
                      f"({cudnn or 0:.1f}) group {group} {stats}", flush=True)
            out.append(row)
    return out


FLEX_VARIANTS = [("auto", None, {})] + [(f"g{g}", None, grid_group(g)) for g in (1, 4, 32)]


def flex(seqs: list[int], ops: list[str]) -> list[dict]:
    out = []
    for op in ops:
        for seq in seqs:
            torch.manual_seed(0)
            q, k, v, score_mod, mask_mod, gqa = make_case(op, seq)
            scale = 1 / math.sqrt(128)
            rows = torch.randperm(seq, device="cuda")[:128].sort().values
            ref = flex_reference(q, k, v, score_mod, mask_mod, rows, scale)
            fl = torch.compile(flex_attention, dynamic=False)
            block_mask = create_block_mask(mask_mod, None, None, seq, seq, device="cuda") if mask_mod else None
            fl(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa)
            flex_us = bench(lambda: fl(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=gqa))
            row = {"op": op, "seq": seq, "flex_us": flex_us, "variants": {}}
            for name, schedule, env in FLEX_VARIANTS:
                def call(schedule=schedule):
                    return nf.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, enable_gqa=gqa,
                                        schedule=schedule)
                clear_cache()  # a fresh compile: the switches are read when a kernel is compiled
                with environment_switches(env):
                    r = timed(f"{op} {seq} {name}", call, lambda o: rel_err(o[:, :, rows], ref))
                if r is None:
                    continue
                row["variants"][name] = {**r, "vs_flex": flex_us / r["us"]}
                print(f"{op:12s} {seq:6d} {name:14s} {r['us']:9.1f}us err {r['rel_err']:.1e}  "
                      f"x{flex_us / r['us']:.3f} Flex ({flex_us:.1f})", flush=True)
            out.append(row)
    return out


def decode_case(op: str, seq: int) -> tuple[torch.Tensor, ...]:
    """(q, k, v, slopes, scale, fp32 reference) of one decode case, from a fixed seed."""
    hq, hkv, kind = DECODE_OPS[op]
    torch.manual_seed(0)
    q = torch.randn(1, hq, 1, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(1, hkv, seq, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    slopes = torch.ones(hq, device="cuda")
    scale = 1 / math.sqrt(128)
    return q, k, v, slopes, scale, torch_plain(q.float(), k.float(), v.float(), slopes, scale, kind).float()


def decode_variants(op: str, seq: int, variants: list[tuple[str, nf.SplitK, dict[str, str]]]) -> dict:
    """Time split-K schedules (each with its environment switches) for one decode case."""
    hq, hkv, kind = DECODE_OPS[op]
    q, k, v, slopes, scale, ref = decode_case(op, seq)
    cudnn = None
    if kind != "softcap":
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn = try_time(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=hq != hkv))
    row = {"op": op, "seq": seq, "cudnn_us": cudnn, "variants": {}}
    for name, schedule, env in variants:
        fn = nf.compile(plain(kind), schedule=schedule)
        with environment_switches(env):
            r = timed(f"{op} {seq} {name}", lambda fn=fn: fn(q, k, v, slopes, scale), lambda o: rel_err(o, ref))
        if r is None:
            continue
        gbps = 2 * hkv * seq * 128 * 2 / (r["us"] * 1e-6) / 1e9
        row["variants"][name] = {**r, "gbps": gbps}
        print(f"{op:10s} {seq:6d} {name:18s} {r['us']:8.1f}us {gbps:6.0f} GB/s err {r['rel_err']:.1e} "
              f"cuDNN {cudnn or 0:.1f}", flush=True)
    return row


def decode(seqs: list[int], ops: list[str], fused_modes: tuple[str, ...], by_hand: list[int]) -> list[dict]:
    """The automatic split-K plan (and by hand, splits) with the combine in or out of the main kernel."""
    out = []
    for op in ops:
        for seq in seqs:
            splits = [None] + [s for s in by_hand if seq >= 64 * s]
            variants = [(f"{'auto' if n is None else f's{n}'}_fused{fused}", nf.split_k(splits=n),
                         {"NEPTUNE_FUSION_FUSED_COMBINE": fused}) for fused in fused_modes for n in splits]
            out.append(decode_variants(op, seq, variants))
    return out


def decode_interleaved(op: str, seq: int, variants: list[tuple[str, nf.SplitK, dict[str, str]]],
                       rounds: int = 3) -> dict:
    """Like `decode_variants`, but every variant is compiled and checked first and then timed in
    `rounds` interleaved rounds (the best median kept): a timing right after a compile read 2-4x
    slow on short decode (item 19)."""
    hq, hkv, kind = DECODE_OPS[op]
    q, k, v, slopes, scale, ref = decode_case(op, seq)
    calls: dict[str, Callable[[], torch.Tensor]] = {}
    if kind != "softcap":
        def cudnn_call() -> torch.Tensor:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=hq != hkv)
        calls["cudnn"] = cudnn_call
    row = {"op": op, "seq": seq, "variants": {}}
    for name, schedule, env in variants:
        fn = nf.compile(plain(kind), schedule=schedule)
        with environment_switches(env):
            try:
                err = rel_err(fn(q, k, v, slopes, scale), ref)
            except Exception as exc:  # noqa: BLE001
                print(f"{op} {seq} {name} FAILED {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
        exe = next(iter(fn._cache.values()))
        row["variants"][name] = {"rel_err": err, "plan": str(exe.plan), "us_rounds": []}
        calls[name] = lambda fn=fn: fn(q, k, v, slopes, scale)
    if "cudnn" in calls:
        row["variants"]["cudnn"] = {"us_rounds": []}
    for _ in range(rounds):
        for name, call in calls.items():
            row["variants"][name]["us_rounds"].append(bench(call))
    nbytes = 2 * hkv * seq * 128 * 2
    for name, r in row["variants"].items():
        r["us"] = min(r["us_rounds"])
        r["gbps"] = nbytes / (r["us"] * 1e-6) / 1e9
        print(f"{op:10s} {seq:6d} {name:22s} {r['us']:8.1f}us {r['gbps']:6.0f} GB/s err {r.get('rel_err', 0):.1e} "
              f"rounds {[round(x, 1) for x in r['us_rounds']]} {r.get('plan', '')}", flush=True)
    return row


def decode_loads(seqs: list[int], ops: list[str]) -> list[dict]:
    """Split-K key tiles through pointers (the default since run 27) against tensor descriptors, and
    by-hand split counts on short decode, timed interleaved."""
    variants = [("auto", nf.split_k(), {}), ("auto_tma", nf.split_k(), {"NEPTUNE_FUSION_SPLITK_TMA": "1"})]
    out = []
    for op in ops:
        for seq in seqs:
            extra = [(f"s{n}", nf.split_k(splits=n), {}) for n in (2, 8, 16) if seq <= 4096 and seq >= 64 * n]
            out.append(decode_interleaved(op, seq, variants + extra))
    return out


def read_ceiling_evict() -> list[dict]:
    """The plain read-and-sum ceiling (bench/read_ceiling.py) with and without eviction hints (run 27:
    no difference, so keeping do_bench's dirty flush lines in the L2 is not what limits the reads)."""
    from bench.read_ceiling import triton_read_us

    rows = []
    for nbytes in (4 * 2**20, 64 * 2**20, 128 * 2**20, 256 * 2**20):
        x = torch.randn(nbytes // 2, device="cuda", dtype=torch.float16)
        row = {"bytes": nbytes}
        for evict in ("", "evict_first", "evict_last"):
            us, config = triton_read_us(x, evict)
            row[evict or "default"] = {"us": us, "gbps": nbytes / (us * 1e-6) / 1e9, "config": config}
        print(f"read {nbytes / 2**20:6.0f} MiB " + "  ".join(f"{k} {v['us']:7.1f}us {v['gbps']:5.0f} GB/s"
                                                          for k, v in row.items() if k != "bytes"), flush=True)
        rows.append(row)
        del x
    return rows


DECODE_TILES = [(16, 64, 2), (16, 64, 3), (16, 128, 2), (16, 128, 3), (8, 128, 3), (8, 64, 3), (32, 64, 2),
                (16, 64, 4)]


def decode_tiles(seqs: list[int], ops: list[str]) -> list[dict]:
    """Split-K (splits, key tile, stages) by hand: how deep the loads in flight should be."""
    variants = [(f"s{n}_k{bk}_st{st}", nf.split_k(splits=n, block_k=bk, num_warps=4, num_stages=st), {})
                for n, bk, st in [(None, None, None), *DECODE_TILES]]
    return [decode_variants(op, seq, variants) for op in ops for seq in seqs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", nargs="+", default=["decode", "prefill", "flex"])
    ap.add_argument("--prefill-ops", nargs="+", default=["pf_global", "pf_causal"])
    ap.add_argument("--prefill-seqs", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--decode-ops", nargs="+", default=["dc_causal", "dc_gqa", "dc_softcap"])
    ap.add_argument("--decode-seqs", type=int, nargs="+", default=[1024, 16384, 32768])
    ap.add_argument("--fused", nargs="+", default=["0", "1"], help="NEPTUNE_FUSION_FUSED_COMBINE settings to time")
    ap.add_argument("--decode-splits", type=int, nargs="*", default=[8, 16, 32, 64], help="split counts by hand")
    ap.add_argument("--flex-ops", nargs="+", default=["pf_alibi", "pf_gqa", "pf_document", "pf_prefix_lm"])
    ap.add_argument("--flex-seqs", type=int, nargs="+", default=[4096])
    args = ap.parse_args()
    warm_up_gpu()
    results: dict[str, list[dict]] = {}
    for part in args.parts:
        try:
            if part == "prefill":
                results[part] = prefill(args.prefill_seqs, args.prefill_ops)
            elif part == "flex":
                results[part] = flex(args.flex_seqs, args.flex_ops)
            elif part == "decode":
                results[part] = decode(args.decode_seqs, args.decode_ops, tuple(args.fused), args.decode_splits)
            elif part == "decode_loads":
                results[part] = decode_loads(args.decode_seqs, args.decode_ops)
            elif part == "ceiling":
                results[part] = read_ceiling_evict()
            elif part == "decode_tiles":
                results[part] = decode_tiles(args.decode_seqs, args.decode_ops)
        except Exception as exc:  # noqa: BLE001 - keep what the other parts measured
            print(f"part {part} FAILED {type(exc).__name__}: {exc}", flush=True)
        path = write_results("explore", {"environment": environment(), **results})
    print("wrote", path)


if __name__ == "__main__":
    main()
