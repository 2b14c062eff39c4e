"""Tracing through torch: FlexAttention-style `score_mod` / `mask_mod` functions on symbolic tensors.

A FlexAttention user writes `score_mod(score, b, h, q_idx, kv_idx)` and `mask_mod(b, h, q_idx,
kv_idx)` with torch operations (`torch.tanh`, `torch.where`, `&`, comparisons, ...) and by
indexing tensors they captured (`slopes[h]`, `doc_id[q_idx] == doc_id[kv_idx]`). To trace those
functions unchanged, `SymTensor.__torch_function__` routes every torch function called on a
symbolic tensor here, where it is mapped to the front end's ops (torch.nn.functional's and other
model-level ops are in the `torch_nn` package). Anything without a mapping raises a `TypeError` naming the
torch operation.

Gathers: indexing with symbolic integer tensors (`table[q_idx - kv_idx + 64]`, `bias[h, q_idx]`)
becomes a `Load` whose indices are the index expressions, of a program input. A captured torch
tensor becomes an extra program input (`cap0`, `cap1`, ..., one per tensor object) registered in
the tracer's `CaptureTable`; the caller passes the tensors as kernel arguments on every call.
Indices are not bounds-checked: out-of-range indices are the user's responsibility, as in
FlexAttention (in a kernel they read arbitrary memory).

Example:
    >>> import torch
    >>> def softcap(score, b, h, q_idx, kv_idx):
    ...     return 30.0 * torch.tanh(score / 30.0)   # traced to Unary("tanh", ...) when `score` is symbolic
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch

from neptune_fusion.ir.expr import Const, Expr, substitute_index
from neptune_fusion.lang.ops import repeat_interleave, same_axis_vars, tracer_dims
from neptune_fusion.lang.tensor import (
    SymTensor,
    binary,
    broadcast,
    cast,
    extremum,
    lift,
    matmul,
    mean,
    reduce_axes,
    unary,
    where,
)
from neptune_fusion.lang.torch_nn import CONTEXT, HANDLERS, UNSUPPORTED
from neptune_fusion.lang.torch_nn import no_out as _no_out

__all__ = ["CaptureTable", "gather", "lift_tensor", "tensor_attribute", "torch_function"]

# --------------------------------------------------------------------------- captured tensors


class CaptureTable:
    """Torch tensors captured by a traced function, each an extra program input (deduplicated by identity).

    Attach one to a tracer (`tracer.captures = CaptureTable(device)`) before running user code
    on its symbolic tensors; afterwards `names[i]` is the input name of `tensors[i]`.
    """

    def __init__(self, device: torch.device | None = None, prefix: str = "cap") -> None:
        self.device = device  # the inputs' device: what `x.device` of a symbolic tensor reports
        self.prefix = prefix
        # the tensors as the traced code holds them (a 0-d CPU scalar stays on the CPU: the caller
        # moves it to the inputs' device per call, so its in-place updates are seen); the list also
        # keeps them alive, so ids stay unique
        self.tensors: list[torch.Tensor] = []
        self.names: list[str] = []
        self._inputs: dict[int, SymTensor] = {}

    def input(self, tensor: torch.Tensor, tracer: Any) -> SymTensor:
        """The program input standing for `tensor` (created on first use)."""
        known = self._inputs.get(id(tensor))
        if known is not None:
            return known
        if tensor.is_complex() or tensor.dtype == torch.float64:
            raise TypeError(
                f"a tensor captured {CONTEXT} has dtype {tensor.dtype}; use float32/float16/bfloat16 "
                "or an integer/bool dtype"
            )
        if tensor.is_floating_point():
            kind = "float"
        elif tensor.dtype == torch.bool:
            kind = "bool"
        else:
            kind = "int"
        name = f"{self.prefix}{len(self.tensors)}"
        sym = tracer.input(name, tuple(int(s) for s in tensor.shape), kind)
        self.tensors.append(tensor)
        self.names.append(name)
        self._inputs[id(tensor)] = sym
        return sym


def _capture(tensor: torch.Tensor, tracer: Any) -> SymTensor:
    table = getattr(tracer, "captures", None)
    if table is None:
        raise TypeError(
            f"a torch tensor of shape {tuple(tensor.shape)} is used together with symbolic tensors; captured "
            "tensors are supported only in nf.attention's score_mod/mask_mod. In an @nf.program, pass it "
            "as an argument instead"
        )
    return table.input(tensor, tracer)


def lift_tensor(value: Any, tracer: Any) -> SymTensor | None:
    """A torch tensor met in arithmetic with symbolic tensors: a captured 0-d tensor (None if not a tensor)."""
    if not isinstance(value, torch.Tensor):
        return None
    if value.dim() != 0:
        if getattr(tracer, "captures", None) is None:  # a compiled function's, not a mod's
            raise TypeError(
                f"a torch tensor of shape {tuple(value.shape)} that the traced function captured (a module's "
                "parameter, a global) is combined with its symbolic tensors; nf.compile traces only the "
                "function's arguments: pass it as one (`nf.compile(lambda x, w: F.linear(x, w))(x, layer.weight)`)"
            )
        raise TypeError(
            f"a captured torch tensor of shape {tuple(value.shape)} is combined with symbolic values {CONTEXT}; "
            "index it with the symbolic indices first (e.g. bias[h, q_idx, kv_idx])"
        )
    return _capture(value, tracer)


# --------------------------------------------------------------------------- gathers


def gather(source: SymTensor, key: Any) -> SymTensor:
    """`source[key]` where `key` holds symbolic integer tensors (and maybe ints / trailing `:`).

    Indexed dims are replaced by the index expressions; the result has the broadcast dims of
    the indices followed by the source's unindexed dims, as in torch advanced indexing.
    """
    tracer = source.tracer
    keys = list(key) if isinstance(key, tuple) else [key]
    if any(k is Ellipsis for k in keys):
        pos = keys.index(Ellipsis)
        if not all(isinstance(k, slice) and k == slice(None) for k in keys[pos + 1:]):
            raise TypeError(f"symbolic indexing: '...' may only be followed by ':' (got {key!r})")
        keys = keys[:pos]
    while keys and isinstance(keys[-1], slice) and keys[-1] == slice(None):
        keys.pop()
    if len(keys) > source.ndim:
        raise IndexError(f"too many indices for a tensor of rank {source.ndim}: got {len(keys)}")
    indices: list[SymTensor] = []
    for pos, k in enumerate(keys):
        if isinstance(k, torch.Tensor) and k.dim() == 0 and not k.is_floating_point():
            k = _capture(k, tracer)
        if isinstance(k, SymTensor):
            if k.kind == "bool":
                raise TypeError("indexing with a boolean symbolic tensor (a mask) is not supported; use torch.where")
            if k.kind != "int":
                raise TypeError("a symbolic index must be an integer tensor (e.g. q_idx - kv_idx), not a float one")
            indices.append(k)
        elif isinstance(k, int) and not isinstance(k, bool):
            size = source.shape[pos]
            if not -size <= k < size:
                raise IndexError(f"index {k} is out of bounds for dimension {pos} with size {size}")
            indices.append(lift(k % size, tracer))
        else:
            raise TypeError(
                f"unsupported index {k!r} at position {pos} of a symbolic gather; use symbolic integer "
                "tensors or ints for the leading dimensions and ':' only after them"
            )
    dims, exprs = broadcast(indices, "indexing")
    mapping: dict[str, Expr] = {}
    all_dims = tracer_dims(tracer)
    for pos, e in enumerate(exprs):
        d = source.dims[pos]
        if d is None:  # a broadcast size-1 dim: the index must be 0 and reads the one element
            continue
        for var in same_axis_vars(source.expr, d, all_dims):
            mapping[var] = e
    expr = substitute_index(source.expr, mapping) if mapping else source.expr
    return SymTensor(tuple(dims) + tuple(source.dims[len(exprs):]), expr, tracer, source.kind)


def getitem(self: Any, key: Any) -> SymTensor:
    """`tensor[index...]` where an index is symbolic: a gather from a captured tensor or an input."""
    if isinstance(self, torch.Tensor):
        keys = key if isinstance(key, tuple) else (key,)
        sym = next(k for k in keys if isinstance(k, SymTensor))
        return gather(_capture(self, sym.tracer), key)
    return gather(self, key)


# --------------------------------------------------------------------------- the op table


def _unary(op: str) -> Callable[..., SymTensor]:
    def fn(x: Any, *, out: Any = None) -> SymTensor:
        _no_out(op, out)
        return unary(op, x)

    return fn


def _binary(op: str, swap: bool = False) -> Callable[..., SymTensor]:
    def fn(a: Any, b: Any, *, out: Any = None) -> SymTensor:
        _no_out(op, out)
        return binary(op, b, a) if swap else binary(op, a, b)

    return fn


def _add(a: Any, b: Any, *, alpha: Any = 1, out: Any = None) -> SymTensor:
    _no_out("add", out)
    return binary("add", a, b if alpha == 1 else binary("mul", b, alpha))


def _sub(a: Any, b: Any, *, alpha: Any = 1, out: Any = None) -> SymTensor:
    _no_out("sub", out)
    return binary("sub", a, b if alpha == 1 else binary("mul", b, alpha))


def _rsub(a: Any, b: Any, *, alpha: Any = 1) -> SymTensor:
    return _sub(b, a, alpha=alpha)


def _kind(x: Any) -> str:
    if isinstance(x, SymTensor):
        return x.kind
    if isinstance(x, bool):
        return "bool"
    if isinstance(x, int):
        return "int"
    if isinstance(x, torch.Tensor):
        return "float" if x.is_floating_point() else ("bool" if x.dtype == torch.bool else "int")
    return "float"


def _div(a: Any, b: Any, *, rounding_mode: str | None = None, out: Any = None) -> SymTensor:
    _no_out("div", out)
    if rounding_mode is None:
        return binary("div", a, b)
    if rounding_mode == "floor":
        return binary("floordiv", a, b)
    if rounding_mode == "trunc":
        if _kind(a) == "float" or _kind(b) == "float":
            raise TypeError(f"torch.div(..., rounding_mode='trunc') on floating-point values is not supported {CONTEXT}")
        q, r = binary("floordiv", a, b), binary("mod", a, b)
        # floor -> truncation: one up where the division was inexact and the signs differ
        fix = binary("and", binary("ne", r, 0), binary("ne", _is_negative(a), _is_negative(b)))
        return where(fix, binary("add", q, 1), q)
    raise ValueError(f"unknown rounding_mode {rounding_mode!r}")


def _is_negative(x: Any) -> Any:
    """x < 0: a Python bool for a Python number (one operand of a torch op may be one), else symbolic."""
    if isinstance(x, (int, float)):
        return x < 0
    return binary("lt", x, 0)


def _pow(a: Any, b: Any, *, out: Any = None) -> SymTensor:
    _no_out("pow", out)
    if isinstance(b, (int, float)) and not isinstance(b, bool) and isinstance(a, SymTensor):
        if b == 0.5:
            return unary("sqrt", a)
        if b == -0.5:
            return unary("rsqrt", a)
        if b == 1:
            return a
        if b == -1:
            return binary("div", 1.0, a)
    return binary("pow", a, b)


def _logical(op: str) -> Callable[..., SymTensor]:
    def fn(a: Any, b: Any, *, out: Any = None) -> SymTensor:
        _no_out(f"logical_{op}", out)
        ta, tb = _as_bool(a), _as_bool(b)
        if op == "xor":
            return binary("ne", ta, tb)
        return binary(op, ta, tb)

    return fn


def _as_bool(x: Any) -> Any:
    if _kind(x) == "bool":
        return x
    return binary("ne", x, 0)


def _bitwise(op: str, swap: bool = False) -> Callable[..., SymTensor]:
    def fn(a: Any, b: Any, *, out: Any = None) -> SymTensor:
        _no_out(f"bitwise_{op}", out)
        if swap:
            a, b = b, a
        if op == "xor":
            if _kind(a) == "bool" and _kind(b) == "bool":
                return binary("ne", a, b)
            raise TypeError(f"bitwise xor of integers is not supported {CONTEXT}")
        return binary(op, a, b)

    return fn


def _not(x: Any, *, out: Any = None) -> SymTensor:
    _no_out("not", out)
    if _kind(x) != "bool":
        raise TypeError(f"bitwise not of integers is not supported {CONTEXT}; use it on boolean masks")
    return unary("not", x)


def _logical_not(x: Any, *, out: Any = None) -> SymTensor:
    _no_out("logical_not", out)
    return unary("not", _as_bool(x))


def _where(cond: Any, a: Any = None, b: Any = None, *, out: Any = None) -> SymTensor:
    _no_out("where", out)
    if a is None or b is None:
        raise TypeError(f"torch.where(condition) with one argument (nonzero) is not supported {CONTEXT}")
    return where(cond, a, b)


def _tensor_where(self: Any, condition: Any, y: Any) -> SymTensor:
    return where(condition, self, y)


def _masked_fill(self: Any, mask: Any, value: Any) -> SymTensor:
    return where(mask, value, self)


def _clamp(x: Any, min: Any = None, max: Any = None, *, out: Any = None) -> SymTensor:  # noqa: A002
    _no_out("clamp", out)
    if min is None and max is None:
        raise ValueError("torch.clamp: at least one of min and max must be given")
    y = x
    if min is not None:
        y = binary("max", y, min)
    if max is not None:
        y = binary("min", y, max)
    return y


def _maxmin(op: str, name: str) -> Callable[..., SymTensor]:
    def fn(a: Any, other: Any = None, *args: Any, **kwargs: Any) -> SymTensor:
        if isinstance(other, (SymTensor, torch.Tensor)) and not args and not kwargs:
            return binary(op, a, other)
        if other is None and not args and not kwargs:  # torch.max(x): the largest value
            return reduce_axes(op, lift(a, a.tracer), None, False)
        dim = other if other is not None else kwargs.pop("dim", None)
        keepdim = args[0] if args else kwargs.pop("keepdim", False)
        _no_out(name, kwargs.pop("out", None))
        if isinstance(dim, bool) or not isinstance(dim, int) or kwargs or len(args) > 1:
            raise TypeError(f"torch.{name} takes (x), (x, dim, keepdim=False) or (a, b) {CONTEXT}")
        return extremum(op, lift(a, a.tracer), dim, bool(keepdim))  # (values, indices): the indices raise

    return fn


def _reduction(op: str) -> Callable[..., SymTensor]:
    """torch.sum / amax / amin / mean(x, dim=None, keepdim=False, *, dtype=None)."""
    def fn(x: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None, out: Any = None) -> SymTensor:
        _no_out(op, out)
        x = lift(x, x.tracer)
        if dtype is not None:
            x = cast(x, dtype)
        return mean(x, dim, keepdim) if op == "mean" else reduce_axes(op, x, dim, keepdim)

    return fn


def _matmul(a: Any, b: Any, *, out: Any = None) -> SymTensor:
    _no_out("matmul", out)
    return matmul(a, b)


def _sign(x: Any, *, out: Any = None) -> SymTensor:
    _no_out("sign", out)
    one = 1 if _kind(x) == "int" else 1.0
    zero = 0 if _kind(x) == "int" else 0.0
    return where(binary("gt", x, 0), one, where(binary("lt", x, 0), -one, zero))


def _rounding(name: str) -> Callable[..., SymTensor]:
    def fn(x: Any, *args: Any, **kwargs: Any) -> SymTensor:
        if _kind(x) != "float":
            return lift(x, x.tracer)
        raise TypeError(f"torch.{name} of floating-point values is not supported {CONTEXT}")

    return fn


def _const_like(value: Any, x: SymTensor, dtype: Any) -> SymTensor:
    kind = _dtype_kind(dtype) if dtype is not None else x.kind
    v = bool(value) if kind == "bool" else (int(value) if kind == "int" else float(value))
    return SymTensor(x.dims, Const(v), x.tracer, kind)


def _dtype_kind(dtype: Any) -> str:
    if dtype is None:
        return "float"
    if dtype == torch.bool:
        return "bool"
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return "float"
    return "int"


def _zeros_like(x: SymTensor, *, dtype: Any = None, **_: Any) -> SymTensor:
    return _const_like(0, x, dtype)


def _ones_like(x: SymTensor, *, dtype: Any = None, **_: Any) -> SymTensor:
    return _const_like(1, x, dtype)


def _full_like(x: SymTensor, fill_value: Any, *, dtype: Any = None, **_: Any) -> SymTensor:
    if isinstance(fill_value, SymTensor):
        raise TypeError(f"torch.full_like with a symbolic fill value is not supported {CONTEXT}")
    if dtype is None and isinstance(fill_value, float):
        dtype = torch.float32
    return _const_like(fill_value, x, dtype)


def _new_const(value: Any, x: SymTensor, size: Any, dtype: Any, name: str) -> SymTensor:
    shape = tuple(size) if isinstance(size, (tuple, list, torch.Size)) else (size,)
    if any(int(s) != 1 for s in shape):
        raise TypeError(f"torch.Tensor.{name} of shape {shape} is not supported {CONTEXT}; only scalars (shape ())")
    kind = _dtype_kind(dtype) if dtype is not None else x.kind
    v = bool(value) if kind == "bool" else (int(value) if kind == "int" else float(value))
    return SymTensor((None,) * len(shape), Const(v), x.tracer, kind)


def _size_arg(size: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if "size" in kwargs:
        return kwargs["size"]
    return size[0] if len(size) == 1 else size


def _new_zeros(x: SymTensor, *size: Any, dtype: Any = None, **kwargs: Any) -> SymTensor:
    return _new_const(0, x, _size_arg(size, kwargs), dtype, "new_zeros")


def _new_ones(x: SymTensor, *size: Any, dtype: Any = None, **kwargs: Any) -> SymTensor:
    return _new_const(1, x, _size_arg(size, kwargs), dtype, "new_ones")


def _new_full(x: SymTensor, size: Any, fill_value: Any, *, dtype: Any = None, **_: Any) -> SymTensor:
    return _new_const(fill_value, x, size, dtype, "new_full")


def _new_tensor(x: SymTensor, data: Any, *, dtype: Any = None, **_: Any) -> SymTensor:
    if not isinstance(data, (bool, int, float)):
        raise TypeError(f"torch.Tensor.new_tensor of non-scalar data is not supported {CONTEXT}")
    if dtype is None:
        dtype = torch.bool if isinstance(data, bool) else (torch.int64 if isinstance(data, int) else torch.float32)
    return _new_const(data, x, (), dtype, "new_tensor")


_CAST_NAMES = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f32",
    torch.int32: "i32", torch.int64: "i64", torch.int16: "i32", torch.int8: "i32", torch.uint8: "i32",
    torch.bool: "bool",
}


def _cast(x: SymTensor, dtype: Any) -> SymTensor:
    if dtype not in _CAST_NAMES:
        raise TypeError(f"casting to {dtype} is not supported {CONTEXT}")
    name = _CAST_NAMES[dtype]
    current = {"float": "f32", "int": "i64", "bool": "bool"}[x.kind]
    if name == current or (name == "f32" and x.kind == "float"):
        return x
    return cast(x, name)


def _to(x: SymTensor, *args: Any, **kwargs: Any) -> SymTensor:
    dtype = kwargs.get("dtype")
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, (torch.Tensor, SymTensor)):
            dtype = a.dtype
    return x if dtype is None else _cast(x, dtype)


def _type(x: SymTensor, dtype: Any = None, **_: Any) -> SymTensor:
    if dtype is None:
        raise TypeError(f"torch.Tensor.type() without a dtype is not supported {CONTEXT}")
    if isinstance(dtype, str):
        dtype = {"torch.FloatTensor": torch.float32, "torch.LongTensor": torch.int64,
                 "torch.IntTensor": torch.int32, "torch.BoolTensor": torch.bool}.get(dtype, dtype)
    return _cast(x, dtype)


def _cast_to(dtype: torch.dtype) -> Callable[..., SymTensor]:
    def fn(x: SymTensor, *_: Any, **__: Any) -> SymTensor:
        return _cast(x, dtype)

    return fn


def _identity(x: Any, *_: Any, **__: Any) -> Any:
    return x


def _detach(x: Any) -> Any:
    """x.detach(): the value, through which no gradient flows (a straight-through estimator's
    `x + (q - x).detach()` differentiates as x)."""
    return unary("detach", x) if isinstance(x, SymTensor) and x.kind == "float" else x


def _data_dependent(name: str) -> Callable[..., Any]:
    def fn(*_: Any, **__: Any) -> Any:
        raise TypeError(
            f"{name} needs a concrete value, but values are symbolic {CONTEXT}: Python control flow on "
            "tensor values is not supported; use torch.where"
        )

    return fn


def _repeat_interleave(x: Any, repeats: Any, dim: Any = None, **_: Any) -> SymTensor:
    if not isinstance(x, SymTensor) or not isinstance(repeats, int) or dim is None:
        raise TypeError(f"torch.repeat_interleave is supported {CONTEXT} only as x.repeat_interleave(int, dim)")
    return repeat_interleave(x, repeats, dim)


def _log10(x: Any, *, out: Any = None) -> SymTensor:
    _no_out("log10", out)
    return binary("div", unary("log", x), math.log(10.0))


def _isnan(x: Any) -> SymTensor:
    return binary("ne", x, x)


def _isinf(x: Any) -> SymTensor:
    return binary("eq", unary("abs", x), math.inf)


def _isfinite(x: Any) -> SymTensor:
    return binary("and", binary("eq", x, x), binary("ne", unary("abs", x), math.inf))


_HANDLERS: dict[str, Callable[..., Any]] = {
    # elementwise math
    "tanh": _unary("tanh"), "exp": _unary("exp"), "exp2": _unary("exp2"), "log": _unary("log"),
    "log2": _unary("log2"), "log10": _log10, "sigmoid": _unary("sigmoid"), "special_expit": _unary("sigmoid"),
    "sqrt": _unary("sqrt"), "rsqrt": _unary("rsqrt"), "sin": _unary("sin"), "cos": _unary("cos"),
    "abs": _unary("abs"), "absolute": _unary("abs"), "neg": _unary("neg"), "negative": _unary("neg"),
    "positive": _identity, "reciprocal": lambda x, *, out=None: binary("div", 1.0, x),
    "square": lambda x, *, out=None: binary("mul", x, x),
    "sign": _sign, "sgn": _sign,
    "floor": _rounding("floor"), "ceil": _rounding("ceil"), "round": _rounding("round"),
    "trunc": _rounding("trunc"), "fix": _rounding("fix"),
    "isnan": _isnan, "isinf": _isinf, "isfinite": _isfinite,
    # arithmetic
    "add": _add, "sub": _sub, "subtract": _sub, "rsub": _rsub, "mul": _binary("mul"), "multiply": _binary("mul"),
    "div": _div, "divide": _div, "true_divide": _binary("div"), "floor_divide": _binary("floordiv"),
    "remainder": _binary("mod"), "pow": _pow, "float_power": _pow,
    "maximum": _binary("max"), "minimum": _binary("min"), "fmax": _binary("max"), "fmin": _binary("min"),
    "max": _maxmin("max", "max"), "min": _maxmin("min", "min"),
    "clamp": _clamp, "clip": _clamp,
    # reductions
    "sum": _reduction("sum"), "amax": _reduction("max"), "amin": _reduction("min"), "mean": _reduction("mean"),
    "matmul": _matmul,
    "clamp_min": lambda x, m: binary("max", x, m), "clamp_max": lambda x, m: binary("min", x, m),
    # comparisons and logic
    "eq": _binary("eq"), "ne": _binary("ne"), "not_equal": _binary("ne"), "lt": _binary("lt"),
    "less": _binary("lt"), "le": _binary("le"), "less_equal": _binary("le"), "gt": _binary("gt"),
    "greater": _binary("gt"), "ge": _binary("ge"), "greater_equal": _binary("ge"),
    "logical_and": _logical("and"), "logical_or": _logical("or"), "logical_xor": _logical("xor"),
    "logical_not": _logical_not, "bitwise_and": _bitwise("and"), "bitwise_or": _bitwise("or"),
    "bitwise_xor": _bitwise("xor"), "bitwise_not": _not,
    "where": _where, "masked_fill": _masked_fill,
    # constants shaped like a tensor
    "zeros_like": _zeros_like, "ones_like": _ones_like, "full_like": _full_like,
    "new_zeros": _new_zeros, "new_ones": _new_ones, "new_full": _new_full, "new_tensor": _new_tensor,
    # dtype and no-op views
    "to": _to, "type": _type, "type_as": lambda x, other: _to(x, other), "float": _cast_to(torch.float32), "half": _cast_to(torch.float16),
    "bfloat16": _cast_to(torch.bfloat16), "double": _cast_to(torch.float64), "int": _cast_to(torch.int32),
    "long": _cast_to(torch.int64), "bool": _cast_to(torch.bool), "short": _cast_to(torch.int16),
    "clone": _identity, "contiguous": _identity, "detach": _detach,
    "repeat_interleave": _repeat_interleave,
    "__getitem__": getitem,
    # values Python would need concretely
    "item": _data_dependent("Tensor.item()"), "tolist": _data_dependent("Tensor.tolist()"),
    "__bool__": _data_dependent("bool(tensor)"), "__int__": _data_dependent("int(tensor)"),
    "__float__": _data_dependent("float(tensor)"), "__index__": _data_dependent("using a tensor as a Python index"),
}

_DUNDERS = {
    "add": _binary("add"), "sub": _binary("sub"), "mul": _binary("mul"), "truediv": _binary("div"),
    "div": _binary("div"), "floordiv": _binary("floordiv"), "mod": _binary("mod"), "pow": _pow,
    "and": _bitwise("and"), "or": _bitwise("or"), "xor": _bitwise("xor"),
}
for _name, _fn in _DUNDERS.items():
    _HANDLERS[f"__{_name}__"] = _fn
    _HANDLERS[f"__r{_name}__"] = (lambda f: lambda a, b: f(b, a))(_fn)
for _name in ("lt", "le", "gt", "ge", "eq", "ne"):
    _HANDLERS[f"__{_name}__"] = _binary(_name)
_HANDLERS["__neg__"] = _unary("neg")
_HANDLERS["__abs__"] = _unary("abs")
_HANDLERS["__invert__"] = _not
_HANDLERS["__pos__"] = _identity
_HANDLERS.update(HANDLERS)  # torch.nn.functional and friends (lang/torch_nn/)


def _torch_name(func: Any) -> str:
    """How a user would spell `func`: torch.tanh, torch.Tensor.sort, torch.nn.functional.gelu."""
    name = getattr(func, "__name__", repr(func))
    qual = getattr(func, "__qualname__", "") or ""
    module = getattr(func, "__module__", "") or ""
    if qual.startswith(("TensorBase.", "Tensor.", "_TensorBase.")):
        return f"torch.Tensor.{name}"
    if module in ("torch._C._nn", "torch.nn.functional"):
        return f"torch.nn.functional.{name}"
    if name.startswith("special_") or module == "torch._C._special":
        return f"torch.special.{name.removeprefix('special_')}"
    if module == "torch._C._linalg" or name.startswith("linalg_"):
        return f"torch.linalg.{name.removeprefix('linalg_')}"
    return f"torch.{name}"


def torch_function(func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
    """The body of `SymTensor.__torch_function__`: map a torch function to the front end's ops."""
    kwargs = kwargs or {}
    name = getattr(func, "__name__", "")
    handler = _HANDLERS.get(name)
    if handler is None or name.endswith("_") and not name.startswith("__"):
        what = _torch_name(func)
        extra = " (in-place operations are not supported)" if name.endswith("_") and not name.startswith("__") else ""
        extra = f": {UNSUPPORTED[name]}" if name in UNSUPPORTED else extra
        raise TypeError(f"{what} is not supported {CONTEXT}{extra}")
    try:
        return handler(*args, **kwargs)
    except TypeError as exc:
        if "not supported" in str(exc) or "symbolic" in str(exc) or "captured" in str(exc):
            raise
        raise TypeError(f"{_torch_name(func)} with these arguments is not supported {CONTEXT}: {exc}") from exc


