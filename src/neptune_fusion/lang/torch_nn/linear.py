"""Linear maps and axis views: `F.linear`, `torch.einsum` (with '...' and implicit outputs), permutes, transposes,
slices (split, chunk, narrow, select, unbind), concatenation (cat, stack), expand, and reshapes (view,
reshape, flatten, unflatten, squeeze)."""

from __future__ import annotations

import string
from typing import Any, Callable

from neptune_fusion.lang.tensor import (
    SymTensor,
    binary,
    concatenate,
    constant_dim,
    einsum,
    reshape,
    unary,
    where,
)
from neptune_fusion.lang.torch_nn.common import CONTEXT, no_out, symbolic

_BATCH_LETTERS = "abcdefghijklmnopqrstuvw"  # y and z name the contracted and the output feature

__all__ = ["HANDLERS"]


def _linear(input: Any, weight: Any, bias: Any = None) -> SymTensor:  # noqa: A002
    x, w = symbolic(input, weight), symbolic(weight, input)
    batch = _BATCH_LETTERS[:x.ndim - 1]
    if w.ndim == 2:
        y = einsum(f"{batch}y,zy->{batch}z", x, w)
    elif w.ndim == 1:
        y = einsum(f"{batch}y,y->{batch}", x, w)
    else:
        raise ValueError(f"linear: weight must be 1-D or 2-D, got shape {list(w.shape)}")
    return y if bias is None else binary("add", y, bias)


def _einsum(equation: Any, *operands: Any) -> SymTensor:
    """torch.einsum: the list form, '...' and the implicit output (letters seen once, sorted)."""
    if not isinstance(equation, str):
        raise TypeError(f"torch.einsum's sublist format is not supported {CONTEXT}; write the equation string")
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    ops = [symbolic(op, *operands) for op in operands]
    lhs, arrow, out = equation.replace(" ", "").partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ops):
        raise ValueError(f"einsum {equation!r} names {len(terms)} operands but got {len(ops)}")
    spare = [c for c in string.ascii_letters if c not in equation]
    widths = [op.ndim - (len(t) - 3) for t, op in zip(terms, ops) if "..." in t]
    width = max(widths, default=0)
    ellipsis = "".join(spare[:width])
    terms = [t.replace("...", ellipsis[width - (op.ndim - (len(t) - 3)):]) if "..." in t else t
             for t, op in zip(terms, ops)]
    if arrow:
        out = out.replace("...", ellipsis)
    else:
        letters = "".join(terms)
        out = ellipsis + "".join(sorted(c for c in set(letters) if letters.count(c) == 1 and c not in ellipsis))
    return einsum(f"{','.join(terms)}->{out}", *ops)


def _contraction(name: str, equation: str, ranks: tuple[int, int]) -> Callable[..., SymTensor]:
    """torch.mm / bmm / mv / dot / outer: `equation` on two operands of exactly `ranks`."""
    def fn(a: Any, b: Any, *, out: Any = None) -> SymTensor:
        no_out(name, out)
        x, y = symbolic(a, b), symbolic(b, a)
        if (x.ndim, y.ndim) != ranks:
            raise ValueError(f"torch.{name} takes operands of {ranks[0]} and {ranks[1]} dims, got shapes "
                             f"{list(x.shape)} and {list(y.shape)}")
        return einsum(equation, x, y)

    return fn


_MM, _BMM, _MV = _contraction("mm", "ij,jk->ik", (2, 2)), _contraction("bmm", "bij,bjk->bik", (3, 3)), \
    _contraction("mv", "ij,j->i", (2, 1))


def _scaled_sum(name: str, product: Callable[..., SymTensor]) -> Callable[..., SymTensor]:
    """torch.addmm / baddbmm / addmv: beta * input + alpha * product(a, b); beta 0 ignores input (NaN too)."""
    def fn(input: Any, a: Any, b: Any, *, beta: Any = 1, alpha: Any = 1, out: Any = None) -> SymTensor:  # noqa: A002
        no_out(name, out)
        y = product(a, b)
        y = y if alpha == 1 else binary("mul", alpha, y)
        if beta == 0:
            return y
        return binary("add", input if beta == 1 else binary("mul", beta, input), y)

    return fn


def _cat(tensors: Any, dim: int = 0, *, axis: Any = None, out: Any = None) -> SymTensor:
    no_out("cat", out)
    parts = list(tensors)
    return concatenate([symbolic(p, *parts) for p in parts], dim if axis is None else axis)


