"""Symbolic tensors: what a traced program's tensor arguments become.

A `SymTensor` is a lazy elementwise expression over its dimensions. Each
dimension is a `Dim` variable; broadcasting and einsum unify dims (union-find),
so after tracing every dimension of every tensor is known to be "the same axis"
as others or not. Reductions and contractions materialise a new stage of the
`Tracer`; elementwise ops only grow the expression.

Example:
    >>> import neptune_fusion as nf
    >>> @nf.program
    ... def softmax(x):
    ...     e = nf.exp(x - x.max(axis=-1, keepdims=True))
    ...     return e / e.sum(axis=-1, keepdims=True)
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Sequence, Union

from neptune_fusion.ir.expr import (
    NARROW_INT_DTYPES,
    Binary,
    Cast,
    Const,
    Expr,
    Index,
    Load,
    Reduce,
    Size,
    Unary,
    Where,
    walk,
)


class Dim:
    """A dimension variable; `find()` gives its representative after unification."""

    _counter = 0
    # every live dim by its index variable (a broadcast tells the classes an expression indexes)
    by_var: weakref.WeakValueDictionary[str, Dim] = weakref.WeakValueDictionary()

    def __init__(self, size: int, hint: str) -> None:
        Dim._counter += 1
        self.uid = Dim._counter
        self.size = size
        self.hint = hint
        self.parent: Dim | None = None
        self.letters: list[str] = []
        Dim.by_var[self.var] = self

    def find(self) -> Dim:
        node = self
        while node.parent is not None:
            node = node.parent
        return node

    @property
    def var(self) -> str:
        return f"_d{self.uid}"

    def __repr__(self) -> str:
        return f"Dim({self.hint}, {self.size})"


def unify(a: Dim, b: Dim, where: str) -> None:
    """Record that two dims are the same axis; ValueError (naming `where`) if their sizes differ."""
    ra, rb = a.find(), b.find()
    if ra is rb:
        return
    if ra.size != rb.size:
        raise ValueError(f"{where}: dimension sizes {ra.size} and {rb.size} do not match")
    rb.parent = ra
    ra.letters.extend(rb.letters)


Scalar = Union[int, float, bool]


@dataclass
class SymTensor:
    """A symbolic tensor: `dims` (None marks a broadcast size-1 dim) and an element expression."""

    dims: tuple[Dim | None, ...]
    expr: Expr
    tracer: object
    kind: str = "float"  # "float" | "int" | "bool"

    def __post_init__(self) -> None:
        # a value computed under torch.no_grad() inside a traced function passes no gradient, as in
        # torch (`trace` runs the function with gradients on, so only its own blocks turn them off)
        if (self.kind == "float" and getattr(self.tracer, "traces_gradients", False)
                and not (isinstance(self.expr, Unary) and self.expr.op == "detach")):
            import torch

            if not torch.is_grad_enabled():
                self.expr = Unary("detach", self.expr)

    @property
    def ndim(self) -> int:
        return len(self.dims)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(1 if d is None else d.size for d in self.dims)

    # arithmetic ------------------------------------------------------------
    def __add__(self, o: TensorLike) -> SymTensor:
        return binary("add", self, o)

    def __radd__(self, o: TensorLike) -> SymTensor:
        return binary("add", o, self)

    def __sub__(self, o: TensorLike) -> SymTensor:
        return binary("sub", self, o)

    def __rsub__(self, o: TensorLike) -> SymTensor:
        return binary("sub", o, self)

    def __mul__(self, o: TensorLike) -> SymTensor:
        return binary("mul", self, o)

    def __rmul__(self, o: TensorLike) -> SymTensor:
        return binary("mul", o, self)

    def __truediv__(self, o: TensorLike) -> SymTensor:
        return binary("div", self, o)

    def __rtruediv__(self, o: TensorLike) -> SymTensor:
        return binary("div", o, self)

    def __floordiv__(self, o: TensorLike) -> SymTensor:
        return binary("floordiv", self, o)

    def __mod__(self, o: TensorLike) -> SymTensor:
        return binary("mod", self, o)

    def __pow__(self, o: TensorLike) -> SymTensor:
        return binary("pow", self, o)

    def __rpow__(self, o: TensorLike) -> SymTensor:
        return binary("pow", o, self)

    def __neg__(self) -> SymTensor:
        return unary("neg", self)

    def __matmul__(self, o: SymTensor) -> SymTensor:
        return matmul(self, o)

    def __rmatmul__(self, o: SymTensor) -> SymTensor:
        return matmul(o, self)

    def __abs__(self) -> SymTensor:
        return unary("abs", self)

    def __lt__(self, o: TensorLike) -> SymTensor:  # type: ignore[override]
        return binary("lt", self, o)

    def __le__(self, o: TensorLike) -> SymTensor:  # type: ignore[override]
        return binary("le", self, o)

    def __gt__(self, o: TensorLike) -> SymTensor:  # type: ignore[override]
        return binary("gt", self, o)

    def __ge__(self, o: TensorLike) -> SymTensor:  # type: ignore[override]
        return binary("ge", self, o)

    def __eq__(self, o: object) -> SymTensor:  # type: ignore[override]
        return binary("eq", self, o)  # type: ignore[arg-type]

    def __ne__(self, o: object) -> SymTensor:  # type: ignore[override]
        return binary("ne", self, o)  # type: ignore[arg-type]

    def __and__(self, o: TensorLike) -> SymTensor:
        return binary("and", self, o)

    def __or__(self, o: TensorLike) -> SymTensor:
        return binary("or", self, o)

    def __xor__(self, o: TensorLike) -> SymTensor:
        return _xor(self, o)

    def __rxor__(self, o: TensorLike) -> SymTensor:
        return _xor(o, self)

    def __invert__(self) -> SymTensor:
        return unary("not", self)

    __hash__ = None  # type: ignore[assignment]

    def __bool__(self) -> bool:
        raise TypeError(
            "a symbolic tensor has no truth value while tracing; use nf.where(cond, a, b) "
            "instead of Python `if`/`and`/`or`"
        )

    # reductions and views ----------------------------------------------------
    # `axis=None` reduces every axis (numpy's and torch's meaning); torch's `dim` / `keepdim`
    # spellings are accepted too
    def sum(self, axis: Axes = None, keepdims: bool = False, *, dim: Axes = None, keepdim: bool | None = None,
            dtype: object = None) -> SymTensor:
        x = self if dtype is None else cast(self, dtype)
        return reduce_axes("sum", x, _axes_arg(axis, dim), _keep_arg(keepdims, keepdim))

    # `axis=` / `keepdims=` (numpy's spelling) give the values; torch's spellings (`x.max(-1)`,
    # `dim=`) give values that also read as torch's (values, indices) pair (`Extremum`)
    def max(self, *args: Any, **kwargs: Any) -> SymTensor:
        return _max_min("max", self, args, kwargs)

    def min(self, *args: Any, **kwargs: Any) -> SymTensor:
        return _max_min("min", self, args, kwargs)

    def mean(self, axis: Axes = None, keepdims: bool = False, *, dim: Axes = None, keepdim: bool | None = None,
             dtype: object = None) -> SymTensor:
        x = self if dtype is None else cast(self, dtype)
        return mean(x, _axes_arg(axis, dim), _keep_arg(keepdims, keepdim))

    def exp(self) -> SymTensor:
        return unary("exp", self)

    def transpose(self, a: int, b: int) -> SymTensor:
        dims = list(self.dims)
        a, b = _norm_axis(a, self.ndim), _norm_axis(b, self.ndim)
        dims[a], dims[b] = dims[b], dims[a]
        return SymTensor(tuple(dims), self.expr, self.tracer, self.kind)

    @property
    def mT(self) -> SymTensor:  # noqa: N802 - torch's name
        return self.transpose(-1, -2)

    def unsqueeze(self, axis: int) -> SymTensor:
        axis = axis if axis >= 0 else self.ndim + 1 + axis
        dims = list(self.dims)
        dims.insert(axis, None)
        return SymTensor(tuple(dims), self.expr, self.tracer, self.kind)

    def __getitem__(self, key: object) -> SymTensor:
        keys = key if isinstance(key, tuple) else (key,)
        if any(isinstance(k, SymTensor) for k in keys):  # a gather: indices are symbolic integers
            from neptune_fusion.lang.torch_function import gather

            return gather(self, key)
        dims: list[Dim | None] = []
        source = list(self.dims)
        expr = self.expr
        consumed = sum(1 for k in keys if k is not None and k is not Ellipsis)
        if consumed > len(source):
            raise IndexError(f"too many indices for a symbolic tensor of rank {self.ndim} (got {key!r})")
        if sum(1 for k in keys if k is Ellipsis) > 1:
            raise IndexError(f"an index can only have a single ellipsis (got {key!r})")
        for k in keys:
            if k is None:
                dims.append(None)
            elif k is Ellipsis:
                rest = sum(1 for x in keys if x is not None and x is not Ellipsis)
                take = len(source) - rest
                dims.extend(source[:take])
                source = source[take:]
            elif isinstance(k, slice) and k == slice(None):
                dims.append(source.pop(0))
            elif isinstance(k, slice):
                dim = source.pop(0)
                kept, expr = sliced_axis(expr, dim, k, self.tracer)
                dims.append(kept)
            elif isinstance(k, int) and not isinstance(k, bool):
                dim = source.pop(0)
                size = 1 if dim is None else dim.find().size
                if not -size <= k < size:
                    raise IndexError(f"index {k} is out of bounds for a dimension of size {size}")
                if dim is not None:
                    expr = _axis_read_at(expr, dim, Const(k % size), self.tracer)
            else:
                raise TypeError(
                    "symbolic tensors support indexing with ints, slices, ':', '...' and None "
                    f"(got {k!r}); write gathers as loads of an index expression"
                )
        dims.extend(source)
        return SymTensor(tuple(dims), expr, self.tracer, self.kind)

    def to(self, dtype: object) -> SymTensor:
        return cast(self, dtype)

    def float(self) -> SymTensor:
        return cast(self, "f32")

    # torch interoperability (FlexAttention-style score_mod / mask_mod) ------------
    @classmethod
    def __torch_function__(cls, func: object, types: object, args: tuple = (), kwargs: dict | None = None) -> object:
        from neptune_fusion.lang.torch_function import torch_function

        return torch_function(func, types, args, kwargs)

    def __getattr__(self, name: str) -> object:
        from neptune_fusion.lang.torch_function import tensor_attribute

        return tensor_attribute(self, name)


TensorLike = Union[SymTensor, Scalar]


def _norm_axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for a tensor of rank {ndim}")
    return axis % ndim


def _tracer_of(*values: object) -> object:
    for v in values:
        if isinstance(v, SymTensor):
            return v.tracer
    raise TypeError("expected at least one symbolic tensor")


def _xor(a: TensorLike, b: TensorLike) -> SymTensor:
    """a ^ b of boolean masks: a != b (the IR has no bitwise xor of integers)."""
    tracer = _tracer_of(a, b)
    ta, tb = lift(a, tracer), lift(b, tracer)
    if ta.kind != "bool" or tb.kind != "bool":
        raise TypeError(f"^ (xor) is supported on boolean masks only, got {ta.kind} ^ {tb.kind}")
    return binary("ne", ta, tb)


def lift(value: TensorLike, tracer: object) -> SymTensor:
    """Wrap a Python scalar (or a scalar `Param` expression) as a rank-0 tensor."""
    if isinstance(value, SymTensor):
        return value
    if isinstance(value, Expr):
        return SymTensor((), value, tracer)
    if isinstance(value, bool):
        return SymTensor((), Const(value), tracer, "bool")
    if isinstance(value, int):
        return SymTensor((), Const(value), tracer, "int")
    if isinstance(value, float):
        return SymTensor((), Const(value), tracer)
    from neptune_fusion.lang.torch_function import lift_tensor  # a torch tensor captured by the traced code

    lifted = lift_tensor(value, tracer)
    if lifted is not None:
        return lifted
    raise TypeError(f"cannot use a value of type {type(value).__name__} in a traced program")


def _class_of(var: str) -> Dim | None:
    dim = Dim.by_var.get(var)
    return None if dim is None else dim.find()


def _index_vars(expr: Expr) -> set[str]:
    return {n.axis for n in walk(expr) if isinstance(n, Index)}


def _read_along(expr: Expr, dim: Dim, target: Dim) -> dict[str, Expr]:
    """The substitution that reads `expr`'s `dim` where the result has `target`: element 0 of a
    size-1 dim broadcast against a larger one; else (two axes of one size known apart, met position
    by position: `x + x @ w` with a square w, x's columns and the product's) the same positions
    along `target`'s axis."""
    if dim.find().size != target.find().size:
        return {dim.var: Const(0)}
    return {v: Index(target.var) for v in _index_vars(expr) if _class_of(v) is dim.find()}


