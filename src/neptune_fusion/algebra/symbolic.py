"""The bridge between IR expressions and SymPy: the only module that imports SymPy.

Subexpressions that do not involve the chosen "running" buffers are abstracted as
opaque real symbols, so only the part of a map that matters to the algebra is
translated.

Example:
    >>> from neptune_fusion.ir.expr import Index, Load, Unary
    >>> g = Unary("exp", Load("x", (Index("j"),)) - Load("m", ()))
    >>> sym, table = to_sympy(g, running={"m"})
    >>> str(sym)
    'exp(c0 - r_m)'
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterator

import sympy as sp

from neptune_fusion.ir.expr import (
    Accumulator,
    Binary,
    Cast,
    Const,
    Expr,
    Index,
    Load,
    Param,
    Running,
    Size,
    Unary,
    Where,
    loads_of,
    walk,
)
from neptune_fusion.ir.printer import format_expr


class NotAlgebraic(Exception):
    """An expression uses an operation the algebra does not model."""


@dataclass
class SymbolTable:
    """Which sympy symbol stands for which IR expression."""

    opaque: dict[Expr, sp.Symbol] = field(default_factory=dict)
    running: dict[str, sp.Symbol] = field(default_factory=dict)
    running_new: dict[str, sp.Symbol] = field(default_factory=dict)
    positive: frozenset[str] = frozenset()  # running values known > 0 (reductions of positive maps)
    nonnegative: frozenset[str] = frozenset()  # running values known >= 0 (sums of non-negative terms)

    def old(self, name: str) -> sp.Symbol:
        return self.running.setdefault(name, self._running_symbol(f"r_{name}", name))

    def new(self, name: str) -> sp.Symbol:
        return self.running_new.setdefault(name, self._running_symbol(f"r_{name}'", name))

    def _running_symbol(self, text: str, name: str) -> sp.Symbol:
        if name in self.positive:
            return sp.Symbol(text, positive=True)
        return sp.Symbol(text, nonnegative=True) if name in self.nonnegative else sp.Symbol(text, real=True)

    def constant(self, expr: Expr) -> sp.Symbol:
        if expr not in self.opaque:
            self.opaque[expr] = sp.Symbol(f"c{len(self.opaque)}", real=True)
        return self.opaque[expr]


_UNARY: dict[str, Any] = {
    "neg": lambda x: -x, "exp": sp.exp, "exp2": lambda x: sp.Integer(2) ** x, "log": sp.log,
    "log2": lambda x: sp.log(x, 2), "tanh": sp.tanh, "sigmoid": lambda x: 1 / (1 + sp.exp(-x)),
    "sqrt": sp.sqrt, "rsqrt": lambda x: 1 / sp.sqrt(x), "abs": sp.Abs, "sin": sp.sin,
    "cos": sp.cos, "recip": lambda x: 1 / x, "erf": sp.erf, "detach": lambda x: x,
}
_BINARY: dict[str, Any] = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b, "pow": lambda a, b: a**b, "max": sp.Max, "min": sp.Min,
}


def to_sympy(expr: Expr, running: set[str], table: SymbolTable | None = None) -> tuple[sp.Expr, SymbolTable]:
    """Translate `expr`; loads of `running` buffers become r_<name>, the rest opaque symbols."""
    table = table or SymbolTable()

    def go(node: Expr) -> sp.Expr:
        if isinstance(node, Accumulator):
            return sp.Symbol("t", real=True)
        if isinstance(node, Running):
            return table.old(node.stage) if node.which == "old" else table.new(node.stage)
        if not (loads_of(node) & running) and not any(isinstance(n, (Accumulator, Running)) for n in walk(node)):
            if isinstance(node, Const) and not isinstance(node.value, bool):
                return sp.nsimplify(node.value) if isinstance(node.value, int) else sp.Float(node.value)
            return table.constant(node)
        if isinstance(node, Load):
            return table.old(node.buffer)
        if isinstance(node, Cast):
            return go(node.x)
        if isinstance(node, Unary) and node.op in _UNARY:
            return _UNARY[node.op](go(node.x))
        if isinstance(node, Binary) and node.op in _BINARY:
            return _BINARY[node.op](go(node.a), go(node.b))
        if isinstance(node, Where):
            return indicator_times(node)
        raise NotAlgebraic(f"operation {getattr(node, 'op', type(node).__name__)!r} on a running value")

    def indicator_times(node: Where) -> sp.Expr:
        # where(cond, a, 0) with a condition free of running values is [cond] * a: the indicator
        # [cond] is one more per-term input, so a repair of a (t * exp(r - r')) repairs it too
        depends = bool(loads_of(node.cond) & running) or any(
            isinstance(n, (Accumulator, Running)) for n in walk(node.cond))
        for kept, other, flag in ((node.a, node.b, (1.0, 0.0)), (node.b, node.a, (0.0, 1.0))):
            if not depends and isinstance(other, Const) and other.value == 0:
                return table.constant(Where(node.cond, Const(flag[0]), Const(flag[1]))) * go(kept)
        raise NotAlgebraic("a where() whose branches depend on a running value (other than where(cond, x, 0) "
                           "with a condition free of running values)")

    return go(expr), table


def from_sympy(value: sp.Expr, table: SymbolTable) -> Expr:
    """Translate back; r_<p> -> Running(p, 'old'), r_<p>' -> Running(p, 'new'), t -> Accumulator."""
    back: dict[sp.Symbol, Expr] = {sym: Running(n, "old") for n, sym in table.running.items()}
    back.update({sym: Running(n, "new") for n, sym in table.running_new.items()})
    back.update({sym: e for e, sym in table.opaque.items()})

    def go(node: sp.Expr) -> Expr:
        if node.is_Symbol:
            if node.name == "t":
                return Accumulator()
            return back[node]
        if node.is_Integer:
            return Const(int(node))
        if node.is_Number:
            return Const(float(node))
        if isinstance(node, sp.exp):
            return Unary("exp", go(node.args[0]))
        if isinstance(node, sp.log):
            return Unary("log", go(node.args[0]))
        if isinstance(node, sp.tanh):
            return Unary("tanh", go(node.args[0]))
        if isinstance(node, sp.Abs):
            return Unary("abs", go(node.args[0]))
        if isinstance(node, sp.erf):
            return Unary("erf", go(node.args[0]))
        if isinstance(node, sp.erfc):  # SymPy may fold 1 - erf(x) into erfc(x)
            return Binary("sub", Const(1.0), Unary("erf", go(node.args[0])))
        if isinstance(node, sp.Add):
            args = sorted(node.args, key=lambda a: (a.could_extract_minus_sign(), str(a) != "t"))
            out = go(args[0])
            for term in args[1:]:
                out = Binary("sub", out, go(-term)) if term.could_extract_minus_sign() else Binary("add", out, go(term))
            return out
        if isinstance(node, sp.Mul):
            if node.could_extract_minus_sign() and node.args[0] == -1:
                return Unary("neg", go(-node))
            num = sorted((a for a in node.args if not (a.is_Pow and a.exp.is_negative)), key=lambda a: str(a) != "t")
            den = [1 / a for a in node.args if a.is_Pow and a.exp.is_negative]
            parts = [go(a) for a in num] or [Const(1.0)]
            out = parts[0]
            for part in parts[1:]:
                out = Binary("mul", out, part)
            for d in den:
                out = Binary("div", out, go(d))
            return out
        if isinstance(node, sp.Pow):
            base, expo = node.args
            if base == 2:
                return Unary("exp2", go(expo))
            if expo.is_Integer and int(expo) < 0:  # 1 / b**n: kernels take small positive powers
                return Binary("div", Const(1.0), go(sp.Pow(base, -expo)))
            if expo.is_Integer and int(expo) > 0:
                out = go(base)
                for _ in range(int(expo) - 1):
                    out = Binary("mul", out, go(base))
                return out
            if expo.is_Rational and expo.q == 2:  # SymPy writes sqrt(b) as b**(1/2): kernels take sqrt
                root = Unary("sqrt", go(base)) if expo.p > 0 else Unary("rsqrt", go(base))
                out = root
                for _ in range(abs(int(expo.p)) - 1):
                    out = Binary("mul", out, root)
                return out
            return Binary("pow", go(base), go(expo))
        if isinstance(node, sp.Max):
            return _fold("max", [go(a) for a in node.args])
        if isinstance(node, sp.Min):
            return _fold("min", [go(a) for a in node.args])
        raise NotAlgebraic(f"cannot translate {node} back to the IR")

    return go(value)


