"""Front end: tracing plain attention-like code into Programs, checked against torch formulas.

Every program is checked three ways: the traced Program through `nf.run_reference`, the
ProgramDef called directly, and the torch formula it is meant to compute.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F  # noqa: N812

import neptune_fusion as nf
from neptune_fusion.ir.expr import Reduce
from neptune_fusion.ir.printer import format_program
from neptune_fusion.ir.program import Program, Stage


def check(fn: nf.ProgramDef, args: dict, expected, atol: float = 1e-5, rtol: float = 1e-5) -> Program:
    """Trace `fn`, run it both ways and compare with `expected` (a tensor or tuple)."""
    prog = fn.trace(**args)
    assert isinstance(prog, Program)
    prog.validate()
    via_reference = nf.run_reference(prog, args)
    via_call = fn(**args)
    expected_t = expected if isinstance(expected, tuple) else (expected,)
    ref_t = via_reference if isinstance(via_reference, tuple) else (via_reference,)
    call_t = via_call if isinstance(via_call, tuple) else (via_call,)
    assert len(ref_t) == len(expected_t) == len(call_t)
    for r, c, e in zip(ref_t, call_t, expected_t, strict=True):
        assert r.shape == e.shape, (r.shape, e.shape)
        torch.testing.assert_close(r, e.to(r.dtype), atol=atol, rtol=rtol, equal_nan=True)
        torch.testing.assert_close(c, r, atol=0, rtol=0, equal_nan=True)
    return prog


def reduce_ops(prog: Program) -> list[tuple[str, str]]:
    return [(st.reduce_op, st.reduce_axis) for st in prog.all_stages() if st.reduce_op]


# --------------------------------------------------------------------------- attention variants


@nf.program
def attention(q, k, v, scale):
    s = nf.einsum("bhqd,bhkd->bhqk", q, k) * scale
    m = s.max(axis=-1, keepdims=True)
    p = nf.exp(s - m)
    return nf.einsum("bhqk,bhkd->bhqd", p, v) / p.sum(axis=-1, keepdims=True)


@nf.program
def causal_attention(q, k, v, scale):
    s = nf.einsum("bhqd,bhkd->bhqk", q, k) * scale
    s = nf.where(nf.index(s, -2) >= nf.index(s, -1), s, -nf.inf)
    m = s.max(axis=-1, keepdims=True)
    p = nf.exp(s - m)
    return nf.einsum("bhqk,bhkd->bhqd", p, v) / p.sum(axis=-1, keepdims=True)


@nf.program
def alibi_attention(q, k, v, slopes, scale):
    s = nf.einsum("bhqd,bhkd->bhqk", q, k) * scale
    s = s + slopes[:, None, None] * (nf.index(s, -1) - nf.index(s, -2))
    s = nf.where(nf.index(s, -2) >= nf.index(s, -1), s, -nf.inf)
    m = s.max(axis=-1, keepdims=True)
    p = nf.exp(s - m)
    return nf.einsum("bhqk,bhkd->bhqd", p, v) / p.sum(axis=-1, keepdims=True)


@nf.program
def bias_attention(q, k, v, bias):
    s = nf.einsum("bhqd,bhkd->bhqk", q, k) + bias
    p = nf.exp(s - s.max(axis=-1, keepdims=True))
    return nf.einsum("bhqk,bhkd->bhqd", p, v) / p.sum(axis=-1, keepdims=True)


@nf.program
def softcap_attention(q, k, v, scale):
    s = nf.einsum("bhqd,bhkd->bhqk", q, k) * scale
    s = 50 * nf.tanh(s / 50)
    s = nf.where(nf.index(s, -2) >= nf.index(s, -1), s, -nf.inf)
    p = nf.exp(s - s.max(axis=-1, keepdims=True))
    return nf.einsum("bhqk,bhkd->bhqd", p, v) / p.sum(axis=-1, keepdims=True)


@nf.program
def matmul_attention(q, k, v, scale):
    s = (q @ k.mT) * scale
    p = nf.exp(s - s.max(axis=-1, keepdims=True))
    return nf.matmul(p, v) / p.sum(axis=-1, keepdims=True)


@nf.program
def transpose_attention(q, kt, v):
    s = nf.matmul(q, kt)  # kt: (b, h, d, k)
    p = nf.exp(s - s.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    return nf.matmul(p, v.transpose(-1, -2).transpose(-2, -1))


def causal_mask(lq: int, lk: int) -> torch.Tensor:
    return torch.arange(lq)[:, None] >= torch.arange(lk)[None, :]


def test_global_attention_matches_sdpa(attn_inputs):
    q, k, v = attn_inputs(2, 3, 5, 7, 4, dv=6)
    scale = 0.37
    expected = F.scaled_dot_product_attention(q, k, v, scale=scale)
    prog = check(attention, dict(q=q, k=k, v=v, scale=scale), expected)
    assert prog.params == ("scale",)
    assert [b.name for b in prog.inputs] == ["q", "k", "v"]
    ops = reduce_ops(prog)
    assert ("max", "k") in ops and ("sum", "k") in ops and ("sum", "d") in ops
    # the scores (q x k) are computed once and read by the max and by the exp
    assert sum(1 for op, ax in ops if ax == "d") == 1


def test_causal_attention_matches_sdpa_with_explicit_mask(attn_inputs):
    q, k, v = attn_inputs(1, 2, 6, 6, 4)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(6, 6), scale=0.5)
    check(causal_attention, dict(q=q, k=k, v=v, scale=0.5), expected)
    # more keys than queries: rows still see key 0, so no row is fully masked
    q, k, v = attn_inputs(2, 1, 4, 9, 3)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(4, 9), scale=0.5)
    check(causal_attention, dict(q=q, k=k, v=v, scale=0.5), expected)


def test_causal_mask_traces_as_index_comparison(attn_inputs):
    q, k, v = attn_inputs(1, 1, 3, 3, 2)
    text = format_program(causal_attention.trace(q, k, v, 0.5))
    assert "q >= k" in text and "-inf" in text


def test_alibi_with_per_head_slopes(attn_inputs, randn):
    b, h, lq, lk = 2, 3, 5, 5
    q, k, v = attn_inputs(b, h, lq, lk, 4)
    slopes = randn(h).abs() + 0.1
    rel = (torch.arange(lk)[None, :] - torch.arange(lq)[:, None]).float()
    bias = slopes[:, None, None] * rel
    mask = torch.where(causal_mask(lq, lk), bias, torch.tensor(-math.inf))
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    prog = check(alibi_attention, dict(q=q, k=k, v=v, slopes=slopes, scale=0.3), expected)
    assert prog.input("slopes").dims == ("h",)


def test_additive_bias_tensor_broadcasts_over_batch_and_positions(attn_inputs, randn):
    q, k, v = attn_inputs(2, 3, 4, 6, 5)
    bias = randn(1, 3, 1, 1)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
    prog = check(bias_attention, dict(q=q, k=k, v=v, bias=bias), expected)
    assert prog.input("bias").dims[1] == "h"
    # a full (b, h, q, k) bias works the same
    bias = randn(2, 3, 4, 6)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)
    check(bias_attention, dict(q=q, k=k, v=v, bias=bias), expected)


def test_softcap_attention(attn_inputs):
    q, k, v = attn_inputs(1, 2, 5, 5, 8, scale=4.0)  # scores of tens, where tanh bends
    scale = 1.5
    s = (q @ k.mT) * scale
    s = 50 * torch.tanh(s / 50)
    assert (s.abs() > 25).any()
    s = s.masked_fill(~causal_mask(5, 5), -math.inf)
    expected = torch.softmax(s, -1) @ v
    check(softcap_attention, dict(q=q, k=k, v=v, scale=scale), expected, atol=1e-5, rtol=1e-4)


def test_matmul_with_mt_and_matmul_operator(attn_inputs):
    q, k, v = attn_inputs(2, 2, 3, 5, 4)
    expected = F.scaled_dot_product_attention(q, k, v, scale=0.25)
    check(matmul_attention, dict(q=q, k=k, v=v, scale=0.25), expected)


def test_matmul_with_transposed_operands(attn_inputs):
    q, k, v = attn_inputs(1, 2, 3, 5, 4)
    expected = F.scaled_dot_product_attention(q, k, v, scale=1.0)
    check(transpose_attention, dict(q=q, kt=k.mT.contiguous(), v=v), expected)


@nf.program
def bmm(a, b):
    return nf.matmul(a, b)


@pytest.mark.parametrize(("sa", "sb"), [((1, 3, 4), (2, 4, 5)), ((2, 3, 4), (1, 4, 5)), ((3, 4), (2, 4, 5)),
                                        ((2, 3, 4), (4, 5))])
def test_matmul_broadcasts_batch_dims(randn, sa, sb):
    a, b = randn(*sa), randn(*sb)
    check(bmm, dict(a=a, b=b), a @ b)


@nf.program
def einsum_broadcast(a, b):
    return nf.einsum("bij,bjk->bik", a, b)


def test_einsum_broadcasts_size_one_dims_of_earlier_operands(randn):
    a, b = randn(1, 3, 4), randn(2, 4, 5)
    prog = check(einsum_broadcast, dict(a=a, b=b), a @ b)
    assert "a[0, " in format_program(prog)


# --------------------------------------------------------------------------- softmax, logsumexp, keepdims


@nf.program
def softmax(x):
    e = nf.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@nf.program
def softmax_nokeep(x):
    e = nf.exp(x - x.max(axis=-1)[..., None])
    return e / nf.sum(e, axis=-1)[..., None]


@nf.program
def softmax_dim0(x):
    e = nf.exp(x - nf.max(x, axis=0, keepdims=True))
    return e / nf.sum(e, axis=0, keepdims=True)


@nf.program
def logsumexp(x):
    m = x.max(axis=-1, keepdims=True)
    return (m + nf.log(nf.exp(x - m).sum(axis=-1, keepdims=True)))[..., 0]


@nf.program
def logsumexp_nokeep(x):
    m = x.max(axis=-1)
    return m + nf.log(nf.exp(x - m[..., None]).sum(-1))


@nf.program
def logsumexp_keep(x):
    m = x.max(axis=-1, keepdims=True)
    return m + nf.log(nf.exp(x - m).sum(axis=-1, keepdims=True))


def test_softmax(randn):
    x = randn(3, 4, 7, scale=3.0)
    check(softmax, dict(x=x), torch.softmax(x, -1))
    check(softmax_nokeep, dict(x=x), torch.softmax(x, -1))
    check(softmax_dim0, dict(x=x), torch.softmax(x, 0))


def test_logsumexp_keepdims_true_and_false(randn):
    x = randn(4, 9, scale=5.0)
    check(logsumexp, dict(x=x), torch.logsumexp(x, -1))
    check(logsumexp_nokeep, dict(x=x), torch.logsumexp(x, -1))
    prog = check(logsumexp_keep, dict(x=x), torch.logsumexp(x, -1, keepdim=True))
    assert prog.outputs[0].dims[-1] is None


@nf.program
def reductions(x):
    return x.sum(-1), x.max(0), x.min(axis=1, keepdims=True), nf.min(x, axis=0)


def test_reductions_and_multiple_outputs(randn):
    x = randn(4, 6)
    expected = (x.sum(-1), x.amax(0), x.amin(1, keepdim=True), x.amin(0))
    prog = check(reductions, dict(x=x), expected)
    assert len(prog.outputs) == 4


@nf.program
def elementwise_zoo(x, y, n):
    a = nf.exp2(x) + nf.log2(nf.abs_(y)) + nf.sigmoid(x) * nf.sqrt(abs(y)) - nf.rsqrt(y * y)
    b = nf.sin(x) * nf.cos(y) + nf.maximum(x, y) - nf.minimum(x, 0.5) + x ** 2 + (-y)
    c = nf.log(nf.exp(x)) / (y * n) + nf.tanh(x)
    return a, b, c


def test_elementwise_ops(randn):
    x, y = randn(3, 5), randn(3, 5)
    a = torch.exp2(x) + torch.log2(y.abs()) + torch.sigmoid(x) * torch.sqrt(y.abs()) - torch.rsqrt(y * y)
    b = torch.sin(x) * torch.cos(y) + torch.maximum(x, y) - torch.clamp(x, max=0.5) + x**2 - y
    c = x / (y * 3) + torch.tanh(x)
    check(elementwise_zoo, dict(x=x, y=y, n=3), (a, b, c), atol=1e-4, rtol=1e-4)


@nf.program
def int_ops(x, n):
    i = nf.index(x, -1)
    j = nf.index(x, 0)
    keep = ((i // 2) % 2 == 0) | (j == n)
    return nf.where(keep & (i != 1), x, 0.0) + (i * j - n)


def test_integer_index_arithmetic_and_int_params(randn):
    x = randn(4, 6)
    i = torch.arange(6)[None, :]
    j = torch.arange(4)[:, None]
    keep = (((i // 2) % 2) == 0) | (j == 2)
    expected = torch.where(keep & (i != 1), x, 0.0) + (i * j - 2)
    prog = check(int_ops, dict(x=x, n=2), expected)
    assert prog.param_kinds == {"n": "int"}


@nf.program
def masked_scores(q, k, mask):
    s = nf.einsum("bqd,bkd->bqk", q, k)
    return nf.where(mask, s, -nf.inf).max(-1)


def test_bool_mask_input(randn):
    q, k = randn(2, 3, 4), randn(2, 5, 4)
    mask = torch.rand(2, 1, 5, generator=torch.Generator().manual_seed(0)) > 0.3
    mask[..., 0] = True
    s = q @ k.mT
    prog = check(masked_scores, dict(q=q, k=k, mask=mask), s.masked_fill(~mask, -math.inf).amax(-1))
    assert prog.input("mask").kind == "bool"


@nf.program
def casts(x):
    return x.to(torch.float16).float() * 3, nf.cast(x > 0, "int32") + 1


def test_casts_round_like_torch(randn):
    x = randn(4, 4) * 1.001
    check(casts, dict(x=x), (x.half().float() * 3, (x > 0).int().float() + 1), atol=0, rtol=0)


def test_half_inputs_computed_in_float32(randn):
    x = randn(3, 6, dtype=torch.float16)
    prog = softmax.trace(x)
    out = nf.run_reference(prog, {"x": x})
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.softmax(x.float(), -1))
    out16 = nf.run_reference(prog, {"x": x}, out_dtype=torch.float16)
    assert out16.dtype == torch.float16


@nf.program
def identity(x):
    return x


@nf.program
def unsqueezed(x):
    return x.unsqueeze(0) * 2 + x[None]


def test_returning_an_input_and_views(randn):
    x = randn(3, 4)
    check(identity, dict(x=x), x)
    check(unsqueezed, dict(x=x), (x * 3)[None])


# --------------------------------------------------------------------------- caching and structure


def test_trace_is_cached_per_shape(attn_inputs):
    q, k, v = attn_inputs(1, 2, 3, 5, 4)
    p1 = attention.trace(q, k, v, 0.5)
    assert attention.trace(q, k, v, 0.25) is p1  # same shapes and kinds
    q2, k2, v2 = attn_inputs(1, 2, 4, 5, 4)
    assert attention.trace(q2, k2, v2, 0.5) is not p1


def test_stage_names_and_unified_axes(attn_inputs):
    q, k, v = attn_inputs(1, 2, 3, 5, 4)
    prog = attention.trace(q, k, v, 0.5)
    assert prog.input("q").dims == ("b", "h", "q", "d")
    assert prog.input("k").dims == ("b", "h", "k", "d")
    assert prog.input("v").dims == ("b", "h", "k", "d2")  # v's last dim is a different axis
    names = [st.name for st in prog.all_stages()]
    assert len(names) == len(set(names))
    for st in prog.all_stages():
        assert isinstance(st, Stage)
        if isinstance(st.body, Reduce):
            assert st.reduce_axis not in st.axes


# --------------------------------------------------------------------------- errors


@nf.program
def bad_broadcast(x, y):
    return x + y


@nf.program
def nokeep_square(x):
    return x - x.max(-1)  # broadcasts the row maxima along the wrong axis


@nf.program
def square_twice(x, w):
    return nf.matmul(nf.matmul(x, w), w)


def test_broadcast_size_mismatch_is_a_clear_value_error(randn):
    with pytest.raises(ValueError, match=r"add: broadcasting dimension -1: dimension sizes 4 and 5 do not match"):
        bad_broadcast.trace(randn(3, 4), randn(5))
    with pytest.raises(ValueError, match="do not match"):
        nokeep_square.trace(randn(4, 5))


def test_two_axes_of_one_size_stay_apart(randn):
    # torch's meaning wherever two different axes of one size meet: a square weight's rows and
    # columns (`x + x @ w`, `(x @ w) @ w`), a tensor beside its transpose, an outer product of a
    # tensor with itself, row maxima broadcast along the columns of a square x
    @nf.program
    def residual(x, w):
        return torch.softmax(x @ w + x, -1)

    @nf.program
    def symmetric(h):
        return h + h.T

    @nf.program
    def outer(x):
        return x[:, None] * x[None, :]

    x, w, h, v = randn(3, 4), randn(4, 4), randn(4, 4), randn(4)
    cases = [(residual, (x, w), torch.softmax(x @ w + x, -1)), (symmetric, (h,), h + h.T),
             (outer, (v,), v[:, None] * v[None, :]), (nokeep_square, (h,), h - h.max(-1).values),
             (square_twice, (x, w), x @ w @ w)]
    for prog, args, want in cases:
        got = nf.run_reference(prog.trace(*args), dict(prog.bind(*args)))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nf.compile(residual)(x, w), torch.softmax(x @ w + x, -1), rtol=1e-5, atol=1e-5)


def test_a_square_weight_between_its_own_axes_gets_gradients(randn):
    # `x + x @ w` (a residual around a square projection): the gradients of x and w are torch's
    def block(x, w):
        return torch.nn.functional.silu(x + x @ w).sum(-1)

    x, w = randn(5, 6).requires_grad_(), randn(6, 6).requires_grad_()
    seed = torch.randn(5)
    got = torch.autograd.grad(nf.compile(block)(x, w), (x, w), seed)
    want = torch.autograd.grad(block(x, w), (x, w), seed)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_reduction_sizes_must_match(randn):
    with pytest.raises(ValueError, match="do not match"):
        square_twice.trace(randn(3, 4), randn(4, 5))


def test_einsum_errors(randn):
    x, y = randn(2, 3), randn(4, 5)

    def run(spec, *ops):
        @nf.program
        def f(a, b):
            return nf.einsum(spec, a, b)

        return f.trace(*ops)

    with pytest.raises(ValueError, match="letter 'j'"):
        run("ij,jk->ik", x, y)
    with pytest.raises(ValueError, match="explicit output"):
        run("ij,jk", x, y)
    with pytest.raises(ValueError, match="rank"):
        run("ijk,kl->il", x, y)
    with pytest.raises(ValueError, match="output letter"):
        run("ij,kl->iz", x, y)


def test_matmul_needs_rank_two(randn):
    @nf.program
    def f(a, b):
        return nf.matmul(a, b)

    with pytest.raises(ValueError, match="rank >= 2"):
        f.trace(randn(3), randn(3, 4))


def test_python_if_on_symbolic_tensor_raises_type_error(randn):
    @nf.program
    def branchy(x):
        if x.sum(-1) > 0:
            return x
        return -x

    @nf.program
    def anded(x):
        return (x > 0) and (x < 1)

    with pytest.raises(TypeError, match="nf.where"):
        branchy.trace(randn(2, 3))
    with pytest.raises(TypeError, match="no truth value"):
        anded.trace(randn(2, 3))


@pytest.mark.parametrize("key", [([0, 1],), (1.5,), ("a",)])
def test_unsupported_indexing_raises_type_error(randn, key):
    @nf.program
    def f(x):
        return x[key]

    with pytest.raises(TypeError, match="indexing with ints, slices"):
        f.trace(randn(3, 4))


@pytest.mark.parametrize("key", [
    (slice(0, 2),), (1,), (0,), (-1,), (Ellipsis, slice(None, None, 2)), (slice(1, None), 2), (slice(None), slice(-3, -1)),
])
def test_slices_and_integer_indices_are_views(randn, key):
    x = randn(3, 4)
    f = nf.compile(nf.program(lambda x: x[key] * 2.0))
    torch.testing.assert_close(f(x), x[key] * 2.0)


def test_too_many_indices(randn):
    @nf.program
    def f(x):
        return x[:, :, :]

    @nf.program
    def g(x):
        return x[..., :, ...]

    with pytest.raises(IndexError, match="too many indices"):
        f.trace(randn(3, 4))
    with pytest.raises(IndexError, match="single ellipsis"):
        g.trace(randn(3, 4))


def test_supported_indexing(randn):
    x = randn(1, 3, 1)

    @nf.program
    def f(x):
        return x[0][..., 0][None, :, None] + x[:, :, -1][..., None]

    check(f, dict(x=x), x[0][..., 0][None, :, None] + x[:, :, -1][..., None])


def test_bad_arguments_and_results(randn):
    @nf.program
    def f(x, flag):
        return x * flag

    with pytest.raises(TypeError, match="boolean scalars"):
        f.trace(randn(2), True)
    with pytest.raises(TypeError, match="expected a torch tensor"):
        f.trace(randn(2), "a")

    @nf.program
    def scalar_out(x):
        return x.sum(-1)

    # a reduction to a single value is a 0-d output (lowered with a row axis of extent 1)
    assert scalar_out.trace(randn(5)).outputs[0].dims == ()

    @nf.program
    def not_a_tensor(x):
        return 1.0

    with pytest.raises(TypeError, match="must return symbolic tensors"):
        not_a_tensor.trace(randn(2))


def test_axis_out_of_range(randn):
    @nf.program
    def f(x):
        return x.sum(axis=2)

    with pytest.raises(ValueError, match="out of range"):
        f.trace(randn(2, 3))


def test_unsupported_dtype(randn):
    @nf.program
    def f(x):
        return x.to(torch.float64)

    with pytest.raises(TypeError, match="unsupported dtype"):
        f.trace(randn(2, 3))


def test_xor_of_boolean_masks(randn):
    """`a ^ b` on masks is a != b, like torch.logical_xor (a regression: SymTensor had no __xor__)."""

    @nf.program
    def f(x):
        i, j = nf.index(x, 0), nf.index(x, 1)
        return nf.where((i >= j) ^ (j % 2 == 0), x, 0.0).sum(axis=-1)

    x = randn(6, 8)
    i, j = torch.arange(6)[:, None], torch.arange(8)[None, :]
    expected = torch.where((i >= j) ^ (j % 2 == 0), x, 0.0).sum(-1)
    torch.testing.assert_close(nf.run_reference(f.trace(x), {"x": x}), expected)
    torch.testing.assert_close(nf.compile(f)(x), expected)

    @nf.program
    def g(x):
        return nf.where((nf.index(x, 1) ^ 3) > 0, x, 0.0).sum(axis=-1)

    with pytest.raises(TypeError, match=r"\^ \(xor\) is supported on boolean masks only, got int \^ int"):
        g.trace(x)


def test_reductions_over_every_axis_several_axes_and_torch_spellings(randn):
    """`x.sum()` reduces every axis (as torch and numpy do); a tuple of axes, torch's `dim` /
    `keepdim`, `mean`, and torch.sum / amax / amin / mean / softmax / log_softmax / logsumexp."""
    x = randn(3, 4, 5)
    check(nf.program(lambda x: x.sum()), dict(x=x), x.sum(), atol=1e-4)
    check(nf.program(lambda x: nf.max(x)), dict(x=x), x.amax())
    check(nf.program(lambda x: x.min(axis=(0, 2), keepdims=True)), dict(x=x), x.amin((0, 2), keepdim=True))
    check(nf.program(lambda x: x.sum(dim=-1, keepdim=True)), dict(x=x), x.sum(-1, keepdim=True))
    check(nf.program(lambda x: x.mean((1, 2))), dict(x=x), x.mean((1, 2)))
    check(nf.program(lambda x: torch.sum(x, dim=(0, 1))), dict(x=x), x.sum((0, 1)))
    check(nf.program(lambda x: torch.amax(x, 1, keepdim=True)), dict(x=x), x.amax(1, keepdim=True))
    check(nf.program(lambda x: x.amin(0)), dict(x=x), x.amin(0))
    check(nf.program(lambda x: torch.mean(x, -1)), dict(x=x), x.mean(-1))
    check(nf.program(lambda x: torch.max(x)), dict(x=x), x.max())
    check(nf.program(lambda x: torch.softmax(x, -1)), dict(x=x), torch.softmax(x, -1))
    check(nf.program(lambda x: x.log_softmax(1)), dict(x=x), torch.log_softmax(x, 1))
    check(nf.program(lambda x: torch.logsumexp(x, 0)), dict(x=x), torch.logsumexp(x, 0))
    w = randn(5, 3)
    check(nf.program(lambda a, b: torch.matmul(a, b.T)), dict(a=w, b=w), w @ w.T, atol=1e-4)
    check(nf.program(lambda x: torch.max(x, 1).values), dict(x=x), x.amax(1))  # torch's (values, indices) pair
    with pytest.raises(TypeError, match="indices of a max"):
        nf.program(lambda x: torch.max(x, 1).indices).trace(x=x)
    with pytest.raises(ValueError, match="twice"):
        nf.program(lambda x: x.sum((1, -2))).trace(x=x)
    with pytest.raises(TypeError, match="not both"):
        nf.program(lambda x: x.sum(0, dim=1)).trace(x=x)


def test_a_reduction_to_one_value_compiles(randn):
    """Reductions over every axis run as kernels (split-K over a row axis of extent 1)."""
    x = randn(6, 33)
    torch.testing.assert_close(nf.compile(nf.program(lambda x: x.sum()))(x), x.sum(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(nf.compile(nf.program(lambda x: x.amax()))(x), x.amax())


def test_reduced_axes_must_be_python_integers(randn):
    """A scalar parameter as the axis was iterated as an empty tuple: no reduction at all."""
    with pytest.raises(TypeError, match="Python integers"):
        nf.program(lambda x, ax: x.sum(axis=ax)).trace(x=randn(2, 3), ax=1)


def test_means_over_axes_an_earlier_kernel_summed(randn):
    """`x.mean((0, 2))`, `x.mean()`: a later kernel divides by the length of an axis none of its
    inputs has (it reads the sums), passed to it as a parameter (partition.size_param)."""
    x = randn(5, 17, 7)
    for body, want in ((lambda x: x.mean((0, 2)), x.mean((0, 2))), (lambda x: x.mean(), x.mean()),
                       (lambda x: x.mean(axis=-1).mean(axis=0), x.mean(-1).mean(0)),
                       (lambda x: x.sum((0, 2)) / nf.size(x, 2), x.sum((0, 2)) / 7)):
        fn = nf.compile(nf.program(body))
        torch.testing.assert_close(fn(x), want, atol=1e-5, rtol=1e-5)
        y = randn(3, 17, 11)  # the same kernels' shapes for the sums, other summed lengths
        torch.testing.assert_close(fn(y), nf.run_reference(nf.program(body).trace(y), {"x": y}), atol=1e-5, rtol=1e-5)


def test_layernorm_written_with_mean_compiles(randn):
    """The run-time length squared in a repair (`size ** -2`) comes back to the IR as 1 / (n * n)."""
    x = randn(6, 40, scale=2.0)

    def ln_max(x):
        c = x - x.mean(axis=-1, keepdims=True)
        return (c / nf.sqrt((c * c).mean(axis=-1, keepdims=True) + 1e-5)).max(axis=-1)

    xf = x.double()
    c = xf - xf.mean(-1, keepdim=True)
    want = (c / torch.sqrt((c * c).mean(-1, keepdim=True) + 1e-5)).amax(-1)
    torch.testing.assert_close(nf.compile(nf.program(ln_max))(x).double(), want, atol=1e-5, rtol=1e-5)


def test_batched_matmuls_with_short_rows_fit_a_tile(randn):
    """(batch, rows, k) @ (k, n) with both output axes short enough to hold whole: the state is
    tiled across the grid where it would not fit (a 4-D tile of 2M elements, above Triton's
    limit, before); a plan that still cannot fit is refused at planning, so the fallback runs."""
    x, w = randn(2, 65, 3), randn(3, 129)
    torch.testing.assert_close(nf.compile(nf.program(lambda x, w: x @ w))(x, w), x @ w, atol=1e-5, rtol=1e-5)
    a, b = randn(1, 1, 130), randn(1, 130, 5)
    prog = nf.program(lambda a, b: nf.einsum("bik,bkn->in", a, b))
    with pytest.warns(UserWarning, match="unfused"):
        out = nf.compile(prog, allow_fallback=True)(a, b)
    torch.testing.assert_close(out, torch.einsum("bik,bkn->in", a, b), atol=1e-5, rtol=1e-5)


def test_a_reduction_of_a_value_that_kept_a_reduced_axis(randn):
    """Reducing another axis of a keepdims result keeps the size-1 axis a broadcast: the stage's
    buffer has its real axes only (its load named the kept axis too, which the kernels refused and
    the reference executor indexed past the buffer's rank)."""
    x = randn(4, 5, 6)
    cases = [(lambda x: x.sum(axis=-1, keepdims=True).max(axis=0), x.sum(-1, keepdim=True).amax(0)),
             (lambda x: x.sum(axis=1, keepdims=True).min(axis=2), x.sum(1, keepdim=True).amin(2)),
             (lambda x: x.max(axis=0, keepdims=True).sum(axis=-1), x.amax(0, keepdim=True).sum(-1)),
             (lambda x: x.mean(axis=(0, 2), keepdims=True).sum(axis=1), x.mean((0, 2), keepdim=True).sum(1)),
             (lambda x: (x.sum(axis=-1, keepdims=True) * 2.0).max(axis=0), (x.sum(-1, keepdim=True) * 2).amax(0))]
    for fn, want in cases:
        prog = nf.program(fn)
        torch.testing.assert_close(nf.compile(prog)(x), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(nf.run_reference(prog.trace(x), {"x": x}), want, atol=1e-5, rtol=1e-5)


def test_outputs_take_torchs_promoted_dtype_of_the_inputs():
    """fp16 and fp32 inputs give an fp32 output whatever their order (it took the first float
    input's dtype: a row sum of 8e4 overflowed to inf in fp16); a 0-d fp32 tensor does not
    promote an fp16 one, as in torch; attention keeps the query's dtype beside fp32 captures."""
    a, b = torch.zeros(2, 8, dtype=torch.float16), torch.full((2, 8), 1e4)
    for prog, args in ((nf.program(lambda a, b: (a + b).sum(axis=-1)), (a, b)),
                       (nf.program(lambda b, a: (a + b).sum(axis=-1)), (b, a))):
        out = nf.compile(prog)(*args)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, (a + b).sum(-1))
    t = torch.tensor(2.0)
    assert nf.compile(nf.program(lambda a, t: (a * t).sum(axis=-1)))(a, t).dtype == torch.float16
    q = torch.randn(1, 2, 16, 8, dtype=torch.float16)
    slopes = torch.rand(2)
    for grad in (False, True):
        slopes.requires_grad_(grad)
        out = nf.attention(q, q, q, score_mod=lambda s, b, h, i, j: s - slopes[h] * (i - j))
        assert out.dtype == torch.float16 and out.requires_grad == grad