def _alias_repeated_classes(out: list[Dim | None], tensors: Sequence[SymTensor]) -> None:
    """A result that would hold one axis twice (`x[:, None] * x[None, :]`, an outer product of a
    tensor with itself) gets a fresh axis of that size at the later position."""
    seen: set[int] = set()
    for pos, dim in enumerate(out):
        if dim is None:
            continue
        if dim.find().uid in seen:
            fresh = Dim(dim.find().size, f"{dim.hint}'")
            tensors[0].tracer.aliases.append((fresh, dim))  # type: ignore[attr-defined]
            out[pos] = fresh
        seen.add(out[pos].find().uid)  # type: ignore[union-attr]


def _distinct_axes(tracer: Any, a: Dim, b: Dim) -> bool:
    """Whether dims `a` and `b` are different axes of one tensor the trace holds (an input's two
    dimensions, or a stage's output axis and its summed axis: a square weight's rows and columns),
    so identifying them would make that tensor index one axis twice."""
    ra, rb = a.find(), b.find()
    if ra is rb or tracer is None:
        return False
    for _, dims, _ in getattr(tracer, "inputs", ()):
        classes = {d.find() for d in dims}
        if ra in classes and rb in classes:
            return True
    for st in getattr(tracer, "stages", ()):
        names = {*st.axes, *(n.axis for n in walk(st.body) if isinstance(n, Reduce))}
        classes = {_class_of(v) for v in names}
        if ra in classes and rb in classes:
            return True
    return False


