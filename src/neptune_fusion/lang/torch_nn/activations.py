"""Activations and pointwise special functions (`F.silu`, `F.gelu`, `torch.erf`, `log1p`, ...), as torch defines them."""

from __future__ import annotations

import math
from typing import Any, Callable

from neptune_fusion.lang.tensor import (
    SymTensor,
    binary,
    unary,
    where,
)
from neptune_fusion.lang.torch_nn.common import CONTEXT, no_inplace, no_out, symbolic

__all__ = ["HANDLERS"]


def _series(x: Any, coefficients: tuple[float, ...]) -> SymTensor:
    """sum_k coefficients[k] * x**(k + 1), by Horner's rule."""
    acc: Any = coefficients[-1]
    for c in reversed(coefficients[:-1]):
        acc = binary("add", c, binary("mul", x, acc))
    return binary("mul", x, acc)


_SMALL = 0.1  # below it, 7 terms of a series are exact to float32 (|x|**8 / 8 < 2e-9)


def _log1p(x: Any, *, out: Any = None) -> SymTensor:
    """log(1 + x), accurate for small |x| (log(1 + x) alone rounds 1 + x and loses x's digits)."""
    no_out("log1p", out)
    series = _series(x, tuple((-1.0) ** k / (k + 1) for k in range(7)))
    return where(binary("lt", unary("abs", x), _SMALL), series, unary("log", binary("add", 1.0, x)))


def _expm1(x: Any, *, out: Any = None) -> SymTensor:
    """exp(x) - 1, accurate for small |x|."""
    no_out("expm1", out)
    series = _series(x, tuple(1.0 / math.factorial(k + 1) for k in range(7)))
    return where(binary("lt", unary("abs", x), _SMALL), series, binary("sub", unary("exp", x), 1.0))


def _relu(x: Any, inplace: bool = False) -> SymTensor:
    no_inplace("relu", inplace)
    x = symbolic(x)
    return binary("max", x, 0.0 if x.kind == "float" else 0)


def _silu(x: Any, inplace: bool = False) -> SymTensor:
    no_inplace("silu", inplace)
    return binary("mul", x, unary("sigmoid", x))


def _gelu(x: Any, approximate: str = "none") -> SymTensor:
    if approximate == "none":  # x * Phi(x), Phi the normal distribution's CDF
        phi = binary("add", 1.0, unary("erf", binary("mul", x, math.sqrt(0.5))))
    elif approximate == "tanh":
        cube = binary("mul", binary("mul", x, x), x)
        inner = binary("mul", math.sqrt(2.0 / math.pi), binary("add", x, binary("mul", 0.044715, cube)))
        phi = binary("add", 1.0, unary("tanh", inner))
    else:
        raise ValueError(f"approximate argument must be either none or tanh, got {approximate!r}")
    return binary("mul", binary("mul", 0.5, x), phi)


def _softplus(x: Any, beta: float = 1.0, threshold: float = 20.0) -> SymTensor:
    z = binary("mul", x, beta) if beta != 1 else symbolic(x)
    # log(1 + exp(z)) / beta, and x itself above the threshold (the clamp keeps exp finite there)
    smooth = _log1p(unary("exp", binary("min", z, float(threshold))))
    return where(binary("gt", z, threshold), x, binary("div", smooth, beta) if beta != 1 else smooth)


def _mish(x: Any, inplace: bool = False) -> SymTensor:
    no_inplace("mish", inplace)
    return binary("mul", x, unary("tanh", _softplus(x)))


def _negative_branch(x: Any, alpha: float, divided: bool) -> SymTensor:
    """x where x > 0, else alpha * (exp(x) - 1) (ELU) or alpha * (exp(x / alpha) - 1) (CELU, `divided`);
    exp reads min(x, 0), so the branch not taken stays finite."""
    z = binary("min", x, 0.0)
    if divided and alpha != 1:
        z = binary("div", z, alpha)
    return where(binary("gt", x, 0.0), x, binary("mul", alpha, _expm1(z)))


def _elu(x: Any, alpha: float = 1.0, inplace: bool = False) -> SymTensor:
    no_inplace("elu", inplace)
    return _negative_branch(x, alpha, False)


_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946


