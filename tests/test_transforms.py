"""Translation validation of every transform: the reference executor gives the same result
before and after (NaN positions included), for attention variants and programs no code names.
Also chain analysis and the refusals of rolling_update / split_k_update."""

from __future__ import annotations

import math

import pytest
import torch

import neptune_fusion as nf
from neptune_fusion.analysis.chains import chain_axis, find_chains, reductions_along, transitive_reads
from neptune_fusion.ir.errors import FusionError
from neptune_fusion.ir.expr import Index, Load, Reduce, Unary
from neptune_fusion.ir.printer import format_expr, format_program
from neptune_fusion.ir.program import FusedLoop, InputBuffer, OutputSpec, Program, Stage
from neptune_fusion.transform.inline import inline_along, inline_elementwise
from neptune_fusion.transform.normalize import hoist_invariant_factors
from neptune_fusion.transform.rolling import build_fused_loop, rolling_update
from neptune_fusion.transform.split_k import split_k_update

BLOCKS = (1, 2, 3, 5, 16)
SPLITS = (1, 2, 3, 7)


def as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def assert_same(before: Program, after: Program, args: dict, *, blocks=(16,), atol=1e-5, rtol=1e-5) -> None:
    """Translation validation: `after` computes what `before` computes (NaN where it is NaN)."""
    expected = as_tuple(nf.run_reference(before, args))
    for block in blocks:
        got = as_tuple(nf.run_reference(after, args, block=block))
        assert len(got) == len(expected)
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, atol=atol, rtol=rtol, equal_nan=True,
                                       msg=lambda m, b=block: f"block={b}: {m}")


def fuse(prog: Program, axis: str | None = None, hoist: bool = True) -> tuple[Program, str]:
    """inline_elementwise -> inline_along(axis) -> [hoist] -> rolling_update(axis)."""
    p = inline_elementwise(prog)
    axis = axis or chain_axis(p)
    assert axis is not None
    p = inline_along(p, axis)
    if hoist:
        p = hoist_invariant_factors(p)
    return rolling_update(p, axis), axis


def loops(prog: Program) -> list[FusedLoop]:
    return [n for n in prog.stages if isinstance(n, FusedLoop)]


def validate_fusion(prog: Program, args: dict, *, hoist: bool = True, atol=1e-5, rtol=1e-5) -> Program:
    """Every transform on the way, each validated; then split-K with several split counts."""
    p1 = inline_elementwise(prog)
    assert_same(prog, p1, args, atol=atol, rtol=rtol)
    axis = chain_axis(p1)
    p2 = inline_along(p1, axis)
    assert_same(prog, p2, args, atol=atol, rtol=rtol)
    p3 = hoist_invariant_factors(p2) if hoist else p2
    assert_same(prog, p3, args, atol=atol, rtol=rtol)
    p4 = rolling_update(p3, axis)
    assert len(loops(p4)) == 1
    assert_same(prog, p4, args, blocks=BLOCKS, atol=atol, rtol=rtol)
    for splits in SPLITS:
        p5 = split_k_update(p4, axis, splits)
        assert_same(prog, p5, args, blocks=(2, 3), atol=atol, rtol=rtol)
    return p4


# --------------------------------------------------------------------------- programs


@nf.program
def attention(q, k, v, scale):
    s = nf.einsum("bhqd,bhkd->bhqk", q, k) * scale
    p = nf.exp(s - s.max(axis=-1, keepdims=True))
    return nf.einsum("bhqk,bhkd->bhqd", p, v) / p.sum(axis=-1, keepdims=True)


@nf.program
def shifted_causal(q, k, v, shift):
    # rows q < shift see no key at all: fully masked rows
    s = nf.einsum("bhqd,bhkd->bhqk", q, k)
    s = nf.where(nf.index(s, -2) >= nf.index(s, -1) + shift, s, -nf.inf)
    p = nf.exp(s - s.max(axis=-1, keepdims=True))
    return nf.einsum("bhqk,bhkd->bhqd", p, v) / p.sum(axis=-1, keepdims=True)


