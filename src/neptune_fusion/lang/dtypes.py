"""The dtype torch gives each output of a traced program: its promotion rules over the expression.

A traced program holds no dtypes, only kinds (float, int, bool); the kernels compute in fp32 and
store into the outputs. What an output is stored as is decided per call from the inputs' dtypes,
as torch would have computed the traced code: comparisons give bool, a sum of bools or integers
int64, `x.half()` float16, and arithmetic promotes as `torch.result_type` does (a dimensioned
tensor's dtype over a 0-d tensor's of the same category, both over a Python scalar's).

Example:
    >>> import torch
    >>> from neptune_fusion.lang.trace import ProgramDef
    >>> prog = ProgramDef(lambda x, n: ((x > 0).sum(-1), x.half() * 2, x.amax(-1) + n))
    >>> x, n = torch.randn(2, 3), torch.tensor([1, 2])
    >>> output_dtypes(prog.trace(x, n), {"x": x, "n": n})
    [torch.int64, torch.float16, torch.float32]
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from neptune_fusion.ir.expr import (
    COMPARISONS,
    Binary,
    Cast,
    Const,
    Expr,
    Index,
    Load,
    Param,
    Reduce,
    Size,
    Unary,
    Where,
)
from neptune_fusion.ir.program import Program

# (dtype, priority): 2 a tensor with dims, 1 a 0-d tensor, 0 a Python scalar (torch's three groups)
Typed = tuple[torch.dtype, int]

_SHORT = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "i32": torch.int32,
          "i64": torch.int64, "bool": torch.bool}
_FLOAT_MATH = ("exp", "exp2", "log", "log2", "tanh", "sigmoid", "sqrt", "rsqrt", "sin", "cos", "recip", "erf")


def output_dtypes(program: Program, values: Mapping[str, Any]) -> list[torch.dtype]:
    """The dtype of each output of `program` called with `values` (tensors and scalars by name)."""
    known: dict[str, Typed] = {}
    for b in program.inputs:
        tensor = values[b.name]
        known[b.name] = (tensor.dtype, 2 if tensor.dim() else 1)
    for p in program.params:
        known[p] = (_scalar_dtype(values[p]), 0)
    for stage in program.all_stages():
        dtype, priority = _typed(stage.body, known)
        known[stage.name] = (dtype, priority if stage.axes else min(priority, 1))  # a stage of no axes is 0-d
    return [known[o.stage][0] for o in program.outputs]


def _scalar_dtype(value: Any) -> torch.dtype:
    if isinstance(value, bool):
        return torch.bool
    return torch.int64 if isinstance(value, int) else torch.float32


def _category(dtype: torch.dtype) -> int:
    return 0 if dtype == torch.bool else (2 if dtype.is_floating_point else 1)


def promote(a: Typed, b: Typed) -> Typed:
    """torch's promotion of two operands: the higher priority group's dtype unless the other is of
    a higher category (a Python float with an int tensor: torch's default float32)."""
    if a[1] == b[1]:
        return torch.promote_types(a[0], b[0]), a[1]
    high, low = (a, b) if a[1] > b[1] else (b, a)
    if _category(low[0]) > _category(high[0]):
        return (low[0] if low[1] else _scalar_dtype({2: 0.0, 1: 0}[_category(low[0])]), high[1])
    return high


def _typed(expr: Expr, known: dict[str, Typed]) -> Typed:
    if isinstance(expr, Load):
        return known[expr.buffer]
    if isinstance(expr, Const):
        return _scalar_dtype(expr.value), 0
    if isinstance(expr, Param):
        return known[expr.name]
    if isinstance(expr, Index):
        return torch.int64, 2
    if isinstance(expr, Size):
        return torch.int64, 0
    if isinstance(expr, Cast):
        return _SHORT[expr.dtype], _typed(expr.x, known)[1]
    if isinstance(expr, Unary):
        x = _typed(expr.x, known)
        if expr.op == "not":
            return torch.bool, x[1]
        if expr.op in _FLOAT_MATH and not x[0].is_floating_point:
            return torch.float32, x[1]
        return x
    if isinstance(expr, Binary):
        a, b = _typed(expr.a, known), _typed(expr.b, known)
        both = promote(a, b)
        if expr.op in COMPARISONS:
            return torch.bool, both[1]
        if expr.op == "div" and not both[0].is_floating_point:
            return torch.float32, both[1]
        return both
    if isinstance(expr, Where):
        return promote(_typed(expr.a, known), _typed(expr.b, known))
    if isinstance(expr, Reduce):
        x = _typed(expr.body, known)
        if expr.op in ("sum", "prod") and not x[0].is_floating_point:
            return torch.int64, x[1]
        return x
    raise TypeError(f"no dtype rule for {type(expr).__name__}")


__all__ = ["output_dtypes", "promote"]
