"""The FlexAttention-compatible front end: nf.attention with score_mod / mask_mod written with torch ops.

Each variant runs the generated kernel (Triton interpreter on CPU) and is compared with
`nf.run_reference(nf.attention_program(...))` and with an explicit masked softmax in float64
built by hand from the same bias / mask (not from the mod functions).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import math  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import neptune_fusion as nf  # noqa: E402
from neptune_fusion.integrations import attention as attention_module  # noqa: E402
from neptune_fusion.ir.expr import Binary, Const, Index, Load, Where, walk  # noqa: E402
from neptune_fusion.ir.program import FusedLoop  # noqa: E402
from neptune_fusion.schedule.pipeline import fuse  # noqa: E402

# the interpreter evaluates both branches of where(l > 0, u / l, 0): 0 / 0 in rows that see no key
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:divide by zero encountered:RuntimeWarning")

DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 2e-5, torch.float16: 3e-3}
LSE_TOL = {torch.float32: 2e-5, torch.float16: 1e-2}  # lse is stored in the input dtype


def make_qkv(b: int, hq: int, lq: int, lk: int, d: int, dtype: torch.dtype, hkv: int | None = None,
             seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hkv = hkv or hq
    q = torch.randn(b, hq, lq, d, generator=gen)
    k = torch.randn(b, hkv, lk, d, generator=gen)
    v = torch.randn(b, hkv, lk, d, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def expected_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                       score_fn=None, bias: torch.Tensor | None = None,
                       mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention in float64: s = q k^T * scale; s = score_fn(s) + bias; mask -> -inf."""
    q, k, v = q.double(), k.double(), v.double()
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    if score_fn is not None:
        s = score_fn(s)
    if bias is not None:
        s = s + bias.double()
    if mask is not None:
        s = s.masked_fill(~mask.expand_as(s), -math.inf)
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - torch.where(torch.isinf(m), torch.zeros_like(m), m))
    denom = p.sum(-1, keepdim=True)
    out = torch.where(denom > 0, (p @ v) / denom, torch.zeros((), dtype=torch.float64))
    lse = torch.where(denom > 0, m + torch.log(denom), torch.full_like(m, -math.inf))[..., 0]
    return out, lse


