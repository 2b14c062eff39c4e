"""Decode benchmark (DESIGN.md section 5): dc_causal, dc_alibi, dc_gqa, dc_softcap.

One query token against the whole KV sequence. The same plain attention programs as
prefill; the compiler picks split-K (FlashDecoding) and packs GQA groups by itself.

    python bench/decode.py [--seqs 1024 4096 16384 32768] [--ops dc_causal ...] [--rounds 5]

Every system is timed in interleaved rounds and keeps its best do_bench median (short cases read
host time at moments, bench/NOTES.md item 33).

Writes $OUT/decode.json (or bench/results/decode.json) and prints a table.
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import neptune_fusion as nf
from bench.common import bench, environment, rel_err, warm_up_gpu, write_results

SOFTCAP = 50.0


def plain(kind: str, front: Any = nf):
    """The plain program for an operator: what a user writes (and what torch.compile gets), with
    `front`'s ops (another neptune_fusion package for before/after comparisons)."""

    def attention(q, k, v, slopes, scale):
        group = q.shape[1] // k.shape[1]
        if group > 1:
            k = front.repeat_interleave(k, group, 1)
            v = front.repeat_interleave(v, group, 1)
        s = front.einsum("bhqd,bhkd->bhqk", q, k) * scale
        if kind == "alibi":
            s = s + slopes[:, None, None] * (front.index(s, -1) - front.index(s, -2) - (k.shape[2] - q.shape[2]))
        if kind == "softcap":
            s = SOFTCAP * front.tanh(s / SOFTCAP)
        p = front.exp(s - s.max(axis=-1, keepdims=True))
        return front.einsum("bhqk,bhkd->bhqd", p, v) / p.sum(axis=-1, keepdims=True)

    return front.program(attention)


def torch_plain(q, k, v, slopes, scale, kind):
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, 1)
        v = v.repeat_interleave(group, 1)
    s = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.float()) * scale
    if kind == "alibi":
        rel = torch.arange(k.shape[2], device=q.device)[None, :] - torch.arange(q.shape[2], device=q.device)[:, None]
        s = s + slopes[:, None, None] * (rel - (k.shape[2] - q.shape[2]))
    if kind == "softcap":
        s = SOFTCAP * torch.tanh(s / SOFTCAP)
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, -1), v.float()).to(q.dtype)


def interleaved(calls: dict[str, Callable[[], object]], rounds: int) -> dict[str, Any]:
    """Best `do_bench` median of each call over `rounds` rounds that each time every call once, in
    turn: short decode kernels swing 2-3x between moments of one run (bench/NOTES.md items 13 and
    19), and interleaving gives every system the same moments. A call that fails is left out."""
    live = {}
    for label, call in calls.items():
        try:
            call()
            torch.cuda.synchronize()
            live[label] = call
        except Exception as exc:  # noqa: BLE001 - a baseline that cannot run is recorded as missing
            print(f"    ({label} failed: {type(exc).__name__}: {str(exc)[:120]})")
    found: dict[str, list[float]] = {label: [] for label in live}
    for _ in range(rounds):
        for label, call in live.items():
            found[label].append(bench(call))
    out: dict[str, Any] = {label: min(ts) for label, ts in found.items()}
    out.update({f"{label}_rounds": ts for label, ts in found.items()})
    return out


OPS = {"dc_causal": (32, 32, "plain"), "dc_alibi": (32, 32, "alibi"), "dc_gqa": (64, 8, "plain"),
       "dc_softcap": (32, 16, "softcap")}


def sweep(op: str, seq: int, dim: int = 128) -> dict:
    """Time split-K settings by hand, to calibrate the automatic choice."""
    hq, hkv, kind = OPS[op]
    q = torch.randn(1, hq, 1, dim, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(1, hkv, seq, dim, device="cuda", dtype=torch.float16) for _ in range(2))
    slopes = torch.ones(hq, device="cuda")
    ref = torch_plain(q.float(), k.float(), v.float(), slopes, 0.1, kind).float()
    out = {}
    for splits in (8, 16, 32, 64):
        for bk in (64, 128):
            for warps, stages in ((4, 2), (4, 3), (8, 3)):
                if seq // splits < bk:
                    continue
                fn = nf.compile(plain(kind), schedule=nf.split_k(splits=splits, block_k=bk, num_warps=warps,
                                                                  num_stages=stages))
                try:
                    err = rel_err(fn(q, k, v, slopes, 0.1), ref)
                    out[f"s{splits}_k{bk}_w{warps}_st{stages}"] = (bench(lambda fn=fn: fn(q, k, v, slopes, 0.1)), err)
                except Exception as exc:  # noqa: BLE001
                    print("   failed", splits, bk, warps, stages, str(exc)[:100])
    best = sorted(out.items(), key=lambda kv: kv[1][0])[:5]
    print(f"  sweep {op} {seq}: " + ", ".join(f"{n} {t:.1f}us (err {e:.0e})" for n, (t, e) in best), flush=True)
    return {n: {"us": t, "rel_err": e} for n, (t, e) in out.items()}


