"""Readable text for expressions and programs (used by `explain` and in error messages).

Example:
    >>> from neptune_fusion.ir.expr import Index, Load
    >>> format_expr(Load("x", (Index("i"),)) * 2)
    'x[i] * 2'
"""

from __future__ import annotations

import math

from neptune_fusion.ir.expr import (
    Accumulator,
    Binary,
    Cast,
    Const,
    Expr,
    Index,
    Load,
    Param,
    Reduce,
    Running,
    Size,
    Unary,
    Where,
)
from neptune_fusion.ir.program import FusedLoop, Program, Stage

_INFIX = {
    "add": ("+", 1), "sub": ("-", 1), "mul": ("*", 2), "div": ("/", 2), "floordiv": ("//", 2),
    "mod": ("%", 2), "lt": ("<", 0), "le": ("<=", 0), "gt": (">", 0), "ge": (">=", 0),
    "eq": ("==", 0), "ne": ("!=", 0), "and": ("&", -1), "or": ("|", -2), "pow": ("**", 3),
}


def format_expr(expr: Expr, _prec: int = -10) -> str:
    """One-line text of an expression, with the fewest parentheses that keep it unambiguous."""
    if isinstance(expr, Const):
        v = expr.value
        if isinstance(v, float) and math.isinf(v):
            return "-inf" if v < 0 else "inf"
        return repr(v)
    if isinstance(expr, Index):
        return expr.axis
    if isinstance(expr, Param):
        return expr.name
    if isinstance(expr, Size):
        return f"|{expr.axis}|"
    if isinstance(expr, Load):
        return f"{expr.buffer}[{', '.join(format_expr(i) for i in expr.index)}]"
    if isinstance(expr, Accumulator):
        return "t"
    if isinstance(expr, Running):
        return f"{expr.stage}.{expr.which}"
    if isinstance(expr, Unary):
        if expr.op == "neg":
            text = f"-{format_expr(expr.x, 4)}"
            return f"({text})" if _prec > 3 else text
        if expr.op == "not":
            return f"~{format_expr(expr.x, 4)}"
        return f"{expr.op}({format_expr(expr.x)})"
    if isinstance(expr, Binary):
        if expr.op in _INFIX:
            sym, prec = _INFIX[expr.op]
            # ** groups to the right (a ** b ** c is a ** (b ** c)); everything else to the left
            left, right = (prec + 1, prec) if expr.op == "pow" else (prec, prec + 1)
            text = f"{format_expr(expr.a, left)} {sym} {format_expr(expr.b, right)}"
            return f"({text})" if prec < _prec else text
        return f"{expr.op}({format_expr(expr.a)}, {format_expr(expr.b)})"
    if isinstance(expr, Where):
        return f"where({format_expr(expr.cond)}, {format_expr(expr.a)}, {format_expr(expr.b)})"
    if isinstance(expr, Cast):
        return f"{expr.dtype}({format_expr(expr.x)})"
    if isinstance(expr, Reduce):
        return f"{expr.op}[{expr.axis}]({format_expr(expr.body)})"
    return repr(expr)


def format_stage(stage: Stage) -> str:
    """`name[axes] = body` on one line."""
    return f"{stage.name}[{', '.join(stage.axes)}] = {format_expr(stage.body)}"


def format_node(node: Stage | FusedLoop) -> str:
    """A stage, or a fused loop with its members and their repair terms."""
    if isinstance(node, Stage):
        return format_stage(node)
    head = f"{node.mode} loop over {node.axis}"
    if node.mode == "split_k":
        head += f" in {node.splits} chunks (private partial states, merged by the repairs)"
    lines = [head + ":"]
    for member in node.members:
        lines.append("  " + format_stage(member))
        producers = node.producers.get(member.name, ())
        repair = node.repairs.get(member.name)
        if producers and repair is not None:
            lines.append(f"      repair when {', '.join(producers)} change: t <- {format_expr(repair)}")
    return "\n".join(lines)


def format_program(program: Program) -> str:
    """The whole program: signature, one line per stage, outputs."""
    ins = ", ".join(f"{b.name}[{', '.join(d or '1' for d in b.dims)}]" for b in program.inputs)
    params = (", " + ", ".join(program.params)) if program.params else ""
    lines = [f"program {program.name}({ins}{params}):"]
    for node in program.stages:
        lines.extend("  " + line for line in format_node(node).splitlines())
    outs = ", ".join(o.stage for o in program.outputs)
    lines.append(f"  return {outs}")
    return "\n".join(lines)
