"""Basis expansion of reductions (Program -> Program): Welford-style basis accumulators.

A sum whose map is a polynomial in earlier reductions along the same axis has no repair
of the `+`/`*` form (`(x - mean)^2`), but it expands into basis sums that do not depend on
them at all: `sum_j (x_j - m)^2 = sum_j x_j^2 - 2 m sum_j x_j + m^2 sum_j 1`. Taken around 0
those terms cancel where the values sit far from 0 relative to their spread (the textbook
variance: a mean 1000 times the spread gave a LayerNorm 12% wrong in fp32, NaN at 10^4), so each
sum producer's basis is taken around its value were every term its first one (`|j| * x_0`, near
the final sum): `sum_j (x_j - x_0)^2 - 2 (m - x_0) sum_j (x_j - x_0) + (m - x_0)^2 sum_j 1`,
shifted data whose terms stay of the spread's size. The basis sums join the fused loop; the
combination with the final `m` happens after it. A basis sum has
only the axes its terms vary along (a LayerNorm-then-matmul's column sums of the weight are one
vector, not one per row), and the sum of a constant is the constant times the axis's extent. This makes
variance, LayerNorm statistics and LayerNorm-then-matmul chains fusable in one pass.
More generally a basis sum may keep a factor with a multiplicative repair (`exp(c - m)`), so
the entropy of a softmax, `sum_j p_j log p_j`, fuses too (algebra/repair.py `separable_split`).

Example:
    >>> import torch, neptune_fusion as nf
    >>> from neptune_fusion.ir.printer import format_program
    >>> from neptune_fusion.transform.inline import inline_elementwise
    >>> @nf.program
    ... def variance(x):
    ...     mean = x.sum(axis=-1, keepdims=True) / x.shape[-1]
    ...     return ((x - mean) * (x - mean)).sum(axis=-1) / x.shape[-1]
    >>> prog = inline_elementwise(variance.trace(torch.randn(4, 8)))
    >>> print(format_program(expand_polynomial_reductions(prog, "a1")))
    program variance(x[a0, a1]):
      sum0[a0] = sum[a1](x[a0, a1])
      sum1_p0[a0] = sum[a1]((x[a0, a1] - 0.125 * (|a1| * x[a0, 0])) * (x[a0, a1] - 0.125 * (|a1| * x[a0, 0])))
      sum1_p1[a0] = sum[a1](0.03125 * (|a1| * x[a0, 0]) - 0.25 * x[a0, a1])
      sum1[a0] = sum1_p0[a0] + (sum0[a0] - |a1| * x[a0, 0]) * sum1_p1[a0] + (sum0[a0] - |a1| * x[a0, 0]) * (sum0[a0] - |a1| * x[a0, 0]) * (0.015625 * |a1|)
      ew1[a0] = sum1[a0] / 8
      return ew1
"""

from __future__ import annotations

from neptune_fusion.algebra.repair import derive_repair, polynomial_split, separable_split
from neptune_fusion.ir.errors import FusionError
from neptune_fusion.ir.expr import (
    Accumulator,
    Binary,
    Const,
    Expr,
    Index,
    Load,
    Reduce,
    Running,
    Size,
    free_axes,
    simplify,
    substitute_index,
    transform_bottom_up,
    walk,
)
from neptune_fusion.ir.program import Node, Program, Stage


def expand_polynomial_reductions(program: Program, axis: str) -> Program:
    """Replace sums along `axis` whose map is a polynomial in other sums' values by basis sums."""
    members = {st.name: st for st in program.stages
               if isinstance(st, Stage) and isinstance(st.body, Reduce) and st.body.axis == axis}
    stages: list[Node] = []
    changed = False
    for node in program.stages:
        if not (isinstance(node, Stage) and node.name in members and node.body.op == "sum"):  # type: ignore[union-attr]
            stages.append(node)
            continue
        body = node.body
        assert isinstance(body, Reduce)
        producers = tuple(sorted(members.keys() & node.reads()))
        if not producers or _has_repair(node, axis, producers):
            stages.append(node)
            continue
        split = polynomial_split(body.body, producers, shifts=_shifts(members, producers, axis))
        if split is None:
            split = separable_split(body.body, axis, producers)
        if split is None:
            stages.append(node)
            continue
        changed = True
        combined: Expr | None = None
        for k, (monomial, coefficient) in enumerate(split.terms):
            coefficient = _running_as_loads(coefficient, members)
            used = free_axes(coefficient)
            if axis not in used and not used & set(node.axes):
                # a constant summed along the axis: the constant times the axis's extent
                total: Expr = Binary("mul", coefficient, Size(axis))
            else:
                # a basis sum keeps only the axes its terms vary along (the column sums of a
                # LayerNorm's weight, not one copy per row)
                basis, kept = f"{node.name}_p{k}", tuple(a for a in node.axes if a in used)
                stages.append(Stage(basis, kept, Reduce("sum", axis, coefficient)))
                total = Load(basis, tuple(Index(a) for a in kept))
            term = Binary("mul", _running_as_loads(monomial, members), total)
            combined = term if combined is None else Binary("add", combined, term)
        assert combined is not None
        stages.append(Stage(node.name, node.axes, simplify(combined)))
    if not changed:
        return program
    out = program.with_stages(stages)
    out.validate()
    return out


def _shifts(members: dict[str, Stage], producers: tuple[str, ...], axis: str) -> dict[str, Expr]:
    """Per producer summed along `axis`, the value it would have if every term were its first one
    (`|axis| * term[0]`): near its final value wherever the terms are close to one another, so basis
    sums taken around it do not cancel (algebra/repair.py `polynomial_split`). Its first term is
    read at index 0 of the axis, which every row has where the sum has any term."""
    out: dict[str, Expr] = {}
    for p in producers:
        body = members[p].body
        assert isinstance(body, Reduce)
        if body.op == "sum" and not any(isinstance(n, (Running, Accumulator)) for n in walk(body.body)):
            out[p] = Binary("mul", Size(axis), substitute_index(body.body, {axis: Const(0)}))
    return out


def _has_repair(stage: Stage, axis: str, producers: tuple[str, ...]) -> bool:
    assert isinstance(stage.body, Reduce)
    try:
        derive_repair(stage.name, stage.body.op, axis, stage.body.body, producers)
    except FusionError:
        return False
    return True


def _running_as_loads(expr: Expr, members: dict[str, Stage]) -> Expr:
    def rule(node: Expr) -> Expr | None:
        if isinstance(node, Running):
            return Load(node.stage, tuple(Index(a) for a in members[node.stage].axes))
        return None

    return transform_bottom_up(expr, rule)
