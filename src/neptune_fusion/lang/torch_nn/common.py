"""What the handlers of torch.nn.functional share: argument checks and lifting to symbolic tensors."""

from __future__ import annotations

from typing import Any

from neptune_fusion.lang.tensor import (
    Axes,
    SymTensor,
    _tracer_of,
    binary,
    cast,
    lift,
    size,
)

__all__ = ["CONTEXT", "dim_axes", "element_count", "floating", "no_inplace", "no_out", "symbolic"]

CONTEXT = "on symbolic tensors (inside nf.program, score_mod or mask_mod)"


def no_out(name: str, out: Any) -> None:
    """Refuse `out=`: a symbolic result is a new value, never written into a given tensor."""
    if out is not None:
        raise TypeError(f"out= is not supported {CONTEXT} ({name})")


def no_inplace(name: str, inplace: bool) -> None:
    if inplace:
        raise TypeError(f"torch.nn.functional.{name}(..., inplace=True) is not supported {CONTEXT}: symbolic "
                        "tensors are values that cannot be updated in place; drop inplace=True and use the result")


def symbolic(x: Any, *others: Any) -> SymTensor:
    """`x` as a symbolic tensor (a Python number or a captured scalar lifted with the others' tracer)."""
    return lift(x, _tracer_of(x, *others))


def floating(x: Any, dtype: Any = None) -> SymTensor:
    """`x` cast to `dtype` if one is given, else to float32 if it is an integer or boolean tensor."""
    x = symbolic(x)
    if dtype is not None:
        return cast(x, dtype)
    return x if x.kind == "float" else cast(x, "f32")


def dim_axes(dim: Any) -> Axes:
    """torch's `dim` argument as reduce_axes takes it: None, [] and () all mean every axis."""
    if dim is None or (isinstance(dim, (tuple, list)) and len(dim) == 0):
        return None
    return list(dim) if isinstance(dim, (tuple, list)) else dim


def element_count(x: SymTensor, axes: Axes) -> Any:
    """The number of elements of `x` along `axes` (None: all), a run-time integer (1 for none)."""
    named = range(x.ndim) if axes is None else (axes if isinstance(axes, list) else [axes])
    count: Any = 1
    for a in named:
        count = size(x, a) if isinstance(count, int) else binary("mul", count, size(x, a))
    return count