def broadcast(tensors: Sequence[SymTensor], what: str) -> tuple[tuple[Dim | None, ...], list[Expr]]:
    """Right-align and broadcast `tensors`; return the result dims and each operand's expr."""
    ndim = max(t.ndim for t in tensors)
    out: list[Dim | None] = [None] * ndim
    for t in tensors:
        for pos, dim in enumerate(t.dims, start=ndim - t.ndim):
            if dim is None:
                continue
            cur = out[pos]
            if cur is None:
                out[pos] = dim
            elif cur.find().size == 1 and dim.find().size != 1:
                out[pos] = dim
            elif dim.find().size == 1 and cur.find().size != 1:
                continue
            elif not _distinct_axes(t.tracer, cur, dim) or cur.find().size != dim.find().size:
                unify(cur, dim, f"{what}: broadcasting dimension {pos - ndim}")
    _alias_repeated_classes(out, tensors)
    exprs = []
    for t in tensors:
        expr = t.expr
        mapping: dict[str, Expr] = {}
        for pos, dim in enumerate(t.dims, start=ndim - t.ndim):
            target = out[pos]
            if dim is None or target is None or dim.find() is target.find():
                continue
            mapping.update(_read_along(expr, dim, target))
        if mapping:
            from neptune_fusion.ir.expr import substitute_index

            expr = substitute_index(expr, mapping)
        exprs.append(expr)
    return tuple(out), exprs