# --------------------------------------------------------------------------- methods and attributes


_KIND_DTYPES = {"float": torch.float32, "int": torch.int32, "bool": torch.bool}


def tensor_attribute(x: SymTensor, name: str) -> Any:
    """`x.<name>` for a torch.Tensor attribute the symbolic tensor does not define itself."""
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    if name == "dtype":
        return _KIND_DTYPES[x.kind]
    if name == "device":
        table = getattr(x.tracer, "captures", None)
        return table.device if table is not None and table.device is not None else torch.device("cpu")
    if name == "requires_grad":
        return False
    if name == "is_floating_point":
        return lambda: x.kind == "float"
    if name == "dim":
        return lambda: x.ndim
    if name == "size":
        return lambda d=None: torch.Size(x.shape) if d is None else x.shape[d]
    if name == "T":  # torch: every axis reversed
        result = x
        for i in range(x.ndim // 2):
            result = result.transpose(i, x.ndim - 1 - i)
        return result
    handler = _HANDLERS.get(name)
    if handler is not None and not name.startswith("__"):
        return functools.partial(handler, x)
    if hasattr(torch.Tensor, name):
        extra = " (in-place operations are not supported)" if name.endswith("_") else ""
        extra = f": {UNSUPPORTED[name]}" if name in UNSUPPORTED else extra
        raise TypeError(f"torch.Tensor.{name} is not supported {CONTEXT}{extra}")
    raise AttributeError(f"{type(x).__name__!r} object has no attribute {name!r}")