def check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, expected: tuple[torch.Tensor, torch.Tensor],
          **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the kernel, the reference executor and compare both with `expected` (out, lse)."""
    out, lse = nf.attention(q, k, v, return_lse=True, **kwargs)
    schedule = kwargs.pop("schedule", None)
    assert out.dtype == q.dtype and out.shape == (*q.shape[:3], v.shape[-1])
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    prog = nf.attention_program(q, k, v, return_lse=True, **kwargs)
    ref_out, ref_lse = nf.run_reference(prog, nf.attention_inputs(q, k, v, return_lse=True, **kwargs))
    exp_out, exp_lse = expected
    tol = TOL[q.dtype]
    torch.testing.assert_close(out.float(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(out.double(), exp_out, atol=tol, rtol=tol)
    ltol = LSE_TOL[q.dtype]
    torch.testing.assert_close(ref_lse.double(), exp_lse, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), exp_lse, atol=ltol, rtol=ltol)
    # without return_lse: the same output
    out_only = nf.attention(q, k, v, schedule=schedule, **kwargs)
    torch.testing.assert_close(out_only, out, atol=0, rtol=0)
    return out, lse


def positions(lq: int, lk: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(lq)[:, None], torch.arange(lk)[None, :]


# --------------------------------------------------------------------------- masks


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal(dtype):
    q, k, v = make_qkv(2, 2, 64, 64, 16, dtype)
    i, j = positions(64, 64)
    check(q, k, v, expected_attention(q, k, v, mask=i >= j), mask_mod=causal)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sliding_window(dtype):
    window = 12

    def sliding_window_causal(b, h, q_idx, kv_idx):
        causal_mask = q_idx >= kv_idx
        window_mask = q_idx - kv_idx <= window
        return causal_mask & window_mask

    q, k, v = make_qkv(1, 3, 80, 80, 16, dtype)
    i, j = positions(80, 80)
    check(q, k, v, expected_attention(q, k, v, mask=(i >= j) & (i - j <= window)), mask_mod=sliding_window_causal)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefix_lm(dtype):
    from torch.nn.attention.flex_attention import or_masks

    prefix_length = 20

    def prefix_mask(b, h, q_idx, kv_idx):
        return kv_idx <= prefix_length

    q, k, v = make_qkv(1, 2, 64, 64, 32, dtype)
    i, j = positions(64, 64)
    check(q, k, v, expected_attention(q, k, v, mask=(j <= prefix_length) | (i >= j)),
          mask_mod=or_masks(prefix_mask, causal))


@pytest.mark.parametrize("dtype", DTYPES)
def test_document_mask(dtype):
    from torch.nn.attention.flex_attention import and_masks

    lengths = [10, 25, 7, 22]
    document_id = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])

    def document_mask(b, h, q_idx, kv_idx):
        return document_id[q_idx] == document_id[kv_idx]

    q, k, v = make_qkv(2, 2, 64, 64, 16, dtype)
    i, j = positions(64, 64)
    same = document_id[:, None] == document_id[None, :]
    check(q, k, v, expected_attention(q, k, v, mask=same), mask_mod=document_mask)
    check(q, k, v, expected_attention(q, k, v, mask=same & (i >= j)), mask_mod=and_masks(document_mask, causal))


@pytest.mark.parametrize("id_dtype", [torch.int8, torch.int16, torch.uint8])
def test_document_ids_in_narrow_integer_dtypes(id_dtype):
    """int8 / int16 / uint8 captured tensors are read as stored and widened to int32 (a regression:
    they passed the argument check, then failed with an unhelpful dtype error)."""
    lengths = [10, 25, 7, 22]
    document_id = torch.cat([torch.full((n,), 200 + i if id_dtype == torch.uint8 else i, dtype=id_dtype)
                             for i, n in enumerate(lengths)])

    def document_mask(b, h, q_idx, kv_idx):
        return (document_id[q_idx] == document_id[kv_idx]) & (document_id[kv_idx] * 100 + kv_idx >= 0)

    q, k, v = make_qkv(1, 2, 64, 64, 16, torch.float32)
    same = document_id[:, None] == document_id[None, :]
    check(q, k, v, expected_attention(q, k, v, mask=same), mask_mod=document_mask)


def test_document_mask_with_offsets():
    """attention-gym's doc mask: causal in each document's own positions (nested gathers)."""
    lengths = [20, 30, 14]
    document_id = torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(lengths)])
    offsets = torch.tensor([0, 20, 50])

    def doc_causal(b, h, q_idx, kv_idx):
        same_doc = document_id[q_idx] == document_id[kv_idx]
        q_logical = q_idx - offsets[document_id[q_idx]]
        kv_logical = kv_idx - offsets[document_id[kv_idx]]
        return same_doc & (q_logical >= kv_logical)

    q, k, v = make_qkv(1, 2, 64, 64, 16, torch.float32)
    i, j = positions(64, 64)
    mask = (document_id[:, None] == document_id[None, :]) & (i >= j)
    check(q, k, v, expected_attention(q, k, v, mask=mask), mask_mod=doc_causal)
    prog = nf.attention_program(q, k, v, mask_mod=doc_causal)
    assert [b.name for b in prog.inputs] == ["q", "k", "v", "cap0", "cap1"]  # each tensor captured once


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_rows(dtype):
    def late_start(b, h, q_idx, kv_idx):  # rows q < 10 see nothing; rows of head 1 see nothing
        return (q_idx >= 10) & (kv_idx <= q_idx) & (h != 1)

    q, k, v = make_qkv(1, 3, 48, 48, 16, dtype)
    i, j = positions(48, 48)
    mask = ((i >= 10) & (j <= i))[None, None] & (torch.arange(3) != 1)[None, :, None, None]
    out, lse = check(q, k, v, expected_attention(q, k, v, mask=mask), mask_mod=late_start)
    assert (out[:, :, :10] == 0).all() and (out[:, 1] == 0).all()
    assert torch.isneginf(lse[:, :, :10]).all() and torch.isneginf(lse[:, 1]).all()
    assert torch.isfinite(lse[:, 0, 10:]).all()


def test_mask_from_captured_bool_table():
    keep = torch.rand(40, 40, generator=torch.Generator().manual_seed(3)) > 0.4

    def table_mask(b, h, q_idx, kv_idx):
        return keep[q_idx, kv_idx]

    q, k, v = make_qkv(1, 2, 40, 40, 16, torch.float32)
    check(q, k, v, expected_attention(q, k, v, mask=keep), mask_mod=table_mask)


# --------------------------------------------------------------------------- score mods


@pytest.mark.parametrize("dtype", DTYPES)
def test_alibi(dtype):
    heads = 4
    slopes = torch.exp2(-8.0 * torch.arange(1, heads + 1) / heads)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    q, k, v = make_qkv(1, heads, 64, 64, 16, dtype)
    i, j = positions(64, 64)
    bias = slopes[:, None, None] * (j - i)
    check(q, k, v, expected_attention(q, k, v, bias=bias, mask=i >= j), score_mod=alibi, mask_mod=causal)


def test_alibi_attention_gym_style():
    """Slopes computed from the head index inside the mod: torch.exp2 of an integer expression."""
    heads = 4

    def alibi(score, b, h, q_idx, kv_idx):
        scale = torch.exp2(-((h + 1) * 8.0 / heads))
        return score + (q_idx - kv_idx) * scale

    q, k, v = make_qkv(1, heads, 48, 48, 16, torch.float32)
    i, j = positions(48, 48)
    slopes = torch.exp2(-(torch.arange(heads) + 1) * 8.0 / heads)
    check(q, k, v, expected_attention(q, k, v, bias=slopes[:, None, None] * (i - j)), score_mod=alibi)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softcap(dtype):
    soft_cap = 5.0  # small, so that the cap matters for these scores

    def tanh_softcap(score, b, h, q_idx, kv_idx):
        return soft_cap * torch.tanh(score / soft_cap)

    q, k, v = make_qkv(2, 2, 48, 48, 32, dtype)
    q = q * 3
    check(q, k, v, expected_attention(q, k, v, score_fn=lambda s: soft_cap * torch.tanh(s / soft_cap)),
          score_mod=tanh_softcap)


@pytest.mark.parametrize("dtype", DTYPES)
def test_relative_position_table(dtype):
    lq = lk = 48
    table = torch.randn(lq + lk, generator=torch.Generator().manual_seed(5))

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + table[q_idx - kv_idx + lk]

    q, k, v = make_qkv(1, 2, lq, lk, 16, dtype)
    i, j = positions(lq, lk)
    check(q, k, v, expected_attention(q, k, v, bias=table[i - j + lk]), score_mod=relative_bias)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_indexed_by_head_and_query(dtype):
    bias = torch.randn(3, 40, generator=torch.Generator().manual_seed(6))
    kv_bias = torch.randn(2, 56, generator=torch.Generator().manual_seed(7))

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx] + kv_bias[b, kv_idx]

    q, k, v = make_qkv(2, 3, 40, 56, 16, dtype)
    full = bias[None, :, :, None] + kv_bias[:, None, None, :]
    check(q, k, v, expected_attention(q, k, v, bias=full), score_mod=score_mod)


def test_captured_scalar_tensor_and_torch_ops():
    """0-d captured tensors, torch.where / clamp / abs / methods on symbolic values."""
    cap = torch.tensor(4.0)

    def score_mod(score, b, h, q_idx, kv_idx):
        s = cap * torch.tanh(score / cap)
        s = torch.where(q_idx % 2 == 0, s, s.abs() * 0.5)
        return torch.clamp(s, min=-1.5) - 0.01 * (q_idx - kv_idx).abs().float()

    q, k, v = make_qkv(1, 2, 32, 32, 16, torch.float32)
    i, j = positions(32, 32)

    def score_fn(s):
        s = 4.0 * torch.tanh(s / 4.0)
        s = torch.where(i % 2 == 0, s, s.abs() * 0.5)
        return torch.clamp(s, min=-1.5) - 0.01 * (i - j).abs()

    check(q, k, v, expected_attention(q, k, v, score_fn=score_fn), score_mod=score_mod)


def test_trunc_division_with_a_python_number_divisor():
    """torch.div(x, 4, rounding_mode="trunc") (a regression: the sign test built an op on two Python
    numbers and crashed). The same function run on torch tensors gives the expectation."""

    def blocks(b, h, q_idx, kv_idx):
        same_block = torch.div(q_idx, 4, rounding_mode="trunc") == torch.div(kv_idx, 4, rounding_mode="trunc")
        return same_block | (torch.div(q_idx - kv_idx, -3, rounding_mode="trunc") == 0)

    q, k, v = make_qkv(1, 2, 32, 32, 16, torch.float32)
    i, j = positions(32, 32)
    check(q, k, v, expected_attention(q, k, v, mask=blocks(None, None, i, j)), mask_mod=blocks)


def test_sign_of_scores_and_of_index_differences():
    """torch.sign (a regression: -1 was built as an op on two Python numbers and crashed)."""

    def signs(score, b, h, q_idx, kv_idx):
        return score + torch.sign(score) + 0.1 * torch.sign(q_idx - kv_idx)

    q, k, v = make_qkv(1, 2, 32, 32, 16, torch.float32)
    i, j = positions(32, 32)
    check(q, k, v, expected_attention(q, k, v, score_fn=lambda s: signs(s, None, None, i, j)), score_mod=signs)


def test_float_floor_division_of_scores():
    """score // 0.5 (a regression: Triton's // on floats failed inside the kernel)."""

    def quantised(score, b, h, q_idx, kv_idx):
        return (score // 0.5) * 0.5

    q, k, v = make_qkv(1, 2, 32, 32, 16, torch.float32)
    check(q, k, v, expected_attention(q, k, v, score_fn=lambda s: torch.floor_divide(s, 0.5) * 0.5), score_mod=quantised)


# --------------------------------------------------------------------------- GQA, shapes, schedules


@pytest.mark.parametrize("dtype", DTYPES)
def test_window_softcap_gqa(dtype):
    window, soft_cap = 16, 5.0

    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)

    def tanh_softcap(score, b, h, q_idx, kv_idx):
        return soft_cap * torch.tanh(score / soft_cap)

    q, k, v = make_qkv(1, 4, 64, 64, 16, dtype, hkv=2)
    q = q * 2
    i, j = positions(64, 64)
    expected = expected_attention(q, k, v, score_fn=lambda s: soft_cap * torch.tanh(s / soft_cap),
                                  mask=(i >= j) & (i - j <= window))
    check(q, k, v, expected, score_mod=tanh_softcap, mask_mod=sliding_window, enable_gqa=True)


