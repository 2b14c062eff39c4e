"""Scalar expressions: the body of every stage.

An expression computes one element of a stage's output from its index variables
(`Index`), scalar parameters (`Param`), elements of other buffers (`Load`) and
nested reductions (`Reduce`). Expressions are frozen dataclasses, so structurally
equal expressions compare and hash equal; that is what CSE and caching rely on.

Example:
    >>> from neptune_fusion.ir.expr import Index, Load, Reduce
    >>> s = Reduce("sum", "d", Load("q", (Index("i"), Index("d"))) * Load("k", (Index("j"), Index("d"))))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Union

Number = Union[int, float, bool]

UNARY_OPS = (
    "neg", "exp", "exp2", "log", "log2", "tanh", "sigmoid", "sqrt", "rsqrt",
    "abs", "not", "sin", "cos", "recip", "erf",
    "detach",  # the value itself, through which no gradient flows (torch's x.detach())
)
BINARY_OPS = (
    "add", "sub", "mul", "div", "max", "min", "pow",
    "lt", "le", "gt", "ge", "eq", "ne", "and", "or", "floordiv", "mod",
)
COMPARISONS = ("lt", "le", "gt", "ge", "eq", "ne")
REDUCERS = ("sum", "max", "min", "prod")
REDUCER_IDENTITY: dict[str, float] = {"sum": 0.0, "max": -math.inf, "min": math.inf, "prod": 1.0}
# What a fused loop computes its readers with while a running value is still its reducer's
# identity: finite (max/min: 0, so no inf - inf; sum: 1, so no division by zero). Exact as long
# as the readers are repaired from the same stand-in (the repair's replacement condition).
RUNNING_STAND_IN: dict[str, float] = {"max": 0.0, "min": 0.0, "sum": 1.0}
DTYPES = ("f32", "f16", "bf16", "i32", "i64", "bool")
# input element types only, widened to i32 when loaded (short name -> torch's name)
NARROW_INT_DTYPES = {"i8": "int8", "i16": "int16", "u8": "uint8"}


class Expr:
    """Base class of scalar expressions; supports Python arithmetic to build trees."""

    def __add__(self, other: ExprLike) -> Expr:
        return Binary("add", self, as_expr(other))

    def __radd__(self, other: ExprLike) -> Expr:
        return Binary("add", as_expr(other), self)

    def __sub__(self, other: ExprLike) -> Expr:
        return Binary("sub", self, as_expr(other))

    def __rsub__(self, other: ExprLike) -> Expr:
        return Binary("sub", as_expr(other), self)

    def __mul__(self, other: ExprLike) -> Expr:
        return Binary("mul", self, as_expr(other))

    def __rmul__(self, other: ExprLike) -> Expr:
        return Binary("mul", as_expr(other), self)

    def __truediv__(self, other: ExprLike) -> Expr:
        return Binary("div", self, as_expr(other))

    def __rtruediv__(self, other: ExprLike) -> Expr:
        return Binary("div", as_expr(other), self)

    def __neg__(self) -> Expr:
        return Unary("neg", self)

    def children(self) -> tuple[Expr, ...]:
        return ()


ExprLike = Union[Expr, Number]


@dataclass(frozen=True, eq=True)
class Const(Expr):
    """A Python number or bool."""

    value: Number

    def __repr__(self) -> str:
        return f"Const({self.value!r})"

    # Equal Python numbers of different types (3, 3.0, True == 1) are different constants: they
    # lower to different dtypes (3 // 2 is integer division, 3.0 // 2 is not), so expressions
    # that hold them must not be merged by structural equality (memo tables, CSE, caches).
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Const):
            return NotImplemented
        return (type(self.value), self.value) == (type(other.value), other.value)

    def __hash__(self) -> int:
        return hash((Const, type(self.value), self.value))


@dataclass(frozen=True, eq=True)
class Index(Expr):
    """The value of the index variable of `axis` at the element being computed."""

    axis: str


@dataclass(frozen=True, eq=True)
class Param(Expr):
    """A scalar runtime parameter of the program (e.g. `scale`)."""

    name: str


@dataclass(frozen=True, eq=True)
class Size(Expr):
    """The extent of `axis` (an integer known when the program runs)."""

    axis: str


@dataclass(frozen=True, eq=True)
class Load(Expr):
    """Element `index` of buffer `buffer`; each index is an integer expression."""

    buffer: str
    index: tuple[Expr, ...]

    def children(self) -> tuple[Expr, ...]:
        return self.index


@dataclass(frozen=True, eq=True)
class Unary(Expr):
    """`op(x)` for an op of UNARY_OPS."""

    op: str
    x: Expr

    def children(self) -> tuple[Expr, ...]:
        return (self.x,)


@dataclass(frozen=True, eq=True)
class Binary(Expr):
    """`op(a, b)` for an op of BINARY_OPS (arithmetic, comparisons, and/or, floor division, modulo)."""

    op: str
    a: Expr
    b: Expr

    def children(self) -> tuple[Expr, ...]:
        return (self.a, self.b)


@dataclass(frozen=True, eq=True)
class Where(Expr):
    """`a` where `cond` holds, else `b`."""

    cond: Expr
    a: Expr
    b: Expr

    def children(self) -> tuple[Expr, ...]:
        return (self.cond, self.a, self.b)


@dataclass(frozen=True, eq=True)
class Cast(Expr):
    """`x` converted to `dtype` (a name of DTYPES)."""

    x: Expr
    dtype: str

    def children(self) -> tuple[Expr, ...]:
        return (self.x,)


@dataclass(frozen=True, eq=True)
class Reduce(Expr):
    """`op` over all values of `axis` of `body` (the other indices fixed)."""

    op: str
    axis: str
    body: Expr

    def children(self) -> tuple[Expr, ...]:
        return (self.body,)


@dataclass(frozen=True, eq=True)
class Accumulator(Expr):
    """Placeholder for the accumulated value `t` in a repair function h(t, r, r')."""


@dataclass(frozen=True, eq=True)
class Running(Expr):
    """Placeholder for a running value `r` ("old") or `r'` ("new") in a repair function."""

    stage: str
    which: str  # "old" | "new"


def as_expr(value: ExprLike) -> Expr:
    """`value` as an expression (Python numbers become Const)."""
    if isinstance(value, Expr):
        return value
    if isinstance(value, (bool, int, float)):
        return Const(value)
    raise TypeError(f"cannot use {type(value).__name__} as a scalar expression")


def rebuild(expr: Expr, children: tuple[Expr, ...]) -> Expr:
    """A copy of `expr` with its children replaced (same order as `children()`)."""
    if isinstance(expr, Load):
        return Load(expr.buffer, children)
    if isinstance(expr, Unary):
        return Unary(expr.op, children[0])
    if isinstance(expr, Binary):
        return Binary(expr.op, children[0], children[1])
    if isinstance(expr, Where):
        return Where(children[0], children[1], children[2])
    if isinstance(expr, Cast):
        return Cast(children[0], expr.dtype)
    if isinstance(expr, Reduce):
        return Reduce(expr.op, expr.axis, children[0])
    return expr


def transform_bottom_up(expr: Expr, fn: Callable[[Expr], Expr | None]) -> Expr:
    """Rewrite `expr` bottom-up: `fn` returns a replacement or None to keep the node."""
    memo: dict[Expr, Expr] = {}

    def visit(node: Expr) -> Expr:
        if node in memo:
            return memo[node]
        kids = node.children()
        new = rebuild(node, tuple(visit(k) for k in kids)) if kids else node
        out = fn(new)
        result = new if out is None else out
        memo[node] = result
        return result

    return visit(expr)


def walk(expr: Expr) -> Iterator[Expr]:
    """All nodes of `expr`, parents before children, each distinct node once."""
    seen: set[int] = set()
    stack = [expr]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        stack.extend(reversed(node.children()))


def loads_of(expr: Expr) -> set[str]:
    """Names of the buffers `expr` reads."""
    return {n.buffer for n in walk(expr) if isinstance(n, Load)}


def product_factors(expr: Expr) -> tuple[list[Expr], float]:
    """The factors of a product, its numeric constants folded into one scale.

    Example:
        >>> factors, scale = product_factors(Load("x", (Index("i"),)) * 2.0 * Load("w", (Index("i"),)))
        >>> [f.buffer for f in factors], scale
        (['x', 'w'], 2.0)
    """
    if isinstance(expr, Binary) and expr.op == "mul":
        a, sa = product_factors(expr.a)
        b, sb = product_factors(expr.b)
        return a + b, sa * sb
    if isinstance(expr, Const) and isinstance(expr.value, (int, float)) and not isinstance(expr.value, bool):
        return [], float(expr.value)
    return [expr], 1.0


def free_axes(expr: Expr) -> set[str]:
    """Index variables `expr` depends on, not counting those bound by a nested Reduce."""
    if isinstance(expr, Index):
        return {expr.axis}
    if isinstance(expr, Reduce):
        return free_axes(expr.body) - {expr.axis}
    out: set[str] = set()
    for child in expr.children():
        out |= free_axes(child)
    return out


def substitute_index(expr: Expr, mapping: dict[str, Expr]) -> Expr:
    """Replace index variables by expressions (respecting axes bound by nested reductions)."""
    if isinstance(expr, Index):
        return mapping.get(expr.axis, expr)
    if isinstance(expr, Reduce):
        inner = {k: v for k, v in mapping.items() if k != expr.axis}
        return Reduce(expr.op, expr.axis, substitute_index(expr.body, inner))
    kids = expr.children()
    if not kids:
        return expr
    return rebuild(expr, tuple(substitute_index(k, mapping) for k in kids))


def rename_reads(expr: Expr, names: Mapping[str, str]) -> Expr:
    """`expr` reading each buffer in `names` under its new name, at the same indices.

    Example:
        >>> rename_reads(Load("x", (Index("i"),)), {"x": "saved_x"})
        Load(buffer='saved_x', index=(Index(axis='i'),))
    """
    return transform_bottom_up(
        expr, lambda node: Load(names[node.buffer], node.index) if isinstance(node, Load) and node.buffer in names else None)


def simplify(expr: Expr) -> Expr:
    """Cheap local simplification: constant folding and identities like x*1, where(True, a, b)."""

    def rule(node: Expr) -> Expr | None:
        if isinstance(node, Binary):
            a, b = node.a, node.b
            if isinstance(a, Const) and isinstance(b, Const):
                try:
                    return Const(_fold_binary(node.op, a.value, b.value))
                except (ZeroDivisionError, OverflowError, ValueError):
                    return None
            if node.op == "mul":
                if _is_const(a, 1):
                    return b
                if _is_const(b, 1):
                    return a
            if node.op == "div" and _is_const(b, 1):
                return a
            if node.op in ("add", "sub") and _is_const(b, 0) and not isinstance(b.value, bool):
                return a
            if node.op == "add" and _is_const(a, 0) and not isinstance(a.value, bool):
                return b
            if node.op == "and":
                if _is_const(a, True):
                    return b
                if _is_const(b, True):
                    return a
                if _is_const(a, False) or _is_const(b, False):
                    return Const(False)
            if node.op == "or":
                if _is_const(a, False):
                    return b
                if _is_const(b, False):
                    return a
                if _is_const(a, True) or _is_const(b, True):
                    return Const(True)
        if isinstance(node, Unary) and isinstance(node.x, Const):
            try:
                return Const(_fold_unary(node.op, node.x.value))
            except (OverflowError, ValueError, ZeroDivisionError):
                return None
        if isinstance(node, Where) and isinstance(node.cond, Const):
            return node.a if node.cond.value else node.b
        return None

    return transform_bottom_up(expr, rule)


def _is_const(expr: Expr, value: Number) -> bool:
    return isinstance(expr, Const) and expr.value == value and type(expr.value) is type(value)


def _fold_binary(op: str, a: Number, b: Number) -> Number:
    table: dict[str, Callable[[Number, Number], Number]] = {
        "add": lambda x, y: x + y, "sub": lambda x, y: x - y, "mul": lambda x, y: x * y,
        "div": lambda x, y: x / y, "max": max, "min": min, "pow": lambda x, y: x**y,
        "lt": lambda x, y: x < y, "le": lambda x, y: x <= y, "gt": lambda x, y: x > y,
        "ge": lambda x, y: x >= y, "eq": lambda x, y: x == y, "ne": lambda x, y: x != y,
        "and": lambda x, y: bool(x and y), "or": lambda x, y: bool(x or y),
        "floordiv": lambda x, y: x // y, "mod": lambda x, y: x % y,
    }
    return table[op](a, b)


def _fold_unary(op: str, x: Number) -> Number:
    table: dict[str, Callable[[Number], Number]] = {
        "neg": lambda v: -v, "exp": math.exp, "exp2": lambda v: 2.0**v, "log": math.log,
        "log2": math.log2, "tanh": math.tanh, "sigmoid": lambda v: 1 / (1 + math.exp(-v)),
        "sqrt": math.sqrt, "rsqrt": lambda v: 1 / math.sqrt(v), "abs": abs,
        "not": lambda v: not v, "sin": math.sin, "cos": math.cos, "recip": lambda v: 1 / v,
        "erf": math.erf, "detach": lambda v: v,
    }
    return table[op](x)