def _result_kind(op: str, kinds: Sequence[str]) -> str:
    from neptune_fusion.ir.expr import COMPARISONS

    if op in COMPARISONS or op == "not":
        return "bool"
    if op in ("and", "or"):
        return "bool" if all(k == "bool" for k in kinds) else "int"
    if all(k in ("int", "bool") for k in kinds) and op in ("add", "sub", "mul", "floordiv", "mod", "max", "min", "neg", "abs"):
        return "int"
    return "float"


def binary(op: str, a: TensorLike, b: TensorLike) -> SymTensor:
    """Elementwise `op(a, b)` with broadcasting."""
    tracer = _tracer_of(a, b)
    ta, tb = lift(a, tracer), lift(b, tracer)
    dims, (ea, eb) = broadcast([ta, tb], op)
    return SymTensor(dims, Binary(op, ea, eb), tracer, _result_kind(op, (ta.kind, tb.kind)))


def unary(op: str, x: TensorLike) -> SymTensor:
    """Elementwise `op(x)`."""
    tracer = _tracer_of(x)
    tx = lift(x, tracer)
    return SymTensor(tx.dims, Unary(op, tx.expr), tracer, _result_kind(op, (tx.kind,)))


def where(cond: TensorLike, a: TensorLike, b: TensorLike) -> SymTensor:
    """Elementwise select: `a` where `cond` holds, else `b` (all three broadcast)."""
    tracer = _tracer_of(cond, a, b)
    tc, ta, tb = lift(cond, tracer), lift(a, tracer), lift(b, tracer)
    dims, (ec, ea, eb) = broadcast([tc, ta, tb], "where")
    kind = "float" if "float" in (ta.kind, tb.kind) else ta.kind
    return SymTensor(dims, Where(ec, ea, eb), tracer, kind)


_DTYPE_NAMES = {
    "float32": "f32", "float16": "f16", "bfloat16": "bf16", "int32": "i32", "int64": "i64",
    "bool": "bool", "f32": "f32", "f16": "f16", "bf16": "bf16", "i32": "i32", "i64": "i64",
    "float": "f32", "half": "f16",
}


# integer inputs narrower than 32 bits: loaded as stored, widened to int32 at once (a kernel
# computes indices and comparisons in int32; a cast to them is not supported)
_NARROW_INT_NAMES = {torch_name: short for short, torch_name in NARROW_INT_DTYPES.items()}


def input_dtype_name(dtype: object) -> str:
    """Our short name for the dtype of an input tensor: a cast target or a narrow integer ('int8' -> 'i8')."""
    key = str(dtype).replace("torch.", "")
    if key in _NARROW_INT_NAMES:
        return _NARROW_INT_NAMES[key]
    if key not in _DTYPE_NAMES:
        raise TypeError(f"unsupported dtype {dtype!r}; supported: float32, float16, bfloat16, int64, int32, int16, "
                        "int8, uint8, bool")
    return _DTYPE_NAMES[key]


def dtype_name(dtype: object) -> str:
    """Our short dtype name for a torch dtype or a string ('float16' -> 'f16')."""
    key = str(dtype).replace("torch.", "")
    if key not in _DTYPE_NAMES:
        raise TypeError(f"unsupported dtype {dtype!r}")
    return _DTYPE_NAMES[key]


def cast(x: SymTensor, dtype: object) -> SymTensor:
    """`x` converted to `dtype` (torch dtype or name); an output cast to a float dtype is stored in it."""
    name = dtype_name(dtype)
    kind = "bool" if name == "bool" else ("int" if name.startswith("i") else "float")
    return SymTensor(x.dims, Cast(x.expr, name), x.tracer, kind)


Axes = int | tuple[int, ...] | list[int] | None


def _axes_arg(axis: Axes, dim: Axes) -> Axes:
    if axis is not None and dim is not None:
        raise TypeError("give the reduced axes as `axis` or as `dim`, not both")
    return dim if axis is None else axis


def _keep_arg(keepdims: bool, keepdim: bool | None) -> bool:
    return bool(keepdims if keepdim is None else keepdim)


def _axis_list(x: SymTensor, axis: Axes) -> list[int]:
    """The distinct axes `axis` names, normalised (None: every axis)."""
    if axis is None:
        return list(range(x.ndim))
    named = list(axis) if isinstance(axis, (tuple, list)) else [axis]
    if not all(isinstance(a, int) and not isinstance(a, bool) for a in named):
        raise TypeError(f"reduced axes must be Python integers (fixed when the program is traced), got {axis!r}")
    axes = [_norm_axis(a, x.ndim) for a in named]
    if len(set(axes)) != len(axes):
        raise ValueError(f"axis {axis!r} names an axis twice")
    return axes


def reduce_axes(op: str, x: SymTensor, axis: Axes, keepdims: bool) -> SymTensor:
    """Reduce `x` along each axis `axis` names (None: all of them) with `op`, one stage per axis.

    Example:
        >>> import torch, neptune_fusion as nf
        >>> total = nf.compile(nf.program(lambda x: x.sum()))
        >>> x = torch.randn(4, 6)
        >>> torch.allclose(total(x), x.sum(), atol=1e-5)
        True
    """
    axes = _axis_list(x, axis)
    if len(axes) == 1:
        return reduce(op, x, axes[0], keepdims)
    result = x
    for a in sorted(axes, reverse=True):  # the last first: earlier indices stay valid
        result = reduce(op, result, a, False)
    if keepdims:
        dims = list(result.dims)
        for a in sorted(axes):
            dims.insert(a, None)
        result = SymTensor(tuple(dims), result.expr, result.tracer, result.kind)
    return result


