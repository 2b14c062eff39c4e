"""torch.nn.functional and friends inside `nf.compile` (lang/torch_nn/), against torch itself.

Each program runs as kernels under the Triton interpreter and is compared with the same function
run eagerly by torch on the same tensors: activations on edge values (softplus past its threshold,
logsigmoid of large negative inputs, NaN), normalisations, norms, statistics, einsum and losses
(ignored targets, label smoothing, class weights, probabilities as targets), alone (a program with no
reduction) and beside or before a reduction. The gradients of a representative subset go
through the derived backward and are compared with torch autograd.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from typing import Any, Callable  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402, N812

import neptune_fusion as nf  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::UserWarning")

# edge values, written into the first row of the activations' input
EDGES = [-100.0, -30.0, -20.0, -5.0, -3.0, -1.0, -1e-3, 0.0, 1e-4, 0.05, 1.0, 3.0, 6.0, 19.9, 20.1, 100.0,
         float("nan")]


def _tuple(x: Any) -> tuple[Any, ...]:
    return x if isinstance(x, tuple) else (x,)


def check(fn: Callable[..., Any], *args: torch.Tensor, atol: float = 1e-5, rtol: float = 1e-5) -> Any:
    """`nf.compile(fn)(*args)` equals `fn(*args)` run by torch (values, shapes and dtypes)."""
    got, want = _tuple(nf.compile(fn)(*args)), _tuple(fn(*args))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
        torch.testing.assert_close(g, w, atol=atol, rtol=rtol, equal_nan=True)
    return got


def check_grad(fn: Callable[..., Any], *args: torch.Tensor, atol: float = 1e-4, rtol: float = 1e-4) -> None:
    """The gradients of `fn`'s outputs (random seeds) wrt its float arguments, as torch autograd gives them."""
    ours = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    theirs = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    got, want = _tuple(nf.compile(fn)(*ours)), _tuple(fn(*theirs))
    gen = torch.Generator().manual_seed(7)
    seeds = [torch.randn(w.shape, generator=gen) for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=atol, rtol=rtol)
    torch.autograd.backward(got, seeds)
    torch.autograd.backward(want, seeds)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if b.requires_grad:
            assert a.grad is not None, f"no gradient for argument {i}"
            torch.testing.assert_close(a.grad, b.grad, atol=atol, rtol=rtol, msg=lambda m, i=i: f"argument {i}: {m}")


@pytest.fixture
def x(randn: Callable[..., torch.Tensor]) -> torch.Tensor:
    """(16, 24) values spread over [-10, 10] or so, with the edge values in the first row."""
    v = randn(16, 24, scale=3.0)
    v[0, :len(EDGES)] = torch.tensor(EDGES)
    return v


# --------------------------------------------------------------------------- activations


ACTIVATIONS: dict[str, Callable[[Any], Any]] = {
    "silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh"), "softplus": F.softplus,
    "softplus_beta": lambda v: F.softplus(v, beta=2.0, threshold=5.0), "mish": F.mish, "elu": F.elu,
    "elu_alpha": lambda v: F.elu(v, alpha=0.5), "selu": F.selu, "celu": lambda v: F.celu(v, alpha=2.0),
    "leaky_relu": F.leaky_relu, "leaky_relu_slope": lambda v: F.leaky_relu(v, 0.2), "relu": F.relu,
    "relu_inplace_false": lambda v: F.relu(v, inplace=False), "relu6": F.relu6, "hardtanh": F.hardtanh,
    "hardtanh_bounds": lambda v: F.hardtanh(v, -2.0, 0.5), "hardsigmoid": F.hardsigmoid,
    "hardswish": F.hardswish, "logsigmoid": F.logsigmoid, "softsign": F.softsign, "erf": torch.erf,
    "erf_method": lambda v: v.erf(), "erfc": torch.erfc, "special_erf": torch.special.erf,
    "F_sigmoid": F.sigmoid, "F_tanh": F.tanh, "expm1": torch.expm1, "log1p": lambda v: torch.log1p(v.abs()),
    "dropout_eval": lambda v: F.dropout(v, 0.3, training=False),
    "tanhshrink": F.tanhshrink, "threshold": lambda v: F.threshold(v, 0.1, 20.0), "softshrink": F.softshrink,
    "hardshrink": lambda v: F.hardshrink(v, 0.7), "rrelu_eval": lambda v: F.rrelu(v, training=False),
    "softmin": lambda v: F.softmin(v, -1),
}


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activation(name: str, x: torch.Tensor) -> None:
    f = ACTIVATIONS[name]
    # relative: tails too (softplus(-30), logsigmoid(20)); GELU's 1 + erf(x) cancels for x << 0, in torch as here
    # GELU's 1 + erf(x) and tanhshrink's x - tanh(x) cancel near 0, in torch as here
    atol = 1e-6 if name.startswith("gelu") or name == "tanhshrink" else 1e-30
    check(lambda v: f(v), x, atol=atol, rtol=4e-6)
    check(lambda v: f(v).sum(-1), x, atol=1e-5, rtol=1e-5)  # beside a reduction; its sum may cancel


@pytest.mark.parametrize("name", ["gelu", "erfc", "softplus", "mish", "selu"])
def test_activation_alone(name: str, x: torch.Tensor) -> None:
    atol = 1e-6 if name.startswith("gelu") else 1e-30
    f = ACTIVATIONS[name]
    check(lambda v: f(v), x, atol=atol, rtol=4e-6)


