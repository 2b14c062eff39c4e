"""Softmax, normalisations, norms and moments (`F.layer_norm`, `F.group_norm`, `F.rms_norm`, `torch.var`,
`vector_norm`, ...)."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from neptune_fusion.lang.tensor import (
    Axes,
    SymTensor,
    binary,
    cast,
    mean,
    reduce_axes,
    reshape,
    unary,
)
from neptune_fusion.lang.torch_nn.common import CONTEXT, dim_axes, element_count, floating, no_out, symbolic

__all__ = ["HANDLERS", "log_softmax"]


def _dim_arg(name: str, dim: Any) -> int:
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"torch.{name} needs one integer dim, got {dim!r}")
    return dim


def _softmax(x: Any, dim: Any = None, dtype: Any = None, *, _stacklevel: int = 3) -> SymTensor:
    x = cast(x, dtype) if dtype is not None else symbolic(x)
    e = unary("exp", binary("sub", x, reduce_axes("max", x, _dim_arg("softmax", dim), True)))
    return binary("div", e, reduce_axes("sum", e, dim, True))


def log_softmax(x: Any, dim: Any = None, dtype: Any = None, *, _stacklevel: int = 3) -> SymTensor:
    x = cast(x, dtype) if dtype is not None else symbolic(x)
    return binary("sub", x, _logsumexp(x, _dim_arg("log_softmax", dim), True))


def _logsumexp(x: Any, dim: Any, keepdim: bool = False, *, out: Any = None) -> SymTensor:
    no_out("logsumexp", out)
    x = symbolic(x)
    m = reduce_axes("max", x, dim, True)
    total = unary("log", reduce_axes("sum", unary("exp", binary("sub", x, m)), dim, True))
    result = binary("add", total, m)
    return result if keepdim else _squeezed(result, dim)


def _squeezed(x: SymTensor, dim: Any) -> SymTensor:
    """`x` without the size-1 axes `dim` names (kept by a keepdim reduction)."""
    axes = {a % x.ndim for a in ([dim] if isinstance(dim, int) else list(dim))}
    return SymTensor(tuple(d for i, d in enumerate(x.dims) if i not in axes), x.expr, x.tracer, x.kind)


def _trailing_axes(x: SymTensor, normalized_shape: Any, name: str) -> list[int]:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    n = len(shape)
    if n == 0 or n > x.ndim or tuple(x.shape[x.ndim - n:]) != tuple(int(s) for s in shape):
        raise ValueError(f"{name}: normalized_shape {list(shape)} does not match the trailing dims of an input "
                         f"of shape {list(x.shape)}")
    return list(range(x.ndim - n, x.ndim))


def _affine(y: SymTensor, weight: Any, bias: Any = None) -> SymTensor:
    if weight is not None:
        y = binary("mul", y, weight)
    return y if bias is None else binary("add", y, bias)


def _layer_norm(input: Any, normalized_shape: Any, weight: Any = None, bias: Any = None,  # noqa: A002
                eps: float = 1e-5) -> SymTensor:
    x = floating(input)
    axes = _trailing_axes(x, normalized_shape, "layer_norm")
    centred = binary("sub", x, mean(x, axes, True))
    variance = mean(binary("mul", centred, centred), axes, True)  # biased, as torch
    return _affine(binary("mul", centred, unary("rsqrt", binary("add", variance, eps))), weight, bias)


def _group_norm(input: Any, num_groups: int, weight: Any = None, bias: Any = None,  # noqa: A002
                eps: float = 1e-5) -> SymTensor:
    """F.group_norm: the channels of (N, C, *) in `num_groups` groups, each normalised over its
    channels and positions (a reshape to (N, G, -1), a view), then the per-channel affine map."""
    x = floating(input)
    if x.ndim < 2 or x.shape[1] % num_groups:
        raise ValueError(f"group_norm: {num_groups} groups do not divide the channels of an input of shape "
                         f"{list(x.shape)}")
    grouped = reshape(x, [x.shape[0], num_groups, -1])
    centred = binary("sub", grouped, mean(grouped, -1, True))
    variance = mean(binary("mul", centred, centred), -1, True)  # biased, as torch
    y = reshape(binary("mul", centred, unary("rsqrt", binary("add", variance, eps))), list(x.shape))
    per_channel = (slice(None),) + (None,) * (x.ndim - 2)
    return _affine(y, None if weight is None else symbolic(weight, x)[per_channel],
                   None if bias is None else symbolic(bias, x)[per_channel])


def _rms_norm(input: Any, normalized_shape: Any, weight: Any = None, eps: float | None = None) -> SymTensor:  # noqa: A002
    x = floating(input)
    axes = _trailing_axes(x, normalized_shape, "rms_norm")
    eps = torch.finfo(torch.float32).eps if eps is None else eps  # torch's default for every input dtype
    square = mean(binary("mul", x, x), axes, True)
    return _affine(binary("mul", x, unary("rsqrt", binary("add", square, eps))), weight)


def _vector_norm(x: Any, ord: Any = 2, dim: Any = None, keepdim: bool = False, *,  # noqa: A002
                 dtype: Any = None, out: Any = None) -> SymTensor:
    no_out("linalg.vector_norm", out)
    if isinstance(ord, (str, SymTensor)) or isinstance(ord, bool):
        raise TypeError(f"torch.linalg.vector_norm: ord must be a number, got {ord!r}")
    x, axes, p = floating(x, dtype), dim_axes(dim), float(ord)
    if p == 2:
        return unary("sqrt", reduce_axes("sum", binary("mul", x, x), axes, keepdim))
    magnitude = unary("abs", x)
    if p == 1:
        return reduce_axes("sum", magnitude, axes, keepdim)
    if math.isinf(p):
        return reduce_axes("max" if p > 0 else "min", magnitude, axes, keepdim)
    if p == 0:  # the number of nonzero elements
        return reduce_axes("sum", cast(binary("ne", x, 0.0), "f32"), axes, keepdim)
    return binary("pow", reduce_axes("sum", binary("pow", magnitude, p), axes, keepdim), 1.0 / p)


def _norm(input: Any, p: Any = "fro", dim: Any = None, keepdim: bool = False, dtype: Any = None, *,  # noqa: A002
          out: Any = None) -> SymTensor:
    """torch.norm / Tensor.norm: vector norms, and the Frobenius norm (a vector 2-norm over two axes)."""
    no_out("norm", out)
    if isinstance(p, str):
        if p != "fro" or (isinstance(dim, (tuple, list)) and len(dim) > 2):
            raise TypeError(f"torch.norm with p={p!r} (a matrix norm) is not supported {CONTEXT}; vector norms "
                            "and p='fro' are")
        p = 2
    return _vector_norm(input, 2 if p is None else p, dim, keepdim, dtype=dtype)


def _linalg_norm(input: Any, ord: Any = None, dim: Any = None, keepdim: bool = False, *,  # noqa: A002
                 out: Any = None, dtype: Any = None) -> SymTensor:
    no_out("linalg.norm", out)
    x = symbolic(input)
    axes = [dim] if isinstance(dim, int) else (list(range(x.ndim)) if dim is None else list(dim))
    if ord is None or (ord == "fro" and len(axes) == 2):
        return _vector_norm(x, 2, dim, keepdim, dtype=dtype)
    if len(axes) == 1 and not isinstance(ord, str):
        return _vector_norm(x, ord, dim, keepdim, dtype=dtype)
    raise TypeError(f"torch.linalg.norm with ord={ord!r} over {len(axes)} dims (a matrix norm) is not supported "
                    f"{CONTEXT}; use torch.linalg.vector_norm")


def _normalize(input: Any, p: float = 2.0, dim: int = 1, eps: float = 1e-12, out: Any = None) -> SymTensor:  # noqa: A002
    no_out("normalize", out)
    return binary("div", input, binary("max", _vector_norm(input, p, dim, True), eps))


def _cosine_similarity(x1: Any, x2: Any, dim: int = 1, eps: float = 1e-8) -> SymTensor:
    a, b = symbolic(x1, x2), symbolic(x2, x1)
    rank = max(a.ndim, b.ndim)  # `dim` counts in the broadcast shape
    a, b = (t[(None,) * (rank - t.ndim)] if t.ndim < rank else t for t in (a, b))
    # as torch 2.13: each side divided by its own norm clamped at eps, then the dot product
    unit_a = binary("div", a, binary("max", _vector_norm(a, 2, dim, True), eps))
    unit_b = binary("div", b, binary("max", _vector_norm(b, 2, dim, True), eps))
    return reduce_axes("sum", binary("mul", unit_a, unit_b), dim, False)


def _variance_args(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Axes, Any, bool]:
    """(axes, correction, keepdim) of torch.var / std: var(x, dim=None, *, correction=1, keepdim=False),
    var(x, dim, unbiased, keepdim=False) and var(x, unbiased)."""
    rest, options = list(args), dict(kwargs)
    no_out(name, options.pop("out", None))
    dim, unbiased = options.pop("dim", None), options.pop("unbiased", None)
    correction, keepdim = options.pop("correction", None), options.pop("keepdim", False)
    if options:
        raise TypeError(f"torch.{name} got unexpected arguments {sorted(options)}")
    if rest and isinstance(rest[0], bool):
        unbiased = rest.pop(0)
    elif rest:
        dim = rest.pop(0)
    if rest:
        unbiased = rest.pop(0)
    if rest:
        keepdim = rest.pop(0)
    if rest:
        raise TypeError(f"torch.{name} got too many positional arguments")
    if unbiased is not None and correction is not None:
        raise TypeError(f"torch.{name}: give correction or unbiased, not both")
    if correction is None:
        correction = 1 if unbiased is None or unbiased else 0
    return dim_axes(dim), correction, bool(keepdim)


def _variance(x: Any, axes: Axes, correction: Any, keepdim: bool) -> tuple[SymTensor, SymTensor]:
    """(variance, mean) of `x` along `axes`: squared deviations summed over max(0, N - correction)."""
    x = floating(x)
    centre = mean(x, axes, True)
    deviation = binary("sub", x, centre)
    total = reduce_axes("sum", binary("mul", deviation, deviation), axes, keepdim)
    divisor = binary("max", binary("sub", element_count(x, axes), correction), 0)
    return binary("div", total, divisor), centre if keepdim else mean(x, axes, False)


def _var(x: Any, *args: Any, **kwargs: Any) -> SymTensor:
    return _variance(x, *_variance_args("var", args, kwargs))[0]


def _std(x: Any, *args: Any, **kwargs: Any) -> SymTensor:
    return unary("sqrt", _variance(x, *_variance_args("std", args, kwargs))[0])


def _var_mean(x: Any, *args: Any, **kwargs: Any) -> tuple[SymTensor, SymTensor]:
    return _variance(x, *_variance_args("var_mean", args, kwargs))


def _std_mean(x: Any, *args: Any, **kwargs: Any) -> tuple[SymTensor, SymTensor]:
    variance, centre = _variance(x, *_variance_args("std_mean", args, kwargs))
    return unary("sqrt", variance), centre


def _softmin(x: Any, dim: Any = None, _stacklevel: int = 3, dtype: Any = None) -> SymTensor:
    return _softmax(unary("neg", symbolic(x)), dim, dtype)


def _truth(op: str, name: str) -> Callable[..., SymTensor]:
    """torch.any (op max) / torch.all (op min) of x != 0 along `dim` (None: all), as bool."""
    def fn(x: Any, dim: Any = None, keepdim: bool = False, *, out: Any = None) -> SymTensor:
        no_out(name, out)
        nonzero = cast(binary("ne", symbolic(x), 0), "f32")  # NaN counts as true, as in torch
        return binary("gt", reduce_axes(op, nonzero, dim_axes(dim), bool(keepdim)), 0.0)

    return fn


def _count_nonzero(x: Any, dim: Any = None) -> SymTensor:
    return reduce_axes("sum", binary("ne", symbolic(x), 0), dim_axes(dim), False)  # a sum of bools: int64


HANDLERS: dict[str, Callable[..., Any]] = {
    "softmax": _softmax, "log_softmax": log_softmax, "logsumexp": _logsumexp, "special_logsumexp": _logsumexp,
    "layer_norm": _layer_norm, "group_norm": _group_norm, "rms_norm": _rms_norm, "normalize": _normalize, "norm": _norm,
    "linalg_vector_norm": _vector_norm, "linalg_norm": _linalg_norm, "cosine_similarity": _cosine_similarity,
    "var": _var, "std": _std, "var_mean": _var_mean, "std_mean": _std_mean, "softmin": _softmin,
    "any": _truth("max", "any"), "all": _truth("min", "all"), "count_nonzero": _count_nonzero,
}