def _axis_read_at(expr: Expr, dim: Dim, position: Expr, tracer: object) -> Expr:
    """`expr` with the axis of `dim` (its own index variable and those unified with it) read at `position`."""
    from neptune_fusion.ir.expr import substitute_index
    from neptune_fusion.lang.ops import same_axis_vars, tracer_dims

    return substitute_index(expr, {v: position for v in same_axis_vars(expr, dim, tracer_dims(tracer))})


def constant_dim(size: int, hint: str, tracer: object) -> Dim:
    """A new dimension of a size fixed when tracing (a slice's, a concatenation's): the program
    records it as a derived axis of that constant size."""
    dim = Dim(size, hint)
    if getattr(tracer, "extra_dims", None) is None:
        tracer.extra_dims = []  # type: ignore[attr-defined]
    tracer.extra_dims.append(dim)  # type: ignore[attr-defined]
    return _fixed_size(dim, tracer)


def _fixed_size(dim: Dim, tracer: object) -> Dim:
    """`dim`, recorded as an axis of the size it has while tracing."""
    if getattr(tracer, "constant_dims", None) is None:
        tracer.constant_dims = []  # type: ignore[attr-defined]
    tracer.constant_dims.append(dim)  # type: ignore[attr-defined]
    return dim


def sliced_axis(expr: Expr, dim: Dim | None, key: slice, tracer: object) -> tuple[Dim | None, Expr]:
    """The dimension and expression of `x[..., key, ...]` along `dim`: a new dimension of the
    slice's length, read at `start + step * i` (a view; no data moves)."""
    size = 1 if dim is None else dim.find().size
    start, stop, step = key.indices(size)
    length = len(range(start, stop, step))
    if step < 0:
        raise ValueError("symbolic tensors do not support negative slice steps (torch does not either)")
    if length == 0:
        raise ValueError(f"the slice {key} of a dimension of size {size} is empty; empty tensors are not supported")
    if length == size:
        return dim, expr
    if dim is None:  # unreachable: a size-1 dim's non-empty slice is whole
        raise AssertionError(key)
    new = constant_dim(length, f"{dim.hint}[{start}:{stop}:{step}]", tracer)
    position: Expr = Index(new.var)
    if step != 1:
        position = Binary("mul", position, Const(step))
    if start:
        position = Binary("add", position, Const(start))
    return new, _axis_read_at(expr, dim, position, tracer)


def reshape(x: SymTensor, shape: Sequence[int]) -> SymTensor:
    """`x` viewed with `shape` (torch.reshape / view, one -1 allowed), in row-major order: a view,
    no data moves. Dims that keep their size keep their axis; dims split or merged become new ones
    of a size fixed while tracing, and each source dim is read at the position the row-major order
    gives (`(flat // stride) % size` of the new dims' flat index in its group).

    Example:
        >>> import torch, neptune_fusion as nf
        >>> heads = nf.compile(lambda x: x.view(2, 3, 4).transpose(0, 1).reshape(3, 8).sum(-1))
        >>> x = torch.randn(2, 12)
        >>> torch.allclose(heads(x), x.view(2, 3, 4).transpose(0, 1).reshape(3, 8).sum(-1), atol=1e-6)
        True
    """
    target = _resolved_shape(x.shape, shape)
    source_dims = [(d, s) for d, s in zip(x.dims, x.shape) if s != 1]
    roots = [d.find() for d, _ in source_dims if d is not None]
    if len(set(map(id, roots))) != len(roots):
        raise ValueError("reshape: two dims of this tensor are one axis (a diagonal read); reshape a copy computed "
                         "over distinct axes")
    expr = x.expr
    for d, s in zip(x.dims, x.shape):  # a dim of size 1 that goes away reads its only element
        if s == 1 and d is not None:
            expr = _axis_read_at(expr, d, Const(0), x.tracer)
    sizes = [s for s in target if s != 1]
    new_dims: list[Dim] = []
    for sources, lengths in _row_major_groups([s for _, s in source_dims], sizes):
        group_dims = [source_dims[i][0] for i in sources]
        if len(sources) == 1 and len(lengths) == 1:
            new_dims.append(group_dims[0])  # type: ignore[arg-type]  # the same size: the same axis
            continue
        for dim in group_dims:  # their sizes are fixed too: the gradient reads each position once, unguarded
            if dim is not None:
                _fixed_size(dim, x.tracer)
        made = [constant_dim(n, f"reshaped{len(new_dims) + k}", x.tracer) for k, n in enumerate(lengths)]
        new_dims.extend(made)
        flat: Expr = Index(made[-1].var)
        stride = lengths[-1]
        for dim, n in zip(reversed(made[:-1]), reversed(lengths[:-1])):
            flat = Binary("add", Binary("mul", Index(dim.var), Const(stride)), flat)
            stride *= n
        stride = 1
        for k in reversed(range(len(sources))):
            dim, n = group_dims[k], source_dims[sources[k]][1]
            position = flat if stride == 1 else Binary("floordiv", flat, Const(stride))
            if k > 0:
                position = Binary("mod", position, Const(n))
            expr = _axis_read_at(expr, dim, position, x.tracer)  # type: ignore[arg-type]
            stride *= n
    kept = iter(new_dims)
    dims = tuple(None if s == 1 else next(kept) for s in target)
    return SymTensor(dims, expr, x.tracer, x.kind)