def test_builtin_needs_a_python_function(x: torch.Tensor) -> None:
    with pytest.raises(TypeError, match="wrap it in a Python function"):
        nf.compile(F.gelu)


@pytest.mark.parametrize("name", ["gelu", "silu", "softplus", "hardswish", "logsigmoid"])
def test_activation_fp16(name: str, randn: Callable[..., torch.Tensor]) -> None:
    f, v = ACTIVATIONS[name], randn(16, 24, scale=3.0, dtype=torch.float16)
    w = randn(24, 8, dtype=torch.float16)
    check(lambda v, w: f(v) @ w, v, w, atol=2e-2, rtol=1e-2)


def test_inplace_and_training_dropout_are_refused(x: torch.Tensor) -> None:
    with pytest.raises(TypeError, match="inplace=True"):
        nf.compile(lambda v: F.silu(v, inplace=True).sum(-1))(x)
    with pytest.raises(TypeError, match="inplace=True"):
        nf.compile(lambda v: F.relu(v, inplace=True).sum(-1))(x)
    with pytest.raises(TypeError, match="random numbers"):
        nf.compile(lambda v: F.dropout(v, 0.1).sum(-1))(x)
    with pytest.raises(ValueError, match="approximate"):
        nf.compile(lambda v: F.gelu(v, approximate="fast").sum(-1))(x)


# --------------------------------------------------------------------------- linear maps, views, einsum


@pytest.mark.parametrize("bias", [False, True])
def test_linear(bias: bool, randn: Callable[..., torch.Tensor]) -> None:
    v, w, b = randn(2, 8, 24), randn(12, 24), randn(12)
    if bias:
        check(lambda v, w, b: F.linear(v, w, b), v, w, b, atol=1e-4)
    else:
        check(lambda v, w: F.linear(v, w), v, w, atol=1e-4)
    check(lambda v, w: F.linear(v, w), v, randn(24), atol=1e-4)  # a 1-D weight


def test_views(randn: Callable[..., torch.Tensor]) -> None:
    v, w = randn(4, 8, 6), randn(8, 5)
    check(lambda v, w: v.permute(0, 2, 1) @ w, v, w, atol=1e-4)
    check(lambda v, w: torch.permute(v, (2, 0, 1)).sum(-1) @ w.t(), v, randn(5, 4), atol=1e-4)
    check(lambda v, w: torch.transpose(v, 1, 2) @ w, v, w, atol=1e-4)
    check(lambda v: torch.unsqueeze(v, 1).sum(-1), v)


EINSUMS = [
    ("ij,jk->ik", [(16, 24), (24, 8)]),
    ("ij,jk", [(16, 24), (24, 8)]),  # implicit output: the letters seen once, sorted
    ("ba,bc", [(16, 24), (16, 8)]),  # implicit, sorted: 'ac'
    ("ij,ij", [(16, 24), (16, 24)]),  # implicit: a scalar
    ("bij,bjk", [(2, 8, 6), (2, 6, 5)]),
    ("...ij,jk->...ik", [(2, 8, 6), (6, 5)]),
    ("...ij,...jk->...ik", [(2, 3, 8, 6), (2, 3, 6, 5)]),
    ("...ij,...jk", [(2, 8, 6), (6, 5)]),  # implicit with an ellipsis: its dims first
    ("i j , j k -> k i", [(8, 6), (6, 5)]),
]


@pytest.mark.parametrize("spec,shapes", EINSUMS)
def test_einsum(spec: str, shapes: list[tuple[int, ...]], randn: Callable[..., torch.Tensor]) -> None:
    ops = [randn(*s) for s in shapes]
    check(lambda a, b: torch.einsum(spec, a, b), *ops, atol=1e-4)
    check(lambda a, b: torch.einsum(spec, [a, b]), *ops, atol=1e-4)  # the list form


# --------------------------------------------------------------------------- normalisation, norms, statistics


@pytest.mark.parametrize("shape,normalized,affine", [
    ((16, 24), (24,), "both"), ((16, 24), (24,), "none"), ((16, 24), [24], "weight"), ((2, 8, 24), (8, 24), "both"),
])
def test_layer_norm(shape: tuple[int, ...], normalized: Any, affine: str, randn: Callable[..., torch.Tensor]) -> None:
    v = randn(*shape, scale=2.0) + 1.5
    trailing = shape[-2:] if isinstance(normalized, tuple) and len(normalized) == 2 else shape[-1:]
    g, b, w = randn(*trailing), randn(*trailing), randn(shape[-1], 6)
    if affine == "both":
        check(lambda v, g, b, w: F.layer_norm(v, normalized, g, b, eps=1e-3) @ w, v, g, b, w, atol=1e-4)
    elif affine == "weight":
        check(lambda v, g, w: F.layer_norm(v, normalized, weight=g) @ w, v, g, w, atol=1e-4)
    else:
        check(lambda v, w: F.layer_norm(v, normalized) @ w, v, w, atol=1e-4)


def test_layer_norm_rms_norm_fp16(randn: Callable[..., torch.Tensor]) -> None:
    v, g, b = randn(16, 24, dtype=torch.float16), randn(24, dtype=torch.float16), randn(24, dtype=torch.float16)
    w = randn(24, 8, dtype=torch.float16)
    check(lambda v, g, b, w: F.layer_norm(v, (24,), g, b) @ w, v, g, b, w, atol=3e-2, rtol=1e-2)
    check(lambda v, g, w: F.rms_norm(v, (24,), g) @ w, v, g, w, atol=3e-2, rtol=1e-2)


