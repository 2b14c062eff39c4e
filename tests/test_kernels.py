"""Generated kernels under the Triton interpreter, against the reference executor and torch formulas."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import neptune_fusion as nf  # noqa: E402
from neptune_fusion.library import attention, causal_attention, logsumexp, softmax  # noqa: E402

DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


@nf.program
def biased_attention(q, k, v, slopes, scale):
    s = nf.einsum("bhqd,bhkd->bhqk", q, k) * scale
    s = s + slopes[:, None, None] * (nf.index(s, -1) - nf.index(s, -2))
    p = nf.exp(s - s.max(axis=-1, keepdims=True))
    return nf.einsum("bhqk,bhkd->bhqd", p, v) / p.sum(axis=-1, keepdims=True)


@nf.program
def softcap_attention(q, k, v, scale):
    s = nf.einsum("bhqd,bhkd->bhqk", q, k) * scale
    s = 50 * nf.tanh(s / 50)
    p = nf.exp(s - s.max(axis=-1, keepdims=True))
    return nf.einsum("bhqk,bhkd->bhqd", p, v) / p.sum(axis=-1, keepdims=True)


def _qkv(b: int, h: int, lq: int, lk: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(lq * 1000 + lk)
    return tuple(torch.randn(b, h, n, d, generator=g).to(dtype) for n in (lq, lk, lk))


def _check(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype
    assert out.shape == expected.shape
    err = ((out.double() - expected.double()).norm() / expected.double().norm()).item()
    assert err < TOL[dtype], f"relative error {err:.2e}"


def _torch_attention(q, k, v, scale, mask=None, bias=None):
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) * scale
    if bias is not None:
        s = s + bias
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, -1), v.double())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lq,lk", [(64, 64), (45, 77), (100, 33)])
def test_global_attention(dtype, lq, lk):
    q, k, v = _qkv(1, 2, lq, lk, 32, dtype)
    out = nf.compile(attention)(q, k, v, scale=0.2)
    _check(out, _torch_attention(q, k, v, 0.2), dtype)
    ref = nf.run_reference(attention.trace(q, k, v, 0.2), {"q": q, "k": k, "v": v, "scale": 0.2})
    _check(out, ref.to(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 97, 256])
def test_causal_attention(dtype, n):
    q, k, v = _qkv(2, 2, n, n, 16, dtype)
    out = nf.compile(causal_attention)(q, k, v, scale=0.25)
    idx = torch.arange(n)
    _check(out, _torch_attention(q, k, v, 0.25, mask=idx[:, None] >= idx[None, :]), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_attention_with_explicit_blocks(dtype):
    q, k, v = _qkv(1, 2, 90, 90, 16, dtype)
    fn = nf.compile(causal_attention, schedule=nf.flash(block_q=16, block_k=32))
    idx = torch.arange(90)
    _check(fn(q, k, v, scale=0.3), _torch_attention(q, k, v, 0.3, mask=idx[:, None] >= idx[None, :]), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_position_bias(dtype):
    q, k, v = _qkv(1, 4, 50, 70, 16, dtype)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=dtype)  # (fp32 slopes would promote the output)
    out = nf.compile(biased_attention)(q, k, v, slopes, scale=0.25)
    rel = (torch.arange(70)[None, :] - torch.arange(50)[:, None]).double()
    bias = slopes.double()[None, :, None, None] * rel
    _check(out, _torch_attention(q, k, v, 0.25, bias=bias), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softcap_attention(dtype):
    q, k, v = _qkv(1, 2, 64, 100, 32, dtype)
    q = q * 8  # large scores so the cap matters
    out = nf.compile(softcap_attention)(q, k, v, scale=1.0)
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double())
    s = 50 * torch.tanh(s / 50)
    expected = torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, -1), v.double())
    _check(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [17, 100, 256])
def test_softmax(dtype, cols):
    x = (torch.randn(37, cols, generator=torch.Generator().manual_seed(cols)) * 3).to(dtype)
    out = nf.compile(softmax)(x)
    _check(out, torch.softmax(x.double(), -1), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_logsumexp(dtype):
    x = (torch.randn(3, 19, 150, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    out = nf.compile(logsumexp)(x)
    _check(out, torch.logsumexp(x.double(), -1), dtype)


def test_kernel_never_materialises_scores():
    q, k, v = _qkv(1, 1, 64, 64, 16, torch.float32)
    exe = nf.compile(attention)
    named = dict(exe.program_def.bind(q, k, v, 0.1))
    compiled = exe.executable_for(exe.program_def.trace(**named), named)
    stores = compiled.main.source.count("tl.store(")
    assert stores == 1, "only the output is written"
    assert "out_" in compiled.main.source


def test_fully_masked_rows_match_reference():
    @nf.program
    def banded(q, k, v, scale):
        s = nf.einsum("bhqd,bhkd->bhqk", q, k) * scale
        i, j = nf.index(s, -2), nf.index(s, -1)
        s = nf.where((j <= i) & (i < 40), s, -nf.inf)
        p = nf.exp(s - s.max(axis=-1, keepdims=True))
        return nf.einsum("bhqk,bhkd->bhqd", p, v) / p.sum(axis=-1, keepdims=True)

    q, k, v = _qkv(1, 1, 64, 64, 16, torch.float32)
    out = nf.compile(banded)(q, k, v, scale=0.3)
    ref = nf.run_reference(banded.trace(q, k, v, 0.3), {"q": q, "k": k, "v": v, "scale": 0.3})
    torch.testing.assert_close(out, ref, equal_nan=True, rtol=1e-4, atol=1e-5)
    assert torch.isnan(out[0, 0, 40:]).all()  # plain code divides 0 by 0 here, as torch does


def test_scale_is_a_runtime_parameter():
    q, k, v = _qkv(1, 1, 32, 32, 16, torch.float32)
    fn = nf.compile(attention)
    a, b = fn(q, k, v, scale=0.1), fn(q, k, v, scale=0.5)
    _check(b, _torch_attention(q, k, v, 0.5), torch.float32)
    assert not torch.allclose(a, b)
    assert len(fn._cache) == 1  # one compiled kernel for both scales


def test_bad_inputs_raise_before_launch():
    q, k, v = _qkv(1, 2, 32, 32, 16, torch.float32)
    fn = nf.compile(attention)
    with pytest.raises(ValueError, match="do not match"):
        fn(q, k[..., :8], v, scale=0.1)
    with pytest.raises(ValueError, match="rank"):
        fn(q, k, v[0], scale=0.1)
    with pytest.raises(TypeError, match="dtype"):
        fn(q.double(), k.double(), v.double(), scale=0.1)
    with pytest.raises(TypeError):
        fn(q, k, v, scale="x")


def test_parameters_outside_the_kernel_ranges_raise_before_launch():
    """Float parameters are float32 in kernels, int ones int32 (a regression: scale=1e300 returned NaN
    silently, an int beyond int64 failed in Triton's specialisation)."""
    q, k, v = _qkv(1, 1, 16, 16, 16, torch.float32)
    with pytest.raises(ValueError, match=r"scalar parameter 'scale' = 1e\+300 is outside the float32 range"):
        nf.compile(attention)(q, k, v, scale=1e300)

    @nf.program
    def shifted_sum(x, shift):
        return nf.exp(x - x.max(axis=-1, keepdims=True)).sum(axis=-1) + shift

    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match=r"scalar parameter 'shift' = 1180591620717411303424 is outside the int32"):
        nf.compile(shifted_sum)(x, 2**70)
    torch.testing.assert_close(nf.compile(shifted_sum)(x, 2**31 - 1), torch.softmax(x, -1).sum(-1) + (2**31 - 1))