def _resolved_shape(have: tuple[int, ...], shape: Sequence[int]) -> tuple[int, ...]:
    """`shape` with its -1 resolved; ValueError unless it holds as many elements as `have`."""
    want = [int(s) for s in shape]
    total = math.prod(have)
    if want.count(-1) > 1 or any(s < -1 for s in want):
        raise ValueError(f"reshape: invalid shape {want}")
    if -1 in want:
        known = math.prod(s for s in want if s != -1)
        if known == 0 or total % known:
            raise ValueError(f"reshape: shape {want} is invalid for a tensor of shape {list(have)}")
        want[want.index(-1)] = total // known
    if math.prod(want) != total:
        raise ValueError(f"reshape: shape {want} is invalid for a tensor of shape {list(have)} ({total} elements)")
    return tuple(want)


def _row_major_groups(have: list[int], want: list[int]) -> list[tuple[list[int], list[int]]]:
    """The shortest runs of source dims and of target sizes with equal products (sizes > 1)."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(have):
        sources, lengths = [i], [want[j]]
        a, b = have[i], want[j]
        i, j = i + 1, j + 1
        while a != b:
            if a < b:
                sources.append(i)
                a *= have[i]
                i += 1
            else:
                lengths.append(want[j])
                b *= want[j]
                j += 1
        groups.append((sources, lengths))
    return groups


def concatenate(parts: Sequence[SymTensor], axis: int) -> SymTensor:
    """`parts` joined along `axis` (torch.cat): a new dimension of their summed lengths; position j
    reads the part whose range holds it (a select over the parts, each read at j - its offset,
    taken modulo its length so the reads not selected stay inside it). Other axes broadcast.

    Example:
        >>> import torch, neptune_fusion as nf
        >>> rotate_half = nf.compile(lambda x: torch.cat((-x[..., 4:], x[..., :4]), dim=-1))
        >>> x = torch.randn(3, 8)
        >>> torch.equal(rotate_half(x), torch.cat((-x[..., 4:], x[..., :4]), dim=-1))
        True
    """
    if not parts:
        raise ValueError("torch.cat needs at least one tensor")
    tracer = _tracer_of(*parts)
    tensors = [lift(p, tracer) for p in parts]
    ndim = tensors[0].ndim
    if any(t.ndim != ndim for t in tensors) or ndim == 0:
        raise ValueError(f"torch.cat: the tensors must have the same number of dims (>= 1), got "
                         f"{[t.ndim for t in tensors]}")
    axis = _norm_axis(axis, ndim)
    lengths = [t.shape[axis] for t in tensors]
    if len(tensors) == 1:
        return tensors[0]
    joined = constant_dim(sum(lengths), "cat", tracer)
    j: Expr = Index(joined.var)
    placed, offset = [], 0
    for t, n in zip(tensors, lengths):
        dim = t.dims[axis]
        expr = t.expr if dim is None else _axis_read_at(
            t.expr, dim, Binary("mod", Binary("sub", j, Const(offset)), Const(n)), tracer)
        offset += n
        placed.append((SymTensor(t.dims[:axis] + (joined,) + t.dims[axis + 1:], expr, tracer, t.kind), offset))
    result = placed[-1][0]
    for part, end in reversed(placed[:-1]):
        below = SymTensor(tuple(joined if i == axis else None for i in range(ndim)), Binary("lt", j, Const(end)),
                          tracer, "bool")
        result = where(below, part, result)
    return result


_NO_INDICES = ("the indices of a max / min (their positions, argmax / argmin) are not supported on symbolic tensors: "
               "reductions give values; use `.values`, or torch.amax / torch.amin")


class NoIndices:
    """The indices half of torch's (values, indices) pair: any use raises a TypeError saying why."""

    def __getattr__(self, name: str) -> Any:
        raise TypeError(_NO_INDICES)

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(_NO_INDICES)

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __getitem__ = _refuse
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __index__ = __int__ = _refuse  # type: ignore[assignment]
    __hash__ = None  # type: ignore[assignment]


class Extremum(SymTensor):
    """The values of `x.max(dim)` / `x.min(dim)` in torch's spelling (a SymTensor), which also read
    as torch's (values, indices) pair: `.values`, `[0]` and unpacking give the values, the indices
    raise. numpy's spelling (`x.max(axis=-1)`) gives plain values, indexed as any tensor."""

    @property
    def values(self) -> SymTensor:
        return SymTensor(self.dims, self.expr, self.tracer, self.kind)

    @property
    def indices(self) -> Any:
        raise TypeError(_NO_INDICES)

    def __getitem__(self, key: object) -> Any:
        if type(key) is int and key in (0, 1):  # torch's pair, as `x.max(-1)[0]` reads it
            if key == 1:
                raise TypeError(_NO_INDICES)
            return self.values
        return super().__getitem__(key)

    def __iter__(self) -> Any:
        return iter((self.values, NoIndices()))


