# ruff: noqa: N803, B023 - Triton constexpr names; every closure is timed right where it is made
"""Probe (run 28): would a persistent prefill kernel whose tile loop Triton flattens into the key loop
(so the next row tile's first key tiles load during this one's last iterations) beat the generated
one-program-per-row-tile kernel on pf_global? A hand-written kernel of the same arithmetic as the
generated one, used only to decide whether the lowering should emit such loops.

    python -m bench.persistent_probe      (GPU machine; writes $OUT/persistent_probe.json)
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

import neptune_fusion as nf
from bench.common import bench, environment, rel_err, warm_up_gpu, write_results
from bench.prefill import reference_rows
from neptune_fusion.library import attention


@triton.jit
def _persistent_attention(q_ptr, k_ptr, v_ptr, o_ptr, size_q, size_k, heads, scale,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, D: tl.constexpr, PROGRAMS: tl.constexpr,
                          GROUP: tl.constexpr, FLATTEN: tl.constexpr):
    ntiles = tl.cdiv(size_q, BLOCK_R)
    scale2 = scale * 1.4426950408889634
    for tile in tl.range(tl.program_id(0), ntiles * heads, PROGRAMS, flatten=FLATTEN):
        per_group = ntiles * GROUP
        index = tile // per_group
        first = index * GROUP
        width = tl.minimum(heads - first, GROUP)
        local = tile - index * per_group
        head = first + local % width
        r0 = (ntiles - 1 - local // width) * BLOCK_R
        rows = r0 + tl.arange(0, BLOCK_R)
        offs = tl.arange(0, D)
        base = head.to(tl.int64) * size_q * D
        kv_base = head.to(tl.int64) * size_k * D
        q = tl.load(q_ptr + base + rows[:, None] * D + offs[None, :], mask=(rows < size_q)[:, None], other=0.0)
        k_desc = tl.make_tensor_descriptor(k_ptr + kv_base, shape=[size_k, D], strides=[D, 1], block_shape=[BLOCK_C, D])
        v_desc = tl.make_tensor_descriptor(v_ptr + kv_base, shape=[size_k, D], strides=[D, 1], block_shape=[BLOCK_C, D])
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        acc = tl.zeros([BLOCK_R, D], tl.float32)
        l_sum = tl.zeros([BLOCK_R], tl.float32)
        for start in range(0, size_k, BLOCK_C):
            s = tl.dot(q, tl.trans(k_desc.load([start, 0])))
            m_new = tl.maximum(m, tl.max(s, axis=1) * scale)
            alpha = tl.exp2((m - m_new) * 1.4426950408889634)
            p = tl.exp2(s * scale2 - (m_new * 1.4426950408889634)[:, None])
            acc = tl.dot(p.to(tl.float16), v_desc.load([start, 0]), acc * alpha[:, None])
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            m = m_new
        out = acc / l_sum[:, None]
        tl.store(o_ptr + base + rows[:, None] * D + offs[None, :], out.to(tl.float16), mask=(rows < size_q)[:, None])


def main() -> None:
    warm_up_gpu()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    rows_out = []
    for seq in (4096, 16384):
        torch.manual_seed(0)
        heads = 32
        q, k, v = (torch.randn(1, heads, seq, 128, device="cuda", dtype=torch.float16) for _ in range(3))
        scale = 1 / math.sqrt(128)
        pick = torch.randperm(seq, device="cuda")[:256].sort().values
        ref = reference_rows(q, k, v, scale, False, pick)
        generated = nf.compile(attention)
        row = {"seq": seq, "variants": {}}
        calls = {"generated": lambda: generated(q, k, v, scale=scale)}
        group = 4 if seq <= 4096 else 1
        # a flattened loop multi-buffers the row tile's Q load too: 3 stages of 128-wide key tiles need
        # 320 KB of shared memory (run 28's first try), so flattened variants take 2 stages or 64-wide tiles
        for name, flatten, block_c, stages in (("persistent_flat_k128_s2", True, 128, 2),
                                               ("persistent_flat_k64_s3", True, 64, 3),
                                               ("persistent_nested_k128_s3", False, 128, 3)):
            out = torch.empty_like(q)

            def call(flatten=flatten, block_c=block_c, stages=stages, out=out):
                _persistent_attention[(sms,)](q, k, v, out, seq, seq, heads, scale, BLOCK_R=128, BLOCK_C=block_c,
                                             D=128, PROGRAMS=sms, GROUP=group, FLATTEN=flatten,
                                             num_warps=8, num_stages=stages)
                return out
            calls[name] = call
        for name, call in list(calls.items()):
            try:
                row["variants"][name] = {"rel_err": rel_err(call()[:, :, pick], ref), "us_rounds": []}
            except Exception as exc:  # noqa: BLE001 - record and time the others
                print(f"{name} FAILED {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                del calls[name]
        for _ in range(3):
            for name, call in calls.items():
                row["variants"][name]["us_rounds"].append(bench(call))
        for name, r in row["variants"].items():
            r["us"] = min(r["us_rounds"])
            print(f"pf_global {seq:6d} {name:18s} {r['us']:9.1f} us err {r['rel_err']:.1e} rounds "
                  f"{[round(x, 1) for x in r['us_rounds']]}", flush=True)
        rows_out.append(row)
    print("wrote", write_results("persistent_probe", {"environment": environment(), "rows": rows_out}))


if __name__ == "__main__":
    main()
