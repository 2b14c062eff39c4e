# ruff: noqa: B023 - every closure is used right where it is made
"""The Gluon backend on the GPU: every case correct against fp32 under both backends, and the
backend the runtime picks by itself; then prefill timings of both backends side by side.

    python -m bench.gluon_check      (GPU machine; writes $OUT/gluon_check.json)
"""

from __future__ import annotations

import math
import os

import torch

import neptune_fusion as nf
from bench.common import bench, environment, rel_err, warm_up_gpu, write_results
from neptune_fusion.integrations.attention import clear_cache
from neptune_fusion.runtime.compiled import Compiled


def reference(q, k, v, score_mod, mask_mod, scale):
    """fp32 attention with the mods applied elementwise; rows with no visible key give 0 and LSE -inf."""
    hq, hkv = q.shape[1], k.shape[1]
    kf, vf = k.float().repeat_interleave(hq // hkv, 1), v.float().repeat_interleave(hq // hkv, 1)
    s = torch.einsum("bhqd,bhkd->bhqk", q.float(), kf) * scale
    b = torch.arange(q.shape[0], device=q.device)[:, None, None, None]
    h = torch.arange(hq, device=q.device)[None, :, None, None]
    qi = torch.arange(q.shape[2], device=q.device)[None, None, :, None]
    ki = torch.arange(k.shape[2], device=q.device)[None, None, None, :]
    if score_mod is not None:
        s = score_mod(s, b, h, qi, ki)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(b, h, qi, ki), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, -1).nan_to_num(0.0), vf), lse


def cases():
    dev = "cuda"
    slopes = torch.exp2(-8.0 * torch.arange(1, 9, device=dev) / 8)
    table = torch.randn(4096, device=dev)
    lengths = torch.tensor([700, 333], device=dev)
    yield "global", dict(hq=4, hkv=4, sq=1000, sk=1000), None, None
    yield "causal_777", dict(hq=4, hkv=4, sq=777, sk=777), None, lambda b, h, qi, ki: qi >= ki
    yield "causal_bf16", dict(hq=4, hkv=4, sq=1024, sk=1024, dtype=torch.bfloat16), None, lambda b, h, qi, ki: qi >= ki
    yield "alibi_causal", dict(hq=8, hkv=8, sq=900, sk=900), (lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi)), \
        (lambda b, h, qi, ki: qi >= ki)
    yield "softcap_window_gqa", dict(hq=8, hkv=2, sq=600, sk=900), (lambda s, b, h, qi, ki: 30 * torch.tanh(s / 30)), \
        (lambda b, h, qi, ki: (qi >= ki) & (qi - ki < 100))
    yield "prefix_lm", dict(hq=4, hkv=4, sq=1000, sk=1000), None, lambda b, h, qi, ki: (ki < 300) | (qi >= ki)
    yield "rel_bias_table", dict(hq=4, hkv=4, sq=640, sk=640), (lambda s, b, h, qi, ki: s + table[qi - ki + 2000]), None
    yield "head_dim_64", dict(hq=4, hkv=4, sq=512, sk=700, d=64), None, lambda b, h, qi, ki: qi >= ki
    yield "masked_rows_lse", dict(hq=4, hkv=4, sq=512, sk=512, lse=True), None, lambda b, h, qi, ki: qi >= ki + 50
    yield "sink_window", dict(hq=4, hkv=4, sq=1024, sk=1024), None, \
        lambda b, h, qi, ki: (ki < 4) | ((qi >= ki) & (qi - ki < 256))
    yield "batch_lengths_blockmap", dict(b=2, hq=4, hkv=4, sq=512, sk=700), None, lambda b, h, qi, ki: ki < lengths[b]
    doc = torch.repeat_interleave(torch.arange(12, device=dev), 100)[:1100]
    yield "document_blockmap", dict(hq=4, hkv=4, sq=1100, sk=1100), None, \
        lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (qi >= ki)
    yield "document_gqa_softcap", dict(hq=8, hkv=2, sq=1100, sk=1100), (lambda s, b, h, qi, ki: 20 * torch.tanh(s / 20)), \
        lambda b, h, qi, ki: doc[qi] == doc[ki]
    yield "short_query", dict(hq=4, hkv=4, sq=40, sk=1000), None, None


def check(name, shape, score_mod, mask_mod) -> dict:
    torch.manual_seed(0)
    b, hq, hkv, sq, sk = shape.get("b", 1), shape["hq"], shape["hkv"], shape["sq"], shape["sk"]
    d, dtype, lse = shape.get("d", 128), shape.get("dtype", torch.float16), shape.get("lse", False)
    q = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype) for _ in range(2))
    scale = 1 / math.sqrt(d)
    ref, ref_lse = reference(q, k, v, score_mod, mask_mod, scale)
    # the rolling (prefill) template even where few programs would make the automatic plan split-K
    kw = dict(score_mod=score_mod, mask_mod=mask_mod, enable_gqa=hq != hkv)
    prog = nf.attention_program(q, k, v, **kw, return_lse=lse)
    exe = Compiled(lambda: None, nf.flash()).executable_for(prog, nf.attention_inputs(q, k, v, **kw, return_lse=lse))
    row = {"case": name, "auto_backend": exe.main.backend, "errors": {}}
    for backend in ("auto", "triton"):
        os.environ["NEPTUNE_FUSION_BACKEND"] = backend
        clear_cache()
        try:
            out = nf.attention(q, k, v, **kw, return_lse=lse, schedule=nf.flash())
            torch.cuda.synchronize()
            err = rel_err(out[0] if lse else out, ref)
            if lse:
                o_lse = out[1].float()
                finite = torch.isfinite(ref_lse)
                same_inf = bool((torch.isinf(o_lse) == ~finite).all())
                err = max(err, rel_err(o_lse[finite], ref_lse[finite])) if same_inf else float("inf")
            row["errors"][backend] = err
        except Exception as exc:  # noqa: BLE001 - record and go on
            row["errors"][backend] = f"{type(exc).__name__}: {str(exc)[:300]}"
    os.environ["NEPTUNE_FUSION_BACKEND"] = "auto"
    clear_cache()
    limit = 1e-2 if dtype == torch.bfloat16 else 2e-3
    row["ok"] = all(isinstance(e, float) and e < limit for e in row["errors"].values())
    print(f"{name:24s} auto={row['auto_backend']:6s} ok={row['ok']} {row['errors']}", flush=True)
    return row