@nf.program
def causal_normalised_first(q, k, v):
    # P / L before the second matmul: a reduction with two running producers (max and sum)
    s = nf.einsum("bhqd,bhkd->bhqk", q, k)
    s = nf.where(nf.index(s, -2) >= nf.index(s, -1), s, -nf.inf)
    p = nf.exp(s - s.max(axis=-1, keepdims=True))
    p = p / p.sum(axis=-1, keepdims=True)
    return nf.einsum("bhqk,bhkd->bhqd", p, v)


@nf.program
def window_softcap(q, k, v, scale):
    # causal + sliding window of 3: leading key tiles are fully masked for late rows
    s = nf.einsum("bhqd,bhkd->bhqk", q, k) * scale
    s = 50 * nf.tanh(s / 50)
    qi, ki = nf.index(s, -2), nf.index(s, -1)
    s = nf.where((qi >= ki) & (qi - ki < 3), s, -nf.inf)
    p = nf.exp(s - s.max(axis=-1, keepdims=True))
    return nf.einsum("bhqk,bhkd->bhqd", p, v) / p.sum(axis=-1, keepdims=True)


@nf.program
def alibi(q, k, v, slopes, scale):
    s = nf.einsum("bhqd,bhkd->bhqk", q, k) * scale
    s = s + slopes[:, None, None] * (nf.index(s, -1) - nf.index(s, -2))
    s = nf.where(nf.index(s, -2) >= nf.index(s, -1), s, -nf.inf)
    p = nf.exp(s - s.max(axis=-1, keepdims=True))
    return nf.einsum("bhqk,bhkd->bhqd", p, v) / p.sum(axis=-1, keepdims=True)


@nf.program
def bias_exp2(q, k, v, bias, scale):
    # exp2 with the scale applied after the shift: the repair carries the (loop-invariant) scale
    s = nf.einsum("bhqd,bhkd->bhqk", q, k) + bias
    p = nf.exp2((s - s.max(axis=-1, keepdims=True)) * scale)
    return nf.einsum("bhqk,bhkd->bhqd", p, v) / p.sum(axis=-1, keepdims=True)


@nf.program
def attention_with_lse(q, k, v, shift):
    s = nf.einsum("bhqd,bhkd->bhqk", q, k)
    s = nf.where(nf.index(s, -2) >= nf.index(s, -1) + shift, s, -nf.inf)
    m = s.max(axis=-1, keepdims=True)
    p = nf.exp(s - m)
    denom = p.sum(axis=-1, keepdims=True)
    return nf.einsum("bhqk,bhkd->bhqd", p, v) / denom, (m + nf.log(denom))[..., 0]


@nf.program
def square_weighted(x, v):
    # never seen by name: out = sum_j (x_j^2 / sum_j x_j^2) * v_j
    x2 = x * x
    return nf.einsum("ij,je->ie", x2 / x2.sum(axis=-1, keepdims=True), v)


@nf.program
def soft_min(x, v, tau):
    # a softmax shifted by a running *minimum*, with a temperature applied after the shift
    m = x.min(axis=-1, keepdims=True)
    w = nf.exp((m - x) * tau)
    return nf.einsum("ij,je->ie", w, v) / w.sum(axis=-1, keepdims=True)


@nf.program
def masked_soft_min(x, v):
    x = nf.where(nf.index(x, 0) >= nf.index(x, 1) + 1, x, nf.inf)
    m = x.min(axis=-1, keepdims=True)
    w = nf.exp(m - x)
    return nf.einsum("ij,je->ie", w, v) / w.sum(axis=-1, keepdims=True)


@nf.program
def max_gap(a, b):
    # a max that reads another running max: repaired additively
    m = a.max(axis=-1, keepdims=True)
    return (a * b - m).max(axis=-1), m[..., 0]


@nf.program
def two_softmaxes(x):
    e = nf.exp(x - x.max(-1, keepdims=True))
    p = e / e.sum(-1, keepdims=True)
    e2 = nf.exp(p - p.max(-2, keepdims=True))
    return e2 / e2.sum(-2, keepdims=True)


# --------------------------------------------------------------------------- translation validation


