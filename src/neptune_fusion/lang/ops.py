"""Functions of the front end (`nf.exp`, `nf.einsum`, ...), all on symbolic tensors.

Example:
    >>> import neptune_fusion as nf
    >>> @nf.program
    ... def softcap_scores(q, k):
    ...     s = nf.einsum("bhqd,bhkd->bhqk", q, k)
    ...     return 50 * nf.tanh(s / 50)
"""

from __future__ import annotations

from neptune_fusion.lang.tensor import (
    SymTensor,
    TensorLike,
    binary,
    cast,
    einsum,
    index,
    inf,
    matmul,
    reduce,
    unary,
    where,
)

__all__ = [
    "exp", "exp2", "log", "log2", "tanh", "sigmoid", "sqrt", "rsqrt", "abs_", "sin", "cos",
    "maximum", "minimum", "where", "einsum", "matmul", "sum", "max", "min", "index", "cast", "inf",
]


def exp(x: TensorLike) -> SymTensor:
    """Elementwise e**x."""
    return unary("exp", x)


def exp2(x: TensorLike) -> SymTensor:
    """Elementwise 2**x."""
    return unary("exp2", x)


def log(x: TensorLike) -> SymTensor:
    """Elementwise natural logarithm."""
    return unary("log", x)


def log2(x: TensorLike) -> SymTensor:
    """Elementwise base-2 logarithm."""
    return unary("log2", x)


def tanh(x: TensorLike) -> SymTensor:
    """Elementwise hyperbolic tangent."""
    return unary("tanh", x)


def sigmoid(x: TensorLike) -> SymTensor:
    """Elementwise 1 / (1 + e**-x)."""
    return unary("sigmoid", x)


def sqrt(x: TensorLike) -> SymTensor:
    """Elementwise square root."""
    return unary("sqrt", x)


def rsqrt(x: TensorLike) -> SymTensor:
    """Elementwise 1 / sqrt(x)."""
    return unary("rsqrt", x)


def abs_(x: TensorLike) -> SymTensor:
    """Elementwise absolute value (also available as Python's `abs`)."""
    return unary("abs", x)


def sin(x: TensorLike) -> SymTensor:
    """Elementwise sine."""
    return unary("sin", x)


def cos(x: TensorLike) -> SymTensor:
    """Elementwise cosine."""
    return unary("cos", x)


def maximum(a: TensorLike, b: TensorLike) -> SymTensor:
    """Elementwise maximum of two (broadcast) tensors."""
    return binary("max", a, b)


def minimum(a: TensorLike, b: TensorLike) -> SymTensor:
    """Elementwise minimum of two (broadcast) tensors."""
    return binary("min", a, b)


def sum(x: SymTensor, axis: int = -1, keepdims: bool = False) -> SymTensor:  # noqa: A001
    """Sum along `axis`."""
    return reduce("sum", x, axis, keepdims)


def max(x: SymTensor, axis: int = -1, keepdims: bool = False) -> SymTensor:  # noqa: A001
    """Maximum along `axis`."""
    return reduce("max", x, axis, keepdims)


def min(x: SymTensor, axis: int = -1, keepdims: bool = False) -> SymTensor:  # noqa: A001
    """Minimum along `axis`."""
    return reduce("min", x, axis, keepdims)