def run_case(op: str, seq: int, dim: int = 128, rounds: int = 5) -> dict:
    hq, hkv, kind = OPS[op]
    torch.manual_seed(0)
    q = torch.randn(1, hq, 1, dim, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(1, hkv, seq, dim, device="cuda", dtype=torch.float16) for _ in range(2))
    slopes = torch.exp2(-8.0 * torch.arange(1, hq + 1, device="cuda", dtype=torch.float32) / hq)
    scale = 1.0 / math.sqrt(dim)
    ref = torch_plain(q.float(), k.float(), v.float(), slopes, scale, kind).float()
    fn = nf.compile(plain(kind))
    out = fn(q, k, v, slopes, scale)
    torch.cuda.synchronize()
    result = {"op": op, "seq": seq, "heads_q": hq, "heads_kv": hkv, "dim": dim, "kind": kind}
    result["nf_rel_err"] = rel_err(out, ref)
    named = dict(fn.program_def.bind(q, k, v, slopes, scale))
    exe = fn.executable_for(fn.program_def.trace(**named), named)
    result["nf_plan"] = str(exe.plan)
    result["nf_steps"] = [s.name for s in exe.steps]
    kv_bytes = 2 * hkv * seq * dim * 2
    result["kv_bytes"] = kv_bytes

    calls: dict[str, Callable[[], object]] = {"nf": lambda: fn(q, k, v, slopes, scale)}
    gqa = hq != hkv
    bias = None
    if kind == "alibi":
        rel = torch.arange(seq, device="cuda")[None, :] - torch.arange(1, device="cuda")[:, None]
        bias = (slopes[:, None, None] * (rel - (seq - 1))).to(q.dtype)[None]
    if kind != "softcap":
        for label, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                               ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)):
            def call(backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=gqa)
            calls[label] = call
    try:
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
        score_mod = None
        if kind == "alibi":
            def score_mod(score, b, h, qi, ki):
                return score + slopes[h] * (ki - qi - (seq - 1))
        elif kind == "softcap":
            def score_mod(score, b, h, qi, ki):
                return SOFTCAP * torch.tanh(score / SOFTCAP)
        calls["flex"] = lambda: flex(q, k, v, score_mod=score_mod, scale=scale, enable_gqa=gqa)
    except Exception as exc:  # noqa: BLE001
        print(f"  flex unavailable: {exc}")
    compiled_plain = torch.compile(lambda q, k, v: torch_plain(q, k, v, slopes, scale, kind), dynamic=False)
    calls["torch_compile"] = lambda: compiled_plain(q, k, v)
    timings = interleaved(calls, rounds)
    result["nf_us"] = timings.pop("nf")
    result["nf_us_rounds"] = timings.pop("nf_rounds")
    result["nf_gbps"] = kv_bytes / (result["nf_us"] * 1e-6) / 1e9
    base: dict[str, float | None] = {label: timings.get(label) for label in calls if label != "nf"}
    result["baselines_rounds_us"] = {label: timings.get(f"{label}_rounds") for label in base}
    result["baselines_us"] = base
    result["speedup_vs"] = {b: (t / result["nf_us"] if t else None) for b, t in base.items()}
    others = [t for t in base.values() if t]
    result["speedup_vs_fastest"] = min(others) / result["nf_us"] if others else None
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    ap.add_argument("--ops", nargs="+", default=list(OPS))
    ap.add_argument("--sweep", action="store_true", help="also time split-K settings by hand")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (the best median is kept)")
    args = ap.parse_args()
    warm_up_gpu()
    results = []
    sweeps = {}
    if args.sweep:
        for op in ("dc_causal", "dc_gqa"):
            for seq in (4096, 16384):
                sweeps[f"{op}_{seq}"] = sweep(op, seq)
    for op in args.ops:
        for seq in args.seqs:
            r = run_case(op, seq, rounds=args.rounds)
            results.append(r)
            b = r["baselines_us"]
            cells = "  ".join(f"{k} {v:7.1f}" for k, v in b.items() if v)
            print(f"{op:10s} {seq:6d} nf {r['nf_us']:7.1f}us {r['nf_gbps']:6.0f} GB/s err {r['nf_rel_err']:.1e} "
                  f"x{r['speedup_vs_fastest'] or 0:.2f} vs fastest | {cells} | {r['nf_plan']}", flush=True)
    path = write_results("decode", {"environment": environment(), "results": results, "sweeps": sweeps})
    print("wrote", path)


if __name__ == "__main__":
    main()
