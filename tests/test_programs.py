"""Programs beyond attention, compiled end to end under the interpreter and checked against torch.

None of these is special-cased anywhere: each goes through the same analysis, algebra,
transforms and code generation as attention.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import neptune_fusion as nf  # noqa: E402
from neptune_fusion.runtime.compiled import kernel_name  # noqa: E402
from neptune_fusion.schedule.pipeline import fuse  # noqa: E402
from neptune_fusion.transform.inline import inline_elementwise  # noqa: E402
from neptune_fusion.transform.normalize import hoist_invariant_factors  # noqa: E402
from neptune_fusion.transform.polynomial import expand_polynomial_reductions  # noqa: E402

G = torch.Generator().manual_seed(11)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=G)


@nf.program
def cross_entropy(logits, target):
    m = logits.max(axis=-1, keepdims=True)
    lse = (m + nf.log(nf.exp(logits - m).sum(axis=-1, keepdims=True)))[..., 0]
    return lse - logits[nf.index(lse, 0), target]


@nf.program
def softmax_dim0(x):
    e = nf.exp(x - x.max(axis=0, keepdims=True))
    return e / e.sum(axis=0, keepdims=True)


@nf.program
def softmin_weighted(x, v):
    e = nf.exp(x.min(axis=-1, keepdims=True) - x)
    return (e * v).sum(axis=-1) / e.sum(axis=-1)


@nf.program
def attention_with_lse(q, k, v, scale):
    s = nf.einsum("bhqd,bhkd->bhqk", q, k) * scale
    m = s.max(axis=-1, keepdims=True)
    p = nf.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)  # noqa: E741
    return nf.einsum("bhqk,bhkd->bhqd", p, v) / l, (m + nf.log(l))[..., 0]


@nf.program
def sigmoid_attention(q, k, v):
    s = nf.sigmoid(nf.einsum("bhqd,bhkd->bhqk", q, k))
    return nf.einsum("bhqk,bhkd->bhqd", s, v) / s.sum(axis=-1, keepdims=True)


@nf.program
def variance(x):
    mean = x.sum(axis=-1, keepdims=True) / x.shape[-1]
    return ((x - mean) * (x - mean)).sum(axis=-1) / x.shape[-1]


@nf.program
def softmax_entropy(x):
    m = x.max(axis=-1, keepdims=True)
    e = nf.exp(x - m)
    p = e / e.sum(axis=-1, keepdims=True)
    return -(p * nf.log(p)).sum(axis=-1)


@nf.program
def attention_with_entropy(q, k, v, scale):
    s = nf.einsum("bhqd,bhkd->bhqk", q, k) * scale
    e = nf.exp(s - s.max(axis=-1, keepdims=True))
    p = e / e.sum(axis=-1, keepdims=True)
    return nf.einsum("bhqk,bhkd->bhqd", p, v), -(p * nf.log(p)).sum(axis=-1)


@nf.program
def causal_attention_zero_where(q, k, v, scale):
    """Masked attention written with the mask on the weights (0) instead of on the scores (-inf)."""
    s = nf.einsum("bhqd,bhkd->bhqk", q, k) * scale
    visible = nf.index(s, -2) >= nf.index(s, -1)
    m = nf.where(visible, s, float("-inf")).max(axis=-1, keepdims=True)
    e = nf.where(visible, nf.exp(s - m), 0.0)
    return nf.einsum("bhqk,bhkd->bhqd", e, v) / e.sum(axis=-1, keepdims=True)


@nf.program
def layernorm_matmul(x, w, eps):
    n = x.shape[-1]
    mean = x.sum(axis=-1, keepdims=True) / n
    var = ((x - mean) * (x - mean)).sum(axis=-1, keepdims=True) / n
    return nf.einsum("rj,je->re", (x - mean) * nf.rsqrt(var + eps), w)


@nf.program
def temperature_softmax_exp2(x, bias, temp):
    y = (x + bias) / temp
    e = nf.exp2(y - y.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_cross_entropy_with_gathered_target():
    x, t = randn(37, 300), torch.randint(0, 300, (37,), generator=G)
    torch.testing.assert_close(nf.compile(cross_entropy)(x, t), torch.nn.functional.cross_entropy(x, t, reduction="none"),
                               rtol=1e-5, atol=1e-5)


def test_softmax_over_the_first_axis():
    x = randn(100, 23)
    torch.testing.assert_close(nf.compile(softmax_dim0)(x), torch.softmax(x, 0))


def test_softmin_weighted_sum():
    x, v = randn(20, 90), randn(20, 90)
    torch.testing.assert_close(nf.compile(softmin_weighted)(x, v), (torch.softmax(-x, -1) * v).sum(-1))


def test_attention_on_strided_inputs():
    q, k, v = (randn(2, n, 3, 16).transpose(1, 2) for n in (50, 70, 70))
    out = nf.compile(attention_with_lse)(q, k, v, 0.3)[0]
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.3))


def test_two_outputs_attention_and_logsumexp():
    q, k, v = randn(1, 2, 40, 16), randn(1, 2, 40, 16), randn(1, 2, 40, 16)
    out, lse = nf.compile(attention_with_lse)(q, k, v, 0.3)
    s = q @ k.mT * 0.3
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v)


def test_sigmoid_attention_needs_no_repair():
    q, k, v = randn(1, 2, 40, 16), randn(1, 2, 48, 16), randn(1, 2, 48, 16)
    s = torch.sigmoid(q @ k.mT)
    torch.testing.assert_close(nf.compile(sigmoid_attention)(q, k, v), (s @ v) / s.sum(-1, keepdim=True))


@pytest.mark.parametrize("schedule", [None, nf.split_k(splits=3)])
def test_variance_fuses_into_one_pass(schedule):
    x = randn(8, 250) * 3 + 2
    torch.testing.assert_close(nf.compile(variance, schedule=schedule)(x), x.var(-1, unbiased=False),
                               rtol=1e-4, atol=1e-4)
    names = [s.name for s in fuse(variance.trace(x))]
    assert any("Welford" in n for n in names)


@pytest.mark.parametrize("schedule", [None, nf.split_k(splits=2)])
def test_layernorm_then_matmul_in_one_pass(schedule):
    x, w = randn(40, 300) * 2 + 1, randn(300, 32)
    out = nf.compile(layernorm_matmul, schedule=schedule)(x, w, 1e-5)
    torch.testing.assert_close(out, torch.nn.functional.layer_norm(x, (300,), eps=1e-5) @ w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("schedule", [None, nf.split_k(splits=3)])
@pytest.mark.parametrize("mean", [1e3, 1e4])
def test_statistics_of_values_far_from_zero_keep_their_digits(mean, schedule):
    """Values whose mean is 10^3-10^4 times their spread: the variance's basis sums are taken
    around the row's first value, not 0, so they do not cancel (around 0, mean 10^3 gave a
    LayerNorm 12% wrong in fp32 and 10^4 NaN); one kernel and split-K, LayerNorm -> matmul too.
    torch's own fp32 LayerNorm errs by 6e-5 / 1.5e-3 here."""
    x, w = randn(40, 300) + mean, randn(300, 32)
    xd = x.double()
    normalised = (xd - xd.mean(-1, keepdim=True)) / torch.sqrt(xd.var(-1, unbiased=False, keepdim=True) + 1e-5)
    out = nf.compile(layernorm_matmul, schedule=schedule)(x, w, 1e-5)
    ref = normalised @ w.double()
    assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 3e-3 * mean / 1e4 + 2e-4
    var = nf.compile(variance, schedule=schedule)(x)
    torch.testing.assert_close(var.double(), xd.var(-1, unbiased=False), rtol=1e-2 * mean / 1e4 + 1e-4, atol=0)