def test_global_attention(attn_inputs):
    q, k, v = attn_inputs(2, 2, 5, 9, 4, dv=3)
    args = dict(q=q, k=k, v=v, scale=0.6)
    prog = attention.trace(**args)
    fused = validate_fusion(prog, args)
    text = format_program(fused)
    assert "rolling loop over k" in text
    assert text.count("repair when max0 change: t <- t * exp(max0.old - max0.new)") == 2
    torch.testing.assert_close(nf.run_reference(fused, args, block=4),
                               torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.6))


@pytest.mark.parametrize(("lq", "lk", "shift"), [(6, 6, 0), (7, 9, 2), (9, 5, 3), (1, 9, 0)])
def test_causal_attention_with_fully_masked_rows(attn_inputs, lq, lk, shift):
    q, k, v = attn_inputs(1, 2, lq, lk, 4)
    args = dict(q=q, k=k, v=v, shift=shift)
    prog = shifted_causal.trace(**args)
    ref = nf.run_reference(prog, args)
    assert bool(torch.isnan(ref).any()) == (shift > 0)  # rows q < shift are fully masked
    validate_fusion(prog, args)


def test_two_producer_normalised_form_without_hoisting(attn_inputs):
    q, k, v = attn_inputs(2, 1, 7, 7, 4)
    args = dict(q=q, k=k, v=v)
    prog = causal_normalised_first.trace(**args)
    fused = validate_fusion(prog, args, hoist=False)
    (loop,) = loops(fused)
    two = [m for m in loop.members if len(loop.producers[m.name]) == 2]
    assert len(two) == 1
    text = format_program(fused)
    assert "exp(max0.old - max0.new)" in text and "sum0.old" in text and "/ sum0.new" in text


def test_two_producer_normalised_form_with_hoisting(attn_inputs):
    q, k, v = attn_inputs(2, 1, 7, 7, 4)
    args = dict(q=q, k=k, v=v)
    prog = causal_normalised_first.trace(**args)
    fused = validate_fusion(prog, args, hoist=True)
    (loop,) = loops(fused)
    assert all(len(p) <= 1 for p in loop.producers.values())  # the division left the loop
    assert any(m.name.endswith("_acc") for m in loop.members)


def test_sliding_window_with_softcap(attn_inputs):
    q, k, v = attn_inputs(1, 2, 8, 8, 4, scale=3.0)
    args = dict(q=q, k=k, v=v, scale=2.0)
    validate_fusion(window_softcap.trace(**args), args, atol=1e-5, rtol=1e-4)
    validate_fusion(causal_normalised_first.trace(q, k, v), dict(q=q, k=k, v=v), hoist=False)


def test_alibi(attn_inputs, randn):
    q, k, v = attn_inputs(2, 3, 6, 6, 4)
    args = dict(q=q, k=k, v=v, slopes=randn(3).abs(), scale=0.5)
    validate_fusion(alibi.trace(**args), args)


def test_bias_and_exp2_with_scale_after_shift(attn_inputs, randn):
    q, k, v = attn_inputs(2, 3, 4, 7, 4)
    args = dict(q=q, k=k, v=v, bias=randn(1, 3, 1, 1), scale=0.7)
    fused = validate_fusion(bias_exp2.trace(**args), args)
    assert "exp2(scale * (max0.old - max0.new))" in format_program(fused)


def test_attention_with_logsumexp_output(attn_inputs):
    q, k, v = attn_inputs(1, 2, 6, 6, 4)
    args = dict(q=q, k=k, v=v, shift=0)
    prog = attention_with_lse.trace(**args)
    out, lse = nf.run_reference(prog, args)
    s = (q @ k.mT).masked_fill(~(torch.arange(6)[:, None] >= torch.arange(6)[None, :]), -math.inf)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))
    validate_fusion(prog, args)
    args["shift"] = 2  # now with fully masked rows: nan in both, positions equal
    validate_fusion(attention_with_lse.trace(**args), args)


def test_square_weighted_sum(randn):
    x, v = randn(3, 11), randn(11, 2)
    args = dict(x=x, v=v)
    prog = square_weighted.trace(**args)
    x2 = x * x
    torch.testing.assert_close(nf.run_reference(prog, args), (x2 / x2.sum(-1, keepdim=True)) @ v)
    fused = validate_fusion(prog, args, hoist=False)
    assert "t * sum0.old / sum0.new" in format_program(fused)
    validate_fusion(prog, args, hoist=True)