def _sections(length: int, split: Any, name: str) -> list[int]:
    """The lengths of torch.split's pieces: `split` a piece length (the last shorter) or the lengths."""
    if isinstance(split, int) and not isinstance(split, bool):
        if split < 1:
            raise ValueError(f"{name}: the split size must be positive, got {split}")
        return [min(split, length - start) for start in range(0, length, split)]
    sizes = [int(n) for n in split]
    if sum(sizes) != length:
        raise ValueError(f"{name}: split sizes {sizes} do not add up to the dimension's {length}")
    return sizes


def _pieces(x: SymTensor, sizes: list[int], dim: int) -> tuple[SymTensor, ...]:
    axis, starts = dim % x.ndim, [sum(sizes[:i]) for i in range(len(sizes))]
    return tuple(x[(slice(None),) * axis + (slice(s, s + n),)] for s, n in zip(starts, sizes))


def _split(x: Any, split_size_or_sections: Any, dim: int = 0) -> tuple[SymTensor, ...]:
    x = symbolic(x)
    return _pieces(x, _sections(x.shape[dim], split_size_or_sections, "split"), dim)


def _chunk(x: Any, chunks: int, dim: int = 0) -> tuple[SymTensor, ...]:
    x = symbolic(x)
    if chunks < 1:
        raise ValueError(f"chunk: the number of chunks must be positive, got {chunks}")
    length = x.shape[dim]
    return _pieces(x, _sections(length, -(-length // chunks), "chunk"), dim)  # torch's ceil(length / chunks)


def _narrow(x: Any, dim: int, start: Any, length: int) -> SymTensor:
    x = symbolic(x)
    start = int(start) % x.shape[dim] if int(start) < 0 else int(start)
    if not 0 <= start <= start + length <= x.shape[dim]:
        raise IndexError(f"narrow: [{start}, {start + length}) is out of a dimension of size {x.shape[dim]}")
    return x[(slice(None),) * (dim % x.ndim) + (slice(start, start + length),)]


def _select(x: Any, dim: int, index: int) -> SymTensor:
    x = symbolic(x)
    return x[(slice(None),) * (dim % x.ndim) + (int(index),)]


def _unbind(x: Any, dim: int = 0) -> tuple[SymTensor, ...]:
    x = symbolic(x)
    return tuple(_select(x, dim, i) for i in range(x.shape[dim]))


def _stack(tensors: Any, dim: int = 0, *, out: Any = None) -> SymTensor:
    no_out("stack", out)
    parts = [symbolic(p, *tensors) for p in tensors]
    if len({p.ndim for p in parts}) > 1:
        raise ValueError(f"torch.stack: the tensors must have one rank, got {[p.ndim for p in parts]}")
    axis = dim % (parts[0].ndim + 1)
    return concatenate([p.unsqueeze(axis) for p in parts], axis)


def _expand(x: Any, *sizes: Any) -> SymTensor:
    """torch.Tensor.expand / broadcast_to: size-1 dims stretched (new ones in front), -1 keeps a dim."""
    x = symbolic(x)
    shape = list(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)) else list(sizes)
    if len(shape) < x.ndim:
        raise ValueError(f"expand: {shape} has fewer dims than the tensor's {list(x.shape)}")
    x = x[(None,) * (len(shape) - x.ndim)]
    dims = list(x.dims)
    for i, (want, have) in enumerate(zip(shape, x.shape)):
        if want == -1 or want == have:
            continue
        if have != 1:
            raise ValueError(f"expand: dim {i} of size {have} cannot become {want}")
        dims[i] = constant_dim(int(want), f"expanded{i}", x.tracer)  # the value does not depend on it
    return SymTensor(tuple(dims), x.expr, x.tracer, x.kind)


def _permute(x: Any, *dims: Any) -> SymTensor:
    x = symbolic(x)
    order = list(dims[0]) if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else list(dims)
    if sorted(a % max(x.ndim, 1) for a in order) != list(range(x.ndim)):
        raise ValueError(f"permute: {order} is not a permutation of the {x.ndim} dims")
    return SymTensor(tuple(x.dims[a] for a in order), x.expr, x.tracer, x.kind)


def _shape_arg(sizes: tuple[Any, ...]) -> list[int]:
    shape = list(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)) else list(sizes)
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in shape):
        raise TypeError(f"a shape is a sequence of Python integers {CONTEXT}, got {sizes!r} (view(dtype) is not supported)")
    return shape