@nf.program
def offset_rmsnorm_matmul(x, g, w):
    r = nf.sqrt((x * x).sum(axis=-1, keepdims=True) / x.shape[-1] + 1e-6)
    return nf.einsum("ik,ek->ie", x / r * g + 0.5, w)


def test_a_basis_coefficient_with_a_square_root_lowers():
    """An RMSNorm operand with an offset expands into basis sums whose coefficient holds
    1/sqrt(mean square): SymPy writes it as a power of 1/2, which the kernels take as rsqrt
    (an unsupported `pow` before)."""
    x, g, w = randn(20, 40), randn(40), randn(30, 40)
    xd = x.double()
    ref = (xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-6) * g.double() + 0.5) @ w.double().T
    torch.testing.assert_close(nf.compile(offset_rmsnorm_matmul)(x, g, w).double(), ref, rtol=1e-4, atol=1e-4)


@nf.program
def weighted_max_of_normalised_rows(x, g):
    return (x / nf.sqrt((x * x).sum(axis=-1, keepdims=True) / x.shape[-1] + 1e-5) * g).max(axis=-1)


@pytest.mark.parametrize("schedule", [None, nf.split_k(splits=3)])
def test_a_max_repaired_by_the_ratio_of_roots_of_sums_of_squares(schedule):
    """The running max of x * g / sqrt(mean square) repairs by a ratio of square roots, positive
    because a sum of squares is non-negative (refused as not provably monotone before)."""
    x, g = randn(44, 209), randn(209)
    xd = x.double()
    ref = (xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + 1e-5) * g.double()).max(-1).values
    torch.testing.assert_close(nf.compile(weighted_max_of_normalised_rows, schedule=schedule)(x, g).double(), ref,
                               rtol=1e-5, atol=1e-5)