def test_soft_min_with_temperature(randn):
    x, v = randn(4, 10, scale=2.0), randn(10, 3)
    args = dict(x=x, v=v, tau=0.8)
    prog = soft_min.trace(**args)
    torch.testing.assert_close(nf.run_reference(prog, args), torch.softmax(-x * 0.8, -1) @ v)
    fused = validate_fusion(prog, args)
    assert "exp(tau * (min0.new - min0.old))" in format_program(fused)


def test_masked_soft_min_with_fully_masked_rows(randn):
    x, v = randn(5, 7), randn(7, 3)
    args = dict(x=x, v=v)
    prog = masked_soft_min.trace(**args)
    assert torch.isnan(nf.run_reference(prog, args)[0]).all()  # row 0 sees nothing
    validate_fusion(prog, args)


def test_max_reading_a_running_max(randn):
    a, b = randn(3, 9), randn(3, 9)
    args = dict(a=a, b=b)
    prog = max_gap.trace(**args)
    gap, m = nf.run_reference(prog, args)
    torch.testing.assert_close(gap, (a * b).amax(-1) - a.amax(-1))
    fused = validate_fusion(prog, args)
    assert "t <- t + max0.old - max0.new" in format_program(fused)


def test_two_chains_on_different_axes(randn):
    x = randn(5, 6)
    args = dict(x=x)
    prog = inline_elementwise(two_softmaxes.trace(x))
    chains = find_chains(prog)
    assert [c.length for c in chains] == [2, 2]
    first, second = (c.axis for c in chains)
    assert {first, second} == {"a0", "a1"}
    r1 = rolling_update(prog, "a1")
    assert_same(prog, r1, args, blocks=(1, 4))
    r2 = rolling_update(r1, "a0")  # the second loop reads members of the first
    assert [type(n).__name__ for n in r2.stages] == ["FusedLoop", "FusedLoop", "Stage"]
    assert_same(prog, r2, args, blocks=(1, 2, 4))
    torch.testing.assert_close(nf.run_reference(r2, args, block=2), torch.softmax(torch.softmax(x, -1), -2))
    assert_same(prog, split_k_update(split_k_update(r2, "a0", 2), "a1", 3), args, blocks=(2,))


# --------------------------------------------------------------------------- individual transforms


def test_inline_elementwise_keeps_outputs_and_reductions(attn_inputs):
    q, k, v = attn_inputs(1, 1, 3, 4, 2)
    prog = attention.trace(q, k, v, 0.5)
    p = inline_elementwise(prog)
    outputs = {o.stage for o in p.outputs}
    for st in p.stages:
        assert st.reduce_op is not None or st.name in outputs
    assert {o.stage for o in prog.outputs} == outputs
    p.validate()


def test_inline_along_removes_score_matrices(attn_inputs):
    q, k, v = attn_inputs(1, 1, 3, 4, 2)
    prog = inline_elementwise(attention.trace(q, k, v, 0.5))
    p = inline_along(prog, "k")
    for st in p.stages:
        assert "k" not in st.axes
    # the q x k scores are recomputed inside each reduction over k as a nested reduction over d
    assert all(isinstance(st.body, Reduce) for st in p.stages[:-1])
    assert "sum[d](" in format_program(p)


def test_hoist_invariant_factors_is_a_no_op_without_invariant_factors(attn_inputs):
    q, k, v = attn_inputs(1, 1, 3, 4, 2)
    prog = inline_along(inline_elementwise(attention.trace(q, k, v, 0.5)), "k")
    assert hoist_invariant_factors(prog).stages == prog.stages