def test_integer_and_float_constants_of_equal_value_stay_apart():
    """GQA 6/2 divides the head by the int 3, softcap 3 divides scores by the float 3.0: equal in
    Python, different in a kernel (a regression: one memoised constant served both, and the integer
    division ran on float32)."""

    def softcap_3(score, b, h, q_idx, kv_idx):
        return 3.0 * torch.tanh(score / 3.0) + ((q_idx - kv_idx) // 3) * 0.1

    q, k, v = make_qkv(1, 6, 16, 16, 16, torch.float32, hkv=2)
    i, j = positions(16, 16)
    expected = expected_attention(q, k, v, score_fn=lambda s: 3.0 * torch.tanh(s / 3.0) + ((i - j) // 3) * 0.1)
    check(q, k, v, expected, score_mod=softcap_3, enable_gqa=True)
    assert Const(3) != Const(3.0) and Const(1) != Const(True) and Const(3) == Const(3)


def test_captured_cpu_scalar_is_copied_to_the_inputs_device_once_per_version():
    """A 0-d CPU tensor captured with inputs on another device (here `meta`, standing in for CUDA)
    is copied there per call site version: the same copy while it is unchanged, a new one after an
    in-place update (a regression: the copy made at the first trace was passed forever)."""
    q = torch.empty(1, 2, 16, 16, device="meta")
    cap = torch.tensor(1.0)

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    first = nf.attention_inputs(q, q, q, score_mod=softcap)
    (name,) = [n for n in first if n.startswith("cap")]
    assert first[name].device.type == "meta"
    assert nf.attention_inputs(q, q, q, score_mod=softcap)[name] is first[name]
    cap.fill_(20.0)
    updated = nf.attention_inputs(q, q, q, score_mod=softcap)[name]
    assert updated is not first[name] and updated.device.type == "meta"
    assert attention_module.scalar_on_device(cap, q.device) is updated


def test_gqa_program_reads_kv_head_h_div_group():
    q, k, v = make_qkv(1, 4, 16, 16, 16, torch.float32, hkv=1)
    prog = nf.attention_program(q, k, v, mask_mod=causal, enable_gqa=True)
    loads = [n for st in prog.all_stages() for n in walk(st.body) if isinstance(n, Load) and n.buffer in ("k", "v")]
    assert loads and all(n.index[1] == Binary("floordiv", Index("h"), Const(4)) for n in loads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_query_and_key_lengths_differ(dtype):
    lq, lk = 24, 72

    def bottom_right_causal(b, h, q_idx, kv_idx):
        return q_idx + (lk - lq) >= kv_idx

    q, k, v = make_qkv(2, 2, lq, lk, 16, dtype)
    i, j = positions(lq, lk)
    check(q, k, v, expected_attention(q, k, v, mask=i + (lk - lq) >= j), mask_mod=bottom_right_causal)
    check(q, k, v, expected_attention(q, k, v, scale=0.3), scale=0.3)


def test_decode_split_k_with_gqa_and_alibi():
    slopes = torch.rand(4, generator=torch.Generator().manual_seed(8))

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - 127)

    q, k, v = make_qkv(1, 4, 1, 128, 16, torch.float32, hkv=2)
    j = torch.arange(128)
    expected = expected_attention(q, k, v, bias=slopes[:, None, None] * (j - 127))
    for schedule in (None, nf.split_k(4)):
        check(q, k, v, expected, score_mod=alibi, enable_gqa=True, schedule=schedule)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_split_k_over_a_block_map(dtype):
    """Data-dependent masks in decode: each split visits its share of the tiles the block map lists;
    a sequence of length 0 gives 0 and an lse of -inf."""
    attention_module.clear_cache()
    lengths = torch.tensor([150, 0, 300])

    def by_length(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]

    q, k, v = make_qkv(3, 4, 1, 300, 16, dtype, hkv=2)
    mask = (torch.arange(300)[None, :] < lengths[:, None])[:, None, None, :]
    for schedule in (nf.split_k(3), nf.split_k(5, block_k=16)):
        check(q, k, v, expected_attention(q, k, v, mask=mask), mask_mod=by_length, enable_gqa=True,
              schedule=schedule)


def test_decode_with_a_data_dependent_mask_chooses_split_k():
    """Few programs and a long key axis: the automatic plan splits it even when a block map lists the tiles."""
    doc = torch.tensor([0] * 100 + [1] * 200 + [2] * 100)

    def same_doc_as_last(b, h, q_idx, kv_idx):
        return doc[kv_idx] == doc[q_idx + 399]

    q, k, v = make_qkv(1, 1, 1, 400, 16, torch.float32)
    check(q, k, v, expected_attention(q, k, v, mask=(doc == 2)[None, None, None, :]), mask_mod=same_doc_as_last)
    compiled = next(iter(attention_module._compiled.values()))
    named = dict(nf.attention_inputs(q, k, v, mask_mod=same_doc_as_last))
    exe = compiled.executable_for(nf.attention_program(q, k, v, mask_mod=same_doc_as_last), named)
    assert exe.plan.splits > 1 and exe.masks is not None


@pytest.mark.parametrize("penalty", [-5.0, 3.0, 0.0])
def test_soft_penalty_written_with_where_is_not_a_mask(penalty):
    """score + where(cond, 0, c) with a finite c moves scores; no tile may be skipped for it
    (a regression: the masked value used to be taken as -inf)."""

    def soft(score, b, h, q_idx, kv_idx):
        return score + torch.where(q_idx >= kv_idx, 0.0, penalty)

    q, k, v = make_qkv(1, 2, 100, 100, 16, torch.float32)
    i, j = positions(100, 100)
    bias = torch.where(i >= j, 0.0, penalty).double()
    for schedule in (None, nf.flash(block_q=16, block_k=16)):
        check(q, k, v, expected_attention(q, k, v, bias=bias), score_mod=soft, schedule=schedule)


def test_head_dim_of_value_differs():
    gen = torch.Generator().manual_seed(9)
    q, k = torch.randn(1, 2, 32, 16, generator=gen), torch.randn(1, 2, 40, 16, generator=gen)
    v = torch.randn(1, 2, 40, 32, generator=gen)
    i, j = positions(32, 40)
    check(q, k, v, expected_attention(q, k, v, mask=j <= i + 8), mask_mod=lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + 8)


def test_empty_key_sequence():
    q = torch.randn(1, 2, 8, 16)
    k = v = torch.randn(1, 2, 0, 16)
    out, lse = nf.attention(q, k, v, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_matches_torch_flex_attention_when_available():
    heads = 2
    slopes = torch.tensor([0.5, 0.25])

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    q, k, v = make_qkv(1, heads, 32, 32, 16, torch.float32)
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            block_mask = create_block_mask(causal, 1, heads, 32, 32, device="cpu")
            expected = flex_attention(q, k, v, score_mod=alibi, block_mask=block_mask)
    except Exception as exc:  # noqa: BLE001 - flex_attention's CPU support varies between torch versions
        pytest.skip(f"torch flex_attention does not run here: {exc}")
    out = nf.attention(q, k, v, score_mod=alibi, mask_mod=block_mask)  # a BlockMask is accepted too
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


# --------------------------------------------------------------------------- the traced program


def test_causal_condition_is_structural_and_fuses():
    q, k, v = make_qkv(1, 2, 32, 32, 16, torch.float32)
    prog = nf.attention_program(q, k, v, mask_mod=causal)
    conds = [n.cond for st in prog.all_stages() for n in walk(st.body) if isinstance(n, Where)]
    assert Binary("ge", Index("q"), Index("k")) in conds
    fused = fuse(prog)[-1].program
    loops = [n for n in fused.stages if isinstance(n, FusedLoop)]
    assert len(loops) == 1 and loops[0].axis == "k"
    assert all(loops[0].repairs[m.name] is not None for m in loops[0].members if loops[0].producers.get(m.name))


def test_and_masks_constant_is_simplified_away():
    from torch.nn.attention.flex_attention import and_masks

    q, k, v = make_qkv(1, 2, 16, 16, 16, torch.float32)
    prog = nf.attention_program(q, k, v, mask_mod=and_masks(causal))
    conds = [n.cond for st in prog.all_stages() for n in walk(st.body) if isinstance(n, Where)]
    assert Binary("ge", Index("q"), Index("k")) in conds
    from torch.nn.attention.flex_attention import noop_mask

    prog = nf.attention_program(q, k, v, mask_mod=noop_mask)  # new_ones(size=(), dtype=torch.bool, ...)
    masks = [n for st in prog.all_stages() for n in walk(st.body) if isinstance(n, Where) and n.b == Const(-math.inf)]
    assert not masks


def test_explain_attention():
    q, k, v = make_qkv(1, 2, 32, 32, 16, torch.float32)
    text = nf.explain_attention(q, k, v, mask_mod=causal)
    assert "rolling" in text and "@triton.jit" in text


# --------------------------------------------------------------------------- caching


def test_repeated_calls_reuse_the_compiled_kernel():
    q, k, v = make_qkv(1, 2, 32, 32, 16, torch.float32)
    nf.attention(q, k, v, mask_mod=causal)
    n_compiled, n_programs = len(attention_module._compiled), len(attention_module._programs)
    for _ in range(3):
        nf.attention(q, k, v, mask_mod=causal)
    assert len(attention_module._compiled) == n_compiled and len(attention_module._programs) == n_programs


WINDOW = 4
BIAS = torch.zeros(32)


def window_mask(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)


def global_bias(score, b, h, q_idx, kv_idx):
    return score + BIAS[kv_idx]


def test_rebound_globals_are_seen():
    global WINDOW, BIAS
    q, k, v = make_qkv(1, 2, 32, 32, 16, torch.float32)
    i, j = positions(32, 32)
    old_window, old_bias = WINDOW, BIAS
    try:
        for window in (4, 9):
            WINDOW = window
            expected = expected_attention(q, k, v, mask=(i >= j) & (i - j <= window))[0]
            torch.testing.assert_close(nf.attention(q, k, v, mask_mod=window_mask).double(), expected,
                                       atol=2e-5, rtol=2e-5)
        for seed in (1, 2):
            BIAS = torch.randn(32, generator=torch.Generator().manual_seed(seed))
            expected = expected_attention(q, k, v, bias=BIAS)[0]
            torch.testing.assert_close(nf.attention(q, k, v, score_mod=global_bias).double(), expected,
                                       atol=2e-5, rtol=2e-5)
        BIAS.mul_(3)  # in-place updates are seen: captured tensors are passed on every call
        expected = expected_attention(q, k, v, bias=BIAS)[0]
        torch.testing.assert_close(nf.attention(q, k, v, score_mod=global_bias).double(), expected,
                                   atol=2e-5, rtol=2e-5)
    finally:
        WINDOW, BIAS = old_window, old_bias


def test_closures_from_one_factory_share_the_kernel():
    def make_bias_mod(bias):
        def bias_mod(score, b, h, q_idx, kv_idx):
            return score + bias[q_idx] * 2
        return bias_mod

    q, k, v = make_qkv(1, 2, 32, 32, 16, torch.float32)
    n_compiled = None
    for seed in range(3):
        bias = torch.randn(32, generator=torch.Generator().manual_seed(seed))
        out = nf.attention(q, k, v, score_mod=make_bias_mod(bias))
        torch.testing.assert_close(out.double(), expected_attention(q, k, v, bias=2 * bias[:, None])[0],
                                   atol=2e-5, rtol=2e-5)
        if n_compiled is None:
            n_compiled = len(attention_module._compiled)
    assert len(attention_module._compiled) == n_compiled


# --------------------------------------------------------------------------- errors


def test_gqa_errors():
    q, k, v = make_qkv(1, 4, 16, 16, 16, torch.float32, hkv=2)
    with pytest.raises(ValueError, match="enable_gqa"):
        nf.attention(q, k, v)
    q3, k3, v3 = make_qkv(1, 4, 16, 16, 16, torch.float32, hkv=3)
    with pytest.raises(ValueError, match="multiple"):
        nf.attention(q3, k3, v3, enable_gqa=True)


@pytest.mark.parametrize("case", [
    "rank", "dtype_mismatch", "float64", "int", "head_dim", "kv_len", "kv_heads", "batch", "not_tensor",
    "scale_type", "scale_inf", "score_mod_type", "mask_mod_type",
])
def test_bad_inputs(case):
    q, k, v = make_qkv(1, 2, 16, 16, 16, torch.float32)
    kwargs = {}
    error: type[Exception] = ValueError
    if case == "rank":
        v = v[0]
    elif case == "dtype_mismatch":
        k, error = k.half(), TypeError
    elif case == "float64":
        q, k, v, error = q.double(), k.double(), v.double(), TypeError
    elif case == "int":
        q, k, v, error = q.long(), k.long(), v.long(), TypeError
    elif case == "head_dim":
        k = torch.randn(1, 2, 16, 8)
    elif case == "kv_len":
        v = torch.randn(1, 2, 15, 16)
    elif case == "kv_heads":
        v = torch.randn(1, 1, 16, 16)
    elif case == "batch":
        k, v = torch.randn(2, 2, 16, 16), torch.randn(2, 2, 16, 16)
    elif case == "not_tensor":
        k, error = k.tolist(), TypeError
    elif case == "scale_type":
        kwargs, error = {"scale": "0.1"}, TypeError
    elif case == "scale_inf":
        kwargs = {"scale": math.inf}
    elif case == "score_mod_type":
        kwargs, error = {"score_mod": 3}, TypeError
    elif case == "mask_mod_type":
        kwargs, error = {"mask_mod": "causal"}, TypeError
    with pytest.raises(error):
        nf.attention(q, k, v, **kwargs)


def test_unsupported_torch_operations_are_named():
    q, k, v = make_qkv(1, 2, 16, 16, 16, torch.float32)

    def sorting(score, b, h, q_idx, kv_idx):
        return torch.sort(score)[0]

    def cumsum_method(score, b, h, q_idx, kv_idx):
        return score.cumsum(0)

    def in_place(score, b, h, q_idx, kv_idx):
        return score.add_(1)

    def python_if(score, b, h, q_idx, kv_idx):
        return score if q_idx > kv_idx else -score

    def unindexed_tensor(score, b, h, q_idx, kv_idx):
        return score + torch.ones(16)

    def int_mask(b, h, q_idx, kv_idx):
        return q_idx - kv_idx

    with pytest.raises(TypeError, match=r"torch\.sort is not supported on symbolic tensors \(inside nf\.program, score_mod or mask_mod\)"):
        nf.attention(q, k, v, score_mod=sorting)
    with pytest.raises(TypeError, match=r"torch\.Tensor\.cumsum is not supported"):
        nf.attention(q, k, v, score_mod=cumsum_method)
    with pytest.raises(TypeError, match="in-place"):
        nf.attention(q, k, v, score_mod=in_place)
    with pytest.raises(TypeError, match="truth value"):
        nf.attention(q, k, v, score_mod=python_if)
    with pytest.raises(TypeError, match="index it"):
        nf.attention(q, k, v, score_mod=unindexed_tensor)
    with pytest.raises(TypeError, match="boolean"):
        nf.attention(q, k, v, mask_mod=int_mask)


# --------------------------------------------------------------------------- lang: gathers and repeat_interleave


def test_gather_from_program_input_and_repeat_interleave():
    @nf.program
    def doc_gqa_scores(q, k, doc):
        kk = nf.repeat_interleave(k, 2, axis=1)
        s = nf.einsum("bhqd,bhkd->bhqk", q, kk)
        same = doc[nf.index(s, -2)] == doc[nf.index(s, -1)]
        return nf.where(same, s, 0.0).sum(axis=-1)

    gen = torch.Generator().manual_seed(10)
    q, k = torch.randn(1, 4, 12, 8, generator=gen), torch.randn(1, 2, 12, 8, generator=gen)
    doc = torch.tensor([0] * 5 + [1] * 7)
    out = doc_gqa_scores(q, k, doc)
    s = q @ k.repeat_interleave(2, 1).transpose(-1, -2)
    expected = torch.where(doc[:, None] == doc[None, :], s, 0.0).sum(-1)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_repeat_interleave_needs_a_sized_dimension():
    @nf.program
    def repeated(x):
        return nf.exp(nf.repeat_interleave(x, 3, axis=0)).sum(axis=-1)

    with pytest.raises(ValueError, match="size"):
        repeated.trace(torch.randn(2, 5))


def test_sparse_and_meta_inputs_are_clear_errors():
    """Tensors without data to read (sparse, meta) are refused by name before any launch (they
    reached Triton's interpreter or `data_ptr` before)."""
    q = torch.randn(1, 2, 8, 16)
    prog = nf.compile(nf.program(lambda x: x.sum(axis=-1)))
    with pytest.raises(TypeError, match="query is a torch.sparse_coo tensor"):
        nf.attention(q.to_sparse(), q, q)
    with pytest.raises(TypeError, match="'x' is a torch.sparse_coo tensor"):
        prog(torch.randn(3, 4).to_sparse())
    with pytest.raises(ValueError, match="meta tensors"):
        nf.attention(*(q.to("meta"),) * 3)
    with pytest.raises(ValueError, match="meta tensors"):
        prog(torch.randn(3, 4, device="meta"))