@nf.program
def max_over_an_absolute_row_statistic(x, g):
    m = x.max(axis=-1, keepdims=True)
    s = m + nf.log(nf.exp(x - m).sum(axis=-1, keepdims=True))
    return (x / (nf.abs_(s) + 1.0) * g).max(axis=-1)


@pytest.mark.parametrize("schedule", [None, nf.split_k(splits=3)])
def test_a_repair_holding_an_absolute_value(schedule):
    """The running max of x * g / (|logsumexp| + 1) repairs by a ratio of absolute values, which
    SymPy returns as Abs: written back as the IR's abs (an internal NotAlgebraic error before)."""
    x, g = randn(44, 665), randn(665)
    xd = x.double()
    ref = (xd / (torch.logsumexp(xd, -1, keepdim=True).abs() + 1.0) * g.double()).max(-1).values
    torch.testing.assert_close(nf.compile(max_over_an_absolute_row_statistic, schedule=schedule)(x, g).double(), ref,
                               rtol=1e-5, atol=1e-5)


def test_temperature_softmax_with_exp2_and_bias():
    x, b = randn(5, 77), randn(77)
    expected = torch.softmax((x + b) / 0.7 * torch.log(torch.tensor(2.0)), -1)
    torch.testing.assert_close(nf.compile(temperature_softmax_exp2)(x, b, 0.7), expected)


@pytest.mark.parametrize("schedule", [None, nf.split_k(splits=3)])
def test_softmax_entropy_fuses_into_one_pass(schedule):
    """-sum p log p needs the final max and normaliser inside its terms: it splits into basis sums
    that keep the exp(x - max) shift (repaired by rescaling) and recombine after the loop."""
    x = randn(9, 300) * 4
    expected = -(torch.softmax(x.double(), -1) * torch.log_softmax(x.double(), -1)).sum(-1)
    torch.testing.assert_close(nf.compile(softmax_entropy, schedule=schedule)(x).double(), expected,
                               rtol=1e-5, atol=1e-5)
    names = [s.name for s in fuse(softmax_entropy.trace(x))]
    assert any("basis sums" in n for n in names)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_with_the_entropy_of_its_weights(dtype):
    q, k, v = (randn(1, 2, n, 16).to(dtype) for n in (40, 70, 70))
    out, entropy = nf.compile(attention_with_entropy)(q, k, v, 0.3)
    s = (q.double() @ k.double().mT) * 0.3
    p = torch.softmax(s, -1)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    torch.testing.assert_close(out.double(), p @ v.double(), rtol=tol, atol=tol)
    torch.testing.assert_close(entropy.double(), -(p * torch.log_softmax(s, -1)).sum(-1), rtol=tol, atol=tol)


@pytest.mark.parametrize("schedule", [None, nf.flash(block_q=16, block_k=16), nf.split_k(splits=3)])
def test_mask_on_the_weights_fuses(schedule):
    q, k, v = (randn(1, 2, 70, 16) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25)
    out = nf.compile(causal_attention_zero_where, schedule=schedule)(q, k, v, 0.25)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@nf.program
def max_of_scaled_exp(x):
    m = (x * x).min(axis=-1, keepdims=True)
    return nf.exp((x - m) * 2.0).max(axis=-1)


@nf.program
def max_after_a_large_sum(x):
    m = (x * x).sum(axis=-1, keepdims=True)
    return nf.exp(x - m).max(axis=-1)