def _fold(op: str, items: list[Expr]) -> Expr:
    out = items[0]
    for item in items[1:]:
        out = Binary(op, out, item)
    return out


def simplify(value: sp.Expr) -> sp.Expr:
    """SymPy simplification, with powers of a common base combined."""
    return sp.powsimp(sp.simplify(value), force=False)



def is_zero(value: sp.Expr) -> bool:
    """Whether `value` simplifies to 0."""
    return bool(sp.simplify(sp.expand(value)) == 0)


def expand_terms(value: sp.Expr) -> tuple[sp.Expr, ...]:
    """The terms of `value` with products distributed and logs of products split where that is an
    identity (SymPy's own assumptions: log(exp(a) * b) = a + log(b) for real a); exp(a + b) stays one
    factor (its argument keeps a shift)."""
    return sp.Add.make_args(sp.expand(value, power_exp=False, power_base=False))


def factors(value: sp.Expr) -> tuple[sp.Expr, ...]:
    """The factors of a product."""
    return sp.Mul.make_args(value)


def product(items: list[sp.Expr]) -> sp.Expr:
    return sp.Mul(*items)


def is_positive(value: sp.Expr) -> bool:
    """Whether SymPy can prove `value > 0` (real symbols)."""
    return bool(value.is_positive)


def is_nonnegative(value: sp.Expr) -> bool:
    """Whether SymPy can prove `value >= 0` (real symbols)."""
    return bool(value.is_nonnegative)