def test_hoist_invariant_factors_moves_divisors_and_params(randn):
    x, v, w = randn(3, 6), randn(6, 2), randn(3)

    @nf.program
    def f(x, v, w, scale):
        e = nf.exp(x) / w[:, None] * scale
        return nf.einsum("ij,je->ie", e, v)

    args = dict(x=x, v=v, w=w, scale=1.5)
    prog = inline_elementwise(f.trace(**args))
    hoisted = hoist_invariant_factors(prog)
    names = [st.name for st in hoisted.stages]
    assert names == ["dot0_acc", "dot0"]
    acc = format_expr(hoisted.stage("dot0_acc").body)
    assert acc == "sum[j](exp(x[i, j]) * v[j, e])"
    assert format_expr(hoisted.stage("dot0").body) == "dot0_acc[i, e] * scale / w[i]"
    assert_same(prog, hoisted, args)


def test_rolling_update_structure(attn_inputs):
    q, k, v = attn_inputs(1, 1, 3, 4, 2)
    fused, axis = fuse(attention.trace(q, k, v, 0.5))
    assert axis == "k"
    (loop,) = loops(fused)
    assert loop.mode == "rolling" and loop.axis == "k" and loop.splits == 1
    assert loop.members[0].reduce_op == "max"
    assert loop.producers[loop.members[0].name] == ()
    assert loop.repairs[loop.members[0].name] is None
    for m in loop.members[1:]:
        assert loop.producers[m.name] == (loop.members[0].name,)
        assert loop.repairs[m.name] is not None
    # the loop comes before the stage that divides
    assert isinstance(fused.stages[0], FusedLoop) and isinstance(fused.stages[-1], Stage)
    fused.validate()


def test_split_k_structure_and_errors(attn_inputs):
    q, k, v = attn_inputs(1, 1, 3, 4, 2)
    fused, axis = fuse(attention.trace(q, k, v, 0.5))
    split = split_k_update(fused, axis, 4)
    (loop,) = loops(split)
    assert loop.mode == "split_k" and loop.splits == 4
    assert "split_k loop over k in 4 chunks" in format_program(split)
    with pytest.raises(ValueError, match="splits must be >= 1"):
        split_k_update(fused, axis, 0)
    with pytest.raises(FusionError, match="run rolling_update first"):
        split_k_update(fused, "d", 2)


# --------------------------------------------------------------------------- refusals


def test_rolling_refuses_dependencies_through_stages_not_inlined(attn_inputs):
    q, k, v = attn_inputs(1, 1, 3, 4, 2)
    prog = attention.trace(q, k, v, 0.5)
    with pytest.raises(FusionError, match=r"rolling update.*depends on reduction\(s\) \['max0'\].*not inlined"):
        rolling_update(prog, "k")


def test_rolling_refuses_an_axis_without_reductions(attn_inputs):
    q, k, v = attn_inputs(1, 1, 3, 4, 2)
    prog = inline_along(inline_elementwise(attention.trace(q, k, v, 0.5)), "k")
    with pytest.raises(FusionError, match="no reduction over axis 'q'"):
        rolling_update(prog, "q")


def test_rolling_refuses_a_map_without_repair(randn):
    @nf.program
    def sin_shift(x):
        return nf.sin(x - x.max(-1, keepdims=True)).sum(-1)

    prog = inline_elementwise(sin_shift.trace(randn(3, 5)))
    with pytest.raises(FusionError, match=r"stage 'sum0' \(sum over a1\).*no repair function"):
        rolling_update(prog, "a1")


def test_rolling_refuses_running_value_at_other_indices(randn):
    # l[i] = sum_j exp(x[i, j] - m[j]): reads the running max at the *reduced* index
    x = Load("x", (Index("i"), Index("j")))
    m = Stage("m", ("i",), Reduce("max", "j", x))
    l_ = Stage("l", ("i",), Reduce("sum", "j", Unary("exp", x - Load("m", (Index("j"),)))))
    prog = Program("t", (InputBuffer("x", ("i", "j")),), (), (m, l_), (OutputSpec("l", ("i",)),))
    prog.validate()
    nf.run_reference(prog, {"x": randn(4, 4)})  # fine unfused
    with pytest.raises(FusionError, match=r"stage 'l' \(sum over j\).*running value 'm' at indices other"):
        rolling_update(prog, "j")
    with pytest.raises(FusionError, match="running value"):
        build_fused_loop(prog, "j")