@pytest.mark.parametrize("eps", [None, 1e-3])
def test_rms_norm(eps: float | None, randn: Callable[..., torch.Tensor]) -> None:
    v, g, w = randn(16, 24), randn(24), randn(24, 8)
    v[3] *= 1e-4  # a row whose mean square is near eps: the default eps shows
    check(lambda v, g, w: F.rms_norm(v, [24], g, eps=eps) @ w, v, g, w, atol=1e-4)
    check(lambda v, w: F.rms_norm(v.unsqueeze(0), (16, 24), eps=eps).sum(0) @ w, v, w, atol=1e-4)


@pytest.mark.parametrize("p,dim", [(2.0, 1), (2.0, -1), (1.0, 0), (3.0, -1), (float("inf"), 1)])
def test_normalize(p: float, dim: int, randn: Callable[..., torch.Tensor]) -> None:
    v, w = randn(16, 24), randn(24, 8)
    v[2] = 0.0  # a zero row: the norm is clamped at eps, the row stays 0
    check(lambda v, w: F.normalize(v, p=p, dim=dim) @ w, v, w, atol=1e-4)
    check(lambda v: F.normalize(v, dim=-1, eps=0.5).sum(-1), v * 0.01)  # every norm below eps


NORMS: dict[str, Callable[[Any], Any]] = {
    "norm_all": lambda v: torch.norm(v), "norm_dim": lambda v: torch.norm(v, dim=-1), "norm_fro": lambda v: torch.norm(v, "fro"),
    "norm_method_p1": lambda v: v.norm(p=1, dim=0), "norm_keepdim": lambda v: v.norm(2, -1, True),
    "vector_norm": lambda v: torch.linalg.vector_norm(v, dim=1),
    "vector_norm_inf": lambda v: torch.linalg.vector_norm(v, float("inf"), dim=-1),
    "vector_norm_neg_inf": lambda v: torch.linalg.vector_norm(v, -math.inf, dim=-1),
    "vector_norm_0": lambda v: torch.linalg.vector_norm(torch.relu(v), 0, dim=-1),
    "vector_norm_3": lambda v: torch.linalg.vector_norm(v, 3, dim=(0, 1)),
    "vector_norm_half": lambda v: torch.linalg.vector_norm(v, 0.5, dim=-1, keepdim=True),
    "linalg_norm": lambda v: torch.linalg.norm(v, dim=-1), "linalg_norm_all": lambda v: torch.linalg.norm(v),
    "linalg_norm_ord1": lambda v: torch.linalg.norm(v, 1, dim=0),
}


@pytest.mark.parametrize("name", list(NORMS))
def test_norms(name: str, randn: Callable[..., torch.Tensor]) -> None:
    check(NORMS[name], randn(16, 24), atol=1e-4, rtol=1e-5)


def test_matrix_norms_are_refused(randn: Callable[..., torch.Tensor]) -> None:
    with pytest.raises(TypeError, match="matrix norm"):
        nf.compile(lambda v: torch.norm(v, "nuc"))(randn(16, 24))
    with pytest.raises(TypeError, match="matrix norm"):
        nf.compile(lambda v: torch.linalg.norm(v, 2))(randn(16, 24))


STATISTICS: dict[str, Callable[[Any], Any]] = {
    "var_all": lambda v: torch.var(v), "var_dim": lambda v: torch.var(v, -1), "var_unbiased_positional": lambda v: torch.var(v, 1, False),
    "var_unbiased_only": lambda v: torch.var(v, False), "var_correction": lambda v: v.var(dim=0, correction=0, keepdim=True),
    "var_correction_2": lambda v: v.var(-1, correction=2), "var_dims": lambda v: v.var(dim=(0, 1)),
    "var_keepdim_positional": lambda v: v.var(1, True, True), "std_dim": lambda v: torch.std(v, dim=-1),
    "std_unbiased": lambda v: v.std(-1, unbiased=False), "std_all": lambda v: torch.std(v, True),
    "var_mean": lambda v: torch.var_mean(v, 1), "var_mean_keepdim": lambda v: torch.var_mean(v, 0, keepdim=True),
    "std_mean": lambda v: torch.std_mean(v, dim=-1, correction=0),
}


@pytest.mark.parametrize("name", list(STATISTICS))
def test_statistics(name: str, randn: Callable[..., torch.Tensor]) -> None:
    check(STATISTICS[name], randn(16, 24, scale=2.0) + 3.0, atol=1e-4, rtol=1e-5)


def test_variance_of_one_element(randn: Callable[..., torch.Tensor]) -> None:
    (out,) = check(lambda v: torch.var(v, -1), randn(16, 1))  # N - correction = 0: NaN, as torch
    assert torch.isnan(out).all()
    check(lambda v: torch.var(v, -1, correction=0), randn(16, 1))


def test_cosine_similarity(randn: Callable[..., torch.Tensor]) -> None:
    a, b = randn(16, 24), randn(16, 24)
    a[1] *= 1e-9  # a norm below eps: clamped (each norm on its own, as torch)
    check(lambda a, b: F.cosine_similarity(a, b), a, b)
    check(lambda a, b: F.cosine_similarity(a, b, dim=-1, eps=1e-3), a, b)
    check(lambda a, b: torch.cosine_similarity(a, b, dim=0), a, b)
    check(lambda a, b: F.cosine_similarity(a, b, dim=-1), a, randn(24))  # broadcast against a vector


# --------------------------------------------------------------------------- losses