def _max_min(op: str, x: SymTensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> SymTensor:
    """`x.max(...)` / `x.min(...)`: (axis=None, keepdims=False) or torch's (dim, keepdim=False)."""
    numpy_style = "axis" in kwargs or "keepdims" in kwargs
    named = dict(kwargs)
    if len(args) > 2:
        raise TypeError(f"{op}() takes at most 2 positional arguments ({len(args)} given)")
    if args:
        if "axis" in named or "dim" in named:
            raise TypeError(f"{op}() got multiple values for its axis")
        named["dim"] = args[0]
    if len(args) > 1:
        named["keepdim"] = args[1]
    axis = _axes_arg(named.pop("axis", None), named.pop("dim", None))
    keep = _keep_arg(named.pop("keepdims", False), named.pop("keepdim", None))
    if named:
        raise TypeError(f"{op}() got unexpected keyword arguments {sorted(named)}")
    return reduce_axes(op, x, axis, keep) if numpy_style else extremum(op, x, axis, keep)


def extremum(op: str, x: SymTensor, axis: Axes, keepdims: bool) -> SymTensor:
    """`reduce_axes(op, ...)` for max / min; along named axes, an `Extremum` (torch's pair too).

    Example:
        >>> import torch, neptune_fusion as nf
        >>> top = nf.compile(lambda x: x.max(dim=-1).values)
        >>> x = torch.randn(3, 5)
        >>> torch.equal(top(x), x.amax(-1))
        True
    """
    result = reduce_axes(op, x, axis, keepdims)
    return result if axis is None else Extremum(result.dims, result.expr, result.tracer, result.kind)


def mean(x: SymTensor, axis: Axes = None, keepdims: bool = False) -> SymTensor:
    """The mean of `x` along `axis` (None: all axes); the lengths are run-time values (`size`).

    Example:
        >>> import torch, neptune_fusion as nf
        >>> fn = nf.compile(nf.program(lambda x: x.mean(axis=-1)))
        >>> x = torch.randn(3, 5)
        >>> torch.allclose(fn(x), x.mean(-1), atol=1e-6)
        True
    """
    axes = _axis_list(x, axis)
    total = reduce_axes("sum", x, axes, keepdims)
    count: TensorLike = 1
    for a in axes:
        count = size(x, a) if isinstance(count, int) else binary("mul", count, size(x, a))
    return binary("div", cast(total, "f32") if x.kind != "float" else total, count)


def reduce(op: str, x: SymTensor, axis: int, keepdims: bool) -> SymTensor:
    """Reduce `x` along `axis` with `op`; materialises a reduction stage."""
    axis = _norm_axis(axis, x.ndim)
    dim = x.dims[axis]
    tracer = x.tracer
    if dim is None:  # reducing a broadcast size-1 dim is the identity
        dims = x.dims[:axis] + ((None,) if keepdims else ()) + x.dims[axis + 1:]
        return SymTensor(dims, x.expr, tracer, x.kind)
    operand = tracer.materialize(x)  # type: ignore[attr-defined]
    out_dims = tuple(d for i, d in enumerate(x.dims) if i != axis)
    body = Reduce(op, dim.var, operand.expr)
    result = tracer.stage(out_dims, body, x.kind)  # type: ignore[attr-defined]
    if keepdims:
        result = SymTensor(out_dims[:axis] + (None,) + out_dims[axis:], result.expr, tracer, result.kind)
    return result


def einsum(spec: str, *operands: SymTensor) -> SymTensor:
    """Einstein summation over symbolic tensors; letters missing from the output are summed."""
    if "->" not in spec:
        raise ValueError("einsum needs an explicit output ('ab,bc->ac')")
    lhs, out = spec.replace(" ", "").split("->")
    terms = lhs.split(",")
    if len(terms) != len(operands):
        raise ValueError(f"einsum {spec!r} names {len(terms)} operands but got {len(operands)}")
    tracer = _tracer_of(*operands)
    letters: dict[str, Dim] = {}
    materialized: list[tuple[str, SymTensor]] = []
    for term, op in zip(terms, operands, strict=True):
        op = lift(op, tracer)
        if len(term) != op.ndim:
            raise ValueError(f"einsum {spec!r}: operand {term!r} has rank {op.ndim}")
        op = tracer.materialize(op)  # type: ignore[attr-defined]
        op = _alias_repeated_dims(term, op, letters, tracer)
        materialized.append((term, op))
        for letter, dim in zip(term, op.dims, strict=True):
            if dim is None:
                continue
            if letter in letters:
                known = letters[letter]
                if known.find().size == 1 and dim.find().size != 1:
                    letters[letter] = dim
                elif dim.find().size == 1 and known.find().size != 1:
                    continue
                elif not _distinct_axes(tracer, known, dim) or known.find().size != dim.find().size:
                    unify(known, dim, f"einsum {spec!r}: letter {letter!r}")
            else:
                letters[letter] = dim
                dim.find().letters.append(letter)
    # A size-1 dim broadcast against a larger one of the same letter reads element 0; this is
    # decided once all operands are seen, so an earlier operand's size-1 dim is handled too.
    exprs: list[Expr] = []
    for term, op in materialized:
        mapping: dict[str, Expr] = {}
        for letter, dim in zip(term, op.dims, strict=True):
            if dim is not None and dim.find() is not letters[letter].find():
                mapping.update(_read_along(op.expr, dim, letters[letter]))
        expr = op.expr
        if mapping:
            from neptune_fusion.ir.expr import substitute_index

            expr = substitute_index(expr, mapping)
        exprs.append(expr)
    body: Expr = exprs[0]
    for e in exprs[1:]:
        body = Binary("mul", body, e)
    summed = [ch for ch in dict.fromkeys("".join(terms)) if ch not in out and ch in letters]
    for letter in reversed(summed):
        body = Reduce("sum", letters[letter].var, body)
    dims = tuple(letters.get(ch) for ch in out)
    if any(ch not in letters for ch in out):
        raise ValueError(f"einsum {spec!r}: output letter not found in the inputs")
    if not summed:
        return SymTensor(dims, body, tracer)
    return tracer.stage(dims, body, "float")  # type: ignore[attr-defined]


def _alias_repeated_dims(term: str, op: SymTensor, letters: dict[str, Dim], tracer: Any) -> SymTensor:
    """`op` with each dim that an earlier operand names by another letter replaced by a fresh dim
    of the same size: distinct letters are distinct indices (`x` in `einsum("id,jd->ij", x, x)`:
    its rows are `i` in one factor and `j` in the other, the two axes of a Gram matrix; and
    attention's `p @ v` when q, k and v are projections of one `x`). The fresh dim's size is the
    original's (`tracer.aliases`)."""
    named = {d.find().uid: letter for letter, d in letters.items()}
    renames: dict[str, str] = {}
    dims = list(op.dims)
    for k, (letter, dim) in enumerate(zip(term, op.dims, strict=True)):
        if dim is None or named.get(dim.find().uid, letter) == letter:
            continue
        fresh = Dim(dim.find().size, f"{dim.hint}'")
        tracer.aliases.append((fresh, dim))
        renames[dim.var] = fresh.var
        dims[k] = fresh
    if not renames:
        return op
    from neptune_fusion.ir.expr import substitute_index

    return SymTensor(tuple(dims), substitute_index(op.expr, {a: Index(b) for a, b in renames.items()}), tracer, op.kind)


def matmul(a: SymTensor, b: SymTensor) -> SymTensor:
    """Batched matrix product `a @ b` (batch dims broadcast)."""
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError("matmul needs operands of rank >= 2")
    letters = "abcdefghijklmnopqrstuvw"
    nb = max(a.ndim, b.ndim) - 2
    batch = letters[:nb]
    sa = batch[nb - (a.ndim - 2):] + "xy"
    sb = batch[nb - (b.ndim - 2):] + "yz"
    return einsum(f"{sa},{sb}->{batch}xz", a, b)


def index(x: SymTensor, axis: int) -> SymTensor:
    """The position along `axis` of `x`, as an integer tensor that broadcasts against `x`.

    Example: causal masking on scores `s[b, h, q, k]`:
        >>> import math, torch, neptune_fusion as nf
        >>> from neptune_fusion.ir.printer import format_expr
        >>> @nf.program
        ... def causal_scores(q, k):
        ...     s = nf.einsum("bhqd,bhkd->bhqk", q, k)
        ...     return nf.where(nf.index(s, -2) >= nf.index(s, -1), s, -math.inf)
        >>> format_expr(causal_scores.trace(torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)).stages[-1].body)
        'where(q >= k, dot0[b, h, q, k], -inf)'
    """
    axis = _norm_axis(axis, x.ndim)
    dim = x.dims[axis]
    dims = tuple(d if i == axis else None for i, d in enumerate(x.dims))
    if dim is None:
        return SymTensor(dims, Const(0), x.tracer, "int")
    return SymTensor(dims, Index(dim.var), x.tracer, "int")


def size(x: SymTensor, axis: int) -> SymTensor:
    """The length of `axis` of `x` as a symbolic integer scalar, known when the kernel runs.

    `x.shape[axis]` is a Python int fixed at trace time: a program that computes with it is traced
    (and fused, planned and compiled) anew for every length. `size` keeps the length a run-time
    value, so programs that differ only in that length are one program (one kernel).

    Example: queries aligned to the end of the keys (decode over a KV cache):
        >>> import math, torch, neptune_fusion as nf
        >>> from neptune_fusion.ir.printer import format_expr
        >>> @nf.program
        ... def cache_causal_scores(q, k):
        ...     s = nf.einsum("bhqd,bhkd->bhqk", q, k)
        ...     offset = nf.size(k, -2) - nf.size(q, -2)
        ...     return nf.where(nf.index(s, -2) + offset >= nf.index(s, -1), s, -math.inf)
        >>> format_expr(cache_causal_scores.trace(torch.randn(1, 1, 2, 8), torch.randn(1, 1, 6, 8)).stages[-1].body)
        'where(q + (|k| - |q|) >= k, dot0[b, h, q, k], -inf)'
    """
    axis = _norm_axis(axis, x.ndim)
    dim = x.dims[axis]
    if dim is None:  # a broadcast size-1 dim
        return SymTensor((), Const(1), x.tracer, "int")
    return SymTensor((), Size(dim.var), x.tracer, "int")


inf = math.inf



def _load(name: str, dims: tuple[Dim | None, ...]) -> Load:
    return Load(name, tuple(Const(0) if d is None else Index(d.var) for d in dims))