def test_cuda_required_outside_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = _qkv(1, 1, 16, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="CUDA"):
        nf.compile(attention)(q, k, v, scale=0.1)


def test_a_reduction_without_a_repair_runs_in_a_later_kernel():
    """sum(sin(x - max)) has no repair for a change of the max: the sum runs in a second kernel
    that reads the finished max."""
    @nf.program
    def sin_chain(x):
        m = x.max(axis=-1, keepdims=True)
        return nf.sin(x - m).sum(axis=-1)

    x = torch.randn(8, 40)
    fn = nf.compile(sin_chain)
    torch.testing.assert_close(fn(x), torch.sin(x - x.max(-1, keepdim=True).values).sum(-1))
    assert any(len(exe.groups) == 2 for exe in fn._cache.values())
    assert "could not join the fused loop" in nf.explain(sin_chain, x)


def test_unfusable_program_falls_back_when_allowed():
    """A contraction over two axes at once whose tile cannot fit (a plan refused at planning)."""
    prog = nf.program(lambda a, b: nf.einsum("bik,bkn->in", a, b))
    a, b = torch.randn(1, 1, 130), torch.randn(1, 130, 5)
    with pytest.raises(nf.FusionError):
        nf.compile(prog)(a, b)
    with pytest.warns(UserWarning, match="unfused"):
        out = nf.compile(prog, allow_fallback=True)(a, b)
    torch.testing.assert_close(out, torch.einsum("bik,bkn->in", a, b), atol=1e-5, rtol=1e-5)