def _selu(x: Any, inplace: bool = False) -> SymTensor:
    no_inplace("selu", inplace)
    return binary("mul", _SELU_SCALE, _elu(x, _SELU_ALPHA))


def _celu(x: Any, alpha: float = 1.0, inplace: bool = False) -> SymTensor:
    no_inplace("celu", inplace)
    return _negative_branch(x, alpha, True)


def _leaky_relu(x: Any, negative_slope: float = 0.01, inplace: bool = False) -> SymTensor:
    no_inplace("leaky_relu", inplace)
    return where(binary("gt", x, 0.0), x, binary("mul", x, negative_slope))


def _hardtanh(x: Any, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False) -> SymTensor:
    no_inplace("hardtanh", inplace)
    # as torch: no gradient at the bounds; a NaN stays NaN (both comparisons fail)
    return where(binary("le", x, min_val), float(min_val), where(binary("ge", x, max_val), float(max_val), x))


def _relu6(x: Any, inplace: bool = False) -> SymTensor:
    no_inplace("relu6", inplace)
    return _hardtanh(x, 0.0, 6.0)


def _hardsigmoid(x: Any, inplace: bool = False) -> SymTensor:
    no_inplace("hardsigmoid", inplace)
    return where(binary("le", x, -3.0), 0.0, where(binary("ge", x, 3.0), 1.0, binary("add", binary("div", x, 6.0), 0.5)))


def _hardswish(x: Any, inplace: bool = False) -> SymTensor:
    no_inplace("hardswish", inplace)
    middle = binary("div", binary("mul", x, binary("add", x, 3.0)), 6.0)
    return where(binary("le", x, -3.0), 0.0, where(binary("ge", x, 3.0), x, middle))


def _logsigmoid(x: Any) -> SymTensor:
    # min(x, 0) - log(1 + exp(-|x|)): no overflow, and exact for large |x|
    return binary("sub", binary("min", x, 0.0), _log1p(unary("exp", unary("neg", unary("abs", x)))))


def _softsign(x: Any) -> SymTensor:
    return binary("div", x, binary("add", unary("abs", x), 1.0))


def _erf(x: Any, *, out: Any = None) -> SymTensor:
    no_out("erf", out)
    return unary("erf", x)


# erfc(|x|) = t exp(-x^2 + P(t)), t = 1 / (1 + |x| / 2): Numerical Recipes' Chebyshev fit (erfcc),
# relative error below 1.2e-7 for every x >= 0 (1 - erf(x) would lose every digit for x > 4)
_ERFC = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807, -1.13520398, 1.48851587,
         -0.82215223, 0.17087277)


def _erfc(x: Any, *, out: Any = None) -> SymTensor:
    no_out("erfc", out)
    a = unary("abs", x)
    t = binary("div", 1.0, binary("add", 1.0, binary("mul", 0.5, a)))
    tail = binary("mul", t, unary("exp", binary("sub", _series(t, _ERFC[1:]), binary("sub", binary("mul", a, a), _ERFC[0]))))
    return where(binary("lt", x, 0.0), binary("sub", 2.0, tail), tail)


