"""Distributing a contraction over the terms of an operand that are constant along it (Program -> Program).

`sum_k (x[i, k] - c[i]) * w[k, e]` equals `sum_k x[i, k] * w[k, e] - c[i] * sum_k w[k, e]`: by
linearity a term constant along the reduced axis leaves the sum, multiplied by the sum of the other
factors (a basis sum with only the axes those factors have: one vector of column sums, not one per
row). The contraction's operands are then tiles read straight from memory, which the tensor cores
take as they are loaded, instead of an operand computed in registers at every step (a centred x).

The rewrite is applied only where that is what it buys, and only where it costs no accuracy:

- the remaining term and every other factor varying along the axis are loaded values of 16-bit
  floating-point inputs (`narrow`), so products are exact in the fp32 accumulator, and the
  constant terms read only inputs (values a previous kernel materialised, parameters), not a
  reduction of this program (those the fusion's basis expansion handles, transform/polynomial.py);
- on 16-bit inputs the cancellation `sum x w - c sum w` leaves an error of about fp32's epsilon times
  |c| sum |w|, far below the fp16 / bf16 rounding of the centred operand `x - c` it replaces for
  any |c| the input can still resolve deviations at. fp32 inputs keep the centred operand.

Example:
    >>> import torch, neptune_fusion as nf
    >>> from neptune_fusion.ir.printer import format_program
    >>> @nf.program
    ... def centred_matmul(x, c, w):
    ...     return nf.einsum("ik,ke->ie", x - c[:, None], w)
    >>> prog = centred_matmul.trace(torch.randn(4, 8), torch.randn(4), torch.randn(8, 3))
    >>> print(format_program(distribute_constant_terms(prog, frozenset({"x", "w"}))))
    program centred_matmul(x[i, k], c[i], w[k, e]):
      dot0_main[i, e] = sum[k](x[i, k] * w[k, e])
      dot0_basis[e] = sum[k](w[k, e])
      dot0[i, e] = dot0_main[i, e] + -c[i] * dot0_basis[e]
      return dot0
"""

from __future__ import annotations

from neptune_fusion.ir.expr import Binary, Cast, Expr, Index, Load, Reduce, Unary, free_axes, loads_of
from neptune_fusion.ir.program import Node, Program, Stage
from neptune_fusion.transform.inline import inline_elementwise_into
from neptune_fusion.transform.normalize import factors_of, product_of


def _terms(expr: Expr, sign: bool = True) -> list[tuple[bool, Expr]]:
    """A sum / difference tree as (positive, term) pairs."""
    if isinstance(expr, Binary) and expr.op in ("add", "sub"):
        return _terms(expr.a, sign) + _terms(expr.b, sign if expr.op == "add" else not sign)
    if isinstance(expr, Unary) and expr.op == "neg":
        return _terms(expr.x, not sign)
    return [(sign, expr)]


def _loaded(expr: Expr, narrow: frozenset[str]) -> bool:
    """A plain element of a 16-bit input (possibly converted)."""
    while isinstance(expr, Cast):
        expr = expr.x
    return isinstance(expr, Load) and expr.buffer in narrow and all(isinstance(i, Index) for i in expr.index)


def _signed_sum(terms: list[tuple[bool, Expr]]) -> Expr:
    out: Expr | None = None
    for positive, t in terms:
        if out is None:
            out = t if positive else Unary("neg", t)
        else:
            out = Binary("add" if positive else "sub", out, t)
    assert out is not None
    return out


def _distributed(stage: Stage, body: Reduce, inputs: set[str], narrow: frozenset[str]) -> list[Stage] | None:
    """The stages replacing `stage` (a sum over body.axis), or None where the rewrite does not apply."""
    axis = body.axis
    factors = factors_of(body.body)
    varying = [(f, inv) for f, inv in factors if axis in free_axes(f)]
    constant = [(f, inv) for f, inv in factors if axis not in free_axes(f)]
    for j, (operand, inv) in enumerate(varying):
        if inv:
            continue
        terms = _terms(operand)
        moving = [(s, t) for s, t in terms if axis in free_axes(t)]
        staying = [(s, t) for s, t in terms if axis not in free_axes(t)]
        others = varying[:j] + varying[j + 1:]
        if (len(moving) != 1 or not staying or not _loaded(moving[0][1], narrow) or not others
                or not all(not i and _loaded(f, narrow) for f, i in others)
                or not all(loads_of(t) <= inputs for _, t in staying)):
            continue
        positive, kept = moving[0]
        rest = product_of(others)
        basis_axes = tuple(a for a in stage.axes if a in free_axes(rest))
        main = Stage(f"{stage.name}_main", stage.axes, Reduce("sum", axis, Binary("mul", kept, rest)))
        basis = Stage(f"{stage.name}_basis", basis_axes, Reduce("sum", axis, rest))
        main_value: Expr = Load(main.name, tuple(Index(a) for a in stage.axes))
        combined = Binary("add", main_value if positive else Unary("neg", main_value),
                          Binary("mul", _signed_sum(staying), Load(basis.name, tuple(Index(a) for a in basis_axes))))
        return [main, basis, Stage(stage.name, stage.axes, product_of([(combined, False), *constant]))]
    return None


def distribute_constant_terms(program: Program, narrow: frozenset[str]) -> Program:
    """Split every sum over a product whose operand is `loaded value +- terms constant along the
    sum` into the sum with the loaded value and a basis sum of the other factors (see the module
    docstring); `narrow` names the inputs stored as 16-bit floats. Returns `program` itself where
    nothing applies."""
    inputs = {b.name for b in program.inputs}
    by_name = {st.name: st for st in program.stages if isinstance(st, Stage)}
    stages: list[Node] = []
    changed = False
    for node in program.stages:
        if isinstance(node, Stage) and isinstance(node.body, Reduce) and node.body.op == "sum":
            body = inline_elementwise_into(node.body, by_name)
            assert isinstance(body, Reduce)
            replaced = _distributed(node, body, inputs, narrow)
            if replaced is not None:
                stages += replaced
                changed = True
                continue
        stages.append(node)
    if not changed:
        return program
    # elementwise stages only the rewritten sums read (now inlined into them) are dropped
    read = {o.stage for o in program.outputs}
    for node in reversed(stages):
        if isinstance(node, Stage) and (node.name in read or node.reduce_op is not None):
            read |= loads_of(node.body)
    return program.with_stages([n for n in stages if not isinstance(n, Stage) or n.name in read])