def test_rolling_refuses_prod_of_a_running_shift(randn):
    @nf.program
    def prod_shift(x):
        return nf.exp(x - x.max(-1, keepdims=True)).sum(-1) * 0 + _prod(nf.exp(x - x.max(-1, keepdims=True)))

    def _prod(t):
        from neptune_fusion.lang.tensor import reduce

        return reduce("prod", t, -1, False)

    prog = inline_elementwise(prod_shift.trace(randn(3, 5)))
    with pytest.raises(FusionError, match="prod over a1.*multiplicative"):
        rolling_update(prog, "a1")


# --------------------------------------------------------------------------- chain analysis


def test_find_chains_on_attention(attn_inputs):
    q, k, v = attn_inputs(1, 1, 3, 4, 2)
    prog = attention.trace(q, k, v, 0.5)
    for p in (prog, inline_elementwise(prog)):
        chains = find_chains(p)
        assert [c.axis for c in chains] == ["k", "d"]
        kc = chains[0]
        assert kc.length == 2 and len(kc.members) == 3
        mx = next(m for m in kc.members if m.startswith("max"))
        assert kc.depends[mx] == ()
        assert all(kc.depends[m] == (mx,) for m in kc.members if m != mx)
        assert chains[1].length == 1
        assert chain_axis(p) == "k"
    assert set(reductions_along(prog)) == {"k", "d"}
    assert "q" in transitive_reads(prog, prog.outputs[0].stage)


def test_chain_axis_without_reductions(randn):
    @nf.program
    def ew(x):
        return nf.exp(x) * 2

    assert chain_axis(ew.trace(randn(2, 3))) is None
    assert find_chains(ew.trace(randn(2, 3))) == []


def test_chain_length_three(randn):
    # max -> sum (reads max) -> expectation of x under the softmax (reads both)
    @nf.program
    def chain3(x):
        e = nf.exp(x - x.max(-1, keepdims=True))
        return (e / e.sum(-1, keepdims=True) * x).sum(-1)

    prog = inline_elementwise(chain3.trace(randn(3, 6)))
    (chain,) = find_chains(prog)
    assert chain.length == 3
    args = dict(x=randn(3, 6))
    fused = rolling_update(prog, chain.axis)
    assert_same(prog, fused, args, blocks=BLOCKS)
    for splits in SPLITS:
        assert_same(prog, split_k_update(fused, chain.axis, splits), args, blocks=(1, 2))


def test_hoist_opens_a_row_guard_around_inputs_values(randn):
    """`where(norm == 0, 0, g / norm)` inside a sum over e (a backward's dP for rows the forward left
    empty): the guard and 1 / norm leave the sum, g (an input) stays, and rows with norm == 0 stay 0."""
    g, v = randn(4, 3), randn(5, 3)
    norm = torch.tensor([0.0, 2.0, 0.5, 0.0])

    @nf.program
    def f(g, v, norm):
        return nf.einsum("ie,je->ij", nf.where(norm[:, None] == 0, 0.0, g / norm[:, None]), v)

    args = dict(g=g, v=v, norm=norm)
    prog = inline_elementwise(f.trace(**args))
    hoisted = hoist_invariant_factors(prog)
    assert [st.name for st in hoisted.stages] == ["dot0_acc", "dot0"]
    assert format_expr(hoisted.stage("dot0_acc").body) == "sum[e](g[i, e] * v[j, e])"
    assert "where" in format_expr(hoisted.stage("dot0").body)
    assert_same(prog, hoisted, args)
    assert nf.run_reference(hoisted, args)[[0, 3]].eq(0).all()


def test_hoist_keeps_a_guard_around_computed_values(randn):
    """exp(x) may overflow where the guard holds: 0 * inf would be NaN, so the guard stays whole."""
    x, v = randn(4, 3), randn(5, 3)
    norm = torch.tensor([0.0, 2.0, 0.5, 0.0])

    @nf.program
    def f(x, v, norm):
        return nf.einsum("ie,je->ij", nf.where(norm[:, None] == 0, 0.0, nf.exp(x) / norm[:, None]), v)

    args = dict(x=x, v=v, norm=norm)
    prog = inline_elementwise(f.trace(**args))
    assert hoist_invariant_factors(prog).stages == prog.stages
