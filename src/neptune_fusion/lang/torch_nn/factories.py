"""Tensors a model makes inside its own code: `torch.arange`, `torch.ones` / `zeros` / `full`, and
the triangles `triu` / `tril` of what they make (a causal mask built as
`torch.ones(t, t, dtype=torch.bool).tril()`, positions as `torch.arange(t)`, labels as
`torch.arange(n) % c`).

While a program is traced, `Factories` (a torch function mode) turns each such call into a
symbolic tensor over new axes of the sizes given (sizes are Python ints, so a program that makes
them is traced anew for each shape, as one reading `x.shape` is): an arange is its position along
its axis, a filled tensor a constant broadcast over its axes. Nothing is allocated and nothing
becomes a kernel argument; the values are index arithmetic in the kernel.

Example:
    >>> import torch, neptune_fusion as nf
    >>> def causal_softmax(s):
    ...     t = s.shape[-1]
    ...     mask = torch.ones(t, t, dtype=torch.bool).tril()
    ...     return torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
    >>> s = torch.randn(2, 5, 5)
    >>> torch.allclose(nf.compile(causal_softmax)(s), causal_softmax(s), atol=1e-6)
    True
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from neptune_fusion.ir.expr import Const, Expr, Index
from neptune_fusion.lang.tensor import Dim, SymTensor, binary, cast, where
from neptune_fusion.lang.torch_nn.common import CONTEXT

__all__ = ["HANDLERS", "Factories"]


def _kind(dtype: Any, default: str) -> str:
    if dtype is None:
        return default
    if dtype == torch.bool:
        return "bool"
    return "float" if dtype.is_floating_point else "int"


def _sizes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...]:
    size = kwargs.pop("size", None)
    if size is None:
        size = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
    if not all(isinstance(n, int) and n > 0 for n in size):
        raise TypeError(f"a tensor made while tracing needs positive Python int sizes, got {tuple(size)} {CONTEXT}")
    return tuple(size)


def _filled(tracer: Any, sizes: tuple[int, ...], value: Any, kind: str) -> SymTensor:
    dims = tuple(Dim(n, f"made{n}") for n in sizes)
    for attr in ("extra_dims", "made_dims"):  # named by the trace; constant where no input has them
        if getattr(tracer, attr, None) is None:
            setattr(tracer, attr, [])
        getattr(tracer, attr).extend(dims)
    return SymTensor(dims, Const(value), tracer, kind)


class Factories(TorchFunctionMode):
    """While `fn` is traced: `torch.arange`, `ones`, `zeros` and `full` return symbolic tensors
    of `tracer` (over new axes of constant sizes); every other call goes on as it would, and so do
    those inside nf.attention's mods, which capture what they make."""

    def __init__(self, tracer: Any) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        # (a score_mod / mask_mod captures the tensors it makes, as FlexAttention does: not these)
        if func in (torch.ones, torch.zeros, torch.full, torch.arange) and getattr(self.tracer, "captures", None) is None:
            for unused in ("device", "layout", "pin_memory", "requires_grad", "memory_format"):
                kwargs.pop(unused, None)
            if kwargs.pop("out", None) is not None:
                raise TypeError(f"torch.{name}(..., out=) is not supported {CONTEXT}")
            dtype = kwargs.pop("dtype", None)
            if func is torch.arange:
                return self.arange(*args, dtype=dtype, **kwargs)
            if func is torch.full:
                value = kwargs.pop("fill_value", None)
                sizes, value = (_sizes(args[:1], kwargs), args[1]) if len(args) > 1 else (_sizes(args, kwargs), value)
                if not isinstance(value, (bool, int, float)):
                    raise TypeError(f"torch.full needs a Python number to fill with, got {type(value).__name__} {CONTEXT}")
                default = "bool" if isinstance(value, bool) else "int" if isinstance(value, int) else "float"
                return _filled(self.tracer, sizes, value, _kind(dtype, default))
            kind, one = _kind(dtype, "float"), func is torch.ones
            return _filled(self.tracer, _sizes(args, kwargs), {"bool": one, "int": int(one), "float": float(one)}[kind], kind)
        return func(*args, **kwargs)

    def arange(self, start: Any, end: Any = None, step: Any = 1, *, dtype: Any = None) -> SymTensor:
        start, end = (0, start) if end is None else (start, end)
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (start, end, step)):
            raise TypeError(f"torch.arange needs Python numbers to be traced, got {(start, end, step)} {CONTEXT}")
        length = math.ceil((end - start) / step)
        if length <= 0:
            raise ValueError(f"torch.arange({start}, {end}, {step}) is empty; empty tensors are not supported")
        (dim,) = _filled(self.tracer, (length,), 0, "int").dims
        position: Expr = Index(dim.var)  # type: ignore[union-attr]
        value = SymTensor((dim,), position, self.tracer, "int")
        if any(isinstance(v, float) for v in (start, end, step)):
            value = cast(value, "f32")  # torch's float arange: start + step * i, in float32
        if step != 1:
            value = binary("mul", value, step)
        if start != 0:
            value = binary("add", value, start)
        return value if dtype is None else cast(value, dtype)


def _triangle(x: SymTensor, diagonal: int, upper: bool) -> SymTensor:
    if x.ndim < 2:
        raise ValueError(f"torch.{'triu' if upper else 'tril'} needs at least 2 dimensions, got {x.ndim}")
    rows = SymTensor(x.dims[-2:-1] + (None,), Index(x.dims[-2].var), x.tracer, "int")  # type: ignore[union-attr]
    cols = SymTensor((None,) + x.dims[-1:], Index(x.dims[-1].var), x.tracer, "int")  # type: ignore[union-attr]
    offset = binary("sub", cols, rows)
    keep = binary("ge", offset, diagonal) if upper else binary("le", offset, diagonal)
    zero: Any = False if x.kind == "bool" else 0
    return where(keep, x, zero)


def _triu(x: SymTensor, diagonal: int = 0, *, out: Any = None) -> SymTensor:
    return _triangle(x, diagonal, upper=True)


def _tril(x: SymTensor, diagonal: int = 0, *, out: Any = None) -> SymTensor:
    return _triangle(x, diagonal, upper=False)


HANDLERS = {"triu": _triu, "tril": _tril}