@pytest.fixture
def logits_target(randn: Callable[..., torch.Tensor],
                  randint: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(16, 10) logits and integer targets with three rows at ignore_index -100."""
    t = randint(0, 10, 16)
    t[[2, 7, 11]] = -100
    return randn(16, 10, scale=2.0), t


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_cross_entropy(reduction: str, smoothing: float, logits_target: tuple[torch.Tensor, torch.Tensor]) -> None:
    s, t = logits_target
    check(lambda s, t: F.cross_entropy(s, t, reduction=reduction, label_smoothing=smoothing), s, t)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_class_weights(reduction: str, logits_target: tuple[torch.Tensor, torch.Tensor],
                                     randn: Callable[..., torch.Tensor]) -> None:
    s, t = logits_target
    weight = randn(10).abs()
    check(lambda s, t, w: F.cross_entropy(s, t, weight=w, reduction=reduction), s, t, weight)
    check(lambda s, t, w: F.cross_entropy(s, t, weight=w, reduction=reduction, label_smoothing=0.1), s, t, weight)


def test_cross_entropy_ignore_index(logits_target: tuple[torch.Tensor, torch.Tensor]) -> None:
    s, t = logits_target
    t = torch.where(t < 0, 3, t)
    check(lambda s, t: F.cross_entropy(s, t, ignore_index=3), s, t)  # a valid class ignored
    check(lambda s, t: F.cross_entropy(s, t, reduction="none", ignore_index=3), s, t)
    everything = torch.full_like(t, -100)  # mean over no target: NaN, as torch
    (out,) = check(lambda s, t: F.cross_entropy(s, t), s, everything)
    assert torch.isnan(out)
    check(lambda s, t: F.cross_entropy(s, t, reduction="sum"), s, everything)


def test_cross_entropy_shapes_and_dtypes(randn: Callable[..., torch.Tensor],
                                         randint: Callable[..., torch.Tensor]) -> None:
    check(lambda s, t: F.cross_entropy(s, t), randn(10), torch.tensor(4))  # one sample: (C,) and a 0-d target
    t = randint(0, 10, 4, 6)
    t[0, 1] = -100
    check(lambda s, t: F.cross_entropy(s, t), randn(4, 10, 6), t)  # (N, C, d) and (N, d)
    check(lambda s, t: F.cross_entropy(s, t, reduction="none"), randn(4, 10, 6), t)
    s16 = randn(16, 10, dtype=torch.float16)
    check(lambda s, t: F.cross_entropy(s, t), s16, randint(0, 10, 16), atol=1e-2, rtol=1e-2)
    s, t = randn(16, 10), randint(0, 10, 16)  # int32 targets (torch takes int64 only)
    torch.testing.assert_close(nf.compile(lambda s, t: F.cross_entropy(s, t))(s, t.int()), F.cross_entropy(s, t))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.3])
def test_cross_entropy_probabilities(reduction: str, smoothing: float, randn: Callable[..., torch.Tensor]) -> None:
    s, p = randn(16, 10), torch.softmax(randn(16, 10), -1)
    check(lambda s, p: F.cross_entropy(s, p, reduction=reduction, label_smoothing=smoothing), s, p)
    check(lambda s, p, w: F.cross_entropy(s, p, weight=w, reduction=reduction), s, p, randn(10).abs())


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_nll_loss(reduction: str, logits_target: tuple[torch.Tensor, torch.Tensor],
                  randn: Callable[..., torch.Tensor]) -> None:
    s, t = logits_target
    check(lambda s, t: F.nll_loss(F.log_softmax(s, -1), t, reduction=reduction), s, t)
    check(lambda s, t, w: F.nll_loss(torch.log_softmax(s, 1), t, w, reduction=reduction), s, t, randn(10).abs())
    check(lambda s, t: F.nll_loss(s.log_softmax(-1), t, ignore_index=1, reduction=reduction),
          s, torch.where(t < 0, 1, t))


@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean", "none"])
@pytest.mark.parametrize("log_target", [False, True])
def test_kl_div(reduction: str, log_target: bool, randn: Callable[..., torch.Tensor]) -> None:
    s, p = randn(16, 10), torch.softmax(randn(16, 10, scale=3.0), -1)
    p[0, :3] = 0.0  # zero probabilities contribute 0 (xlogy)
    target = torch.log_softmax(randn(16, 10), -1) if log_target else p

    def fn(s: Any, q: Any) -> Any:
        loss = F.kl_div(F.log_softmax(s, -1), q, reduction=reduction, log_target=log_target)
        return (loss, loss.sum()) if reduction == "none" else loss

    check(fn, s, target)


POINTWISE: dict[str, Callable[..., Any]] = {
    "mse": F.mse_loss, "l1": F.l1_loss, "smooth_l1": F.smooth_l1_loss,
    "smooth_l1_beta": lambda a, b, **k: F.smooth_l1_loss(a, b, beta=0.5, **k),
    "smooth_l1_beta0": lambda a, b, **k: F.smooth_l1_loss(a, b, beta=0.0, **k),
    "huber": F.huber_loss, "huber_delta": lambda a, b, **k: F.huber_loss(a, b, delta=0.5, **k),
}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("name", list(POINTWISE))
def test_pointwise_losses(name: str, reduction: str, randn: Callable[..., torch.Tensor]) -> None:
    f = POINTWISE[name]

    def fn(a: Any, b: Any) -> Any:
        loss = f(a, b, reduction=reduction)
        return (loss, loss.sum(-1)) if reduction == "none" else loss

    check(fn, randn(16, 24), randn(16, 24, scale=1.5))


def test_weighted_and_legacy_losses(randn: Callable[..., torch.Tensor]) -> None:
    a, b, w = randn(16, 24), randn(16, 24), randn(16, 24).abs()
    check(lambda a, b, w: F.mse_loss(a, b, weight=w), a, b, w)  # the mean divides by the weights' sum
    check(lambda a, b, w: F.huber_loss(a, b, weight=w, delta=0.7), a, b, w)  # the mean divides by the count
    check(lambda a, b: F.mse_loss(a, b, size_average=False), a, b)  # legacy arguments: a sum
    check(lambda a, b: F.mse_loss(a, b), a, b[0].clone())  # the target broadcast
    check(lambda a, b: F.mse_loss(a, b, reduction="mean"), a.half(), b.half(), atol=1e-3, rtol=1e-3)


# --------------------------------------------------------------------------- torch idioms: pairs, truth, products


def test_max_min_along_a_dim_read_as_torch_pairs(randn: Callable[..., torch.Tensor]) -> None:
    x = randn(16, 24)
    check(lambda x: (x.max(dim=-1).values, x.min(1, keepdim=True)[0], torch.max(x, 0).values), x)
    check(lambda x: tuple(torch.min(x, -1, True))[0] * 2, x)
    with pytest.raises(TypeError, match="indices of a max"):
        nf.compile(lambda x: x.max(-1).indices)(x)
    with pytest.raises(TypeError, match="indices of a max"):
        nf.compile(lambda x: torch.max(x, 1)[1])(x)


def test_any_all_count_nonzero(randn: Callable[..., torch.Tensor]) -> None:
    x = randn(16, 24)
    x[3, 5] = float("nan")
    check(lambda x: ((x > 1.5).any(-1), (x > -2.5).all(dim=1), torch.any(x > 2), (x > 0).all(), torch.isfinite(x).all(-1),
                     torch.count_nonzero(x > 0, dim=-1), x.any(-1, keepdim=True)), x)


def test_products_and_scaled_sums(randn: Callable[..., torch.Tensor]) -> None:
    a, b, c = randn(8, 24), randn(24, 5), randn(8, 5)
    check(lambda a, b: torch.mm(a, b), a, b)
    check(lambda a, b, c: torch.addmm(c, a, b, beta=0.5, alpha=2.0), a, b, c)
    p, q, r = randn(3, 8, 24), randn(3, 24, 5), randn(3, 8, 5)
    check(lambda p, q: torch.bmm(p, q), p, q)
    check(lambda r, p, q: torch.baddbmm(r, p, q, alpha=0.5), r, p, q)
    u, v, m, n = randn(24), randn(24), randn(8, 24), randn(8)
    check(lambda u, v, m, n: (torch.dot(u, v), torch.outer(u, v), torch.mv(m, v), torch.addmv(n, m, v)), u, v, m, n)
    with pytest.raises(ValueError, match="torch.mm takes operands of 2 and 2 dims"):
        nf.compile(lambda p, q: torch.mm(p, q))(p, q)


def test_pointwise_pairs(randn: Callable[..., torch.Tensor]) -> None:
    x, y = randn(16, 24, scale=3.0), randn(16, 24, scale=3.0)
    y[0, :3] = x[0, :3]  # logaddexp of equal arguments
    x[1, :2] = 0.0  # xlogy's zeros
    check(lambda x, y: (torch.logaddexp(x, y), torch.hypot(x, y), torch.xlogy(x, y.abs()), torch.lerp(x, y, 0.3),
                        x.sum(-1, dtype=torch.float32), x.mean(0, dtype=torch.float32)), x, y)
    one, channels = randn(1).abs(), randn(24).abs()
    check(lambda x, one, channels: (F.prelu(x, one), F.prelu(x, channels)), x, one, channels)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_binary_cross_entropy(reduction: str, randn: Callable[..., torch.Tensor]) -> None:
    x, t, w = randn(16, 24, scale=4.0), torch.sigmoid(randn(16, 24)), randn(24).abs()
    x[0, :4] = torch.tensor([-100.0, 100.0, 40.0, -40.0])  # saturated probabilities: the logs clamp at -100
    check(lambda x, t: F.binary_cross_entropy(torch.sigmoid(x), t, reduction=reduction), x, t, atol=1e-4)
    check(lambda x, t, w: F.binary_cross_entropy_with_logits(x, t, weight=w, pos_weight=w * 2, reduction=reduction),
          x, t, w, atol=1e-4)
    check(lambda x, t: F.binary_cross_entropy_with_logits(x, t, reduction=reduction), x, t, atol=1e-4)


# --------------------------------------------------------------------------- slices and concatenation


def _rotate_half(x: Any) -> Any:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def test_slices_and_concatenation(randn: Callable[..., torch.Tensor]) -> None:
    x, y, w = randn(8, 24), randn(8, 24), randn(12, 5)
    check(lambda x, y: (x[:, :12].sum(-1), x[:, 1::3] * y[:, ::3], x[2:6].amax(-1), x[:, 3] + y[1].sum(), x[-1] * 2,
                        torch.softmax(x[:, 4:20], -1)), x, y)
    check(lambda x, w: (F.glu(x, -1) @ w, x[:, 6:18] @ w), x, w)
    check(lambda x, y: (x * 0.5 + _rotate_half(x) * y, torch.cat([x, y, x], 0).sum(0),
                        torch.cat([x[:, :5], y[:, :3]], 1).amax(-1)), x, y)
    check(lambda x, y: (sum(p.sum(-1) for p in x.split([5, 7, 12], dim=1)), x.split(10, dim=1)[-1].mean(-1),
                        x.narrow(1, 3, 9).sum(), x.select(0, 2) + y[3], sum(x[:3].unbind(0)),
                        x.chunk(5, dim=1)[-1].sum(-1)), x, y)
    check(lambda x, y: (torch.stack([x, y], 0).sum(0), torch.stack([x, y], -1).amax(-1),
                        x[:, None, :].expand(8, 3, 24).sum(1), x.sum(-1, keepdim=True).expand(-1, 24) * y,
                        torch.broadcast_to(x[0], (5, 24))), x, y)
    with pytest.raises(IndexError, match="out of bounds"):
        nf.compile(lambda x: x[:, 30])(x)
    with pytest.raises(ValueError, match="empty"):
        nf.compile(lambda x: x[:, 30:])(x)


def test_slices_of_reductions(randn: Callable[..., torch.Tensor]) -> None:
    """A slice of a reduction's result (a matmul's columns, a softmax's every other value) reads it
    at other positions than a kernel holds: an earlier kernel writes it (schedule/partition.py)."""
    x, w = randn(8, 24), randn(24, 10)
    check(lambda x, w: (x @ w)[:, 2:5].exp(), x, w)
    check(lambda x: torch.softmax(x, -1)[:, ::2].sum(-1), x)
    check(lambda x: torch.cat([x.amax(-1, keepdim=True), x.sum(-1, keepdim=True)], -1), x)


def test_slices_and_concatenation_gradients(randn: Callable[..., torch.Tensor]) -> None:
    """The gradient of a slice lands on the slice (a shifted read where the slice meets another
    dimension of its length: SwiGLU's halves before a matmul); a concatenation's on each part."""
    x, y, w = randn(8, 24), randn(8, 24), randn(12, 5)
    check_grad(lambda x, w: (lambda a, b: F.silu(a) * b)(*x.chunk(2, -1)) @ w, x, w)
    check_grad(lambda x, y: (x * 0.5 + _rotate_half(x) * y).sum(-1), x, y)
    check_grad(lambda x, y: torch.softmax(x[:, 4:20], -1) * y[:, 2:18], x, y)
    check_grad(lambda x, y: (x[:, 1::3] * y[:, ::3]).sum(-1) + torch.cat([x, y], 0).amax(0).sum(), x, y)


# --------------------------------------------------------------------------- scaled_dot_product_attention


@pytest.mark.parametrize("variant", ["plain", "causal", "bool_mask", "float_mask"])
def test_scaled_dot_product_attention(variant: str, randn: Callable[..., torch.Tensor]) -> None:
    """Model code calling F.scaled_dot_product_attention compiles into the fused attention the
    algebra derives: GQA, a causal mask (top-left), bool and float masks, rows with no visible key
    (0, as torch), gradients of q, k and v."""
    q, k, v = randn(2, 4, 40, 16), randn(2, 2, 56, 16), randn(2, 2, 56, 16)
    mask = torch.rand(40, 56, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[3] = False
    bias = randn(2, 1, 40, 56)
    if variant in ("plain", "causal"):
        def fn(q: Any, k: Any, v: Any) -> Any:
            return F.scaled_dot_product_attention(q, k, v, is_causal=variant == "causal", enable_gqa=True, scale=0.3)
        args: tuple[torch.Tensor, ...] = (q, k, v)
    else:
        def fn(q: Any, k: Any, v: Any, m: Any) -> Any:  # type: ignore[misc]
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True, scale=0.3)
        args = (q, k, v, mask if variant == "bool_mask" else bias)
    check(fn, *args)
    check_grad(fn, *args)


# --------------------------------------------------------------------------- reshapes


@pytest.mark.parametrize("name,fn", [
    ("split", lambda v: v.view(16, 4, 6).amax(-1)),
    ("merge", lambda v: v.view(4, 4, 24).transpose(0, 1).reshape(4, 96).sum(-1)),
    ("flatten", lambda v: torch.flatten(v).softmax(0)),
    ("unflatten_squeeze", lambda v: v.unflatten(1, (2, 3, 4))[:, :1].squeeze(1).mean(-1)),
    ("regroup", lambda v: v.reshape(24, 16).logsumexp(-1)),  # rows of 24 become rows of 16: no shared axis
    ("minus_one", lambda v: (v.reshape(-1, 8) * v[0, :8]).sum(-1)),
    ("size_one", lambda v: v.reshape(1, 16, 1, 24).view(16, 24, 1).sum((0, 2))),
])
def test_reshapes_as_views(name: str, fn: Callable[[Any], Any], randn: Callable[..., torch.Tensor]) -> None:
    """A reshape reads its source in row-major order (no copy): values and gradients as torch's."""
    check(fn, randn(16, 24))
    check_grad(fn, randn(16, 24))


def test_reshape_heads_of_an_attention_block(randn: Callable[..., torch.Tensor]) -> None:
    """Multi-head attention written as model code: projections split into heads by `view`, merged
    back by `reshape` before the output projection (values and every weight's gradient)."""
    def block(x: Any, wq: Any, wk: Any, wv: Any, wo: Any) -> Any:
        b, n, c = x.shape
        q, k, v = ((x @ w.T).view(b, n, 4, c // 4).transpose(1, 2) for w in (wq, wk, wv))
        o = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(c // 4), -1) @ v
        return o.transpose(1, 2).reshape(b, n, c) @ wo.T

    args = (randn(2, 16, 32), *(randn(32, 32, scale=0.2) for _ in range(4)))
    check(block, *args, atol=1e-4)
    check_grad(block, *args)


def _repeat_kv(h: Any, n_rep: int) -> Any:  # transformers' GQA: expand, then merge into heads
    b, kvh, n, d = h.shape
    return h[:, :, None, :, :].expand(b, kvh, n_rep, n, d).reshape(b, kvh * n_rep, n, d)


def _gqa(q: Any, k: Any, v: Any) -> Any:
    s = q @ _repeat_kv(k, 2).transpose(2, 3) / math.sqrt(q.shape[-1])
    return torch.softmax(s, -1) @ _repeat_kv(v, 2)


def _gpt2(x: Any, w: Any, b: Any) -> Any:  # one qkv projection split, heads by view, sdpa
    n, t, c = x.size()
    q, k, v = ((p.view(n, t, 4, c // 4).transpose(1, 2)) for p in (x @ w + b).split(c, dim=2))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(n, t, c)


def _lm_loss(h: Any, w: Any, labels: Any) -> Any:
    logits = h @ w.T
    return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))


def _patches(img: Any, w: Any) -> Any:  # ViT's patch embedding as a reshape, a permute and a linear map
    n, c, hh, ww = img.shape
    x = img.reshape(n, c, hh // 4, 4, ww // 4, 4).permute(0, 2, 4, 1, 3, 5).reshape(n, -1, c * 16)
    return x @ w


def _heads_in_batch(x: Any) -> Any:  # nn.MultiheadAttention's (T, B * H, D) layout
    t, b, c = x.shape
    q = x.reshape(t, b * 4, c // 4).transpose(0, 1)
    return (torch.softmax(q @ q.transpose(1, 2), -1) @ q).transpose(0, 1).reshape(t, b, c)


@pytest.mark.parametrize("name,fn,shapes", [
    ("repeat_kv", _gqa, ((1, 4, 16, 8), (1, 2, 16, 8), (1, 2, 16, 8))),
    ("gpt2", _gpt2, ((2, 16, 32), (32, 96), (96,))),
    ("lm_loss", _lm_loss, ((2, 8, 16), (40, 16), "labels")),
    ("patches", _patches, ((2, 3, 16, 16), (48, 8))),
    ("heads_in_batch", _heads_in_batch, ((16, 2, 16),)),
    ("group_norm", lambda x, w, b: F.group_norm(x, 2, w, b), ((2, 4, 4, 4), (4,), (4,))),
])
def test_model_code_with_reshapes(name: str, fn: Callable[..., Any], shapes: tuple[Any, ...],
                                  randn: Callable[..., torch.Tensor], randint: Callable[..., torch.Tensor]) -> None:
    args = [randint(0, 40, 2, 8) if shape == "labels" else randn(*shape, scale=0.3) for shape in shapes]
    check(fn, *args, atol=1e-4)
    check_grad(fn, *args)


@pytest.mark.parametrize("spec", ["blc,hdc->bhld", "blc,hdc->lbhd", "lc,hdc->hld"])
def test_einsum_with_several_output_axes_per_operand(spec: str, randn: Callable[..., torch.Tensor]) -> None:
    """A projection into heads as one einsum: the tile holds the row and one axis of the other
    operand, the operands' other output axes go across the grid."""
    x = randn(2, 16, 32) if spec.startswith("blc") else randn(16, 32)
    check(lambda x, w: torch.einsum(spec, x, w), x, randn(4, 8, 32), atol=1e-4)
    check_grad(lambda x, w: torch.einsum(spec, x, w), x, randn(4, 8, 32))


def test_einsum_attention_block_with_per_head_weights(randn: Callable[..., torch.Tensor]) -> None:
    """Projections as einsums with per-head weights, the output projection contracting two letters
    (heads and head dim) at once: values and gradients."""
    def block(x: Any, wq: Any, wk: Any, wv: Any, wo: Any) -> Any:
        q, k, v = (torch.einsum("blc,hdc->bhld", x, w) for w in (wq, wk, wv))
        o = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), -1) @ v
        return torch.einsum("bhld,nhd->bln", o, wo)

    args = (randn(2, 16, 32), *(randn(4, 8, 32, scale=0.2) for _ in range(3)), randn(32, 4, 8, scale=0.2))
    check(block, *args, atol=1e-4)
    check_grad(block, *args)


def test_reshape_refusals(randn: Callable[..., torch.Tensor]) -> None:
    with pytest.raises(ValueError, match=r"reshape: shape \[5, -1\] is invalid"):
        nf.compile(lambda v: v.view(5, -1))(randn(16, 24))
    with pytest.raises(ValueError, match="invalid for a tensor of shape"):
        nf.compile(lambda v: v.reshape(16, 25))(randn(16, 24))
    with pytest.raises(TypeError, match="view\\(dtype\\) is not supported"):
        nf.compile(lambda v: v.view(torch.int32))(randn(16, 24))


# --------------------------------------------------------------------------- refused, with reasons


@pytest.mark.parametrize("fn,reason", [
    (lambda v: torch.prod(v, -1), r"torch\.prod is not supported .*: kernels reduce with sum, max and min"),
    (lambda v: torch.argmax(v, -1).float(), "positions"),
    (lambda v: torch.cumsum(v, -1).sum(-1), "scans"),
])
def test_refused_with_a_reason(fn: Callable[[Any], Any], reason: str, randn: Callable[..., torch.Tensor]) -> None:
    with pytest.raises(TypeError, match=reason):
        nf.compile(fn)(randn(16, 24))


# --------------------------------------------------------------------------- gradients (the derived backward)


def test_grad_activations(randn: Callable[..., torch.Tensor]) -> None:
    v, w = randn(16, 24, scale=2.0), randn(24, 8)
    check_grad(lambda v, w: F.gelu(v) @ w, v, w)
    check_grad(lambda v, w: F.silu(v @ w).sum(-1), v, w)
    check_grad(lambda v, w: F.softplus(v, beta=2.0, threshold=3.0) @ w, v, w)
    check_grad(lambda v, w: F.logsigmoid(v * 10) @ w, v, w)
    check_grad(lambda v, w: (torch.erfc(v) + F.elu(v) + F.hardswish(v * 2)) @ w, v, w)


@pytest.mark.parametrize("name,fn", [
    ("straight_through", lambda x, w: (x + ((x > 0).float() - x).detach()) @ w),
    ("stop_max", lambda x, w: (x - x.amax(-1, keepdim=True).detach()).exp() @ w),
    ("fixed_target", lambda x, w: ((x @ w - (x @ w).detach().tanh()) ** 2).mean()),
])
def test_grad_stops_at_detach(name: str, fn: Callable[..., Any], randn: Callable[..., torch.Tensor]) -> None:
    """No gradient flows through `detach` (it used to be read as the value alone: the gradients
    above went through it, silently wrong)."""
    check_grad(fn, randn(16, 24), randn(24, 8))


def test_grad_stops_at_a_no_grad_block(randn: Callable[..., torch.Tensor]) -> None:
    """Values computed under torch.no_grad() inside the traced function pass no gradient (one
    also used outside the block keeps its gradient there); tracing runs the function with
    gradients on, so an outer no_grad (a first call at inference) changes nothing."""
    def fn(x: Any, w: Any) -> Any:
        y = x @ w
        with torch.no_grad():
            scale = y.abs().amax(-1, keepdim=True)
            total = y.sum(-1, keepdim=True)
        return (y / scale).exp() + y.sum(-1, keepdim=True) * total

    x, w = randn(16, 24), randn(24, 8, scale=0.2)
    compiled = nf.compile(fn)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, w), fn(x, w), atol=1e-5, rtol=1e-5)
    ours, theirs = [(x.clone().requires_grad_(), w.clone().requires_grad_()) for _ in range(2)]
    seed = randn(16, 8)
    (compiled(*ours) * seed).sum().backward()
    (fn(*theirs) * seed).sum().backward()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4)


def test_embedding_with_a_padding_row(randn: Callable[..., torch.Tensor], randint: Callable[..., torch.Tensor]) -> None:
    """F.embedding gathers rows; the padding row gets no gradient (torch's padding_idx)."""
    ids = randint(0, 12, 2, 8)
    ids[0, :3] = 0

    def embed_norm(ids: Any, table: Any, w: Any) -> Any:
        e = F.embedding(ids, table, padding_idx=0)
        return (e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(e) * w

    check(embed_norm, ids, randn(12, 16), randn(16))
    check_grad(embed_norm, ids, randn(12, 16), randn(16))
    check_grad(lambda ids, t: F.embedding(ids, t) @ t.T, ids, randn(12, 16))


def test_grad_swiglu(randn: Callable[..., torch.Tensor]) -> None:
    v, w1, w2 = randn(16, 24), randn(24, 12), randn(24, 12)
    check_grad(lambda v, w1, w2: (F.silu(v @ w1) * (v @ w2)).sum(-1), v, w1, w2)


def test_grad_layer_norm_and_rms_norm(randn: Callable[..., torch.Tensor]) -> None:
    v, g, b, w = randn(16, 24) + 1.0, randn(24), randn(24), randn(24, 8)
    check_grad(lambda v, g, b, w: F.layer_norm(v, (24,), g, b) @ w, v, g, b, w)
    check_grad(lambda v, g, w: F.rms_norm(v, (24,), g) @ w, v, g, w)


def test_grad_layer_norm_linear_wider_than_a_tile(randn: Callable[..., torch.Tensor]) -> None:
    """The backward sums the upstream gradient over the output axis (the norm's input gradient) and
    keeps it as an axis of the weight's gradient: too wide to hold, the two run in kernels apart."""
    v, g, b, w = randn(8, 16) + 1.0, randn(16), randn(16), randn(600, 16)
    check_grad(lambda v, g, b, w: F.linear(F.layer_norm(v, (16,), g, b), w), v, g, b, w)


def test_grad_linear_cross_entropy(randn: Callable[..., torch.Tensor], randint: Callable[..., torch.Tensor]) -> None:
    h, w, b = randn(16, 24), randn(10, 24, scale=0.5), randn(10)
    t = randint(0, 10, 16)
    t[[1, 5]] = -100
    check_grad(lambda h, w, b, t: F.cross_entropy(F.linear(h, w, b), t), h, w, b, t)
    check_grad(lambda h, w, t: F.cross_entropy(F.linear(h, w), t, reduction="sum", label_smoothing=0.1), h, w, t)


def test_grad_normalize_and_var(randn: Callable[..., torch.Tensor]) -> None:
    v, w = randn(16, 24), randn(24, 8)
    check_grad(lambda v, w: F.normalize(v, dim=-1) @ w, v, w)
    check_grad(lambda v: torch.var(v, -1), v * 2 + 1)
    check_grad(lambda v: v.std(0, correction=0), v)