def derivative(value: sp.Expr, symbol: sp.Symbol) -> sp.Expr:
    """d value / d symbol."""
    return sp.diff(value, symbol)



def number(value: float) -> sp.Expr:
    """A finite number as SymPy sees it (exact for integers)."""
    return sp.Integer(int(value)) if float(value).is_integer() else sp.Float(value)


def symbol(name: str) -> sp.Symbol:
    """A real SymPy symbol."""
    return sp.Symbol(name, real=True)


NEG_INF = -sp.oo


def preorder(expr: sp.Expr) -> Iterator[sp.Expr]:
    """Every subexpression of `expr`, outermost first."""
    return iter(sp.preorder_traversal(expr))


def exponent_of(node: sp.Expr) -> sp.Expr | None:
    """The exponent of an exponential node (`exp(a)`, or `c ** a` with a constant base c), else None."""
    if isinstance(node, sp.exp):
        return node.args[0]
    if isinstance(node, sp.Pow) and not node.base.free_symbols and node.exp.free_symbols:
        return node.exp
    return None


class ValueSymbols:
    """Every load, index, parameter and size of a `where`-free expression as a SymPy symbol: the
    view of a stage body as a function of the values it reads (used to differentiate it).

    Example:
        >>> from neptune_fusion.ir.expr import Index, Load, Unary
        >>> values = ValueSymbols()
        >>> x = Load("x", (Index("i"),))
        >>> str(values.convert(Unary("exp", x) * x))
        'x[i]*exp(x[i])'
    """

    def __init__(self) -> None:
        self.symbols: dict[Expr, sp.Symbol] = {}
        self.exprs: dict[sp.Symbol, Expr] = {}

    def symbol(self, expr: Expr) -> sp.Symbol:
        """The symbol standing for `expr` (a load, index, parameter or size)."""
        if expr not in self.symbols:
            sym = sp.Symbol(format_expr(expr), real=True)
            if sym in self.exprs:  # equal text, different expression (3 and 3.0): keep them apart
                sym = sp.Symbol(f"{sym.name}#{len(self.exprs)}", real=True)
            self.symbols[expr] = sym
            self.exprs[sym] = expr
        return self.symbols[expr]

    def convert(self, expr: Expr) -> sp.Expr:
        """`expr` as a SymPy expression; raises NotAlgebraic for a `where` or a comparison."""
        if isinstance(expr, Const):
            if isinstance(expr.value, bool):
                raise NotAlgebraic("a boolean constant in arithmetic")
            return number(expr.value) if math.isfinite(expr.value) else (sp.oo if expr.value > 0 else -sp.oo)
        if isinstance(expr, Cast):
            if is_condition(expr.x):  # a 0 / 1 flag: constant wherever it is differentiable
                return self.symbol(expr)
            return self.convert(expr.x)
        if isinstance(expr, Unary) and expr.op in _UNARY:
            return _UNARY[expr.op](self.convert(expr.x))
        if isinstance(expr, Binary) and expr.op in _BINARY:
            return _BINARY[expr.op](self.convert(expr.a), self.convert(expr.b))
        if isinstance(expr, (Load, Index, Param, Size)):
            return self.symbol(expr)
        raise NotAlgebraic(f"operation {getattr(expr, 'op', type(expr).__name__)!r} in a differentiated value")


