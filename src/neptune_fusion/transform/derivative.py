"""Partial derivatives of scalar expressions with respect to one load (Expr -> Expr).

The building block of reverse-mode differentiation (`transform/grad.py`): the body of a stage
is a scalar expression of the elements it loads, and `partial(body, load)` is the derivative
of that expression with respect to one of them. `None` stands for a derivative that is zero
by structure (the load does not occur, or only through an integer or boolean operation), so
callers prune whole gradient paths without building them.

Where a branch of `where(cond, a, b)` is differentiated, the result keeps the `where` with a
zero in the other branch: a value the forward discarded (0 / 0 in a row with no visible key)
is never multiplied into a gradient.

Example:
    >>> from neptune_fusion.ir.expr import Index, Load, Unary
    >>> from neptune_fusion.ir.printer import format_expr
    >>> x = Load("x", (Index("i"),))
    >>> format_expr(partial(Unary("exp", x) * x, x))
    'x[i] * exp(x[i]) + exp(x[i])'
"""

from __future__ import annotations

import math

from neptune_fusion.ir.errors import FusionError
from neptune_fusion.ir.expr import (
    Binary,
    Cast,
    Const,
    Expr,
    Load,
    Reduce,
    Unary,
    Where,
    simplify,
)

FLOAT_DTYPES = ("f32", "f16", "bf16")
_ONE, _ZERO, _HALF = Const(1.0), Const(0.0), Const(0.5)


def partial(expr: Expr, target: Load) -> Expr | None:
    """d expr / d target, or None where it is zero by structure (loads inside an index, integer
    and boolean operations, comparisons and floor division carry no derivative)."""
    memo: dict[Expr, Expr | None] = {}

    def d(node: Expr) -> Expr | None:
        if node not in memo:
            memo[node] = _rule(node, d, target)
        return memo[node]

    out = d(expr)
    return None if out is None else simplify(out)


def _add(a: Expr | None, b: Expr | None) -> Expr | None:
    if a is None:
        return b
    return a if b is None else a + b


def _scale(factor: Expr, dx: Expr | None) -> Expr | None:
    if dx is None:
        return None
    return factor if dx == _ONE else dx if factor == _ONE else factor * dx


def _rule(node: Expr, d, target: Load) -> Expr | None:  # noqa: ANN001 - d is the memoised recursion
    if isinstance(node, Load):
        return _ONE if node == target else None
    if isinstance(node, Cast):
        return d(node.x) if node.dtype in FLOAT_DTYPES else None
    if isinstance(node, Where):
        da, db = d(node.a), d(node.b)
        if da is None and db is None:
            return None
        return Where(node.cond, _ZERO if da is None else da, _ZERO if db is None else db)
    if isinstance(node, Unary):
        return _unary(node, d(node.x))
    if isinstance(node, Binary):
        return _binary(node, d)
    if isinstance(node, Reduce):
        raise FusionError("differentiate", "?", f"{node.op} over {node.axis}",
                          "a reduction nested inside an expression (traced programs give each its own stage)")
    return None  # Const, Index, Param, Size


def _unary(node: Unary, dx: Expr | None) -> Expr | None:
    if dx is None:
        return None
    x, op = node.x, node.op
    factor: dict[str, Expr] = {
        "neg": Const(-1.0),
        "exp": node,
        "exp2": node * Const(math.log(2.0)),
        "log": _ONE / x,
        "log2": _ONE / (x * Const(math.log(2.0))),
        "tanh": _ONE - node * node,
        "sigmoid": node * (_ONE - node),
        "sqrt": _HALF / node,
        "rsqrt": Const(-0.5) * node / x,
        "abs": Where(Binary("gt", x, _ZERO), _ONE, Where(Binary("lt", x, _ZERO), Const(-1.0), _ZERO)),
        "sin": Unary("cos", x),
        "cos": -Unary("sin", x),
        "recip": -(node * node),
        "erf": Const(2.0 / math.sqrt(math.pi)) * Unary("exp", -(x * x)),
    }
    if op in ("not", "detach"):
        return None
    return _scale(factor[op], dx)


def _binary(node: Binary, d) -> Expr | None:  # noqa: ANN001
    a, b, op = node.a, node.b, node.op
    if op in ("add", "sub"):
        da, db = d(a), d(b)
        return _add(da, None if db is None else (-db if op == "sub" else db))
    if op == "mul":
        return _add(_scale(b, d(a)), _scale(a, d(b)))
    if op == "div":
        da, db = d(a), d(b)
        return _add(None if da is None else da / b, _scale(-(node / b), db))
    if op == "pow":
        # as torch's pow backward: no gradient to the base where the exponent is 0, none to the
        # exponent at a zero base with a nonnegative exponent (log 0 * 0 ** b is NaN or -inf there)
        da, db = d(a), d(b)
        base = b * Binary("pow", a, b - _ONE)
        if not isinstance(b, Const):
            base = Where(Binary("eq", b, _ZERO), _ZERO, base)
        if isinstance(b, Const) and b.value == 0:
            da = None
        exponent = Where(Binary("and", Binary("eq", a, _ZERO), Binary("ge", b, _ZERO)), _ZERO, Unary("log", a) * node)
        return _add(_scale(base, da), _scale(exponent, db))
    if op in ("max", "min"):
        # torch's maximum/minimum: the larger (smaller) side takes the gradient, a tie shares it
        da, db = d(a), d(b)
        if da is None and db is None:
            return None
        wins = Binary("gt" if op == "max" else "lt", a, b)
        loses = Binary("lt" if op == "max" else "gt", a, b)
        da_, db_ = (_ZERO if da is None else da), (_ZERO if db is None else db)
        return Where(wins, da_, Where(loses, db_, _HALF * (da_ + db_)))
    return None  # comparisons, logic, floor division and modulo are piecewise constant