def _reshape(x: Any, *sizes: Any, shape: Any = None) -> SymTensor:
    return reshape(symbolic(x), _shape_arg((shape,) if shape is not None else sizes))


def _flatten(x: Any, start_dim: int = 0, end_dim: int = -1) -> SymTensor:
    x = symbolic(x)
    if x.ndim == 0:
        return reshape(x, [1])
    start, end = start_dim % x.ndim, end_dim % x.ndim
    if start > end:
        raise ValueError(f"flatten: start_dim {start_dim} comes after end_dim {end_dim}")
    return reshape(x, [*x.shape[:start], -1, *x.shape[end + 1:]])


def _unflatten(x: Any, dim: int, sizes: Any) -> SymTensor:
    x = symbolic(x)
    axis = dim % x.ndim
    return reshape(x, [*x.shape[:axis], *_shape_arg((sizes,)), *x.shape[axis + 1:]])


def _squeeze(x: Any, dim: Any = None) -> SymTensor:
    x = symbolic(x)
    axes = range(x.ndim) if dim is None else [a % x.ndim for a in (dim if isinstance(dim, (tuple, list)) else [dim])]
    gone = {a for a in axes if x.shape[a] == 1}
    return reshape(x, [s for a, s in enumerate(x.shape) if a not in gone])


def _embedding(input: Any, weight: Any, padding_idx: int | None = None, max_norm: Any = None,  # noqa: A002
               norm_type: float = 2.0, scale_grad_by_freq: bool = False, sparse: bool = False) -> SymTensor:
    """F.embedding: the rows of `weight` the integer `input` names (a gather); the row at
    `padding_idx` gets no gradient, as in torch."""
    if max_norm is not None or scale_grad_by_freq or sparse:
        raise TypeError(f"F.embedding's max_norm (renormalises the weight in place), scale_grad_by_freq and sparse "
                        f"are not supported {CONTEXT}")
    ids, table = symbolic(input, weight), symbolic(weight, input)
    if ids.kind != "int":
        raise TypeError(f"F.embedding: the indices must be an integer tensor, got a {ids.kind} one")
    rows = table[ids]
    if padding_idx is None:
        return rows
    padding = padding_idx % table.shape[0]
    return where(binary("eq", ids, padding).unsqueeze(-1), unary("detach", rows), rows)


def _t(x: Any) -> SymTensor:
    x = symbolic(x)
    if x.ndim > 2:
        raise ValueError(f"t() expects a tensor with <= 2 dimensions, got {x.ndim}")
    return x.transpose(0, 1) if x.ndim == 2 else x


HANDLERS: dict[str, Callable[..., Any]] = {
    "linear": _linear, "einsum": _einsum, "permute": _permute, "t": _t,
    "transpose": lambda x, a, b: symbolic(x).transpose(a, b), "swapaxes": lambda x, a, b: symbolic(x).transpose(a, b),
    "unsqueeze": lambda x, dim: symbolic(x).unsqueeze(dim),
    "mm": _MM, "bmm": _BMM, "mv": _MV, "dot": _contraction("dot", "i,i->", (1, 1)), "vdot": _contraction("vdot", "i,i->", (1, 1)),
    "inner": _contraction("inner", "i,i->", (1, 1)), "outer": _contraction("outer", "i,j->ij", (1, 1)),
    "ger": _contraction("ger", "i,j->ij", (1, 1)), "addmm": _scaled_sum("addmm", _MM),
    "baddbmm": _scaled_sum("baddbmm", _BMM), "addmv": _scaled_sum("addmv", _MV),
    "cat": _cat, "concat": _cat, "concatenate": _cat, "split": _split, "chunk": _chunk, "narrow": _narrow,
    "select": _select, "unbind": _unbind, "stack": _stack, "expand": _expand, "broadcast_to": _expand,
    "expand_as": lambda x, other: _expand(x, symbolic(other, x).shape),
    "embedding": _embedding, "reshape": _reshape, "view": _reshape, "flatten": _flatten, "unflatten": _unflatten, "squeeze": _squeeze,
    "view_as": lambda x, other: _reshape(x, tuple(other.shape)),
    "reshape_as": lambda x, other: _reshape(x, tuple(other.shape)),
}