_CONDITIONS = frozenset({"lt", "le", "gt", "ge", "eq", "ne", "and", "or"})


def is_condition(expr: Expr) -> bool:
    """Whether `expr` is a comparison or a boolean combination of them (a 0 / 1 flag when cast).

    Example:
        >>> from neptune_fusion.ir.expr import Binary, Const, Index
        >>> is_condition(Binary("lt", Index("i"), Const(3))), is_condition(Index("i"))
        (True, False)
    """
    return (isinstance(expr, Binary) and expr.op in _CONDITIONS) or (isinstance(expr, Unary) and expr.op == "not")


def directional_derivative(value: sp.Expr, motion: dict[sp.Symbol, sp.Expr]) -> sp.Expr:
    """The derivative of `value` when each symbol `s` of `motion` moves at rate `motion[s]`."""
    return sp.Add(*(sp.diff(value, s) * rate for s, rate in motion.items() if value.has(s)))


def ratio(value: sp.Expr, reference: sp.Expr) -> sp.Expr | None:
    """`value / reference` simplified, or None where `reference` is 0 (no ratio to speak of)."""
    if is_zero(reference):
        return None
    found = sp.simplify(value / reference)
    # a ratio of two expressions carrying the same float constant (exp(0.25) as 1.284...) can miss
    # its exact value by a rounding: snap floats to the simple rationals they are within 1e-12 of
    return sp.nsimplify(found, tolerance=1e-12, rational=True) if found.has(sp.Float) else found


def solve_for(expr: Expr, unknown: Expr, value: Expr) -> Expr | None:
    """The expression for `unknown` that makes `expr` equal `value` (both IR), or None when SymPy
    finds no unique solution: `solve_for(u / l, u, o)` is `o * l`."""
    values = ValueSymbols()
    try:
        lhs = values.convert(expr)
    except NotAlgebraic:
        return None
    if any(isinstance(e, Cast) and is_condition(e.x) for e in values.exprs.values()):
        return None  # a 0 / 1 flag: solving through it would divide by it where it is 0
    target, result = values.symbol(unknown), values.symbol(value)
    if not lhs.has(target):
        return None
    solutions = sp.solve(sp.Eq(lhs, result), target, dict=False)
    if len(solutions) != 1:
        return None
    try:
        return from_sympy(sp.sympify(solutions[0]), SymbolTable(opaque=dict(values.symbols)))
    except NotAlgebraic:
        return None
