"""Commuting a normalisation past a later linear reduction (Program -> Program).

`sum_j a[j] * c / n` with `c` and `n` independent of j becomes `(sum_j a[j]) * c / n`:
the loop-invariant factors leave the reduction, so the division happens once per
output element after the loop, and the reduction no longer depends on `n`.

Example:
    >>> import torch, neptune_fusion as nf
    >>> from neptune_fusion.ir.printer import format_expr
    >>> from neptune_fusion.transform.inline import inline_elementwise
    >>> @nf.program
    ... def weighted(x, v, w, scale):
    ...     return nf.einsum("ij,je->ie", nf.exp(x) / w[:, None] * scale, v)
    >>> prog = inline_elementwise(weighted.trace(torch.randn(3, 6), torch.randn(6, 2), torch.randn(3), 1.5))
    >>> [format_expr(st.body) for st in hoist_invariant_factors(prog).stages]
    ['sum[j](exp(x[i, j]) * v[j, e])', 'dot0_acc[i, e] * scale / w[i]']
"""

from __future__ import annotations

import math

from neptune_fusion.ir.expr import Binary, Const, Expr, Index, Load, Reduce, Where, free_axes
from neptune_fusion.ir.program import Node, Program, Stage


def factors_of(expr: Expr) -> list[tuple[Expr, bool]]:
    """Flatten a product/quotient tree into (factor, is_divisor) pairs.

    Example:
        >>> from neptune_fusion.ir.expr import Param
        >>> [(f.name, inv) for f, inv in factors_of(Binary("div", Binary("mul", Param("a"), Param("b")), Param("c")))]
        [('a', False), ('b', False), ('c', True)]
    """
    if isinstance(expr, Binary) and expr.op == "mul":
        return factors_of(expr.a) + factors_of(expr.b)
    if isinstance(expr, Binary) and expr.op == "div":
        return factors_of(expr.a) + [(f, not inv) for f, inv in factors_of(expr.b)]
    return [(expr, False)]


def product_of(factors: list[tuple[Expr, bool]]) -> Expr:
    """The product of `factors` ((factor, is_divisor) pairs), the divisors last.

    Example:
        >>> from neptune_fusion.ir.expr import Param
        >>> from neptune_fusion.ir.printer import format_expr
        >>> format_expr(product_of([(Param("c"), True), (Param("a"), False)]))
        'a / c'
    """
    num = [f for f, inv in factors if not inv]
    den = [f for f, inv in factors if inv]
    out: Expr = num[0] if num else Const(1.0)
    for f in num[1:]:
        out = Binary("mul", out, f)
    for f in den:
        out = Binary("div", out, f)
    return out


def _depends_on(expr: Expr, axis: str, program: Program) -> bool:
    return axis in free_axes(expr)


def _input_value(expr: Expr, program: Program) -> bool:
    """An input's element or a finite constant: finite wherever the inputs are."""
    if isinstance(expr, Const):
        return not isinstance(expr.value, float) or math.isfinite(expr.value)
    return isinstance(expr, Load) and expr.buffer in {b.name for b in program.inputs}


def _open_guards(factors: list[tuple[Expr, bool]], axis: str, program: Program) -> list[tuple[Expr, bool]]:
    """`where(c, 0, x * f)` with c and f independent of `axis` -> `x * where(c, 0, f)`, where the
    factors x that depend on `axis` are inputs' values: finite, so 0 * x is still 0 where c holds
    (a guard that zeroes rows the forward left empty keeps its value, and its factor leaves the sum)."""
    out: list[tuple[Expr, bool]] = []
    for f, inv in factors:
        zero_first = isinstance(f, Where) and isinstance(f.a, Const) and f.a.value == 0
        zero_second = isinstance(f, Where) and isinstance(f.b, Const) and f.b.value == 0
        if inv or not (zero_first or zero_second) or _depends_on(f.cond, axis, program):  # type: ignore[union-attr]
            out.append((f, inv))
            continue
        assert isinstance(f, Where)
        guarded = factors_of(f.b if zero_first else f.a)
        inner = [(g, i) for g, i in guarded if _depends_on(g, axis, program)]
        outer = [(g, i) for g, i in guarded if not _depends_on(g, axis, program)]
        if not inner or not outer or not all(not i and _input_value(g, program) for g, i in inner):
            out.append((f, inv))
            continue
        rest = product_of(outer)
        out += [*inner, (Where(f.cond, f.a, rest) if zero_first else Where(f.cond, rest, f.b), False)]
    return out


def hoist_invariant_factors(program: Program) -> Program:
    """Move factors that do not depend on the reduce axis out of every sum reduction."""
    stages: list[Node] = []
    for node in program.stages:
        if not (isinstance(node, Stage) and isinstance(node.body, Reduce) and node.body.op == "sum"):
            stages.append(node)
            continue
        red = node.body
        factors = _open_guards(factors_of(red.body), red.axis, program)
        inner = [(f, inv) for f, inv in factors if _depends_on(f, red.axis, program)]
        outer = [(f, inv) for f, inv in factors if not _depends_on(f, red.axis, program)]
        # Only worth it when a factor actually reads something (not a bare constant).
        if not inner or not [f for f, _ in outer if not isinstance(f, Const)]:
            stages.append(node)
            continue
        acc_name = f"{node.name}_acc"
        stages.append(Stage(acc_name, node.axes, Reduce("sum", red.axis, product_of(inner))))
        acc = Load(acc_name, tuple(Index(a) for a in node.axes))
        stages.append(Stage(node.name, node.axes, product_of([(acc, False)] + outer)))
    return program.with_stages(stages)
