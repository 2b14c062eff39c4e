# ruff: noqa: N803, N806, B023 - Gluon constexpr names; every closure is timed right where it is made
"""Probe (run 29): how fast is a warp-specialised FlashAttention loop on the H200 when written in Gluon
(Triton 3.6's explicit-layout dialect: producer warp with TMA into a ring of key/value buffers, two
consumer warpgroups of 64 rows each that run independently, no CTA-wide barriers in the loop)? A
hand-written kernel, used only to decide whether neptune_fusion should grow a Gluon backend for
its tile programs. Global attention, fp16, head dim 128, sequence a multiple of 128.

    python -m bench.gluon_probe      (GPU machine; writes $OUT/gluon_probe.json)
"""

from __future__ import annotations

import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

LOG2E = 1.4426950408889634


@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, free_bars, q_row, kv_row,
                    n_tiles, NUM_BUF: gl.constexpr, BN: gl.constexpr, HALF: gl.constexpr):
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [q_row + HALF, 0], q_bar, q_smem.index(1))
    for j in range(n_tiles):
        slot = j % NUM_BUF
        phase = (j // NUM_BUF) & 1
        mbarrier.wait(free_bars.index(slot), phase ^ 1)
        mbarrier.expect(k_bars.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row + j * BN, 0], k_bars.index(slot), k_smem.index(slot))
        mbarrier.expect(v_bars.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [kv_row + j * BN, 0], v_bars.index(slot), v_smem.index(slot))


@gluon.jit
def _softmax_partition(q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, free_bars, o_ptr, o_row, n_tiles, scale,
                       NUM_BUF: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, HALF: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    scale2 = scale * 1.4426950408889634
    m_i = gl.full([HALF], float("-inf"), gl.float32, row_s)
    l_i = gl.full([HALF], 0.0, gl.float32, row_s)
    acc = gl.zeros([HALF, D], gl.float32, o_layout)
    zero_s = gl.zeros([HALF, BN], gl.float32, s_layout)
    mbarrier.wait(q_bar, 0)
    for j in range(n_tiles):
        slot = j % NUM_BUF
        phase = (j // NUM_BUF) & 1
        mbarrier.wait(k_bars.index(slot), phase)
        s = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s, ))
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale)
        alpha = gl.exp2((m_i - m_new) * 1.4426950408889634)
        p = gl.exp2(s * scale2 - gl.expand_dims(m_new * 1.4426950408889634, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        p16 = gl.convert_layout(p.to(gl.float16), p_layout)
        mbarrier.wait(v_bars.index(slot), phase)
        acc = warpgroup_mma(p16, v_smem.index(slot), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(free_bars.index(slot), count=1)
        m_i = m_new
    out = acc / gl.expand_dims(gl.convert_layout(l_i, row_o), 1)
    rows = o_row + gl.arange(0, HALF, layout=row_o)
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    ptrs = o_ptr + gl.expand_dims(rows.to(gl.int64) * D, 1) + gl.expand_dims(cols, 0)
    gl.store(ptrs, out.to(gl.float16))


@gluon.jit
def _attention_kernel(q_desc, k_desc, v_desc, o_ptr, seq, scale, NUM_BUF: gl.constexpr, BN: gl.constexpr,
                      D: gl.constexpr, HALF: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    pid_m = gl.program_id(0)
    bh = gl.program_id(1)
    q_row = bh * seq + pid_m * (2 * HALF)
    kv_row = bh * seq
    n_tiles = seq // BN
    q_smem = gl.allocate_shared_memory(gl.float16, [2, HALF, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(gl.float16, [NUM_BUF, BN, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.float16, [NUM_BUF, BN, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    free_bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
        mbarrier.init(free_bars.index(i), count=2)
    gl.warp_specialize([
        (_softmax_partition, (q_smem.index(0), k_smem, v_smem, q_bar, k_bars, v_bars, free_bars, o_ptr, q_row, n_tiles,
                              scale, NUM_BUF, BN, D, HALF)),
        (_softmax_partition, (q_smem.index(1), k_smem, v_smem, q_bar, k_bars, v_bars, free_bars, o_ptr, q_row + HALF,
                              n_tiles, scale, NUM_BUF, BN, D, HALF)),
        (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_bars, v_bars, free_bars, q_row,
                           kv_row, n_tiles, NUM_BUF, BN, HALF)),
    ], [4, 1], [CONSUMER_REGS, 24])


def gluon_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, num_buf: int = 2,
                    block_n: int = 128, consumer_regs: int = 232) -> torch.Tensor:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    b, h, s, d = q.shape
    assert s % 128 == 0 and d == 128 and q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    out = torch.empty_like(q)
    q2, k2, v2 = (x.view(b * h * s, d) for x in (q, k, v))
    half = 64
    q_layout = gl.NVMMASharedLayout.get_default_for([half, d], gl.float16)
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, d], gl.float16)
    q_desc = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [half, d], q_layout)
    k_desc = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [block_n, d], kv_layout)
    v_desc = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [block_n, d], kv_layout)
    grid = (s // 128, b * h)
    _attention_kernel[grid](q_desc, k_desc, v_desc, out, s, scale, NUM_BUF=num_buf, BN=block_n, D=d, HALF=half,
                            CONSUMER_REGS=consumer_regs, num_warps=4)
    return out


def main() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import neptune_fusion as nf
    from bench.common import bench, environment, rel_err, warm_up_gpu, write_results
    from bench.prefill import reference_rows
    from neptune_fusion.library import attention

    warm_up_gpu()
    rows_out = []
    for seq in (4096, 16384):
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 32, seq, 128, device="cuda", dtype=torch.float16) for _ in range(3))
        scale = 1 / math.sqrt(128)
        pick = torch.randperm(seq, device="cuda")[:256].sort().values
        ref = reference_rows(q, k, v, scale, False, pick)
        generated = nf.compile(attention)

        def cudnn() -> torch.Tensor:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
        calls = {"generated": lambda: generated(q, k, v, scale=scale), "cudnn": cudnn}
        for nb in (2, 3):
            calls[f"gluon_ws_buf{nb}"] = lambda nb=nb: gluon_attention(q, k, v, scale, num_buf=nb)
        row = {"seq": seq, "variants": {}}
        for name, call in list(calls.items()):
            try:
                row["variants"][name] = {"rel_err": rel_err(call()[:, :, pick], ref), "us_rounds": []}
            except Exception as exc:  # noqa: BLE001 - record and time the others
                print(f"{name} FAILED {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                del calls[name]
        for _ in range(3):
            for name, call in calls.items():
                row["variants"][name]["us_rounds"].append(bench(call))
        for name, r in row["variants"].items():
            r["us"] = min(r["us_rounds"])
            r["tflops"] = 4 * 32 * seq * seq * 128 / (r["us"] * 1e-6) / 1e12
            print(f"pf_global {seq:6d} {name:18s} {r['us']:9.1f} us {r['tflops']:5.0f} TF/s err {r['rel_err']:.1e} "
                  f"rounds {[round(x, 1) for x in r['us_rounds']]}", flush=True)
        rows_out.append(row)
    print("wrote", write_results("gluon_probe", {"environment": environment(), "rows": rows_out}))


if __name__ == "__main__":
    main()
