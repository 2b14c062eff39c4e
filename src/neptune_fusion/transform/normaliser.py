"""Save a log-normaliser instead of a stabiliser and its sum (Gradient -> Gradient).

A backward that reads a free stabiliser `m = max_r F` and the sum `l = sum_r exp(F - m)` computes
the same gradients from any consistent pair: the forward's outputs do not depend on `m` (that is
what makes it free, proved in `grad._free_stabilisers`), so the backward, derived with `m` held
fixed, is the true gradient at every `m` whose sum is the one it reads. Shifting `m` by `log(l)`
gives the pair `(m + log(l), 1)`: the forward saves the one row statistic `lse = m + log(l)`, the
backward reads it for `m` and the constant 1 for `l`, and every `exp(F - m) / l` it recomputes
becomes `exp(F - lse)` (FlashAttention's form: one per-row value instead of two, and no division).

Declined, leaving the gradient as it is, where another saved value depends on `m` (it would have to
be rescaled too), where `l` is not the plain sum of `exp(F - m)` with `F` the max's own operand,
where the backward does not read `l`, or where a condition of the backward reads `l` or reads `m`
other than as `m == -inf` (it could flip at `m + log(l)`). A row that sees nothing (`m = -inf`) gets
`lse = -inf`, so the backward's guards on `m == -inf` keep their meaning.

Example:
    >>> import torch
    >>> from neptune_fusion.library import softmax_pooling
    >>> from neptune_fusion.transform.grad import differentiate
    >>> grad = differentiate(softmax_pooling.trace(torch.randn(4, 8), torch.randn(4, 8)), ("x", "v"))
    >>> grad.saved                      # was ('max0', 'sum0')
    ('lse_max0',)
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from neptune_fusion.algebra import symbolic
from neptune_fusion.analysis.chains import transitive_reads
from neptune_fusion.ir.expr import (
    Binary,
    Cast,
    Const,
    Expr,
    Index,
    Load,
    Reduce,
    Unary,
    Where,
    loads_of,
    simplify,
    transform_bottom_up,
    walk,
)
from neptune_fusion.ir.program import InputBuffer, OutputSpec, Program, Stage, axis_sources
from neptune_fusion.transform.inline import inline_elementwise_into

if TYPE_CHECKING:
    from neptune_fusion.transform.grad import Gradient

__all__ = ["save_log_normalisers"]


def save_log_normalisers(gradient: Gradient, program: Program) -> Gradient:
    """`gradient` (of `program`) with each foldable (stabiliser, sum) pair saved as one
    log-normaliser (see the module doc)."""
    stages = {st.name: st for st in program.all_stages()}
    for top, total in _pairs(gradient, program, stages):
        gradient = _fold(gradient, program, stages, top, total)
    return gradient


def _is_log_sum_exp(m: Stage, total: Stage, stages: dict[str, Stage]) -> bool:
    """Whether `total = sum_r exp(F - m)` where `m = max_r F` (over the same axes and axis)."""
    if not (isinstance(m.body, Reduce) and isinstance(total.body, Reduce) and m.body.op == "max"
            and total.body.op == "sum" and m.body.axis == total.body.axis and m.axes == total.axes):
        return False
    summand = inline_elementwise_into(total.body.body, stages)
    if not (isinstance(summand, Unary) and summand.op == "exp"):
        return False
    operand = inline_elementwise_into(m.body.body, stages)
    shifted = Binary("sub", operand, Load(m.name, tuple(map(Index, m.axes))))
    if summand.x == shifted:
        return True
    try:
        lhs, table = symbolic.to_sympy(summand.x, {m.name})
        rhs, _ = symbolic.to_sympy(shifted, {m.name}, table)
    except symbolic.NotAlgebraic:
        return False
    return symbolic.is_zero(symbolic.simplify(lhs - rhs))


def _pairs(gradient: Gradient, program: Program, stages: dict[str, Stage]) -> list[tuple[str, str]]:
    read = {b.name for b in gradient.backward.inputs}
    pairs: list[tuple[str, str]] = []
    for m in gradient.saved:
        if m not in gradient.free_stabilisers:
            continue
        sums = [s for s in gradient.saved if s != m and s in read and _is_log_sum_exp(stages[m], stages[s], stages)]
        others = [s for s in gradient.saved if s != m and s not in sums[:1] and m in transitive_reads(program, s)]
        if sums and not others and _conditions_keep(gradient.backward, m, sums[0]):
            pairs.append((m, sums[0]))
    return pairs


def _conditions_keep(backward: Program, m: str, total: str) -> bool:
    """Whether every condition of the backward that reads `m` (a where's, a cast flag's) holds at
    `m + log(l)` exactly where it holds at `m`: only `m == -inf` and `m != -inf` do (a row that
    sees nothing keeps lse = -inf); `m > 0` would flip where m < 0 < m + log(l). No condition may
    read the sum `total`, which becomes 1 (`l == 0` would never hold)."""
    def invariant(cond: Expr) -> bool:
        if total in loads_of(cond):
            return False
        if m not in loads_of(cond):
            return True
        if isinstance(cond, Unary) and cond.op == "not":
            return invariant(cond.x)
        if isinstance(cond, Binary) and cond.op in ("and", "or"):
            return invariant(cond.a) and invariant(cond.b)
        if isinstance(cond, Binary) and cond.op in ("eq", "ne"):
            sides = (cond.a, cond.b)
            return any(isinstance(x, Load) and x.buffer == m for x in sides) and \
                any(isinstance(x, Const) and x.value == -math.inf for x in sides)
        return False

    for stage in backward.all_stages():
        for node in walk(stage.body):
            if isinstance(node, Where) and not invariant(node.cond):
                return False
            if isinstance(node, Cast) and symbolic.is_condition(node.x) and not invariant(node.x):
                return False
    return True


def _fresh(base: str, taken: set[str]) -> str:
    name, n = base, 0
    while name in taken:
        n += 1
        name = f"{base}_{n}"
    return name


def _fold(gradient: Gradient, program: Program, stages: dict[str, Stage], m: str, total: str) -> Gradient:
    forward, backward = gradient.forward, gradient.backward
    taken = {st.name for st in forward.all_stages()} | {b.name for b in forward.inputs}
    taken |= {st.name for st in backward.all_stages()} | {b.name for b in backward.inputs} | set(program.params)
    axes = stages[m].axes
    here = tuple(map(Index, axes))
    lse = _fresh(f"lse_{m}", taken)
    cast = _fresh(f"saved_{lse}", taken | {lse})

    # the forward: its own outputs, then the saved statistics with lse in m's place and total gone
    n_own = len(program.outputs)
    casts = dict(zip(gradient.saved, forward.outputs[n_own:]))
    saved = tuple(lse if s == m else s for s in gradient.saved if s != total)
    # a row that sees nothing has m = -inf and total = 0 (or 0 / 0 where exp(-inf + inf) was summed)
    empty = Binary("eq", Load(m, here), Const(-math.inf))
    shifted = Binary("add", Load(m, here), Unary("log", Load(total, here)))
    lse_stage = Stage(lse, axes, Where(empty, Const(-math.inf), shifted))
    cast_stage = Stage(cast, axes, Cast(Load(lse, here), "f32"))
    dropped = {casts[m].stage, casts[total].stage}
    kept = [node for node in forward.stages if node.name not in dropped]
    outputs = [*forward.outputs[:n_own],
               *(OutputSpec(cast, axes) if s == lse else casts[s] for s in saved)]
    forward = replace(forward, stages=(*kept, lse_stage, cast_stage), outputs=tuple(outputs))
    forward.validate()

    inputs = tuple(InputBuffer(lse, b.dims) if b.name == m else b for b in backward.inputs if b.name != total)
    body = tuple(Stage(st.name, st.axes, _substitute(st.body, m, lse, total)) for st in backward.all_stages())
    # an axis sized by an input it is not a dimension of (`z` of x @ x.T, sized by x's rows) keeps that source
    kept_sizes = {a: (lse if src == m else src, d) for a, (src, d) in backward.axis_sizes.items() if src != total}
    backward = replace(backward, inputs=inputs, stages=body, axis_sizes={**axis_sources(inputs), **kept_sizes})
    backward.validate()
    return replace(gradient, forward=forward, backward=backward, saved=saved)


_UNIT = Load("<sum = 1>", ())  # the sum's value: a product or quotient by it drops it (it multiplied a float)


def _substitute(expr: Expr, m: str, lse: str, total: str) -> Expr:
    """`expr` with `m` read as `lse` and `total` as 1, the factors of 1 this makes dropped."""

    def rule(node: Expr) -> Expr | None:
        if isinstance(node, Load) and node.buffer == m:
            return Load(lse, node.index)
        if isinstance(node, Load) and node.buffer == total:
            return _UNIT
        if isinstance(node, Binary) and node.op in ("mul", "div") and node.b == _UNIT:
            one = isinstance(node.a, Const) and node.a.value == 1  # 1 / total is total again
            return _UNIT if one else node.a
        if isinstance(node, Binary) and node.op == "mul" and node.a == _UNIT:
            return node.b
        return None

    def unit(node: Expr) -> Expr | None:
        return Const(1.0) if node == _UNIT else None

    return simplify(transform_bottom_up(transform_bottom_up(expr, rule), unit))