@pytest.mark.parametrize("schedule", [None, nf.split_k(splits=3)])
def test_running_values_under_a_constant_factor_stay_in_the_loop(schedule):
    """exp((x - m) * 2): the factor 2 is loop-invariant, the running m is not (a regression: its
    repair was hoisted out of the loop)."""
    x = randn(5, 100)
    m = (x.double() ** 2).amin(-1, keepdim=True)
    expected = torch.exp((x.double() - m) * 2).amax(-1)
    torch.testing.assert_close(nf.compile(max_of_scaled_exp, schedule=schedule)(x).double(), expected,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("schedule", [None, nf.split_k(splits=3)])
def test_a_max_that_has_seen_nothing_is_not_rescaled_into_nan(schedule):
    """The max starts at -inf; rescaling it by exp(0 - sum) underflows to 0 and -inf * 0 is NaN (a
    regression). Here the sum reaches ~130, so every factor underflows in float32."""
    x = randn(5, 130)
    out = nf.compile(max_after_a_large_sum, schedule=schedule)(x)
    assert not torch.isnan(out).any()
    expected = torch.exp(x - (x * x).sum(-1, keepdim=True)).amax(-1)  # float32, as the kernel computes it
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-30)


@nf.program
def sum_after_a_max_of_masked_rows(x):
    m = nf.where(nf.index(x, 0) >= 2, x, -nf.inf).max(axis=-1, keepdims=True)  # rows 0, 1: -inf
    return nf.exp((x - m) * -1.0).sum(axis=-1), nf.exp(x - m).sum(axis=-1)  # 0 and inf there


@nf.program
def sum_after_a_max_of_masked_columns(x):
    m = nf.where(nf.index(x, 1) >= 20, x, -nf.inf).max(axis=-1, keepdims=True)  # the first tile sees -inf only
    return nf.exp(x - m).sum(axis=-1)


