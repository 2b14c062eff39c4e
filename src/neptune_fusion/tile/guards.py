"""Reads that a `where` makes only where its condition holds.

The gradient of a slice reads its source modulo the slice's length, `where(0 <= s & s < n,
x[s % n], 0)`, so that the reads off the slice stay in bounds. Where the condition holds, `s % n`
is `s`: the branch can read `x[s]` with its loads masked by the bounds on `s`, which reads each
element once (no load runs for the lanes the `where` discards) at an affine, vectorisable address
instead of a run-time modulo of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from neptune_fusion.analysis.masks import conjuncts
from neptune_fusion.ir.expr import Binary, Const, Expr, Index, Load, Size, simplify, transform_bottom_up, walk


@dataclass(frozen=True)
class GuardedBranch:
    """A where's taken branch with its bounded modulos read plainly: `loads` (the reads whose
    index changed) are valid only where `guard` (the bounds that made the modulos identities) holds."""

    branch: Expr
    guard: Expr
    loads: frozenset[Load]


def _is_zero(expr: Expr) -> bool:
    return isinstance(expr, Const) and expr.value == 0 and not isinstance(expr.value, bool)


def nonnegative_index(expr: Expr) -> bool:
    """Whether `expr` is integer index arithmetic known not to be negative: axes, sizes and
    non-negative integers under +, *, // and %.

    Example:
        >>> nonnegative_index(Binary("floordiv", Index("h"), Const(4))), nonnegative_index(Binary("sub", Index("z"), Const(8)))
        (True, False)
    """
    if isinstance(expr, (Index, Size)):
        return True
    if isinstance(expr, Const):
        return isinstance(expr.value, int) and not isinstance(expr.value, bool) and expr.value >= 0
    return (isinstance(expr, Binary) and expr.op in ("add", "mul", "floordiv", "mod")
            and nonnegative_index(expr.a) and nonnegative_index(expr.b))


def _lower_bound(value: Expr, facts: list[Expr]) -> list[Expr] | None:
    """The conjuncts that prove `value >= 0` ([] where it holds by structure), or None."""
    if nonnegative_index(value):
        return []
    for fact in facts:
        if isinstance(fact, Binary) and ((fact.op == "ge" and simplify(fact.a) == value and _is_zero(fact.b))
                                         or (fact.op == "le" and simplify(fact.b) == value and _is_zero(fact.a))):
            return [fact]
    if (isinstance(value, Binary) and value.op == "floordiv" and isinstance(value.b, Const)
            and isinstance(value.b.value, int) and value.b.value > 0):
        return _lower_bound(value.a, facts)
    return None


def guarded_branch(cond: Expr, branch: Expr) -> GuardedBranch | None:
    """`branch` (taken where `cond` holds) with each `s % n` read as `s` where `cond` bounds `s` to
    [0, n), or None where it has no such modulo.

    Example:
        >>> from neptune_fusion.ir.printer import format_expr
        >>> z, n = Index("z"), Size("y")
        >>> s = Binary("sub", z, Const(8))
        >>> cond = Binary("and", Binary("ge", s, Const(0)), Binary("lt", s, n))
        >>> g = guarded_branch(cond, Load("x", (Binary("mod", s, n),)))
        >>> format_expr(g.branch), format_expr(g.guard)
        ('x[z - 8]', 'z - 8 >= 0 & z - 8 < |y|')
        >>> format_expr(guarded_branch(Binary("lt", z, Const(8)), Load("x", (Binary("mod", Binary("sub", z, Const(0)), Const(8)),))).branch)
        'x[z]'
    """
    facts = conjuncts(cond)
    bounded: dict[tuple[Expr, Expr], list[Expr]] = {}
    for fact in facts:
        if isinstance(fact, Binary) and fact.op in ("lt", "gt"):
            value, bound = (simplify(fact.a), simplify(fact.b)) if fact.op == "lt" else (simplify(fact.b), simplify(fact.a))
            below = _lower_bound(value, facts)
            if below is not None and not any(isinstance(n, Load) for n in walk(fact)):
                bounded[(value, bound)] = below + [fact]
    used: list[Expr] = []

    def plain(node: Expr) -> Expr | None:
        key = (simplify(node.a), simplify(node.b)) if isinstance(node, Binary) and node.op == "mod" else None
        if key in bounded:
            used.extend(f for f in bounded[key] if f not in used)
            return key[0]
        return None

    rewritten = transform_bottom_up(branch, plain)
    if not used or any(isinstance(n, Load) for f in used for n in walk(f)):
        return None
    before = {n for n in walk(branch) if isinstance(n, Load)}
    changed = frozenset(n for n in walk(rewritten) if isinstance(n, Load) and n not in before)
    guard = used[0]
    for fact in used[1:]:
        guard = Binary("and", guard, fact)
    return GuardedBranch(rewritten, guard, changed)
