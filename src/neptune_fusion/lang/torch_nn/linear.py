"""Linear maps and axis views: `F.linear`, `torch.einsum` (with '...' and implicit outputs), permutes and transposes."""

from __future__ import annotations

import string
from typing import Any, Callable

from neptune_fusion.lang.tensor import (
    SymTensor,
    binary,
    einsum,
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


def _permute(x: Any, *dims: Any) -> SymTensor:
    x = symbolic(x)
    order = list(dims[0]) if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else list(dims)
    if sorted(a % max(x.ndim, 1) for a in order) != list(range(x.ndim)):
        raise ValueError(f"permute: {order} is not a permutation of the {x.ndim} dims")
    return SymTensor(tuple(x.dims[a] for a in order), x.expr, x.tracer, x.kind)


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
}