@pytest.mark.parametrize("schedule", [None, nf.flash(block_q=16, block_k=16), nf.split_k(splits=4, block_k=16)])
@pytest.mark.parametrize("program", [sum_after_a_max_of_masked_rows, sum_after_a_max_of_masked_columns])
def test_sum_reading_a_max_that_saw_only_minus_inf_matches_the_reference(program, schedule):
    """The sum reads x where the max saw -inf, so its terms computed with the stand-in 0 for the
    running max count: they are repaired from 0 (a regression: they were kept as if computed with
    the final max, and a max that ended at -inf was taken as 0)."""
    x = randn(4, 64)
    expected = nf.run_reference(program.trace(x), {"x": x})
    out = nf.compile(program, schedule=schedule)(x)
    for got, want in zip(out if isinstance(out, tuple) else (out,), expected if isinstance(expected, tuple) else (expected,)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if program is sum_after_a_max_of_masked_rows:
        assert out[0][:2].eq(0).all() and out[1][:2].isinf().all()


@nf.program
def max_attention_weighted_value(x, y):
    m = x.max(axis=-1, keepdims=True)
    e = nf.exp(x - m)
    return (e * y / e.sum(axis=-1, keepdims=True)).max(axis=-1)


def test_max_of_softmax_weighted_values():
    """The max member is rescaled by l / l': monotone because l sums exp(...) > 0. The proof does
    not carry over to merging split-K partial states (their signs are not known): explicit split_k
    refuses, the automatic plan (few rows: split-K) falls back to one pass."""
    x, y = randn(2, 600) * 2, randn(2, 600)
    expected = (torch.softmax(x.double(), -1) * y.double()).amax(-1)
    fn = nf.compile(max_attention_weighted_value)
    torch.testing.assert_close(fn(x, y).double(), expected, rtol=1e-5, atol=1e-6)
    named = dict(fn.program_def.bind(x, y))
    assert fn.executable_for(fn.program_def.trace(**named), named).plan.splits == 1
    with pytest.raises(nf.FusionError, match="over split"):
        nf.compile(max_attention_weighted_value, schedule=nf.split_k(splits=3))(x, y)


@nf.program
def max_of_weights_masked_in_the_first_tile(x, y):
    x = nf.where(nf.index(x, 1) >= 20, x, -nf.inf)
    e = nf.exp(x - x.max(axis=-1, keepdims=True))
    return (e * y / e.sum(axis=-1, keepdims=True)).max(axis=-1)


def test_a_running_sum_still_at_zero_is_stood_in_for_as_the_reference_does():
    """The first tile is masked: the running sum is 0 there, and e * y / 0 = nan. Like the
    reference executor the kernel computes with 1 there and repairs from it (a regression: nan)."""
    x, y = randn(4, 64), randn(4, 64)
    expected = nf.run_reference(max_of_weights_masked_in_the_first_tile.trace(x, y), {"x": x, "y": y})
    out = nf.compile(max_of_weights_masked_in_the_first_tile, schedule=nf.flash(block_q=16, block_k=16))(x, y)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    visible = torch.arange(64) >= 20
    torch.testing.assert_close(out, (torch.softmax(x[:, visible], -1) * y[:, visible]).amax(-1), rtol=1e-5, atol=1e-6)


def test_basis_expansion_of_entropy_translation_validation():
    x = randn(6, 50) * 3
    prog = hoist_invariant_factors(inline_elementwise(softmax_entropy.trace(x)))
    expanded = expand_polynomial_reductions(prog, "a1")
    assert expanded is not prog
    torch.testing.assert_close(nf.run_reference(expanded, {"x": x}), nf.run_reference(prog, {"x": x}),
                               rtol=1e-5, atol=1e-5)


def test_polynomial_expansion_translation_validation():
    x = randn(6, 40)
    prog = hoist_invariant_factors(inline_elementwise(variance.trace(x)))
    expanded = expand_polynomial_reductions(prog, "a1")
    assert expanded is not prog
    torch.testing.assert_close(nf.run_reference(expanded, {"x": x}), nf.run_reference(prog, {"x": x}),
                               rtol=1e-5, atol=1e-5)


def test_reductions_across_programs_run_as_separate_kernels():
    """A second reduction along the row axis would span programs: it runs as a kernel of its own
    (schedule/partition.py), never guessed inside the first."""

    @nf.program
    def two_axes(x):
        a = nf.exp(x - x.max(axis=-1, keepdims=True)).sum(axis=-1)
        return a, x.max(axis=0)

    x = randn(70, 40)
    fn = nf.compile(two_axes)
    a, b = fn(x)
    assert fn.fallback_reason is None
    assert any(len(exe.groups) == 2 for exe in fn._cache.values())
    torch.testing.assert_close(b, x.max(0).values)
    torch.testing.assert_close(a, torch.exp(x - x.max(-1, keepdim=True).values).sum(-1))


@nf.program
def max_of_exp_of_a_sum(x):
    total = x.sum(axis=-1, keepdims=True)
    return nf.exp((x - total) * 0.5).max(axis=-1)


@pytest.mark.parametrize("schedule", [None, nf.split_k(splits=3)])
def test_a_sum_no_repair_may_exponentiate_runs_in_an_earlier_kernel(schedule):
    """Partial sums are not bounded by the final one: a rolling exp((x - partial) / 2) overflows
    float32 on the way while the true maximum is tiny (fuzz seed 173 gave nan where the reference
    gives ~0). The one-loop fusion refuses it, naming the stage and the condition; the compiled
    program then runs the sum in an earlier kernel and the max over the finished sum."""
    x = randn(4, 40) * 30
    with pytest.raises(nf.FusionError, match=r"stage 'max0'.*running sum.*overflow"):
        fuse(max_of_exp_of_a_sum.trace(x))
    fn = nf.compile(max_of_exp_of_a_sum, schedule=schedule)
    expected = torch.exp((x.double() - x.double().sum(-1, keepdim=True)) * 0.5).amax(-1)
    torch.testing.assert_close(fn(x), expected.float(), rtol=1e-4, atol=0.0)
    assert any(len(exe.groups) == 2 for exe in fn._cache.values())


@pytest.mark.parametrize("schedule", [None, nf.split_k(splits=4)])
def test_probabilities_and_logsumexp_together(schedule):
    @nf.program
    def probs_and_lse(x):
        m = x.max(axis=-1, keepdims=True)
        e = nf.exp(x - m)
        total = e.sum(axis=-1, keepdims=True)
        return e / total, (m + nf.log(total))[..., 0]

    x = randn(5, 300) * 3
    p, lse = nf.compile(probs_and_lse, schedule=schedule)(x)
    torch.testing.assert_close(p, torch.softmax(x, -1))
    torch.testing.assert_close(lse, torch.logsumexp(x, -1))


def test_softmax_over_a_middle_axis():
    @nf.program
    def softmax_mid(x):
        e = nf.exp(x - x.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    x = randn(3, 50, 7)
    torch.testing.assert_close(nf.compile(softmax_mid)(x), torch.softmax(x, 1))


@nf.program
def window_attention_of_width(q, k, v, width):
    s = nf.einsum("bhqd,bhkd->bhqk", q, k) * 0.25
    i, j = nf.index(s, -2), nf.index(s, -1)
    s = nf.where((i >= j) & (i - j <= width), s, -nf.inf)
    p = nf.exp(s - s.max(axis=-1, keepdims=True))
    return nf.einsum("bhqk,bhkd->bhqd", p, v) / p.sum(axis=-1, keepdims=True)


def test_a_parameter_first_int_then_float_gets_its_own_kernel():
    """The fingerprint (the kernel cache key) includes the parameter kinds: an int width makes
    integer loop bounds, so a later float width must not reuse that kernel (a regression: crash)."""
    q, k, v = (randn(1, 1, 32, 16) for _ in range(3))
    fn = nf.compile(window_attention_of_width)
    i, j = torch.arange(32)[:, None], torch.arange(32)[None, :]
    for width in (4, 4.5, 2.5):
        s = (q @ k.mT * 0.25).masked_fill(~((i >= j) & (i - j <= width)), float("-inf"))
        torch.testing.assert_close(fn(q, k, v, width=width), torch.softmax(s, -1) @ v)
    as_int = window_attention_of_width.trace(q, k, v, width=4)
    as_float = window_attention_of_width.trace(q, k, v, width=4.5)
    assert as_int.param_kinds != as_float.param_kinds and as_int.fingerprint() != as_float.fingerprint()


def test_a_lambda_program_compiles_to_a_kernel_with_an_identifier_name():
    """nf.program(lambda ...) is named "<lambda>" (a regression: the kernel nf_<lambda> did not parse)."""
    softmax = nf.program(lambda x: nf.exp(x - x.max(axis=-1, keepdims=True))
                         / nf.exp(x - x.max(axis=-1, keepdims=True)).sum(axis=-1, keepdims=True))
    x = randn(4, 32)
    torch.testing.assert_close(nf.compile(softmax)(x), torch.softmax(x, -1))
    assert kernel_name("<lambda>").isidentifier() and kernel_name("größe-2").isidentifier()


@nf.program
def float_floor_division_and_modulo(x, y):
    return (x // y).sum(axis=-1), (x % y).sum(axis=-1), (x // 0.1).sum(axis=-1)


def test_float_floor_division_and_modulo_match_torch():
    """Float `//` lowers to a floor division from the remainder (a regression: Triton's // on
    floats failed); it is exact where floor(x / y) is not (1.0 // 0.1 is 9.0). One element per row."""
    x = torch.tensor([1.0, -1.0, 5.5, -5.5, 0.3, -0.3, 7.0, 0.0, -0.0, 2.5, 100.0, -7.25, 1e-3, 3.3, 0.7, 1.0])
    y = torch.tensor([0.1, 0.1, 2.0, 2.0, 0.1, -0.1, -2.0, 0.5, 0.5, -0.5, 0.3, 0.25, 0.1, 1.1, 0.1, -0.0])
    x, y = x[:, None], y[:, None]
    quotient, remainder, by_constant = nf.compile(float_floor_division_and_modulo)(x, y)
    torch.testing.assert_close(quotient, torch.floor_divide(x, y)[:, 0], rtol=0, atol=0)
    torch.testing.assert_close(remainder, torch.remainder(x, y)[:, 0], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(by_constant, torch.floor_divide(x, 0.1)[:, 0], rtol=0, atol=0)
    assert quotient[0] == 9.0


@nf.program
def sum_where_kept(x, keep, offset):
    return nf.where(keep[nf.index(x, -1)] * 100 + offset[nf.index(x, -1)] > 150, x, 0.0).sum(axis=-1)


def test_narrow_integer_inputs_are_widened_to_int32():
    """uint8 and int16 inputs (keep * 100 would wrap in 8 bits: the kernel and the reference compute in int32)."""
    x = randn(4, 16)
    keep = (torch.arange(16) % 3 == 0).to(torch.uint8) * 2
    offset = torch.arange(16, dtype=torch.int16) - 8
    out = nf.compile(sum_where_kept)(x, keep, offset)
    wide = keep.to(torch.int32) * 100 + offset.to(torch.int32)
    expected = torch.where(wide > 150, x, 0.0).sum(-1)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(nf.run_reference(sum_where_kept.trace(x, keep, offset),
                                                {"x": x, "keep": keep, "offset": offset}), expected)
    with pytest.raises(TypeError, match=r"argument 'keep'.*unsupported dtype torch.uint16.*supported"):
        nf.compile(sum_where_kept)(x, keep.to(torch.uint16), offset)