def timings() -> list[dict]:
    from neptune_fusion.library import attention, causal_attention

    rows = []
    for op, prog in (("pf_global", attention), ("pf_causal", causal_attention)):
        for seq in (4096, 16384):
            torch.manual_seed(0)
            q, k, v = (torch.randn(1, 32, seq, 128, device="cuda", dtype=torch.float16) for _ in range(3))
            row = {"op": op, "seq": seq}
            for backend in ("auto", "triton", "auto_again"):
                os.environ["NEPTUNE_FUSION_BACKEND"] = backend.removesuffix("_again")
                fn = nf.compile(prog)
                fn(q, k, v, scale=0.088)
                row[backend] = bench(lambda: fn(q, k, v, scale=0.088))
            os.environ["NEPTUNE_FUSION_BACKEND"] = "auto"
            print(f"{op} {seq:6d} gluon {row['auto']:8.1f} / {row['auto_again']:8.1f} us  triton {row['triton']:8.1f} us",
                  flush=True)
            rows.append(row)
    return rows


def document_timings() -> list[dict]:
    """Document masks (block-mapped) at 4k / 16k: Gluon with 64- and 128-wide key tiles, Triton's
    default, FlexAttention; each checked against fp32 on sampled rows first."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from bench.flex_ops import make_case
    from bench.flex_ops import reference_rows as flex_reference

    rows = []
    for seq in (4096, 16384):
        torch.manual_seed(0)
        q, k, v, score_mod, mask_mod, gqa = make_case("pf_document", seq)
        pick = torch.randperm(seq, device="cuda")[:128].sort().values
        ref = flex_reference(q, k, v, score_mod, mask_mod, pick, 1 / math.sqrt(128))
        flex = torch.compile(flex_attention, dynamic=False)
        block_mask = create_block_mask(mask_mod, None, None, seq, seq, device="cuda")
        row = {"seq": seq, "flex_us": bench(lambda: flex(q, k, v, block_mask=block_mask))}
        for name, backend, schedule in (("gluon_k64", "auto", None), ("gluon_k128", "auto", nf.flash(128, 128)),
                                        ("triton", "triton", None)):
            os.environ["NEPTUNE_FUSION_BACKEND"] = backend
            clear_cache()
            def call(schedule=schedule):
                return nf.attention(q, k, v, mask_mod=mask_mod, schedule=schedule)
            err = rel_err(call()[:, :, pick], ref)
            row[name] = {"us": bench(call), "rel_err": err}
        os.environ["NEPTUNE_FUSION_BACKEND"] = "auto"
        clear_cache()
        print(f"pf_document {seq:6d} " + "  ".join(f"{n} {row[n]['us']:8.1f} us ({row['flex_us'] / row[n]['us']:.2f}x Flex,"
                                                    f" err {row[n]['rel_err']:.1e})" for n in ("gluon_k64", "gluon_k128", "triton"))
              + f"  flex {row['flex_us']:8.1f}", flush=True)
        rows.append(row)
    return rows


def captured_scalar_check() -> dict:
    """A 0-d CPU tensor captured by a score_mod with CUDA inputs, updated in place between calls:
    each call must see its current value (a fuzzing find: it used to be copied once at trace time)."""
    q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.float16)
    cap = torch.tensor(1.0)

    def softcap(s, b, h, qi, ki):
        return cap * torch.tanh(s / cap)
    errors = {}
    for val in (1.0, 20.0):
        cap.fill_(val)
        out = nf.attention(q, q, q, score_mod=softcap)
        s = q.double() @ q.double().mT / 8
        ref = torch.softmax(val * torch.tanh(s / val), -1) @ q.double()
        errors[str(val)] = rel_err(out, ref)
    print(f"captured CPU scalar updated in place: {errors}", flush=True)
    return {"errors": errors, "ok": all(e < 2e-3 for e in errors.values())}


def main() -> None:
    import sys

    os.environ["NEPTUNE_FUSION_BACKEND"] = "auto"
    warm_up_gpu()
    checked = [check(*c) for c in cases()]
    captured = captured_scalar_check()
    times = [] if "--no-timings" in sys.argv else timings()
    documents = [] if "--no-documents" in sys.argv else document_timings()
    print("all correct:", all(r["ok"] for r in checked) and captured["ok"])
    print("wrote", write_results("gluon_check", {"environment": environment(), "cases": checked, "timings": times,
                                                 "documents": documents, "captured_scalar": captured}))


if __name__ == "__main__":
    main()