def _dropout(x: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> SymTensor:
    no_inplace("dropout", inplace)
    if training and p != 0:
        raise TypeError(f"torch.nn.functional.dropout while training is not supported {CONTEXT}: kernels draw "
                        "no random numbers; pass training=False (evaluation) or p=0")
    return symbolic(x)


def _tanhshrink(x: Any) -> SymTensor:
    return binary("sub", x, unary("tanh", x))


def _threshold(x: Any, threshold: float, value: float, inplace: bool = False) -> SymTensor:
    no_inplace("threshold", inplace)
    return where(binary("le", x, threshold), float(value), x)  # a NaN stays NaN, as in torch


def _softshrink(x: Any, lambd: float = 0.5) -> SymTensor:
    # |x| <= lambd fails for NaN, which stays NaN as in torch
    return where(binary("le", unary("abs", x), lambd), 0.0, binary("sub", x, where(binary("gt", x, 0.0), lambd, -lambd)))


def _hardshrink(x: Any, lambd: float = 0.5) -> SymTensor:
    return where(binary("le", unary("abs", x), lambd), 0.0, x)


def _rrelu(x: Any, lower: float = 1.0 / 8, upper: float = 1.0 / 3, training: bool = False,
           inplace: bool = False) -> SymTensor:
    no_inplace("rrelu", inplace)
    if training:
        raise TypeError(f"torch.nn.functional.rrelu while training is not supported {CONTEXT}: kernels draw no "
                        "random numbers; pass training=False (the mean slope)")
    return _leaky_relu(x, (lower + upper) / 2)


def _prelu(x: Any, weight: Any) -> SymTensor:
    """x where x > 0, else weight * x; a weight of C values runs along axis 1 (channels), as torch."""
    x = symbolic(x, weight)
    w = symbolic(weight, x)
    if w.ndim != 1 or (w.shape[0] != 1 and (x.ndim < 2 or x.shape[1] != w.shape[0])):
        raise ValueError(f"prelu: a weight of shape {list(w.shape)} fits neither one slope nor the channels (axis 1) "
                         f"of an input of shape {list(x.shape)}")
    if w.shape[0] != 1:
        w = w[(slice(None),) + (None,) * (x.ndim - 2)]
    return where(binary("gt", x, 0.0), x, binary("mul", w, x))


def _logaddexp(a: Any, b: Any, *, out: Any = None) -> SymTensor:
    """log(exp(a) + exp(b)) = max + log1p(exp(-|a - b|)); equal infinities give that infinity."""
    no_out("logaddexp", out)
    top = binary("max", a, b)
    gap = unary("abs", binary("sub", a, b))
    same_infinity = binary("and", binary("eq", a, b), binary("eq", unary("abs", top), math.inf))  # gap NaN there
    return where(same_infinity, top, binary("add", top, _log1p(unary("exp", unary("neg", gap)))))


def _hypot(a: Any, b: Any, *, out: Any = None) -> SymTensor:
    no_out("hypot", out)
    return unary("sqrt", binary("add", binary("mul", a, a), binary("mul", b, b)))


def _xlogy(x: Any, y: Any, *, out: Any = None) -> SymTensor:
    """x * log(y), 0 where x is 0 (unless y is NaN), as torch.xlogy."""
    no_out("xlogy", out)
    product = binary("mul", x, unary("log", y))
    return where(binary("and", binary("eq", x, 0.0), binary("eq", y, y)), 0.0, product)


def _lerp(start: Any, end: Any, weight: Any, *, out: Any = None) -> SymTensor:
    no_out("lerp", out)
    return binary("add", start, binary("mul", weight, binary("sub", end, start)))


def _glu(x: Any, dim: int = -1) -> SymTensor:
    """The first half along `dim` times the sigmoid of the second (torch.nn.functional.glu)."""
    x = symbolic(x)
    n = x.shape[dim]
    if n % 2:
        raise ValueError(f"glu: halving a dimension of odd size {n}")
    lead = (slice(None),) * (dim % x.ndim)
    return binary("mul", x[lead + (slice(0, n // 2),)], unary("sigmoid", x[lead + (slice(n // 2, n),)]))


HANDLERS: dict[str, Callable[..., Any]] = {
    "relu": _relu, "silu": _silu, "gelu": _gelu, "softplus": _softplus, "mish": _mish, "elu": _elu, "selu": _selu,
    "celu": _celu, "leaky_relu": _leaky_relu, "relu6": _relu6, "hardtanh": _hardtanh, "hardsigmoid": _hardsigmoid,
    "hardswish": _hardswish, "log_sigmoid": _logsigmoid, "logsigmoid": _logsigmoid, "softsign": _softsign,
    "log1p": _log1p, "special_log1p": _log1p, "expm1": _expm1, "special_expm1": _expm1,
    "erf": _erf, "special_erf": _erf, "erfc": _erfc, "special_erfc": _erfc, "dropout": _dropout,
    "tanhshrink": _tanhshrink, "threshold": _threshold, "_threshold": _threshold, "softshrink": _softshrink,
    "hardshrink": _hardshrink, "rrelu": _rrelu, "prelu": _prelu, "logaddexp": _logaddexp, "hypot": _hypot,
    "xlogy": _xlogy, "special_xlogy": _xlogy, "lerp": _lerp, "glu": _glu,
}
