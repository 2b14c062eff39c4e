"""Functions of the front end (`nf.exp`, `nf.einsum`, ...), all on symbolic tensors.

Example:
    >>> import neptune_fusion as nf
    >>> @nf.program
    ... def softcap_scores(q, k):
    ...     s = nf.einsum("bhqd,bhkd->bhqk", q, k)
    ...     return 50 * nf.tanh(s / 50)
"""

from __future__ import annotations

from typing import Any, Sequence

from neptune_fusion.ir.expr import Binary, Const, Expr, Index, substitute_index, walk
from neptune_fusion.lang.tensor import (
    Axes,
    Dim,
    SymTensor,
    TensorLike,
    _norm_axis,
    binary,
    cast,
    einsum,
    index,
    inf,
    matmul,
    reduce_axes,
    size,
    unary,
    where,
)

__all__ = [
    "exp", "exp2", "log", "log2", "tanh", "sigmoid", "sqrt", "rsqrt", "abs_", "sin", "cos",
    "maximum", "minimum", "where", "einsum", "matmul", "sum", "max", "min", "index", "cast", "inf",
    "repeat_interleave", "size", "erf",
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


def erf(x: TensorLike) -> SymTensor:
    """Elementwise error function, 2 / sqrt(pi) * integral from 0 to x of exp(-t**2)."""
    return unary("erf", x)


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


def sum(x: SymTensor, axis: Axes = None, keepdims: bool = False) -> SymTensor:  # noqa: A001
    """Sum along `axis` (an int, a tuple of them, or None: every axis)."""
    return reduce_axes("sum", x, axis, keepdims)


def max(x: SymTensor, axis: Axes = None, keepdims: bool = False) -> SymTensor:  # noqa: A001
    """Maximum along `axis` (an int, a tuple of them, or None: every axis)."""
    return reduce_axes("max", x, axis, keepdims)


def min(x: SymTensor, axis: Axes = None, keepdims: bool = False) -> SymTensor:  # noqa: A001
    """Minimum along `axis` (an int, a tuple of them, or None: every axis)."""
    return reduce_axes("min", x, axis, keepdims)


def tracer_dims(tracer: Any) -> list[Dim]:
    """Every `Dim` a tracer knows: those of its inputs and those made by views (repeat_interleave)."""
    dims: list[Dim] = []
    for _, ds, _ in getattr(tracer, "inputs", ()):
        dims.extend(ds)
    dims.extend(getattr(tracer, "extra_dims", ()))
    return dims


def same_axis_vars(expr: Expr, dim: Dim, dims: Sequence[Dim]) -> set[str]:
    """Index variables in `expr` that stand for the axis of `dim` (its own and unified ones)."""
    by_var = {d.var: d for d in dims}
    root = dim.find()
    out = {dim.var}
    for node in walk(expr):
        if isinstance(node, Index) and node.axis in by_var and by_var[node.axis].find() is root:
            out.add(node.axis)
    return out


def repeat_interleave(x: SymTensor, repeats: int, axis: int) -> SymTensor:
    """`x` with each element along `axis` repeated `repeats` times, as torch.repeat_interleave.

    A view, no data movement: the new dimension (size n * repeats) reads element
    `index // repeats` of the source dimension. Used for grouped-query attention: query head
    `h` reads key/value head `h // group`. The new dimension must meet a dimension of the same
    size of another input (through broadcasting or einsum), which gives its size at run time.

    Example:
        >>> import neptune_fusion as nf
        >>> @nf.program
        ... def gqa_scores(q, k):   # q: (b, 8, s, d), k: (b, 2, s, d)
        ...     return nf.einsum("bhqd,bhkd->bhqk", q, nf.repeat_interleave(k, 4, axis=1))
    """
    if not isinstance(x, SymTensor):
        raise TypeError(f"repeat_interleave expects a symbolic tensor, got {type(x).__name__}")
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    axis = _norm_axis(axis, x.ndim)
    src = x.dims[axis]
    if repeats == 1:
        return x
    tracer = x.tracer
    size = 1 if src is None else src.find().size
    new = Dim(size * repeats, f"{src.hint if src is not None else 'dim'}*{repeats}")
    extra = getattr(tracer, "extra_dims", None)
    if extra is None:
        extra = []
        tracer.extra_dims = extra  # type: ignore[attr-defined]
    extra.append(new)
    expr = x.expr
    if src is not None:
        source_index = Binary("floordiv", Index(new.var), Const(repeats))
        expr = substitute_index(expr, {v: source_index for v in same_axis_vars(expr, src, tracer_dims(tracer))})
    dims = x.dims[:axis] + (new,) + x.dims[axis + 1:]
    return SymTensor(dims, expr, tracer, x.kind)