def test_any_power_compiles_as_torch_pow_computes_it():
    """`x ** c` for any constant c, and `x ** y` for a tensor y, as torch.pow on floats: negative
    bases with odd and fractional exponents, signed zeros, infinities, NaN, (-1) ** inf; scalar
    bases and exponents; forward and gradient (0 at a zero base, as torch's)."""
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, math.nan, -2.0, 0.5, 3.0, -0.25])
    x = torch.cat([special, torch.randn(53) * 3]).reshape(64, 1)
    def power_sum(c: float) -> nf.ProgramDef:  # (the exponent a constant of the program, not a parameter)
        return nf.program(lambda x: (x ** c).sum(axis=-1))

    for c in (1.3, -0.7, 10.0, 9.0, -11.0, 7.5, -2.5, math.inf, -math.inf, 0.0, math.nan):
        got = nf.compile(power_sum(c))(x)
        torch.testing.assert_close(got.double(), (x.double() ** c).sum(-1), rtol=1e-4, atol=1e-5, equal_nan=True)
    exponents = torch.tensor([math.nan, math.inf, -math.inf, 0.0, 0.5, -0.5, 3.0, -3.0, 2.5])
    pairs = torch.cartesian_prod(special, exponents)
    base, exponent = pairs[:, :1].contiguous(), pairs[:, 1:].contiguous()
    got = nf.compile(nf.program(lambda x, y: (x ** y).sum(axis=-1)))(base, exponent)
    torch.testing.assert_close(got.double(), (base.double() ** exponent.double()).sum(-1), rtol=1e-5, atol=1e-6,
                               equal_nan=True)
    # a scalar exponent (a parameter), a scalar base, a column of exponents with its gradient
    z = torch.randn(8, 32)
    mean = nf.compile(nf.program(lambda x, p: ((nf.abs_(x) ** p).mean(axis=-1)) ** (1 / p)))(z, 3.0)
    torch.testing.assert_close(mean, (z.abs() ** 3).mean(-1) ** (1 / 3), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(nf.compile(nf.program(lambda x: (2.0 ** x).sum(axis=-1)))(z), (2.0 ** z).sum(-1))
    base = torch.cat([torch.zeros(8, 1), torch.rand(8, 31) + 0.1], 1).requires_grad_()
    column = torch.cat([torch.tensor([[0.0], [1.5]]), torch.rand(6, 1) * 2 + 1]).requires_grad_()
    got = torch.autograd.grad(nf.compile(nf.program(lambda x, y: (x ** y).max(axis=-1)))(base, column).sum(),
                              [base, column])
    want = torch.autograd.grad((base ** column).amax(-1).sum(), [base, column])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    y = torch.randn(6, 40)
    yg = y.clone().requires_grad_()
    out = nf.compile(nf.program(lambda y: (nf.abs_(y) ** 1.3).sum(axis=-1)))(yg)
    out.backward(torch.arange(6.0))
    y64 = y.double().requires_grad_()
    ((y64.abs() ** 1.3).sum(-1) * torch.arange(6.0, dtype=torch.float64)).sum().backward()
    torch.testing.assert_close(out.double(), (y.double().abs() ** 1.3).sum(-1), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(yg.grad.double(), y64.grad, atol=1e-4, rtol=1e-4)


def test_half_integer_and_negative_powers_compile():
    """`x ** c` for c a multiple of 1/2 (|c| <= 8) lowers to products of x and sqrt(x), inverted
    for c < 0: a norm written `(ms + eps) ** -0.5`, forward and gradient."""
    x = torch.randn(6, 40)

    @nf.program
    def powers(x):
        a = nf.abs_(x) + 0.5
        return (a ** 2.5).sum(axis=-1) + (a ** -2).sum(axis=-1) + (a ** 0.5).max(axis=-1)

    a = x.abs() + 0.5
    torch.testing.assert_close(nf.compile(powers)(x), (a ** 2.5).sum(-1) + (a ** -2).sum(-1) + (a ** 0.5).amax(-1),
                               atol=1e-4, rtol=1e-5)

    @nf.program
    def rmsnorm_max(x):
        return (x * ((x * x).sum(axis=-1, keepdims=True) / x.shape[-1] + 1e-5) ** -0.5).max(axis=-1)

    xg = x.clone().requires_grad_()
    nf.compile(rmsnorm_max)(xg).sum().backward()
    x64 = x.double().requires_grad_()
    (x64 * ((x64 * x64).mean(-1, keepdim=True) + 1e-5) ** -0.5).amax(-1).sum().backward()
    torch.testing.assert_close(xg.grad.double(), x64.grad, atol=1e-4, rtol=1e-4)


def test_explain_shows_every_stage():
    q, k, v = _qkv(1, 1, 32, 32, 16, torch.float16)
    text = nf.explain(causal_attention, q, k, v, scale=0.1)
    for needle in ("rolling loop over", "repair when", "exp(max0.old - max0.new)", "tile kernel",
                   "@triton.jit", "fully visible tiles"):
        assert needle in text, needle
    assert math.isfinite(len(text))


@pytest.mark.parametrize("program", [attention, causal_attention])
def test_tensor_descriptor_loads(monkeypatch, program):
    """Tiles read through tensor descriptors (TMA on Hopper) give the same result, masks included."""
    monkeypatch.setenv("NEPTUNE_FUSION_TMA", "force")
    q, k, v = _qkv(1, 2, 70, 70, 32, torch.float16)
    fn = nf.compile(program, schedule=nf.flash(block_q=32, block_k=16))
    named = dict(fn.program_def.bind(q, k, v, 0.2))
    exe = fn.executable_for(fn.program_def.trace(**named), named)
    assert "make_tensor_descriptor" in exe.main.source
    idx = torch.arange(70)
    mask = idx[:, None] >= idx[None, :] if program is causal_attention else None
    _check(fn(q, k, v, scale=0.2), _torch_attention(q, k, v, 0.2, mask=mask), torch.float16)


def test_split_k_loads_through_pointers(monkeypatch):
    """Split-K (memory-bound) reads key tiles through pointers where tensor descriptors are allowed."""
    monkeypatch.setenv("NEPTUNE_FUSION_TMA", "force")
    q, k, v = _qkv(1, 2, 1, 200, 32, torch.float16)
    fn = nf.compile(attention, schedule=nf.split_k(splits=4, block_k=16))
    named = dict(fn.program_def.bind(q, k, v, 0.2))
    exe = fn.executable_for(fn.program_def.trace(**named), named)
    assert "make_tensor_descriptor" not in exe.main.source
    _check(fn(q, k, v, scale=0.2), _torch_attention(q, k, v, 0.2), torch.float16)


def test_positive_scale_specialisation_keeps_negative_scales_correct():
    """Kernels take max(s) * scale for a positive scale; a negative scale gets its own kernel."""
    q, k, v = _qkv(1, 2, 40, 60, 16, torch.float32)
    fn = nf.compile(causal_attention)
    idx = torch.arange(60)
    mask = idx[None, :40].T >= idx[None, :]
    for scale in (0.3, -0.3, 0.2):
        _check(fn(q, k, v, scale=scale), _torch_attention(q, k, v, scale, mask=mask[:40]), torch.float32)
    assert len(fn._cache) == 2
    named = dict(fn.program_def.bind(q, k, v, 0.3))
    assert "_max_nan(dot" in fn.executable_for(fn.program_def.trace(**named), named).main.source


def test_explain_accepts_a_traced_program():
    q, k, v = _qkv(1, 2, 40, 40, 16, torch.float32)
    causal = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx  # noqa: E731
    text = nf.explain(nf.attention_program(q, k, v, mask_mod=causal), **nf.attention_inputs(q, k, v, mask_mod=causal))
    assert "rolling loop over" in text and "fully visible tiles" in text


def test_autotune_times_candidates_and_remembers(tmp_path, monkeypatch):
    from neptune_fusion.runtime import autotune as tuner

    monkeypatch.setenv("NEPTUNE_FUSION_CACHE_DIR", str(tmp_path))
    q, k, v = _qkv(1, 2, 64, 64, 16, torch.float32)
    fn = nf.compile(causal_attention, schedule=nf.autotune())
    idx = torch.arange(64)
    _check(fn(q, k, v, scale=0.2), _torch_attention(q, k, v, 0.2, mask=idx[:, None] >= idx[None, :]), torch.float32)
    assert len(tuner.last_report) >= 2 and all("us" in r or "rejected" in r for r in tuner.last_report)
    assert (tmp_path / "autotune.json").exists()
    tuner.last_report = []
    fn2 = nf.compile(causal_attention, schedule=nf.autotune())
    _check(fn2(q, k, v, scale=0.2), _torch_attention(q, k, v, 0.2, mask=idx[:, None] >= idx[None, :]), torch.float32)
    assert tuner.last_report == []  # the remembered choice was used, nothing timed again


def test_non_finite_scalars_are_refused_on_every_call():
    q, k, v = _qkv(1, 1, 16, 16, 16, torch.float32)
    fn = nf.compile(attention)
    fn(q, k, v, scale=0.1)
    with pytest.raises(ValueError, match="finite"):
        fn(q, k, v, scale=float("nan"))


@pytest.mark.parametrize("schedule", [None, nf.split_k(splits=3)])
def test_bfloat16_under_the_interpreter(schedule):
    """The interpreter computes bf16 wrongly; tiles are converted to f32 after loading there."""
    q, k, v = (t.bfloat16() for t in _qkv(1, 2, 64, 64, 32, torch.float32))
    out = nf.compile(causal_attention, schedule=schedule)(q, k, v, scale=0.2)
    idx = torch.arange(64)
    expected = _torch_attention(q.float(), k.float(), v.float(), 0.2, mask=idx[:, None] >= idx[None, :])
    assert out.dtype == torch.bfloat16
    assert ((out.double() - expected).norm() / expected.norm()).item() < 1e-2


@pytest.mark.parametrize("make, error, message", [
    (lambda: nf.flash(block_q=16.0), TypeError, r"block_q must be an int or None, got float 16.0"),
    (lambda: nf.flash(num_warps="4"), TypeError, r"num_warps must be an int"),
    (lambda: nf.flash(prefetch_dot=1), TypeError, r"prefetch_dot must be a bool"),
    (lambda: nf.split_k(splits=2.5), TypeError, r"splits must be an int"),
    (lambda: nf.autotune(max_candidates=None), TypeError, r"max_candidates must be an int"),
    (lambda: nf.autotune(base="flash"), TypeError, r"base must be nf.flash\(\)"),
    (lambda: nf.flash(block_q=24), ValueError, r"block_q must be a power of two >= 16, got 24"),
])
def test_schedule_arguments_are_validated_with_clear_errors(make, error, message):
    """Types are checked before values (a regression: block_q=16.0 failed inside the check with
    "unsupported operand type(s) for &")."""
    with pytest.raises(error, match=message):
        make()
